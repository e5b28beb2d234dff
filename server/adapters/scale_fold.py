"""Multiply adapter tensors by their LoRA scaling, on the GPU where they are pinned.

vLLM folds each layer's scaling (``alpha / r``) into its B once an adapter
is loaded, in host memory (:func:`skyrl_lora.server.compat.fold_lora_scalings`).
The engine process runs torch on one CPU thread, and a bf16 multiply there
goes at about 2.5 ns an element: for the 8B model's rank-32 adapter (44
million B elements) the fold was 110 of a staging's 200 ms on an H100, and
it grows with the adapter. Where the tensors are in pinned memory (vLLM pins
loaded adapters on a GPU machine) :func:`multiply_in_place` copies them to
the GPU, multiplies there and copies them back, on a CUDA stream of its own
(the engine's kernels are not waited for): two copies at the link's speed.
Tensors already on the GPU (a hand-over staged there, :mod:`.staging`) are
multiplied where they are, on that stream. On a CPU, or for unpinned host
tensors, it multiplies in place on the host.

Both ways compute each product in float32 and round it once to the tensors'
dtype, so a version folded on the GPU holds the bytes a host fold would. On
the host the factor goes in as a float64 0-dim tensor: that rounds exactly
as ``B *= scaling`` with a Python float (a float scalar list rounds
differently in bf16).
"""

from __future__ import annotations

from typing import Any

import torch

from .cuda_streams import side_stream


def multiply_in_place(tensors: list[Any], factor: float, device: Any = None) -> None:
    """``t *= factor`` for every tensor, on ``device`` when it is a GPU and
    the tensors are pinned host tensors, on their own GPU when they are there."""
    if not tensors:
        return
    if tensors[0].is_cuda:
        stream = side_stream(tensors[0].device)
        with torch.cuda.stream(stream):
            torch._foreach_mul_(tensors, factor)
        stream.synchronize()
        return
    if device is None or torch.device(device).type != "cuda" or not tensors[0].is_pinned():
        torch._foreach_mul_(tensors, torch.tensor(factor, dtype=torch.float64))
        return
    stream = side_stream(device)
    with torch.cuda.stream(stream):
        on_device = [torch.empty_like(t, device=device) for t in tensors]
        torch._foreach_copy_(on_device, tensors, non_blocking=True)
        torch._foreach_mul_(on_device, factor)
        torch._foreach_copy_(tensors, on_device, non_blocking=True)
    stream.synchronize()
