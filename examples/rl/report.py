"""Figures of a finished run: time to target, staleness, aborts, isolation; table, JSON, plot."""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from examples.rl.colocation import overlap_lines, rate_by_training
from examples.rl.engine_rate import (
    CACHED_COUNTER,
    COUNTER,
    GRAPH_TOKENS,
    PROMPT_COUNTER,
    RUNNING_GAUGE,
    STEPS,
    STEPS_IN_GRAPH,
    WAITING_GAUGE,
    EngineTokenCounter,
    covered,
    exclusive_windows,
    uncovered,
)
from examples.rl.gpu_busy import GpuBusy
from examples.rl.tenant import Swap, TenantLog
from skyrl_lora.rl_accounting import staleness_counts
from skyrl_lora.server.telemetry.event_log import Event


@dataclass(frozen=True)
class ModeRun:
    """One pause mode's run: every tenant's log, the engine's token counter, the clock."""

    mode: str
    logs: Mapping[str, TenantLog]
    counter: EngineTokenCounter
    start: float
    end: float
    gpu: GpuBusy | None = None  # None on a CPU machine
    #: The server's events on the mode's clock
    #: (:func:`skyrl_lora.server.telemetry.event_log.read_events`), those of
    #: the whole server run; None where its log cannot be read.
    engine_events: Sequence[Event] | None = None

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
    busy = covered(swaps)
    busy_s = sum(b - a for a, b in busy)
    busy_tokens = sum(run.counter.tokens_between(a, b) for a, b in busy)
    outside_tokens = run.counter.tokens_between(run.start, run.end) - busy_tokens
    outside = outside_tokens / max(run.wall_s - busy_s, 1e-9)
    return run.counter.rate_inside(COUNTER, lone), outside, lone_s


def sync_split(run: ModeRun) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """The mode's time inside any tenant's sync, and outside every sync."""
    syncs = covered([(s.start, s.end) for log in run.logs.values() for s in log.swaps])
    return syncs, uncovered(syncs, run.start, run.end)


def gpu_busy(run: ModeRun) -> dict[str, dict[str, float]] | None:
    """The GPU's busy share over the mode, inside any tenant's sync and
    outside every sync (:mod:`examples.rl.gpu_busy`); None without a GPU."""
    if run.gpu is None:
        return None
    inside, outside = sync_split(run)
    return {
        "mode": run.gpu.between(run.start, run.end),
        "during_syncs": run.gpu.inside(inside),
        "outside_syncs": run.gpu.inside(outside),
    }


def engine_requests(run: ModeRun) -> dict[str, float | None]:
    """The engine's mean batch (requests running) and queue (waiting), over
    the mode and outside every sync."""
    inside, outside = sync_split(run)
    whole = [(run.start, run.end)]
    mean = run.counter.mean_inside
    return {
        "running": mean(RUNNING_GAUGE, whole),
        "running_outside_syncs": mean(RUNNING_GAUGE, outside),
        "running_during_syncs": mean(RUNNING_GAUGE, inside),
        "waiting": mean(WAITING_GAUGE, whole),
    }


def engine_prefill(run: ModeRun) -> dict[str, float]:
    """The engine's prefill in a mode, per second and per generated token.

    ``computed``: prompt tokens not found in the prefix cache, the work a
    resumed sample's second prefill adds (a sync, per-adapter or global,
    aborts the tenant's samples, whose prompt and partial tokens are
    prefilled again on the new version).
    """
    wall = max(run.wall_s, 1e-9)
    prompt = run.counter.between(PROMPT_COUNTER, run.start, run.end)
    cached = run.counter.between(CACHED_COUNTER, run.start, run.end)
    generated = max(run.counter.tokens_between(run.start, run.end), 1.0)
    return {
        "prompt_tok_s": prompt / wall,
        "cached_tok_s": cached / wall,
        "computed_per_generated": (prompt - cached) / generated,
    }


