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
interval (:data:`skyrl_lora.server.loading.staging.STAGING_SWITCH_INTERVAL_S`).

Each round writes with both methods, the order alternating round by round:
vLLM's own ``set_lora`` per layer, and
:class:`skyrl_lora.server.loading.slot_batch.BatchedSlotWriter` (its first write
records, the rest replay). Runs in a process of its own (vLLM's
distributed state is process-wide): ``python -m benchmarks.slot_write``
prints the figures as JSON.

Then, idle, a fresh slot's first write after another slot's: recorded (each
layer's ``set_lora`` run under the recorder, as every fresh slot was until
0f34c81) against the other slot's plan moved to it, and a replay after
either, the order alternating round by round. On an H200 the recording
took 70-105 ms of the engine's CPU for the 8B shape's 128 layers, and the
other tenants' longest gap of a run was that write.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from benchmarks.stats import Spread
from benchmarks.step_loop import interleaved, round_ratio, staging_switch_interval, timed_ms

METHODS = ("per_layer", "batched")
#: A fresh slot's first write: how the writer comes by the slot's plan.
FIRST_WRITES = ("recorded", "moved")
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
    #: Per round, idle: a fresh slot's first write by each of
    #: :data:`FIRST_WRITES`, and a write replaying the slot's plan after it.
    first_write_ms: dict[str, list[float]] = field(
        default_factory=lambda: {m: [] for m in (*FIRST_WRITES, "replayed")}
    )
    #: The per-round figures, each ``{method: [per round]}``.
    FIGURES: ClassVar[tuple[str, ...]] = ("write_ms", "loop_max_ms")

    def ratio(self, figure: str) -> Spread:
        """batched / per-layer, round by round."""
        return round_ratio(getattr(self, figure), "batched", "per_layer")

    def first_write_ratio(self) -> Spread:
        """A fresh slot's first write, moved / recorded, round by round."""
        return round_ratio(self.first_write_ms, "moved", "recorded")


def measure(device: str) -> SlotWriteFigures:
    """Build the layers on ``device`` and time both methods, in this process."""
    import torch

    from benchmarks.vllm_layers import (
        DecoderShape,
        decoder_lora_layers,
        random_lora_weights,
        single_process_group,
    )
    from skyrl_lora.server.loading.slot_batch import BatchedSlotWriter

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

    def adapter() -> Iterator[tuple[str, Any, Any]]:
        """The adapter as a slot write takes it: ``(name, lora_a, lora_b)``."""
        return ((name, *weights[name]) for name in layers)

    def batched() -> None:
        writer.write(1, adapter())

    def synced(write: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:  # the prefill waits for its copies to land
            with staging_switch_interval():
                write()
                if on_gpu:
                    torch.cuda.synchronize()

        return run

    write = {"per_layer": synced(per_layer), "batched": synced(batched)}
    beside = interleaved(write, ROUNDS, WRITES_PER_ROUND)  # the first write records
    figures = SlotWriteFigures(
        write_ms=beside.call_ms,
        loop_max_ms=beside.loop_max_ms,
        idle_write_ms=beside.idle_ms,
        loop_outside_p99_ms=beside.loop_outside_p99_ms,
        layers=len(layers),
        device=device,
    )
    for round_ in range(ROUNDS):
        order = FIRST_WRITES if round_ % 2 == 0 else FIRST_WRITES[::-1]
        for how in order:
            fresh = BatchedSlotWriter(layers, move_plans=how == "moved")
            fresh.write(0, adapter())  # slot 0's plan

            def into_slot_1(writer: BatchedSlotWriter = fresh) -> None:
                writer.write(1, adapter())

            figures.first_write_ms[how].append(timed_ms(synced(into_slot_1)))
            if how == "moved":
                figures.first_write_ms["replayed"].append(timed_ms(synced(into_slot_1)))
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
