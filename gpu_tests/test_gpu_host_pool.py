"""Pinned snapshot copies are kept and reused (:mod:`skyrl_lora.server.transfer.host_pool`).

Allocating pinned host memory was 45% of the staging thread's wall time on
an H100 (py-spy, main ca0af75). This times, for the 336 MB of a rank-64
adapter of the 8B model, a fresh pinned block, the pool's reuse of one, and
torch's own caching allocator (a fresh block, then one of the same size
after a free), and prints them as one JSON line. No server; seconds.
"""

from __future__ import annotations

import json
import time

import torch

from skyrl_lora.server.transfer.host_pool import HostBufferPool
from skyrl_lora.server.transfer.tensor_pickle import host_buffers

NBYTES = 336 << 20


def timed(call):
    started = time.perf_counter()
    result = call()
    return result, round((time.perf_counter() - started) * 1000, 3)


def test_a_pinned_snapshot_copy_is_reused_and_the_reuse_costs_nothing() -> None:
    pool = HostBufferPool(host_buffers(True))
    first, fresh_ms = timed(lambda: pool.take(NBYTES))
    assert first.is_pinned() and first.numel() == NBYTES
    pointer = first.data_ptr()
    del first
    second, reused_ms = timed(lambda: pool.take(NBYTES))
    assert second.data_ptr() == pointer and second.is_pinned()

    plain, torch_fresh_ms = timed(lambda: torch.empty(NBYTES, dtype=torch.uint8, pin_memory=True))
    del plain
    again, torch_after_free_ms = timed(
        lambda: torch.empty(NBYTES, dtype=torch.uint8, pin_memory=True)
    )
    del again
    stats = getattr(torch.cuda, "host_memory_stats", None)
    print(
        "host_pool_probe",
        json.dumps(
            {
                "bytes": NBYTES,
                "pool_fresh_ms": fresh_ms,
                "pool_reused_ms": reused_ms,
                "torch_fresh_ms": torch_fresh_ms,
                "torch_after_free_ms": torch_after_free_ms,
                "torch_host_stats": None
                if stats is None
                else {key: value for key, value in stats().items() if "alloc" in key},
            }
        ),
    )
    assert reused_ms < fresh_ms / 10
