"""Slot writes beside a busy step loop: batched against vLLM's per-layer calls.

The staging thread writes a new adapter version into a free engine slot
while the step loop keeps serving the other tenants, in one process, under
one GIL. This measures that contention alone, with vLLM's own LoRA layer
classes shaped as the GPU perf model's (16 decoder layers, hidden 2048, a
rank-16 adapter: 64 LoRA layers, 224 A and B tensors) on the CPU or on a
GPU (``--device cuda``: stacked tensors there, adapters in pinned host
memory, as in the engine). A thread stands in for the step loop: about
2 ms of scheduling in Python with a small tensor op every few dozen
microseconds, then 4 ms waiting for the device without the GIL. Its
iterations that overlap a write are what the other tenants would feel as a
longer inter-token gap. Writes run with the server's staging switch
interval (:data:`skyrl_lora.server.staging.STAGING_SWITCH_INTERVAL_S`).

Each round writes with both methods, the order alternating round by round:
vLLM's own ``set_lora`` per layer, and
:class:`skyrl_lora.server.slot_batch.BatchedSlotWriter` (its first write
records, the rest replay). Runs in a process of its own (vLLM's
distributed state is process-wide): ``python -m benchmarks.slot_write``
prints the figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from benchmarks.stats import Spread, median, percentile

METHODS = ("per_layer", "batched")
ROUNDS = 5
WRITES_PER_ROUND = 5
RANK = 16


@dataclass
class SlotWriteFigures:
    """Per round and method: median write time and the step loop's longest
    iteration during the writes; outside: its iterations between writes."""

    write_ms: dict[str, list[float]] = field(default_factory=lambda: {m: [] for m in METHODS})
    loop_max_ms: dict[str, list[float]] = field(default_factory=lambda: {m: [] for m in METHODS})
    idle_write_ms: dict[str, float] = field(default_factory=dict)
    loop_outside_p99_ms: float = 0.0
    layers: int = 0
    device: str = "cpu"
    #: The per-round figures, each ``{method: [per round]}``.
    FIGURES: ClassVar[tuple[str, ...]] = ("write_ms", "loop_max_ms")

    def ratio(self, figure: str) -> Spread:
        """batched / per-layer, round by round."""
        values: dict[str, list[float]] = getattr(self, figure)
        return Spread.of(b / a for a, b in zip(values["per_layer"], values["batched"]))


class _StepLoopStandIn:
    """A thread that holds the GIL as a step loop does: Python scheduling with
    small tensor ops, then a wait for the device that lets the GIL go."""

    def __init__(self) -> None:
        import torch

        self._small = torch.zeros(64)
        self._stop = threading.Event()
        self.iterations: list[tuple[float, float]] = []
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.perf_counter()
            for _ in range(40):  # the scheduler's bookkeeping, input preparation
                queue = {i: i for i in range(100)}
                del queue
                self._small.add_(1)
            time.sleep(0.004)  # the forward on the device: the GIL is let go
            self.iterations.append((started, time.perf_counter()))

    def __enter__(self) -> _StepLoopStandIn:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def longest_within(self, start: float, end: float) -> float:
        return max(
            ((b - a) * 1000 for a, b in self.iterations if b > start and a < end), default=0.0
        )


def measure(device: str) -> SlotWriteFigures:
    """Build the layers on ``device`` and time both methods, in this process."""
    import torch

    from benchmarks.vllm_layers import (
        DecoderShape,
        decoder_lora_layers,
        random_lora_weights,
        single_process_group,
    )
    from skyrl_lora.server.slot_batch import BatchedSlotWriter
    from skyrl_lora.server.staging import STAGING_SWITCH_INTERVAL_S

    torch.set_num_threads(1)
    on_gpu = device != "cpu"
    with (
        tempfile.TemporaryDirectory() as tmp,
        single_process_group(Path(tmp) / "rendezvous"),
        torch.device(device),
    ):
        layers = decoder_lora_layers(DecoderShape(), slots=2, max_rank=RANK, dtype=torch.bfloat16)
    weights = {
        name: _on_host(random_lora_weights(layer, RANK, seed=0), pin=on_gpu)
        for name, layer in layers.items()
    }
    writer = BatchedSlotWriter(layers)

    def per_layer() -> None:
        for name, layer in layers.items():
            layer.set_lora(1, *weights[name])

    def batched() -> None:
        writer.write(1, ((name, *weights[name]) for name in layers))

    def synced(write: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:  # the prefill waits for its copies to land
            previous = sys.getswitchinterval()
            sys.setswitchinterval(STAGING_SWITCH_INTERVAL_S)
            try:
                write()
                if on_gpu:
                    torch.cuda.synchronize()
            finally:
                sys.setswitchinterval(previous)

        return run

    write = {"per_layer": synced(per_layer), "batched": synced(batched)}
    figures = SlotWriteFigures(layers=len(layers), device=device)
    for method in METHODS:
        write[method]()  # first write: batched records, views cached
        figures.idle_write_ms[method] = median([_timed(write[method]) for _ in range(10)])
    windows: list[tuple[float, float]] = []
    with _StepLoopStandIn() as loop:
        time.sleep(0.2)
        for round_ in range(ROUNDS):
            order = METHODS if round_ % 2 == 0 else METHODS[::-1]
            for method in order:
                times, longest = [], 0.0
                for _ in range(WRITES_PER_ROUND):
                    time.sleep(0.05)
                    start = time.perf_counter()
                    write[method]()
                    end = time.perf_counter()
                    windows.append((start, end))
                    times.append((end - start) * 1000)
                    longest = max(longest, loop.longest_within(start, end))
                figures.write_ms[method].append(median(times))
                figures.loop_max_ms[method].append(longest)
    outside = [
        (b - a) * 1000 for a, b in loop.iterations if not any(b > s and a < e for s, e in windows)
    ]
    figures.loop_outside_p99_ms = percentile(outside, 99)
    return figures


def _on_host(weights: tuple[Any, Any], pin: bool) -> tuple[Any, Any]:
    """An adapter's A and B as the engine holds them: host memory, pinned
    where a GPU copies from them."""

    def host(t: Any) -> Any:
        t = t.cpu()
        return t.pin_memory() if pin else t

    return tuple(  # type: ignore[return-value]
        [host(t) for t in w] if isinstance(w, list) else host(w) for w in weights
    )


def _timed(call: Callable[[], None]) -> float:
    started = time.perf_counter()
    call()
    return (time.perf_counter() - started) * 1000


def run(device: str = "cpu") -> SlotWriteFigures:
    """:func:`measure` in a fresh process."""
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.slot_write", "--device", device],
        capture_output=True,
        text=True,
        check=True,
    )
    return SlotWriteFigures(**json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.slot_write", description=__doc__)
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    print(json.dumps(asdict(measure(parser.parse_args().device))))


if __name__ == "__main__":
    main()
