"""Adapter file reads beside a busy step loop: safetensors tensor by tensor
against one call into one buffer.

The staging thread reads a new adapter version with vLLM's own
``LoRAModel.from_local_checkpoint`` while the step loop keeps serving the
other tenants, in one process, under one GIL. On an H100 that read took
20 ms idle and 36-45 ms at the median under load (113 ms at worst) for a
rank-16 adapter of the GPU perf model (staging logs of 1bfa1da, 2026-11-23), the largest
part of a swap. This times vLLM's read of such an adapter (16 decoder
layers, hidden 2048, 224 bf16 tensors, 18.6 MB) two ways, beside the
stand-in step loop of :mod:`benchmarks.step_loop`:

* ``safetensors``: vLLM's read as it ships (``get_tensor`` per tensor, then
  ``pin_memory`` per tensor where vLLM pins);
* ``one_buffer``: the same call with its file opened by
  :class:`skyrl_lora.server.adapters.adapter_file.OneBufferFile`, as the server's
  staging thread does.

It also splits vLLM's own read, idle: the tensors out of safetensors, and
their ``pin_memory`` calls. Pinning happens where vLLM pins (a machine with
CUDA). Runs in a process of its own: ``python -m benchmarks.adapter_read``
prints the figures as JSON.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import tempfile
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.stats import Spread, median
from benchmarks.step_loop import interleaved, round_ratio, staging_switch_interval, timed_ms

METHODS = ("safetensors", "one_buffer")
ROUNDS = 5
READS_PER_ROUND = 5
RANK = 16


@dataclass(frozen=True)
class AdapterReadFigures:
    """Per round and method: median read time and the step loop's longest
    iteration during the reads; idle: medians without the loop."""

    read_ms: dict[str, list[float]]
    loop_max_ms: dict[str, list[float]]
    idle_read_ms: dict[str, float]
    #: vLLM's own read split, idle: ``tensors`` out of safetensors, their ``pin``.
    idle_parts_ms: dict[str, float]
    loop_outside_p99_ms: float
    tensors: int
    adapter_mb: float
    pinned: bool

    def ratio(self, figure: str) -> Spread:
        """one buffer / safetensors, round by round."""
        return round_ratio(getattr(self, figure), "one_buffer", "safetensors")


def measure() -> AdapterReadFigures:
    """Write the adapter and time both reads, in this process."""
    import safetensors
    import torch
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    from benchmarks.vllm_layers import DecoderShape, write_random_adapter
    from skyrl_lora.server import compat
    from skyrl_lora.server.adapters.adapter_file import OneBufferFile
    from skyrl_lora.server.embedded.builder import TARGET_MODULES
    from skyrl_lora.server.transfer import tensor_pickle

    torch.set_num_threads(1)
    pinned = compat.lora_pin_memory()
    host_buffers = tensor_pickle.host_buffers(pinned)
    one_buffer = threading.local()
    compat.route_lora_file_opens(
        lambda path: OneBufferFile(path, host_buffers) if getattr(one_buffer, "on", False) else None
    )
    with tempfile.TemporaryDirectory() as tmp:
        adapter = write_random_adapter(DecoderShape(), Path(tmp) / "a", RANK, 0, "perf")
        data = adapter / "adapter_model.safetensors"
        helper = PEFTHelper.from_local_dir(str(adapter), 2048)

        def read(method: str) -> Any:
            one_buffer.on = method == "one_buffer"
            try:
                with staging_switch_interval():
                    return LoRAModel.from_local_checkpoint(
                        str(adapter),
                        set(TARGET_MODULES),
                        helper,
                        lora_model_id=1,
                        device="cpu",
                        dtype=torch.bfloat16,
                    )
            finally:
                one_buffer.on = False

        def tensors() -> list[Any]:
            with safetensors.safe_open(str(data), framework="pt") as file:
                return [file.get_tensor(name) for name in file.keys()]  # noqa: SIM118

        loaded = tensors()
        parts = {
            "tensors": median([timed_ms(tensors) for _ in range(10)]),
            "pin": median([timed_ms(lambda: [t.pin_memory() for t in loaded]) for _ in range(10)])
            if pinned
            else 0.0,
        }
        beside = interleaved(
            {m: functools.partial(read, m) for m in METHODS},
            ROUNDS,
            READS_PER_ROUND,
        )
        return AdapterReadFigures(
            read_ms=beside.call_ms,
            loop_max_ms=beside.loop_max_ms,
            idle_read_ms=beside.idle_ms,
            idle_parts_ms=parts,
            loop_outside_p99_ms=beside.loop_outside_p99_ms,
            tensors=len(loaded),
            adapter_mb=round(data.stat().st_size / 1e6, 1),
            pinned=pinned,
        )


def run() -> AdapterReadFigures:
    """:func:`measure` in a fresh process."""
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.adapter_read"],
        capture_output=True,
        text=True,
        check=True,
    )
    return AdapterReadFigures(**json.loads(out.stdout.strip().splitlines()[-1]))


if __name__ == "__main__":
    print(json.dumps(asdict(measure())))
