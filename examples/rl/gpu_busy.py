"""How busy the GPU is while a mode runs, and whose kernels keep it busy (NVML).

On one GPU shared by the engine and the learners, the per-adapter pause can
only add the engine time that the global pause leaves unused. If the GPU is
busy nearly all the time under the global pause (its stopped engine time
taken up by the learners' training), there is little for the per-adapter
pause to gain in tokens/s, however short its syncs. Five runs showed the
learners' steps growing under the per-adapter pause (``docs/gpu.md``, "Why
per-adapter gains so little tokens/s"); this poll measures the bound
directly: the device's busy share, and each side's share of the SMs.

NVML's device utilisation is the share of its last sample period (1/6 to
1 s) in which any kernel ran; its per-process figure is each process's SM
share over its last period, for processes that ran any. The engine process
is told apart by its title (vLLM names it ``VLLM::EngineCore``); every other
process on the GPU is a learner here. The same poll reads the engine
process's CPU time (``/proc``): an engine whose GPU waits may be waiting
for its own step loop on the CPU. Polled every ``interval`` seconds, the
readings are averaged over any window of the run.
"""

from __future__ import annotations

import asyncio
import bisect
import os
import time
from pathlib import Path
from typing import Any

from examples.rl.engine_rate import poll

ENGINE_TITLE = b"VLLM"


def _nvml() -> Any:
    """NVML's bindings: nvidia-ml-py where installed, else vLLM's own copy."""
    try:
        import pynvml
    except ImportError:
        from vllm.third_party import pynvml  # type: ignore[no-redef]
    return pynvml


def process_kind(pid: int) -> str:
    """``"engine"`` for vLLM's engine process, ``"learners"`` for any other."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "learners"
    return "engine" if cmdline.startswith(ENGINE_TITLE) else "learners"


def cpu_seconds(pid: int) -> float:
    """CPU time (user and system, all threads) of process ``pid``; 0 once gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    # after the title: state is field 3, utime and stime fields 14 and 15
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class GpuBusy:
    """Polls one GPU's utilisation; :meth:`between` averages a window."""

    def __init__(self, nvml: Any, handle: Any, interval: float = 0.1) -> None:
        self._nvml = nvml
        self._handle = handle
        self.interval = interval
        self.times: list[float] = []
        #: Per reading: the device's busy percent, and SM percent by process kind.
        self.device: list[float] = []
        self.sm: list[dict[str, float]] = []
        #: Per reading: the engine processes' CPU seconds so far.
        self.engine_cpu_s: list[float] = []
        self._last_seen = 0
        self._kinds: dict[int, str] = {}

    @classmethod
    def open(cls, index: int = 0, interval: float = 0.1) -> GpuBusy | None:
        """A poll of GPU ``index``; None where NVML finds no GPU (a CPU machine)."""
        try:
            nvml = _nvml()
            nvml.nvmlInit()
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
        except Exception:  # no driver, no library, no such GPU: nothing to poll
            return None
        return cls(nvml, handle, interval)

    async def run(self, stop: asyncio.Event) -> None:
        """Poll until ``stop`` is set (one last reading after it)."""
        await poll(lambda: asyncio.to_thread(self.read), stop, self.interval)

    def read(self) -> None:
        nvml, handle = self._nvml, self._handle
        device = float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
        sm = {"engine": 0.0, "learners": 0.0}
        try:
            samples = nvml.nvmlDeviceGetProcessUtilization(handle, self._last_seen)
        except nvml.NVMLError:  # no process ran a kernel since the last reading
            samples = []
        for sample in samples:
            self._last_seen = max(self._last_seen, int(sample.timeStamp))
            if sample.pid not in self._kinds:
                self._kinds[sample.pid] = process_kind(sample.pid)
            sm[self._kinds[sample.pid]] += float(sample.smUtil)
        for proc in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid not in self._kinds:
                self._kinds[proc.pid] = process_kind(proc.pid)
        engines = [pid for pid, kind in self._kinds.items() if kind == "engine"]
        self.times.append(time.monotonic())
        self.device.append(device)
        self.sm.append(sm)
        self.engine_cpu_s.append(sum(cpu_seconds(pid) for pid in engines))

    def between(self, start: float, end: float) -> dict[str, float]:
        """Mean busy percents of the readings taken from ``start`` to ``end``."""
        lo = bisect.bisect_left(self.times, start)
        return self._means(range(lo, bisect.bisect_right(self.times, end)))

    def inside(self, windows: list[tuple[float, float]]) -> dict[str, float]:
        """The same means over the readings taken inside any of ``windows``."""
        return self._means(
            [i for i, t in enumerate(self.times) if any(a <= t <= b for a, b in windows)]
        )

    def _means(self, picked: range | list[int]) -> dict[str, float]:
        n = max(len(picked), 1)
        # CPU: each reading's share of the time since the one before it
        cpu = [
            (self.engine_cpu_s[i] - self.engine_cpu_s[i - 1])
            / max(self.times[i] - self.times[i - 1], 1e-9)
            for i in picked
            if i > 0
        ]
        return {
            "device_busy_pct": sum(self.device[i] for i in picked) / n,
            "engine_sm_pct": sum(self.sm[i]["engine"] for i in picked) / n,
            "learners_sm_pct": sum(self.sm[i]["learners"] for i in picked) / n,
            "engine_cpu_pct": 100 * sum(cpu) / max(len(cpu), 1),
            "readings": float(len(picked)),
        }
