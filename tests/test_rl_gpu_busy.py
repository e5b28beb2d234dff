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

from examples.rl.engine_rate import uncovered
from examples.rl.gpu_busy import GpuBusy, cpu_seconds, process_kind
from examples.rl.report import ModeRun, gpu_busy


class FakeNvml:
    """Hands out the readings queued in ``device`` and ``processes``."""

    class NVMLError(Exception):
        pass

    def __init__(self, device: list[float], processes: list[list[tuple[int, float]] | None]):
        self.device = device
        self.processes = processes
        self.seen: list[int] = []
        self.running: list[int] = []

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        return SimpleNamespace(gpu=self.device.pop(0))

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> Any:
        return [SimpleNamespace(pid=pid) for pid in self.running]

    def nvmlDeviceGetProcessUtilization(self, handle: Any, last_seen: int) -> Any:
        self.seen.append(last_seen)
        samples = self.processes.pop(0)
        if samples is None:
            raise self.NVMLError("not found")
        stamp = 1000 * len(self.seen)
        return [SimpleNamespace(pid=p, smUtil=u, timeStamp=stamp) for p, u in samples]


def _wait_for_title(pid: int) -> None:
    for _ in range(500):  # until exec has renamed it
        if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"VLLM"):
            return
        time.sleep(0.01)


@pytest.fixture
def engine_pid() -> Any:
    """A process titled as vLLM titles its engine."""
    child = subprocess.Popen(["bash", "-c", "exec -a VLLM::EngineCore sleep 60"])
    try:
        _wait_for_title(child.pid)
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
    whole = busy.between(t[0], t[-1])
    assert whole == {
        "device_busy_pct": 50.0,
        "engine_sm_pct": 20.0,
        "learners_sm_pct": 70.0 / 3,
        "engine_cpu_pct": whole["engine_cpu_pct"],
        "readings": 3.0,
    }
    assert busy.inside([(t[1], t[1])])["device_busy_pct"] == 50.0
    assert busy.between(t[-1] + 1, t[-1] + 2)["readings"] == 0.0

    sync = SimpleNamespace(start=t[0] - 1, end=(t[0] + t[1]) / 2)  # reading 0 only
    logs: Any = {"a": SimpleNamespace(swaps=[sync])}
    run = ModeRun("global", logs, None, t[0] - 1, t[-1], busy)  # type: ignore[arg-type]
    split = gpu_busy(run)
    assert split is not None
    assert split["during_syncs"]["device_busy_pct"] == 100.0
    assert split["outside_syncs"] == {
        "device_busy_pct": 25.0,
        "engine_sm_pct": 0.0,
        "learners_sm_pct": 20.0,
        "engine_cpu_pct": 0.0,  # nothing reported an engine to read the CPU time of
        "readings": 2.0,
    }
    assert gpu_busy(ModeRun("global", {}, None, 0.0, 1.0)) is None  # type: ignore[arg-type]


def test_the_engines_cpu_time_is_read_from_proc() -> None:
    """A process titled as the engine, spinning: its CPU share shows."""
    spin = subprocess.Popen(
        ["bash", "-c", "exec -a VLLM::EngineCore bash -c 'while :; do :; done'"]
    )
    try:
        _wait_for_title(spin.pid)
        nvml = FakeNvml(device=[0.0] * 3, processes=[None] * 3)
        nvml.running = [spin.pid]
        busy = GpuBusy(nvml, handle=None)
        for _ in range(3):
            busy.read()
            time.sleep(0.3)
        cpu = busy.between(busy.times[0], busy.times[-1])["engine_cpu_pct"]
        assert 50 < cpu < 150, cpu  # one thread spinning: about one core
    finally:
        spin.kill()
        spin.wait()
    assert cpu_seconds(spin.pid) == 0.0  # gone


def test_the_time_outside_windows() -> None:
    assert uncovered([(2.0, 3.0), (2.5, 4.0), (6.0, 7.0)], 1.0, 8.0) == [
        (1.0, 2.0),
        (4.0, 6.0),
        (7.0, 8.0),
    ]
    assert uncovered([(0.0, 9.0)], 1.0, 8.0) == []
    assert uncovered([], 1.0, 2.0) == [(1.0, 2.0)]


def test_no_gpu_means_no_poll() -> None:
    assert GpuBusy.open(index=99) is None


def test_the_poll_reads_until_stopped_and_once_after() -> None:
    import asyncio

    busy = GpuBusy(FakeNvml(device=[50.0] * 100, processes=[None] * 100), None, interval=0.02)

    async def run_briefly() -> float:
        stop = asyncio.Event()
        polling = asyncio.create_task(busy.run(stop))
        await asyncio.sleep(0.2)
        stop.set()
        stopped = time.monotonic()
        await polling
        return stopped

    stopped = asyncio.run(run_briefly())
    assert len(busy.times) >= 3
    assert busy.times[-1] >= stopped  # the last reading came after the stop
    assert busy.between(busy.times[0], busy.times[-1])["device_busy_pct"] == 50.0
