"""The scaling fold on the GPU writes the bytes the host fold writes, faster.

:func:`skyrl_lora.server.adapters.scale_fold.multiply_in_place` folds a
staged adapter's scalings on the GPU when its tensors are pinned; a version
folded there must serve exactly what one folded on the host (the adapter
reader process, a CPU machine) serves. Checked for the 8B model's rank-32 B
shapes and the factors LoRA configs give (alpha / r, rsLoRA's alpha /
sqrt(r)), with the time of each way. No server; a few seconds.
"""

from __future__ import annotations

import math
import time

import torch

from skyrl_lora.server.adapters.scale_fold import multiply_in_place

#: B of one 8B layer at rank 32 (q, k, v, o, gate, up, down), 32 layers.
OUTS = (4096, 1024, 1024, 4096, 14336, 14336, 4096)


def test_device_fold_equals_host_fold_and_is_faster() -> None:
    gen = torch.Generator().manual_seed(0)
    base = [torch.randn(out, 32, generator=gen).bfloat16() for _ in range(32) for out in OUTS]
    for factor in (2.0, 0.5, 1 / 3, 16 / math.sqrt(32)):
        host = [t.clone() for t in base]
        started = time.perf_counter()
        multiply_in_place(host, factor)  # no device: the host fold
        host_ms = (time.perf_counter() - started) * 1000
        pinned = [t.clone().pin_memory() for t in base]
        started = time.perf_counter()
        multiply_in_place(pinned, factor, "cuda:0")
        device_ms = (time.perf_counter() - started) * 1000
        assert all(torch.equal(a, b) for a, b in zip(host, pinned, strict=True)), factor
        print(f"factor {factor:.4f}: host {host_ms:.1f} ms, GPU {device_ms:.1f} ms")
