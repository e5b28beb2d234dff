"""Figures of a finished run: time to target, staleness, aborts, isolation; table, JSON, plot."""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from examples.rl.engine_rate import EngineTokenCounter, covered, exclusive_windows
from examples.rl.tenant import TenantLog
from skyrl_lora.rl_accounting import staleness_counts


@dataclass(frozen=True)
class ModeRun:
    """One pause mode's run: every tenant's log, the engine's token counter, the clock."""

    mode: str
    logs: Mapping[str, TenantLog]
    counter: EngineTokenCounter
    start: float
    end: float

    @property
    def wall_s(self) -> float:
        return self.end - self.start


def step_to_target(log: TenantLog, target: float) -> int | None:
    """The first step (from 1) whose batch reward reaches ``target``."""
    for step, result in enumerate(log.steps, start=1):
        if result.mean_reward >= target:
            return step
    return None


def time_to_target(log: TenantLog, target: float) -> float | None:
    """Seconds from the mode's start to the end of :func:`step_to_target`."""
    step = step_to_target(log, target)
    return None if step is None else log.step_times[step - 1]


def tenant_staleness(log: TenantLog) -> Counter[int]:
    return staleness_counts(t for step in log.steps for t in step.tokens)


def fresh_log_ratio(log: TenantLog) -> float:
    """Largest |log ratio| over tokens the trainer's own weights produced.

    It should be ~0: the server computed those logprobs with the very weights
    the trainer holds. Anything else means a token was charged to the wrong
    version, or trainer and server disagree on the model.
    """
    return max(
        (
            abs(math.log(r))
            for step in log.steps
            for t in step.tokens
            for s, r in zip(t.staleness, t.ratios)
            if s == 0
        ),
        default=0.0,
    )


def others_rate_during_swaps(run: ModeRun) -> tuple[float, float, float]:
    """(engine tokens/s while exactly one tenant swaps, outside every swap,
    seconds of such lone swaps).

    The swapping tenant is paused during its own swap in both modes, so the
    engine's tokens in a lone swap are the two other tenants'. With the
    global pause they should be near 0; with the per-adapter pause, near the
    rate outside swaps (the paused tenant's share goes to the others).
    """
    swaps = [(s.start, s.end) for log in run.logs.values() for s in log.swaps]
    lone = exclusive_windows(swaps)
    lone_s = sum(b - a for a, b in lone)
    lone_tokens = sum(run.counter.tokens_between(a, b) for a, b in lone)
    busy = covered(swaps)
    busy_s = sum(b - a for a, b in busy)
    busy_tokens = sum(run.counter.tokens_between(a, b) for a, b in busy)
    outside_tokens = run.counter.tokens_between(run.start, run.end) - busy_tokens
    outside = outside_tokens / max(run.wall_s - busy_s, 1e-9)
    return lone_tokens / max(lone_s, 1e-9), outside, lone_s


