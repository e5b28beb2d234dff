"""Adapter file reads on a CUDA machine: vLLM's per-tensor read and pinning
against one call into one pinned buffer, beside a busy step loop.

Runs :mod:`benchmarks.adapter_read` where vLLM pins adapters (a rank-16
adapter of the perf model's shape, 224 tensors). On the H100 vLLM's read of
that adapter took 20 ms idle and 36-45 ms at the median under load in the
real engine (staging logs of 1bfa1da, 2026-11-23), the largest part of a swap. Writes
``adapter_read.json`` to ``$OUT`` and ``docs/gpu/``. Takes about 20 s, no server.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

from benchmarks import adapter_read
from benchmarks.stats import Spread

ROOT = Path(__file__).resolve().parent.parent


def test_one_buffer_reads_beat_vllms_per_tensor_reads_where_vllm_pins() -> None:
    import torch

    figures = adapter_read.run()
    text = json.dumps({"gpu": torch.cuda.get_device_name(0), **asdict(figures)}, indent=2)
    for out in (Path(os.environ.get("OUT") or ROOT / "docs" / "gpu"), ROOT / "docs" / "gpu"):
        out.mkdir(parents=True, exist_ok=True)
        (out / "adapter_read.json").write_text(text)
    print(text)
    assert figures.pinned, "vLLM does not pin adapters here: not the machine this measures"
    assert figures.idle_read_ms["one_buffer"] < figures.idle_read_ms["safetensors"]
    assert (
        Spread.of(figures.read_ms["one_buffer"]).median
        < Spread.of(figures.read_ms["safetensors"]).median
    )