def engine_steps(run: ModeRun) -> dict[str, float | None]:
    """The engine's steps a second in a mode, those past the largest CUDA
    graph, and its long steps, over the mode and outside every sync.

    All steps and those past :data:`~examples.rl.engine_rate.GRAPH_TOKENS`
    tokens (``over_graph``: eager on a GPU) come from vLLM's histogram of
    tokens per step. It counts a prompt's tokens in the step that finishes
    it, so it is exact only while no prefill is chunked (vLLM's default
    token budget, 8192 on an H100, chunks only prompts longer than the room
    left): under ``--max-num-batched-tokens 512`` it showed 9-10 steps a
    second over 512 tokens on a server none of whose steps had more
    (1f92e2f, 2026-11-27).

    Long steps come from the step watch's ``engine_long_step`` events
    (:mod:`skyrl_lora.server.telemetry.step_watch`: steps over 50 ms, each with the
    tokens it scheduled), so they need the server's log: None without it.
    ``long_step_share`` is the share of the time the engine spent in them
    (every running request waits through each one), and
    ``long_steps_over_graph_share`` the share of them past the graphs.
    """
    _, outside = sync_split(run)
    whole = [(run.start, run.end)]
    per_s = run.counter.rate_inside
    steps, outside_steps = per_s(STEPS, whole), per_s(STEPS, outside)
    figures: dict[str, float | None] = {
        "steps_per_s": steps,
        "over_graph_per_s": steps - per_s(STEPS_IN_GRAPH, whole),
        "steps_per_s_outside_syncs": outside_steps,
        "over_graph_per_s_outside_syncs": outside_steps - per_s(STEPS_IN_GRAPH, outside),
    }
    for suffix, windows in (("", whole), ("_outside_syncs", outside)):
        keys = [f"{k}{suffix}" for k in ("long_steps_per_s", "long_step_share")]
        over_graph = f"long_steps_over_graph_share{suffix}"
        if run.engine_events is None:
            figures |= dict.fromkeys([*keys, over_graph])
            continue
        seconds = sum(b - a for a, b in windows)
        long = [
            e.fields
            for e in run.engine_events
            if e.name == "engine_long_step" and any(a <= e.at <= b for a, b in windows)
        ]
        # An event also counts the long steps the watch left unwritten before it.
        count = sum(1 + int(e.get("suppressed", 0)) for e in long)
        figures[keys[0]] = count / seconds
        figures[keys[1]] = sum(float(e["ms"]) for e in long) / 1000 / seconds
        figures[over_graph] = (
            sum(int(e["tokens"]) > GRAPH_TOKENS for e in long) / len(long) if long else None
        )
    return figures


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in [0, 100]) of ``values``; None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def median(values: Sequence[float | None]) -> float | None:
    """Median of the values that exist (a tenant that never reached a target has None)."""
    present = sorted(v for v in values if v is not None)
    if not present:
        return None
    mid = len(present) // 2
    return present[mid] if len(present) % 2 else (present[mid - 1] + present[mid]) / 2


def median_time(values: Sequence[float | None]) -> float | None:
    """Median of times to a reward, a tenant that never got there counting as
    infinitely slow: None unless at least half the tenants got there."""
    ordered = sorted(values, key=lambda v: math.inf if v is None else v)
    if not ordered:
        return None
    mid = len(ordered) // 2
    pick = ordered[mid - 1 : mid + 1] if len(ordered) % 2 == 0 else ordered[mid : mid + 1]
    if any(v is None for v in pick):
        return None
    return sum(v for v in pick if v is not None) / len(pick)


def step_split(log: TenantLog) -> dict[str, float]:
    """Seconds of the tenant's steps spent waiting for samples, in the learner
    (its own compute, and the rest of the call: pickling, the process hop),
    saving the adapter, and syncing it (pause + push + resume)."""
    train = sum(s.train_s for s in log.steps)
    learner = sum(log.learner_s)
    return {
        "sampling_wait_s": sum(log.wait_s),
        "training_s": train,
        "learner_call_overhead_s": max(learner - train, 0.0),
        "save_s": sum(log.save_s),
        "sync_s": sum(s.sync_s for s in log.swaps),
    }


