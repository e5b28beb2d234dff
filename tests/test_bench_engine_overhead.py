"""Pure tests of the engine-overhead row's arithmetic and verdict (no server)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from benchmarks.engine_overhead import MIN_RATIO, Overhead, Window, tree_cpu_s
from benchmarks.stats import UntrustworthyRunError


def windows(
    tokens: list[float], cpu_s: float = 1.0, gaps: tuple[float, ...] = (10.0, 20.0, 30.0)
) -> list[Window]:
    """Windows of 2 s of wall time each."""
    return [Window(t, 2.0, cpu_s, gaps) for t in tokens]


def test_ratios_are_taken_per_round_then_summarised() -> None:
    run = Overhead({"ours": windows([90, 100, 120], cpu_s=0.5), "vllm": windows([100, 100, 100])})
    assert run.ratios() == pytest.approx([0.9, 1.0, 1.2])
    assert (run.ratio.median, run.ratio.min, run.ratio.max) == pytest.approx((1.0, 0.9, 1.2))
    assert run.ratios("tokens_per_cpu_s") == pytest.approx([1.8, 2.0, 2.4])
    assert run.figure("ours", "tokens_per_s").median == pytest.approx(50.0)
    assert run.passed
    assert "ok" in run.verdict() and "REGRESSION" not in run.rows()[0][4]


def test_the_check_is_on_cpu_not_on_a_busy_machines_tokens_per_s() -> None:
    """Ours at half vLLM's tokens/s (a neighbour took the cores) for the same CPU per token."""
    run = Overhead({"ours": windows([50] * 3, cpu_s=0.5), "vllm": windows([100] * 3)})
    assert run.ratio.median == pytest.approx(0.5)
    assert run.cpu_ratio.median == pytest.approx(1.0)
    assert run.passed


def test_more_cpu_per_token_is_flagged_in_the_line_the_row_and_the_json() -> None:
    more = 1 / (MIN_RATIO - 0.05)
    run = Overhead({"ours": windows([100] * 3, cpu_s=more), "vllm": windows([100] * 3)})
    assert not run.passed
    assert run.verdict().startswith("engine overhead REGRESSION")
    assert run.rows()[0][4].startswith("REGRESSION")
    figures = run.to_json()
    assert figures["passed"] is False and figures["min_ratio"] == MIN_RATIO


def test_gaps_are_each_rounds_tail_summarised_over_rounds() -> None:
    run = Overhead(
        {
            "ours": [Window(1, 1, 1, (1.0, 2.0, 9.0)), Window(1, 1, 1, (3.0, 4.0, 5.0))],
            "vllm": windows([1, 1]),
        }
    )
    gaps = run.gaps("ours")
    assert (gaps["max"].min, gaps["max"].max) == (5.0, 9.0)
    assert (gaps["p50"].min, gaps["p50"].max) == (2.0, 4.0)


def test_a_window_without_tokens_or_cpu_or_unpaired_rounds_is_untrustworthy() -> None:
    silent = [Window(1, 1, 1, (1.0,)), Window(0, 1, 1, ())]
    with pytest.raises(UntrustworthyRunError, match=r"vllm streamed no tokens .* rounds \[1\]"):
        Overhead({"ours": windows([1, 1]), "vllm": silent}).check()
    idle = windows([1, 1], cpu_s=0.0)
    with pytest.raises(UntrustworthyRunError, match=r"ours streamed no tokens .* rounds \[0, 1\]"):
        Overhead({"ours": idle, "vllm": windows([1, 1])}).check()
    with pytest.raises(ValueError, match="unpaired"):
        Overhead({"ours": windows([1, 1]), "vllm": windows([1])}).check()


def test_the_cpu_of_a_process_tree_counts_its_children() -> None:
    # A grandchild that spins for 0.3 s of CPU and then stays (an exited one's
    # CPU moves to its parent's children's total, which no one here reads).
    spin = "import time\nend = time.process_time() + 0.3\nwhile time.process_time() < end: pass\n"
    spin += "time.sleep(30)\n"
    child = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {spin!r}])"
    parent = subprocess.Popen([sys.executable, "-c", child], start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while tree_cpu_s(parent.pid) < 0.3 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert tree_cpu_s(parent.pid) >= 0.3
        assert tree_cpu_s(os.getpid()) > 0
    finally:
        os.killpg(parent.pid, signal.SIGKILL)  # the grandchild too
        parent.wait()
