"""The finite check on the GPU: right answers on either stream, and its time.

:func:`skyrl_lora.server.adapters.finite_check.nonfinite_count` runs on the
staging's side stream when called from the engine's default stream, and
stays on a caller's side stream (the slot write's, whose copies it checks).
Checked on the 8B model's rank-64 adapter shapes (448 tensors, 336 MB,
bf16), with the time it takes, printed. No server; a few seconds.
"""

from __future__ import annotations

import time

import torch

from skyrl_lora.server.adapters.finite_check import nonfinite_count

#: A and B of one 8B layer at rank 64 (q, k, v, o, gate, up, down), 32 layers.
SHAPES = [
    shape
    for ins, out in (
        (4096, 4096),
        (4096, 1024),
        (4096, 1024),
        (4096, 4096),
        (4096, 14336),
        (4096, 14336),
        (14336, 4096),
    )
    for shape in ((64, ins), (out, 64))
] * 32


def test_device_check_finds_one_nan_on_either_stream_and_times_itself() -> None:
    tensors = [torch.randn(s, device="cuda", dtype=torch.bfloat16) for s in SHAPES]
    assert nonfinite_count(tensors) == 0
    started = time.perf_counter()
    assert nonfinite_count(tensors) == 0
    took_ms = (time.perf_counter() - started) * 1000
    tensors[-5].view(-1)[7] = float("nan")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        tensors[3].view(-1)[0] = float("inf")  # queued on the caller's side stream
        assert nonfinite_count(tensors) == 2
    assert nonfinite_count(tensors) == 2
    print(f"finite check of {len(tensors)} tensors, 336 MB bf16: {took_ms:.2f} ms")