def tenant_figures(log: TenantLog, target: float, max_staleness: int) -> dict[str, Any]:
    """One tenant's row of figures in one mode."""
    counts = tenant_staleness(log)
    total = max(sum(counts.values()), 1)
    swap_ms = [s.sync_s * 1000 for s in log.swaps]
    split = step_split(log)
    steps_s = sum(split.values())
    return {
        "rewards": [round(s.mean_reward, 4) for s in log.steps],
        "step_times_s": [round(t, 3) for t in log.step_times],
        "versions": log.versions,
        "time_to_target_s": time_to_target(log, target),
        "step_to_target": step_to_target(log, target),
        "time_to_reward_s": {str(r): time_to_target(log, r) for r in REWARD_LEVELS},
        "samples": log.samples,
        "resumed_samples": log.resumed,
        "samples_spanning_versions": log.spanning,
        "aborted_by_pauses": sum(s.aborted for s in log.swaps),
        "tokens": log.tokens,
        "run_s": log.end_s,
        "tokens_per_s": log.tokens / max(log.end_s, 1e-9),
        "staleness_share": {
            str(k): counts[k] / total for k in sorted(counts) if k <= max_staleness
        },
        "on_policy_share": counts[0] / total,
        "fresh_max_abs_log_ratio": fresh_log_ratio(log),
        "dropped_share": sum(v for k, v in counts.items() if k > max_staleness) / total,
        "swap_ms_median": percentile(swap_ms, 50),
        "swap_ms_p99": percentile(swap_ms, 99),
        "swap_ms_max": max(swap_ms, default=None),
        "pause_ms_median": percentile([s.pause_s * 1000 for s in log.swaps], 50),
        "push_ms_median": percentile([s.push_s * 1000 for s in log.swaps], 50),
        "push_ms_p99": percentile([s.push_s * 1000 for s in log.swaps], 99),
        "resume_ms_median": percentile([s.resume_s * 1000 for s in log.swaps], 50),
        **handover_split(log.swaps),
        "drain_ms_median": percentile([s.drain_s * 1000 for s in log.swaps], 50),
        "swap_share_of_wall": sum(s.sync_s for s in log.swaps) / max(log.end_s, 1e-9),
        # per_adapter_on_policy: the adapter paused across its learner's step too
        "held_ms_median": percentile([s.held_s * 1000 for s in log.swaps if s.held_s], 50),
        "step_split_s": split,
        "step_split_share": {k: v / max(steps_s, 1e-9) for k, v in split.items()},
        "seconds_per_step": steps_s / max(len(log.steps), 1),
        "train_s_median": percentile([s.train_s for s in log.steps], 50),
    }


def handover_split(swaps: Sequence[Swap]) -> dict[str, float | None]:
    """Medians of where a hand-over's push went: the learner process's look-up
    of its weights, its copy into the hand-over buffer, the HTTP call, and the
    rest of the push as the tenant timed it (the trip to the learner process
    and back)."""
    parts: dict[str, list[float]] = {"state": [], "update": [], "request": [], "elsewhere": []}
    for swap in swaps:
        h = swap.handover
        if h is None:
            continue
        parts["state"].append(h.state_s * 1000)
        parts["update"].append(h.update_s * 1000)
        parts["request"].append(h.request_s * 1000)
        parts["elsewhere"].append((swap.push_s - h.state_s - h.update_s - h.request_s) * 1000)
    return {f"handover_{k}_ms_median": percentile(v, 50) for k, v in parts.items()}


#: Rewards whose time to reach every report gives (besides the target).
REWARD_LEVELS = (0.15, 0.2, 0.3, 0.5, 0.9)

#: Per-mode medians over tenants of these tenant figures.
MEDIAN_KEYS = (
    "time_to_target_s",
    "tokens_per_s",
    "on_policy_share",
    "swap_ms_median",
    "swap_ms_p99",
    "pause_ms_median",
    "push_ms_median",
    "push_ms_p99",
    "resume_ms_median",
    "handover_state_ms_median",
    "handover_update_ms_median",
    "handover_request_ms_median",
    "handover_elsewhere_ms_median",
    "seconds_per_step",
    "train_s_median",
)


