"""Where a GPU hand-over's time goes, step by step, outside the server.

A rank-64 hand-over of the 8B model (448 tensors, 336 MB) took 46 ms idle
on an H100 (823f7b7), of which the engine's staging was 16 ms. This probe
times the other steps alone, in two processes on one GPU, as the trainer
and the engine run them:

* trainer: ``AdapterHandover.update`` (448 ``copy_`` calls into the flat
  buffer and a device synchronize), and ``request()`` (a CUDA IPC share of
  the buffer);
* engine: opening the share (``rebuild_cuda_tensor``), copying it device
  to device on a side stream, and closing it (dropping the tensor), as
  :func:`skyrl_lora.server.transfer.handover.copy_out` does, and the same
  with the share kept open from one hand-over to the next (as
  :mod:`skyrl_lora.server.transfer.open_shares` keeps it);

idle, then under a stand-in for the engine's load (steps of large matrix
products on the default stream, in a thread of the engine process). A
thread that sleeps 0.5 ms at a time measures, in its lateness, how long
another thread held the GIL: "GIL wait in close" is the latest it woke
during a close (compare "GIL wait in copy", where the staging thread waits
with the GIL let go).

``python scripts/probes/handover_steps.py [--rounds N]`` prints one line per
step: median, p90 and max in ms.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections import defaultdict

import torch
import torch.multiprocessing as mp

from skyrl_lora.client import AdapterHandover
from skyrl_lora.server.transfer import handover

#: The 8B model's rank-64 adapter: 32 layers of q/k/v/o/gate/up/down, A and B.
SHAPES = {
    "q_proj": (4096, 4096),
    "k_proj": (4096, 1024),
    "v_proj": (4096, 1024),
    "o_proj": (4096, 4096),
    "gate_proj": (4096, 14336),
    "up_proj": (4096, 14336),
    "down_proj": (14336, 4096),
}


def tensors(rank: int = 64, layers: int = 32) -> dict[str, torch.Tensor]:
    out = {}
    for layer in range(layers):
        for module, (fan_in, fan_out) in SHAPES.items():
            key = f"base_model.model.model.layers.{layer}.{module}"
            out[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, device="cuda").bfloat16()
            out[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, device="cuda").bfloat16()
    return out


def summary(name: str, ms: list[float]) -> str:
    ordered = sorted(ms)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    return f"{name:<34} median {statistics.median(ms):7.2f}  p90 {p90:7.2f}  max {ordered[-1]:7.2f}"


class GilTicker:
    """A thread that sleeps 0.5 ms at a time and notes how late it wakes:
    a thread that wants the GIL back waits while another holds it, so its
    lateness during a step says whether that step held the GIL."""

    def __init__(self) -> None:
        self.ticks: list[tuple[float, float]] = []  # (woke at, late by) in s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.perf_counter()
            time.sleep(0.0005)
            woke = time.perf_counter()
            self.ticks.append((woke, woke - started - 0.0005))

    def latest_in(self, start: float, end: float) -> float:
        """The latest wake-up, in ms, of the ticks that woke in [start, end + 1 ms]."""
        late = [lag for woke, lag in self.ticks if start <= woke <= end + 0.001]
        return max(late, default=0.0) * 1000

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class GpuLoad:
    """A stand-in for the engine's step loop: steps of large matrix products
    on the default stream (where vLLM queues its kernels), each waited for."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for _ in range(8):
                self._a @ self._a
            torch.cuda.synchronize()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def engine(requests: mp.Queue, results: mp.Queue) -> None:
    torch.cuda.init()
    sys.setswitchinterval(0.0005)  # a GIL waiter asks for it back after 0.5 ms, not 5
    stream = torch.cuda.Stream()  # the staging's side stream
    target = torch.empty(0, dtype=torch.uint8, device="cuda")
    kept = None
    load: GpuLoad | None = None
    ticker = GilTicker()
    times: dict[str, list[float]] = defaultdict(list)
    while (request := requests.get()) is not None:
        buffer, keep, loaded = request
        if loaded and load is None:
            load = GpuLoad()
        if not loaded and load is not None:
            load.stop()
            load = None
        where = "under load" if loaded else "idle"
        if target.numel() != buffer["nbytes"]:
            target = torch.empty(buffer["nbytes"], dtype=torch.uint8, device="cuda")
        if not keep and kept is not None:
            kept = None  # the share kept so far closes here, untimed: each round opens afresh
        cached = keep and kept is not None  # torch finds the open share by its handle
        with torch.cuda.stream(stream):
            started = time.perf_counter()
            shared = handover.open_and_wait(buffer, 0)
            opened = time.perf_counter()
            target.copy_(shared)
            stream.synchronize()
            copied = time.perf_counter()
            if keep:
                kept = shared
            del shared  # closes the share unless it is kept
            closed = time.perf_counter()
        open_name = "open (kept)" if cached else "open"
        times[f"{where}: {open_name}"].append((opened - started) * 1000)
        times[f"{where}: copy"].append((copied - opened) * 1000)
        times[f"{where}: GIL wait in copy"].append(ticker.latest_in(opened, copied))
        if not keep:
            times[f"{where}: close"].append((closed - copied) * 1000)
            times[f"{where}: GIL wait in close"].append(ticker.latest_in(copied, closed))
        results.put("done")
    if load is not None:
        load.stop()
    ticker.stop()
    del kept
    results.put(dict(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    mp.set_start_method("spawn")
    requests: mp.Queue = mp.Queue()
    results: mp.Queue = mp.Queue()
    child = mp.Process(target=engine, args=(requests, results))
    child.start()
    weights = tensors()
    print(f"{len(weights)} tensors, {sum(t.numel() * 2 for t in weights.values()) >> 20} MiB")
    adapter = AdapterHandover({"r": 64, "lora_alpha": 128})
    trainer: dict[str, list[float]] = {"update (copies + sync)": [], "request (IPC share)": []}
    for loaded in (False, True):
        for keep in (False, True):
            for _ in range(args.rounds):
                started = time.perf_counter()
                adapter.update(weights)
                updated = time.perf_counter()
                request = adapter.request()
                shared = time.perf_counter()
                trainer["update (copies + sync)"].append((updated - started) * 1000)
                trainer["request (IPC share)"].append((shared - updated) * 1000)
                requests.put((request["buffer"], keep, loaded))
                results.get()
    requests.put(None)
    engine_times = results.get()
    child.join()
    for name, ms in {**trainer, **engine_times}.items():
        if ms:
            print(summary(name, ms))
    adapter.close()


if __name__ == "__main__":
    main()
