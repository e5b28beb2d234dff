"""Several GPU RL runs side by side: each run's ratios, and their median and spread.

    python3 scripts/probes/rl_runs.py NAME=PATH [NAME=PATH ...] [--json OUT.json]

Each PATH is what ``scripts/gpu_device_run.sh rl`` leaves in its ``$OUT``
(a folder: ``rl_gpu.json``, the headline summary, ``rl_gpu_server.log`` and,
under MPS, ``nvidia_smi_mid_run.txt``), or a run's headline JSON alone as
``docs/gpu/`` keeps it (no long steps, no MPS count). A run that held
several per-adapter pauses (``--modes per_adapter_staged,per_adapter_on_policy,
global,...``) gives one entry per pause, ``NAME:MODE``.

The ratios (per-adapter over global) are of each mode's mean over its
positions in the run (``order_balanced``: ABBA puts each mode first once),
never of the first positions alone. One run's ratio rests on two 40 s
positions per mode; from run to run it moved by more than the per-adapter
pause's gain, so a configuration's figure is the median of its runs, with
the range. Runs with the same step budget and other serve flags are one
configuration (:func:`configuration`).

Per run: the tenants' and the engine's tokens/s over the global pause's,
the ceiling and the share of it won, the per-adapter engine's own pace
(``learners_overlap``), time to target, the engine's tokens/s by position
and its mean, the mean of the positions' seconds a step (both modes: these
two compare configurations, which run on different servers), sync
p99 (median tenant in the worse position, and pooled over the per-adapter
positions), whether every tenant's on-policy share was at least its share
under the global pause, the whole server run's long steps
(the step watch's events: count, seconds, median tokens, share past 512
tokens), and whether ``nvidia-smi`` saw the processes as MPS clients (``M+C``).

Give the headline JSONs of earlier runs so a configuration's median spans
machines and days. ``all_runs`` pools every run whatever its flags: how
often the per-adapter pause beat the global pause at all, and how often it
met the issue's targets (1.2x tokens/s, 0.75x time to target). Standard
library only.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any


def long_steps(log: Path) -> dict[str, float] | None:
    if not log.exists():
        return None
    steps = []
    for line in log.open(errors="replace"):
        i = line.find('skyrl_event {"event": "engine_long_step"')
        if i >= 0:
            steps.append(json.loads(line[i + len("skyrl_event ") :]))
    if not steps:
        return {"count": 0, "seconds": 0.0}
    return {
        "count": sum(1 + s.get("suppressed", 0) for s in steps),
        "seconds": sum(s["ms"] for s in steps) / 1000,
        "median_tokens": statistics.median(s["tokens"] for s in steps),
        "over_512_share": sum(s["tokens"] > 512 for s in steps) / len(steps),
    }


def mps_clients(smi: Path) -> int | None:
    """Processes ``nvidia-smi`` listed as MPS clients mid-run; None if not sampled."""
    return smi.read_text().count("M+C") if smi.exists() else None


def configuration(run: dict[str, Any]) -> str:
    """A run's configuration: its step budget, its other serve flags, and its
    per-adapter mode where that is not ``per_adapter_staged`` (every run
    before 3675b5e).

    ``serve_flags`` alone cannot say it: since ``serve`` cuts the budget to
    512 tokens by itself on a GPU, no flags means that budget, where before
    it meant vLLM's. Runs that recorded ``engine_step_budget`` say which;
    older ones had vLLM's unless their flags cut it."""
    flags = run["serve_flags"].split()
    budget = run.get("engine_step_budget") or {}
    rest = []
    tokens = budget.get("tokens") if budget.get("graph_step_budget") else None
    i = 0
    while i < len(flags):
        if flags[i] == "--max-num-batched-tokens":
            tokens, i = int(flags[i + 1]), i + 2
        elif flags[i] == "--max-num-seqs":
            i += 2
        elif flags[i] == "--no-graph-step-budget":
            i += 1
        else:
            rest.append(flags[i])
            i += 1
    label = f"{tokens}-token steps" if tokens else "vLLM's step budget"
    if run["mode"] != "per_adapter_staged":
        rest.append(run["mode"])
    return " ".join([label, *rest])


def run_figures(path: Path) -> dict[str, dict[str, Any]]:
    """One run's figures for each per-adapter pause it held, by mode."""
    folder = path if path.is_dir() else path.parent
    data = json.loads((path / "rl_gpu.json" if path.is_dir() else path).read_text())
    logs = path.is_dir()
    balanced = data["order_balanced"]["ratios"]
    by_mode = data.get("by_per_adapter_mode") or {
        data["per_adapter_mode"]: {
            "on_policy_every_tenant": data["on_policy_per_adapter_ge_global_every_tenant"]
        }
    }
    ceiling = data["tokens_per_s_ceiling"]
    shares = data["on_policy_share"]

    def positions(figures: dict[str, Any], mode: str) -> list[Any]:
        return [v for k, v in figures.items() if k.split("#")[0] == mode]

    return {
        mode: {
            "commit": data["commit"],
            "date": data["date"],
            "machine": data["machine"],
            "serve_flags": data.get("serve_flags") or "",
            "engine_step_budget": data.get("engine_step_budget"),
            "mode": mode,
            "tenants_tokens_per_s_over_global": balanced[f"tokens_per_s_{mode}_over_global"],
            "engine_tokens_per_s_over_global": ceiling["engine_tokens_per_s_over_global"][mode],
            "ceiling": ceiling["ceiling"],
            "share_of_ceiling_won": ceiling["won"][mode],
            "own_pace": data["learners_overlap"][mode]["own_pace"],
            "none_training_over_global": data["learners_overlap"][mode][
                "none_training_over_global"
            ],
            "time_to_target_over_global": balanced[f"time_to_target_s_{mode}_over_global"],
            "engine_tok_s_by_position": data["engine_tok_s"],
            # Across configurations (other servers: compare medians of several runs)
            "engine_tok_s_mean": statistics.mean(data["engine_tok_s"].values()),
            "seconds_per_step_mean": statistics.mean(data["seconds_per_step"].values()),
            "sync_p99_ms_median_tenant": max(positions(data["swap_ms"]["by_mode_p99"], mode)),
            "sync_p99_ms_pooled_max_position": max(
                v["p99"] for v in positions(data["swap_ms"]["pooled"], mode)
            ),
            "on_policy_mean": {
                mode: statistics.mean(positions(shares, mode)),
                "global": statistics.mean(positions(shares, "global")),
            },
            "on_policy_every_tenant": figures["on_policy_every_tenant"],
            "long_steps_whole_server_run": (
                long_steps(folder / "rl_gpu_server.log") if logs else None
            ),
            "mps_clients_mid_run": (
                mps_clients(folder / "nvidia_smi_mid_run.txt") if logs else None
            ),
        }
        for mode, figures in by_mode.items()
    }


