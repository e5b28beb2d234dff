"""``benchmarks.cpu_neighbour``: a step loop that times itself, and how a
benchmark reads which of its steps a send stretched."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.cpu_neighbour import Neighbour, Window, overlapping, stretched
from benchmarks.push_receive import tree_cpu_s


def test_a_step_counts_for_every_window_it_overlaps() -> None:
    steps = [(10.000, 5.0), (10.005, 40.0), (10.045, 5.0), (11.000, 5.0)]
    assert overlapping(steps, Window(10.010, 10.020)) == [40.0], "ran across the window"
    assert overlapping(steps, Window(10.004, 10.006)) == [5.0, 40.0]
    assert overlapping(steps, Window(10.060, 10.900)) == [], "nothing ran then"


def test_stretch_is_each_sends_longest_step_over_the_quiet_median() -> None:
    quiet = [Window(0.0, 1.0)]
    steps = [(0.1 * i, 5.0) for i in range(10)]  # quiet: 5 ms each
    steps += [(2.0, 5.0), (2.005, 25.0), (3.0, 9.0)]
    sends = [Window(2.0, 2.02), Window(3.0, 3.01), Window(4.0, 4.01)]  # the last saw no step
    seen = stretched(steps, sends, quiet)
    assert seen["quiet_step_ms"] == 5.0
    over = seen["longest_step_over_quiet_ms"]
    assert (over["min"], over["max"], over["rounds"]) == (4.0, 20.0, 2)
    assert seen["steps_during_sends_ms"]["max"] == 25.0
    with pytest.raises(ValueError, match="quiet"):
        stretched(steps, sends, [Window(50.0, 51.0)])


def test_the_neighbour_runs_steps_of_about_its_size_until_stopped(tmp_path: Path) -> None:
    neighbour = Neighbour(5.0, tmp_path / "steps.json")
    neighbour.start()
    time.sleep(1.5)
    steps = neighbour.stop()
    starts = [start for start, _ in steps]
    assert len(steps) >= 20 and starts == sorted(starts)
    lengths = sorted(ms for _, ms in steps)
    assert 1.0 < lengths[len(lengths) // 2] < 25.0, "about 5 ms on a core it mostly has"
    neighbour.kill()  # stopped already: nothing to do


def test_a_run_that_fails_leaves_no_neighbour_behind(tmp_path: Path) -> None:
    neighbour = Neighbour(5.0, tmp_path / "steps.json")
    neighbour.kill()  # never started: nothing to do
    neighbour.start()
    neighbour.kill()
    assert neighbour._process is not None and neighbour._process.returncode is not None


def test_tree_cpu_counts_the_processes_below_this_one() -> None:
    """A child that burnt 0.4 s of CPU (and lives on) is counted in its parent's tree."""
    before = tree_cpu_s(os.getpid())
    burn = (
        "import sys, time\n"
        "t = time.process_time()\n"
        "while time.process_time() - t < 0.4: pass\n"
        "print('burnt', flush=True); time.sleep(30)"
    )
    child = subprocess.Popen([sys.executable, "-c", burn], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline() == b"burnt\n"
        assert tree_cpu_s(os.getpid()) - before >= 0.35
        assert tree_cpu_s(child.pid) >= 0.35
    finally:
        child.kill()
        child.wait()
