"""The opt-in staging profiler: off by default, and when asked the first N
stagings' op tables and traces."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from skyrl_lora.server.loading.staging_profile import ENV, StagingProfiler


def test_off_without_the_variable_and_parsed_with_it(tmp_path: Path) -> None:
    assert StagingProfiler.from_env({}).folder is None
    profiler = StagingProfiler.from_env({ENV: f"{tmp_path},3"})
    assert (profiler.folder, profiler.count) == (tmp_path, 3)
    assert StagingProfiler.from_env({ENV: str(tmp_path)}).count == 8


def test_profiles_the_first_n_stagings_only(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    profiler = StagingProfiler(tmp_path, count=2)
    for i in range(3):
        with profiler.capture(f"tenant@{i}/x"):
            torch.ones(64, 64).mul_(2.0).sum()
    deadline = time.monotonic() + 30
    while len(list(tmp_path.glob("*.txt"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)  # a third, if one were written
    tables = sorted(tmp_path.glob("*.txt"))
    assert [t.name.split("-", 2)[2] for t in tables] == ["1-tenant@0_x.txt", "2-tenant@1_x.txt"]
    assert "aten::mul_" in tables[0].read_text()
    deadline = time.monotonic() + 30  # the trace is written after the table
    while not tables[1].with_suffix(".json").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    trace = json.loads(tables[1].with_suffix(".json").read_text())
    assert any(e.get("name") == "aten::mul_" for e in trace["traceEvents"])
