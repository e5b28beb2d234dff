"""A reserve taken before serving spares the step loop the driver's pinning
(:mod:`skyrl_lora.server.transfer.pinned_reserve`).

A stand-in for the engine's step loop (matmuls and a synchronize, over and
over) runs on a thread while this thread takes pinned blocks for the 336 MB
of a rank-64 adapter of the 8B model: after the reserve, every take comes
from torch's cache and the loop's longest iteration meanwhile stays near its
usual one. For contrast, a block of a size class the reserve did not cover
is pinned fresh, and the loop's longest iteration during that is printed
beside (on an H200 the loop stalled for all of a 314 ms ``cudaHostAlloc``;
``docs/gpu/pinned_alloc_stall_h200.txt``). One JSON line; no server; seconds.
"""

from __future__ import annotations

import json
import threading
import time

import torch

from skyrl_lora.server.transfer.pinned_reserve import reserve
from skyrl_lora.server.transfer.tensor_pickle import host_buffers

NBYTES = 336 << 20
BLOCKS = 3


class StepLoop:
    """A thread stepping the GPU; records each iteration's start and length."""

    def __init__(self) -> None:
        self._a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        self.steps: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        while not self._stop.is_set():
            began = time.perf_counter()
            for _ in range(4):
                self._a @ self._a
            torch.cuda.synchronize()
            self.steps.append((began, (time.perf_counter() - began) * 1000))

    def __enter__(self) -> StepLoop:
        self._thread.start()
        time.sleep(0.5)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def longest_ms(self, began: float, ended: float) -> float:
        """The longest iteration that overlapped ``began``..``ended``."""
        return max(ms for start, ms in self.steps if start < ended and start + ms / 1000 > began)

    def usual_ms(self) -> float:
        lengths = sorted(ms for _, ms in self.steps)
        return lengths[len(lengths) // 2]


def timed_take(loop: StepLoop, allocate, nbytes: int) -> tuple[torch.Tensor, float, float]:
    time.sleep(0.2)
    began = time.perf_counter()
    block = allocate(nbytes)
    ended = time.perf_counter()
    time.sleep(0.1)
    return block, (ended - began) * 1000, loop.longest_ms(began, ended)


def test_blocks_taken_after_the_reserve_do_not_stall_the_step_loop() -> None:
    allocate = host_buffers(True)
    report = reserve(NBYTES, BLOCKS, allocate)
    assert report.blocks == BLOCKS
    with StepLoop() as loop:
        held, takes = [], []
        for _ in range(BLOCKS):
            block, take_ms, longest_ms = timed_take(loop, allocate, NBYTES)
            assert block.is_pinned()
            held.append(block)
            takes.append({"take_ms": round(take_ms, 2), "loop_longest_ms": round(longest_ms, 2)})
        # A size class the reserve did not cover (torch rounds 700 MB to 1 GB).
        fresh, fresh_ms, fresh_longest_ms = timed_take(loop, allocate, 700 << 20)
        usual = loop.usual_ms()
    del held, fresh
    print(
        "pinned_reserve_probe",
        json.dumps(
            {
                "reserve": {"blocks": report.blocks, "bytes": NBYTES, "ms": report.ms},
                "loop_usual_ms": round(usual, 2),
                "takes_after_reserve": takes,
                "fresh_700mb": {
                    "take_ms": round(fresh_ms, 1),
                    "loop_longest_ms": round(fresh_longest_ms, 1),
                },
            }
        ),
    )
    for take in takes:
        assert take["take_ms"] < 5, takes
        assert take["loop_longest_ms"] < usual + 10, (takes, usual)