SPREAD_KEYS = (
    "tenants_tokens_per_s_over_global",
    "engine_tokens_per_s_over_global",
    "share_of_ceiling_won",
    "own_pace",
    "time_to_target_over_global",
    "sync_p99_ms_median_tenant",
    "engine_tok_s_mean",
    "seconds_per_step_mean",
)


def spread(runs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    return {
        key: {
            "median": statistics.median(r[key] for r in runs),
            "min": min(r[key] for r in runs),
            "max": max(r[key] for r in runs),
        }
        for key in SPREAD_KEYS
    }


def pooled(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Every run, whatever its configuration: the sign and the targets, counted."""
    tokens = [r["tenants_tokens_per_s_over_global"] for r in runs.values()]
    target = [r["time_to_target_over_global"] for r in runs.values()]
    return {
        "runs": len(runs),
        "tenants_tokens_per_s_over_global": {
            "median": statistics.median(tokens),
            "min": min(tokens),
            "max": max(tokens),
            "runs_over_1": sum(t > 1 for t in tokens),
            "runs_at_least_1_2": sum(t >= 1.2 for t in tokens),
        },
        "time_to_target_over_global": {
            "median": statistics.median(target),
            "min": min(target),
            "max": max(target),
            "runs_under_1": sum(t < 1 for t in target),
            "runs_at_most_0_75": sum(t <= 0.75 for t in target),
        },
        "runs_on_policy_every_tenant": sum(bool(r["on_policy_every_tenant"]) for r in runs.values()),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("runs", nargs="+", help="NAME=PATH: a run's $OUT folder or headline JSON")
    parser.add_argument("--json")
    args = parser.parse_args()
    runs = {}
    for spec in args.runs:
        name, path = spec.split("=", 1)
        by_mode = run_figures(Path(path))
        for mode, figures in by_mode.items():
            runs[name if len(by_mode) == 1 else f"{name}:{mode}"] = figures
    configs: dict[str, list[str]] = {}
    for name, run in runs.items():
        configs.setdefault(configuration(run), []).append(name)
    out = {
        "runs": runs,
        "by_configuration": {
            config: {"runs": names, **spread([runs[n] for n in names])}
            for config, names in configs.items()
        },
        "all_runs": pooled(runs),
    }
    for name, r in runs.items():
        steps = r["long_steps_whole_server_run"]
        long = f"{steps['count']} ({steps['seconds']:.1f} s)" if steps else "not kept"
        print(
            f"{name}: [{configuration(r)}] tenants {r['tenants_tokens_per_s_over_global']:.3f}x, "
            f"engine {r['engine_tokens_per_s_over_global']:.3f}x of ceiling {r['ceiling']:.3f}x "
            f"(won {r['share_of_ceiling_won']:.0%}), own pace {r['own_pace']:.3f}, "
            f"time to target {r['time_to_target_over_global']:.2f}x, "
            f"engine tok/s {', '.join(f'{v:.0f}' for v in r['engine_tok_s_by_position'].values())}, "
            f"{r['seconds_per_step_mean']:.2f} s a step, "
            f"sync p99 {r['sync_p99_ms_median_tenant']:.0f} ms, "
            f"on-policy every tenant {r['on_policy_every_tenant']}, long steps {long}, "
            f"MPS clients {r['mps_clients_mid_run']}"
        )
    for flags, s in out["by_configuration"].items():
        print(f"{flags} ({', '.join(s['runs'])}): " + "; ".join(
            f"{k} {v['median']:.3f} [{v['min']:.3f}-{v['max']:.3f}]"
            for k, v in s.items() if k != "runs"
        ))
    every = out["all_runs"]
    tok, ttt = every["tenants_tokens_per_s_over_global"], every["time_to_target_over_global"]
    print(
        f"all {every['runs']} runs: tenants {tok['median']:.3f}x [{tok['min']:.3f}-{tok['max']:.3f}], "
        f"over 1 in {tok['runs_over_1']}, at least 1.2x in {tok['runs_at_least_1_2']}; "
        f"time to target {ttt['median']:.2f}x [{ttt['min']:.2f}-{ttt['max']:.2f}], "
        f"at most 0.75x in {ttt['runs_at_most_0_75']}; "
        f"on-policy every tenant in {every['runs_on_policy_every_tenant']}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
