"""Slot writes on CUDA: batched against vLLM's per-layer calls, beside a busy step loop.

Runs :mod:`benchmarks.slot_write` with the stacked tensors on the GPU and
the adapter in pinned host memory, as the engine holds them (vLLM's layers,
the perf model's shape, rank 16). On the H100 vLLM's per-layer write of
that adapter took 12 ms idle and 39-41 ms under load in the real engine
(staging log of a9b1106, 2026-11-23), most of it tensor-call overhead and GIL
hand-overs; the batched write makes two calls. Also a fresh slot's first
write, idle: recorded, or another slot's plan moved to it (0f34c81; on an
H200 the recording took 70-105 ms in the engine for the 8B shape). Writes
``slot_write.json`` to ``$OUT`` and ``docs/gpu/``. Takes about 15 s, no server.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

from benchmarks import slot_write
from benchmarks.stats import Spread

ROOT = Path(__file__).resolve().parent.parent


def test_batched_slot_writes_beat_vllms_per_layer_writes_on_cuda() -> None:
    import torch

    figures = slot_write.run("cuda")
    text = json.dumps({"gpu": torch.cuda.get_device_name(0), **asdict(figures)}, indent=2)
    for out in (Path(os.environ.get("OUT") or ROOT / "docs" / "gpu"), ROOT / "docs" / "gpu"):
        out.mkdir(parents=True, exist_ok=True)
        (out / "slot_write.json").write_text(text)
    print(text)
    assert figures.idle_write_ms["batched"] < figures.idle_write_ms["per_layer"]
    assert (
        Spread.of(figures.write_ms["batched"]).median
        < Spread.of(figures.write_ms["per_layer"]).median
    )
    first = {how: Spread.of(ms).median for how, ms in figures.first_write_ms.items()}
    assert first["moved"] < first["recorded"]
