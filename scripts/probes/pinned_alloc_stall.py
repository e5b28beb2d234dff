"""Does pinning host memory stall a GPU step loop in the same process?

``python3 scripts/probes/pinned_alloc_stall.py [--mb 336] [--tries 3]`` (torch
with CUDA, no server) runs a stand-in for vLLM's step loop on one thread:
a few large matmuls, then a synchronize, over and over, timing each
iteration. Meanwhile the main thread pins ``--mb`` of host memory, three
ways in turn, each a second apart:

* ``torch.empty(pin_memory=True)`` from an empty host cache (what a reload
  pays when torch's caching host allocator has no free block: ``cudaHostAlloc``);
* the same block freed and the host cache emptied (``cudaFreeHost``);
* ``cudaHostRegister`` of pageable memory already touched, then unregistered;
* ``cudaHostRegister`` of a shared map of a ``/dev/shm`` file (where a push's
  bytes land), then copies of the same bytes to the GPU on a side stream from
  that registered map, from pageable memory and from a pinned block: what a
  staging that copied straight out of a kept, registered receive area would
  pay, and what it would cost the loop.

It prints each one's duration and the longest step-loop iteration during
it, against the longest outside every window.
"""

from __future__ import annotations

import argparse
import mmap
import os
import threading
import time

import torch


def shm_copies(timed, cudart, nbytes: int, pageable: torch.Tensor) -> None:
    """Register a /dev/shm file's shared map, and time host-to-GPU copies from it and from others."""
    path = "/dev/shm/skyrl-pinned-stall-probe"
    with open(path, "wb") as out:
        out.truncate(nbytes)
    fd = os.open(path, os.O_RDWR)
    try:
        area = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        mapped = torch.frombuffer(area, dtype=torch.uint8)
        mapped.copy_(pageable)
        timed("cudaHostRegister(/dev/shm map)", lambda: torch.cuda.check_error(cudart.cudaHostRegister(mapped.data_ptr(), nbytes, 0)))
        device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        side = torch.cuda.Stream()

        def copy_from(source: torch.Tensor) -> None:
            with torch.cuda.stream(side):
                device.copy_(source, non_blocking=True)
            side.synchronize()

        pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        pinned.copy_(pageable)
        timed("H2D from registered /dev/shm map", lambda: copy_from(mapped))
        timed("H2D from pageable", lambda: copy_from(pageable))
        timed("H2D from pinned", lambda: copy_from(pinned))
        timed("cudaHostUnregister(/dev/shm map)", lambda: torch.cuda.check_error(cudart.cudaHostUnregister(mapped.data_ptr())))
        del mapped, pinned, device
        area.close()
    finally:
        os.close(fd)
        os.unlink(path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=336)
    parser.add_argument("--tries", type=int, default=3)
    args = parser.parse_args()
    nbytes = args.mb << 20
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    steps: list[tuple[float, float]] = []
    stop = threading.Event()

    def step_loop() -> None:
        while not stop.is_set():
            began = time.perf_counter()
            for _ in range(8):
                a @ a  # noqa: B018 (GPU work)
            torch.cuda.synchronize()
            steps.append((began, time.perf_counter()))

    windows: list[tuple[str, float, float]] = []

    def timed(name: str, action) -> None:
        time.sleep(1.0)
        began = time.perf_counter()
        action()
        windows.append((name, began, time.perf_counter()))

    cudart = torch.cuda.cudart()
    loop = threading.Thread(target=step_loop)
    loop.start()
    try:
        time.sleep(1.0)
        for _ in range(args.tries):
            held: list[torch.Tensor] = []
            timed("cudaHostAlloc", lambda: held.append(torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)))

            def free() -> None:
                held.clear()
                torch._C._host_emptyCache()

            timed("cudaFreeHost", free)
            pageable = torch.ones(nbytes, dtype=torch.uint8)
            timed("cudaHostRegister", lambda: torch.cuda.check_error(cudart.cudaHostRegister(pageable.data_ptr(), nbytes, 0)))
            timed("cudaHostUnregister", lambda: torch.cuda.check_error(cudart.cudaHostUnregister(pageable.data_ptr())))
            shm_copies(timed, cudart, nbytes, pageable)
        time.sleep(1.0)
    finally:
        stop.set()
        loop.join()
    step_ms = [(b, (e - b) * 1000) for b, e in steps]

    def longest(lo: float, hi: float) -> float:
        return max((ms for b, ms in step_ms if lo - 0.05 < b < hi), default=0.0)

    inside = set()
    for name, began, ended in windows:
        worst = longest(began, ended)
        inside.update(b for b, _ in step_ms if began - 0.05 < b < ended)
        print(f"{name}: {(ended - began) * 1000:.1f} ms; longest step-loop iteration meanwhile {worst:.1f} ms")
    outside = [ms for b, ms in step_ms if b not in inside]
    outside.sort()
    print(
        f"outside: {len(outside)} iterations, p50 {outside[len(outside) // 2]:.1f} ms, "
        f"max {outside[-1]:.1f} ms"
    )


if __name__ == "__main__":
    main()