def summarize(runs: Sequence[ModeRun], target: float, max_staleness: int) -> dict[str, Any]:
    """Everything printed and written, as plain data (the JSON file).

    Several runs of one mode (``--rounds``) are kept as ``mode``,
    ``mode#2``, ...: each is its own entry.
    """
    out: dict[str, Any] = {"target": target, "max_staleness": max_staleness, "modes": {}}
    for run in runs:
        inside, outside, lone_s = others_rate_during_swaps(run)
        tenants = {
            name: tenant_figures(log, target, max_staleness) for name, log in run.logs.items()
        }
        swaps = [(s.end - s.start) * 1000 for log in run.logs.values() for s in log.swaps]
        split = {
            key: sum(t["step_split_s"][key] for t in tenants.values())
            for key in next(iter(tenants.values()))["step_split_s"]
        }
        key = run.mode
        n = 2
        while key in out["modes"]:
            key, n = f"{run.mode}#{n}", n + 1
        out["modes"][key] = {
            "wall_s": run.wall_s,
            "seconds_per_step": run.wall_s / max(len(log.steps) for log in run.logs.values()),
            "others_tok_s_during_lone_swaps": inside,
            "lone_swap_s": lone_s,
            "engine_tok_s_outside_swaps": outside,
            "engine_tok_s": run.counter.tokens_between(run.start, run.end) / run.wall_s,
            "engine_prefill": engine_prefill(run),
            "engine_steps": engine_steps(run),
            "tenants_at_target": sum(t["time_to_target_s"] is not None for t in tenants.values()),
            "median_over_tenants": {
                k: (median_time if k == "time_to_target_s" else median)(
                    [t[k] for t in tenants.values()]
                )
                for k in MEDIAN_KEYS
            },
            "swap_ms_pooled": {
                "p50": percentile(swaps, 50),
                "p99": percentile(swaps, 99),
                "max": max(swaps, default=None),
                "count": len(swaps),
            },
            "step_split_share": {k: v / max(sum(split.values()), 1e-9) for k, v in split.items()},
            "gpu_busy": gpu_busy(run),
            "engine_requests": engine_requests(run),
            "engine_by_learners_training": rate_by_training(
                run.counter,
                sync_split(run)[1],
                [w for log in run.logs.values() for w in log.train_windows],
            ),
            "tenants": tenants,
        }
    return out


def position_means(
    modes: Mapping[str, Any], figure: Callable[[Mapping[str, Any]], float | None]
) -> dict[str, float]:
    """Each mode's mean of ``figure`` over its positions in the run
    (``mode``, ``mode#2``, ...), in the order the modes first ran; a mode
    whose figure is None in every position is left out."""
    values: dict[str, list[float]] = {}
    for mode, data in modes.items():
        value = figure(data)
        if value is not None:
            values.setdefault(mode.split("#")[0], []).append(value)
    return {base: sum(v) / len(v) for base, v in values.items()}


def sync_ceiling(modes: Mapping[str, Any]) -> dict[str, Any] | None:
    """What the global pause's syncs cost its engine, and how much of it
    each other mode won back; None without a global mode.

    The per-adapter pause can win only the tokens the global pause loses
    while the engine is stopped for a sync: were its engine to run at the
    global mode's rate outside syncs and lose nothing to syncs, it would
    make the global's rate outside syncs over its rate for the whole mode
    (``ceiling``) times the global's engine tokens. That bounds the gain a
    workload can show: it grows with the syncs per second (tenants over
    seconds per step) and with a sync's stall, not with anything the
    per-adapter path does. ``won`` is the share of ``ceiling - 1`` a mode's
    engine tokens/s over the global's reached (1 = all of it), in the
    engine's counter, which the ceiling is measured in; the tenants' median
    tokens/s over the global's is given beside it. Means over a mode's
    positions.
    """
    whole = position_means(modes, lambda d: d["engine_tok_s"])
    if "global" not in whole:
        return None
    outside = position_means(modes, lambda d: d["engine_tok_s_outside_swaps"])
    tenants = position_means(modes, lambda d: d["median_over_tenants"]["tokens_per_s"])
    ceiling = outside["global"] / whole["global"]
    others = [base for base in whole if base != "global"]
    engine = {base: whole[base] / whole["global"] for base in others}
    return {
        "engine_outside_over_whole": {base: outside[base] / whole[base] for base in whole},
        "ceiling": ceiling,
        "engine_tokens_per_s_over_global": engine,
        "won": {
            base: (engine[base] - 1) / (ceiling - 1) if ceiling > 1 else None for base in others
        },
        "tenants_tokens_per_s_over_global": {
            base: tenants[base] / tenants["global"]
            if base in tenants and tenants.get("global")
            else None
            for base in others
        },
    }


