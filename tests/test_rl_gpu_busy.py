"""The RL run's GPU busy poll (:mod:`examples.rl.gpu_busy`), with NVML stood in.

NVML needs a GPU; what is tested here is what the poll makes of its
readings: the engine told apart from the learners by its process title,
NVML's "no sample since" error read as no kernel, and the means over a
mode, its syncs and the rest. The poll itself runs on the GPU in the RL
example's runs (``docs/gpu.md``).
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from examples.rl.gpu_busy import GpuBusy, process_kind
from examples.rl.report import ModeRun, gpu_busy


class FakeNvml:
    """Hands out the readings queued in ``device`` and ``processes``."""

    class NVMLError(Exception):
        pass

    def __init__(self, device: list[float], processes: list[list[tuple[int, float]] | None]):
        self.device = device
        self.processes = processes
        self.seen: list[int] = []

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        return SimpleNamespace(gpu=self.device.pop(0))

    def nvmlDeviceGetProcessUtilization(self, handle: Any, last_seen: int) -> Any:
        self.seen.append(last_seen)
        samples = self.processes.pop(0)
        if samples is None:
            raise self.NVMLError("not found")
        stamp = 1000 * len(self.seen)
        return [SimpleNamespace(pid=p, smUtil=u, timeStamp=stamp) for p, u in samples]


@pytest.fixture
def engine_pid() -> Any:
    """A process titled as vLLM titles its engine."""
    child = subprocess.Popen(["bash", "-c", "exec -a VLLM::EngineCore sleep 60"])
    try:
        for _ in range(500):  # until exec has renamed it
            if Path(f"/proc/{child.pid}/cmdline").read_bytes().startswith(b"VLLM"):
                break
            time.sleep(0.01)
        yield child.pid
    finally:
        child.kill()
        child.wait()


def test_the_engine_is_told_apart_by_its_title(engine_pid: int) -> None:
    assert process_kind(engine_pid) == "engine"
    assert process_kind(os.getpid()) == "learners"
    assert process_kind(2**22 + 1) == "learners"  # gone, or never was


def test_readings_are_split_by_kind_and_averaged_over_windows(engine_pid: int) -> None:
    me = os.getpid()
    nvml = FakeNvml(
        device=[100.0, 50.0, 0.0],
        processes=[[(engine_pid, 60.0), (me, 30.0)], [(me, 40.0)], None],
    )
    busy = GpuBusy(nvml, handle=None)
    for _ in range(3):
        busy.read()
    assert nvml.seen == [0, 1000, 2000]  # each asks only for samples since the last
    t = busy.times
    assert busy.between(t[0], t[-1]) == {
        "device_busy_pct": 50.0,
        "engine_sm_pct": 20.0,
        "learners_sm_pct": 70.0 / 3,
        "readings": 3.0,
    }
    assert busy.inside([(t[1], t[1])])["device_busy_pct"] == 50.0
    assert busy.between(t[-1] + 1, t[-1] + 2)["readings"] == 0.0

    swap = SimpleNamespace(start=t[0], end=t[0])
    logs: Any = {"a": SimpleNamespace(swaps=[swap])}
    run = ModeRun("global", logs, None, t[0], t[-1], busy)  # type: ignore[arg-type]
    split = gpu_busy(run)
    assert split is not None
    assert split["during_syncs"]["device_busy_pct"] == 100.0
    assert split["outside_syncs"] == {
        "device_busy_pct": 25.0,
        "engine_sm_pct": 0.0,
        "learners_sm_pct": 20.0,
        "readings": 2.0,
    }
    assert gpu_busy(ModeRun("global", {}, None, 0.0, 1.0)) is None  # type: ignore[arg-type]


def test_no_gpu_means_no_poll() -> None:
    assert GpuBusy.open(index=99) is None