def summarize(runs: Sequence[ModeRun], target: float, max_staleness: int) -> dict[str, Any]:
    """Everything printed and written, as plain data (the JSON file)."""
    out: dict[str, Any] = {"target": target, "max_staleness": max_staleness, "modes": {}}
    for run in runs:
        inside, outside, lone_s = others_rate_during_swaps(run)
        tenants: dict[str, Any] = {}
        for name, log in run.logs.items():
            counts = tenant_staleness(log)
            total = max(sum(counts.values()), 1)
            swap_ms = sorted((s.end - s.start) * 1000 for s in log.swaps)
            drain_ms = sorted(s.drain_s * 1000 for s in log.swaps)
            tenants[name] = {
                "rewards": [round(s.mean_reward, 4) for s in log.steps],
                "step_times_s": [round(t, 3) for t in log.step_times],
                "versions": log.versions,
                "time_to_target_s": time_to_target(log, target),
                "step_to_target": step_to_target(log, target),
                "samples": log.samples,
                "resumed_samples": log.resumed,
                "samples_spanning_versions": log.spanning,
                "aborted_by_pauses": sum(s.aborted for s in log.swaps),
                "tokens_per_s": log.tokens / run.wall_s,
                "staleness_share": {
                    str(k): counts[k] / total for k in sorted(counts) if k <= max_staleness
                },
                "fresh_max_abs_log_ratio": fresh_log_ratio(log),
                "dropped_share": sum(v for k, v in counts.items() if k > max_staleness) / total,
                "swap_ms_median": swap_ms[len(swap_ms) // 2] if swap_ms else None,
                "drain_ms_median": drain_ms[len(drain_ms) // 2] if drain_ms else None,
                "swap_share_of_wall": sum(s.end - s.start for s in log.swaps) / run.wall_s,
            }
        out["modes"][run.mode] = {
            "wall_s": run.wall_s,
            "seconds_per_step": run.wall_s / max(len(log.steps) for log in run.logs.values()),
            "others_tok_s_during_lone_swaps": inside,
            "lone_swap_s": lone_s,
            "engine_tok_s_outside_swaps": outside,
            "tenants": tenants,
        }
    return out


def _fmt_s(value: float | None) -> str:
    return "never" if value is None else f"{value:.1f} s"


def table(summary: Mapping[str, Any]) -> str:
    """The summary table (markdown, so it pastes into docs/rl.md as is)."""
    target = summary["target"]
    lines = [
        f"| mode | tenant | reward first -> last | time (step) to {target} "
        "| resumed (2+ versions) / samples | staleness 0 / 1 / 2 / dropped "
        "| swap (drain) median | tok/s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for mode, data in summary["modes"].items():
        for name, t in data["tenants"].items():
            shares = [t["staleness_share"].get(str(k), 0.0) for k in range(3)]
            stale = " / ".join(f"{100 * s:.0f}%" for s in [*shares, t["dropped_share"]])
            lines.append(
                f"| {mode} | {name} | {t['rewards'][0]:.2f} -> {t['rewards'][-1]:.2f} "
                f"| {_fmt_s(t['time_to_target_s'])} ({t['step_to_target']}) "
                f"| {t['resumed_samples']} ({t['samples_spanning_versions']}) / {t['samples']} "
                f"| {stale} | {t['swap_ms_median']:.0f} ({t['drain_ms_median']:.0f}) ms "
                f"| {t['tokens_per_s']:.0f} |"
            )
    lines.append("")
    modes = summary["modes"]
    for mode, data in modes.items():
        worst = max(t["fresh_max_abs_log_ratio"] for t in data["tenants"].values())
        lines.append(f"{mode}: largest |log ratio| of a staleness-0 token: {worst:.2g}")
    for mode, data in modes.items():
        lines.append(
            f"{mode}: whole run {data['wall_s']:.1f} s ({data['seconds_per_step']:.2f} s/step); "
            f"other tenants' sampling {data['others_tok_s_during_lone_swaps']:.0f} tok/s while "
            f"one tenant swaps ({data['lone_swap_s']:.1f} s of such swaps), engine "
            f"{data['engine_tok_s_outside_swaps']:.0f} tok/s outside swaps"
        )
    if {"per_adapter", "global"} <= modes.keys():
        a, b = modes["per_adapter"]["seconds_per_step"], modes["global"]["seconds_per_step"]
        lines.append(f"seconds per step, per-adapter / global: {a:.2f} / {b:.2f} = {a / b:.2f}")
        for name in modes["per_adapter"]["tenants"]:
            a = modes["per_adapter"]["tenants"][name]["time_to_target_s"]
            b = modes["global"]["tenants"][name]["time_to_target_s"]
            ratio = f"{a / b:.2f}" if a is not None and b else "n/a"
            lines.append(
                f"time to target, {name}: per-adapter {_fmt_s(a)} / global {_fmt_s(b)} = {ratio}"
            )
    return "\n".join(lines)


def reward_rows(summary: Mapping[str, Any]) -> str:
    """Per tenant, the reward of every step (what the issue asks to print)."""
    rows = []
    for mode, data in summary["modes"].items():
        for name, t in data["tenants"].items():
            rows.append(f"{mode:11} {name:10} " + " ".join(f"{r:.2f}" for r in t["rewards"]))
    return "\n".join(rows)


def write_json(summary: Mapping[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2) + "\n")


def plot(summary: Mapping[str, Any], path: Path) -> None:
    """Reward against wall-clock (left) and against step (right), one colour
    per tenant, one line style per mode. The right panel shows how much of a
    time-to-target difference is the RL run itself (the step a tenant first
    finds its word varies from run to run) rather than the pause mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_time, by_step) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    styles = {"per_adapter": "-", "global": "--"}
    for mode, data in summary["modes"].items():
        for i, (name, t) in enumerate(data["tenants"].items()):
            style = {"color": f"C{i}", "marker": ".", "linestyle": styles.get(mode, ":")}
            label = f"{name} ({mode.replace('_', '-')} pause)"
            by_time.plot(t["step_times_s"], t["rewards"], label=label, **style)
            by_step.plot(range(1, len(t["rewards"]) + 1), t["rewards"], **style)
    for ax in (by_time, by_step):
        ax.axhline(summary["target"], color="grey", linewidth=0.8)
        ax.set_ylim(-0.02, 1.02)
    by_time.set_xlabel("wall-clock since the mode's start (s)")
    by_step.set_xlabel("training step")
    by_time.set_ylabel("mean reward of the step's batch")
    by_time.legend(fontsize=8, loc="lower right")
    fig.suptitle("Three tenants, async GRPO on one server: per-adapter vs global pause")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