def ceiling_lines(modes: Mapping[str, Any]) -> list[str]:
    """:func:`sync_ceiling` in words."""
    found = sync_ceiling(modes)
    if found is None:
        return []
    lines = [
        f"global: its engine made {found['ceiling']:.3f}x as many tokens/s outside syncs as "
        f"over the whole mode: what a mode that loses nothing to syncs gains over it"
    ]
    for base, ratio in found["engine_tokens_per_s_over_global"].items():
        won = found["won"][base]
        share = "n/a" if won is None else f"{won:.0%} of the gain"
        tenants = found["tenants_tokens_per_s_over_global"][base]
        lines.append(
            f"{base}: engine tokens/s {ratio:.3f}x the global pause's ({share}); "
            f"tenants' median tokens/s {_fmt(tenants, '.3f')}x"
        )
    return lines


def _fmt_s(value: float | None) -> str:
    return "never" if value is None else f"{value:.1f} s"


def _fmt_ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def mode_table(summary: Mapping[str, Any]) -> str:
    """Per mode, medians over tenants: the headline table (markdown)."""
    lines = [
        "| mode | tenants at target | time to target | tokens/s | on-policy share "
        "| sync p50 / p99 (pooled) | pause / push / resume p50 | s/step | "
        "step: sampling wait / training / save / sync |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for mode, data in summary["modes"].items():
        m, sw, sh = data["median_over_tenants"], data["swap_ms_pooled"], data["step_split_share"]
        lines.append(
            f"| {mode} | {data['tenants_at_target']}/{len(data['tenants'])} "
            f"| {_fmt_s(m['time_to_target_s'])} | {_fmt(m['tokens_per_s'], '.0f')} "
            f"| {_fmt(m['on_policy_share'], '.0%')} "
            f"| {_fmt(sw['p50'], '.0f')} / {_fmt(sw['p99'], '.0f')} ms "
            f"| {_fmt(m['pause_ms_median'], '.0f')} / {_fmt(m['push_ms_median'], '.0f')} / "
            f"{_fmt(m['resume_ms_median'], '.0f')} ms | {_fmt(m['seconds_per_step'], '.2f')} "
            f"| {sh['sampling_wait_s']:.0%} / "
            f"{sh['training_s'] + sh['learner_call_overhead_s']:.0%} / {sh['save_s']:.0%} / "
            f"{sh['sync_s']:.0%} |"
        )
    for mode, data in summary["modes"].items():
        m = data["median_over_tenants"]
        if m.get("handover_request_ms_median") is not None:
            lines.append(
                f"\n{mode}: a hand-over's push, learner's weights / copy into the buffer / "
                f"HTTP call / the rest (to the learner process and back), medians: "
                + " / ".join(
                    _fmt(m[f"handover_{part}_ms_median"], ".1f")
                    for part in ("state", "update", "request", "elsewhere")
                )
                + " ms"
            )
    return "\n".join(lines)


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
                f"| {stale} | {_fmt_ms(t['swap_ms_median'])} ({_fmt_ms(t['drain_ms_median'])}) ms "
                f"| {t['tokens_per_s']:.0f} |"
            )
    lines.append("")
    modes = summary["modes"]
    for mode, data in modes.items():
        worst = max(t["fresh_max_abs_log_ratio"] for t in data["tenants"].values())
        lines.append(f"{mode}: largest |log ratio| of a staleness-0 token: {worst:.2g}")
    for mode, data in modes.items():
        prefill = data["engine_prefill"]
        lines.append(
            f"{mode}: whole run {data['wall_s']:.1f} s ({data['seconds_per_step']:.2f} s/step); "
            f"other tenants' sampling {data['others_tok_s_during_lone_swaps']:.0f} tok/s while "
            f"one tenant swaps ({data['lone_swap_s']:.1f} s of such swaps), engine "
            f"{data['engine_tok_s_outside_swaps']:.0f} tok/s outside swaps; prefill "
            f"{prefill['prompt_tok_s']:.0f} tok/s ({prefill['cached_tok_s']:.0f} cached), "
            f"{prefill['computed_per_generated']:.2f} computed per generated token"
        )
        steps = data["engine_steps"]
        long_steps = (
            "no server log for its long steps"
            if steps["long_steps_per_s"] is None
            else f"{steps['long_steps_per_s']:.1f} of them over 50 ms, "
            f"{steps['long_step_share']:.0%} of the time"
            + (
                ""
                if steps["long_steps_over_graph_share"] is None
                else f" ({steps['long_steps_over_graph_share']:.0%} of those over "
                f"{GRAPH_TOKENS} tokens: no CUDA graph on a GPU)"
            )
        )
        lines.append(
            f"{mode}: engine {steps['steps_per_s']:.1f} steps a second "
            f"({steps['steps_per_s_outside_syncs']:.1f} outside syncs), "
            f"{steps['over_graph_per_s']:.1f} of them over {GRAPH_TOKENS} tokens by vLLM's "
            f"histogram (exact unless prefills are chunked), {long_steps}"
        )
        batch = data["engine_requests"]
        if batch["running"] is not None:
            lines.append(
                f"{mode}: engine batch {batch['running']:.1f} requests running "
                f"({batch['running_outside_syncs'] or 0:.1f} outside syncs, "
                f"{batch['running_during_syncs'] or 0:.1f} during), {batch['waiting']:.1f} waiting"
            )
        if busy := data.get("gpu_busy"):
            whole, inside, outside = busy["mode"], busy["during_syncs"], busy["outside_syncs"]
            lines.append(
                f"{mode}: GPU busy {whole['device_busy_pct']:.0f}% of the mode "
                f"({inside['device_busy_pct']:.0f}% during syncs, "
                f"{outside['device_busy_pct']:.0f}% outside); SM share engine "
                f"{whole['engine_sm_pct']:.0f}%, learners {whole['learners_sm_pct']:.0f}% "
                f"({inside['engine_sm_pct']:.0f}% / {inside['learners_sm_pct']:.0f}% during "
                f"syncs); engine process CPU {whole['engine_cpu_pct']:.0f}% "
                f"({outside['engine_cpu_pct']:.0f}% outside syncs)"
            )
    lines.extend(ceiling_lines(modes))
    lines.extend(overlap_lines(modes))
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
    """Reward against wall-clock, one panel per mode run, one colour per
    tenant (the same colour in every panel), the target as a grey line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(summary["modes"].items())
    fig, axes = plt.subplots(
        1, len(modes), figsize=(4.5 * len(modes) + 1, 4.5), sharey=True, squeeze=False
    )
    longest = max(
        (max(t["step_times_s"], default=0) for _, d in modes for t in d["tenants"].values()),
        default=1,
    )
    for ax, (mode, data) in zip(axes[0], modes):
        for i, (name, t) in enumerate(data["tenants"].items()):
            ax.plot(t["step_times_s"], t["rewards"], color=f"C{i}", marker=".", label=name)
        ax.axhline(summary["target"], color="grey", linewidth=0.8)
        ax.set_xlim(0, longest * 1.02)
        ax.set_ylim(-0.02, 1.02)
        ttt = data["median_over_tenants"]["time_to_target_s"]
        ax.set_title(f"{mode.replace('_', '-')}: median time to target {_fmt_s(ttt)}", fontsize=9)
        ax.set_xlabel("wall-clock since the mode's start (s)")
    axes[0][0].set_ylabel("mean reward of the step's batch")
    axes[0][-1].legend(fontsize=7, loc="lower right")
    tenants = len(modes[0][1]["tenants"]) if modes else 0
    fig.suptitle(f"{tenants} tenants, async GRPO on one server: reward against wall time by mode")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
