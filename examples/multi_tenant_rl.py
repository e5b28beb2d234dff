"""Multi-tenant asynchronous RL on one skyrl-lora server, end to end, on CPU or GPU.

Each tenant trains a fresh LoRA with GRPO (PEFT and torch, in a process of
its own) to say its own words: the reward of a sample is the share of its
tokens that are the tenant's target tokens. Each tenant's samplers keep
``sample_with_retry`` calls in flight while its trainer updates; after
every step the trainer saves its adapter and syncs it (pause -> push ->
resume) while the other tenants keep sampling. Tokens carry the adapter
version that produced them; the trainer weights each token by its
truncated importance ratio and drops tokens more than ``--max-staleness``
versions old (:mod:`skyrl_lora.rl_accounting`).

The run repeats the same seeds and steps under each pause mode, interleaved
over ``--rounds``: the per-adapter pause (abort and resume), the
per-adapter swap that lets requests in flight finish on the old version
(``finish_old``), and vLLM's global keep-mode pause; ``--modes`` also
offers the one-call staged swap (``per_adapter_staged``) and the
per-adapter pause held across the tenant's own learner step
(``per_adapter_on_policy``). It prints a live line
per tenant and step, the tables, and writes the JSON and a plot.

* CPU (``scripts/dev.sh rl``): the correctness demo anybody can run; three
  tenants on the embedded tiny model, each learning one animal word.
* GPU (``--gpu``, on a CUDA machine with vLLM: ``scripts/gpu_device_run.sh
  run python3 -m examples.multi_tenant_rl --gpu``): eight tenants on the
  random 0.8B Llama of ``skyrl_lora.server.embedded.random_model``, rank-16 adapters,
  generations of 128-512 tokens, learners colocated on the GPU with vLLM
  (which gets ``--gpu-mem`` of it), or on a GPU of their own
  (``--learner-device cuda:1``); weights always travel by the push route.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import shlex
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from examples.rl.colocation import overlap_explains
from examples.rl.engine_rate import EngineTokenCounter
from examples.rl.gpu_busy import GpuBusy
from examples.rl.learner import LearnerConfig, LearnerProcess
from examples.rl.report import (
    ModeRun,
    median_time,
    mode_table,
    plot,
    position_means,
    reward_rows,
    summarize,
    sync_ceiling,
    table,
    write_json,
)
from examples.rl.tenant import (
    LoopConfig,
    PauseMode,
    TenantLog,
    random_lengths,
    random_prompts,
    run_tenant,
    send_adapter,
)
from skyrl_lora.client import RemoteInferenceClient
from skyrl_lora.rl_accounting import OffPolicyConfig, staleness_counts
from skyrl_lora.server.telemetry.event_log import read_events

ROOT = Path(__file__).resolve().parent.parent
CPU_TENANTS = {"rl-meow": "meow", "rl-woof": "woof", "rl-moo": "moo"}
#: The GPU shape's default: the pause held across the learner's step against
#: the global pause, ABBA. It led ``per_adapter_staged`` in tokens/s, time to
#: target and on-policy share on an H100 (a884d0a, docs/gpu.md).
GPU_MODES: tuple[PauseMode, ...] = (
    "per_adapter_on_policy",
    "global",
    "global",
    "per_adapter_on_policy",
)
#: Every mode a run may ask for (``--modes``).
ALL_MODES: tuple[PauseMode, ...] = (
    "per_adapter",
    "per_adapter_staged",
    "per_adapter_on_policy",
    "finish_old",
    "global",
)
CPU_MODES: tuple[PauseMode, ...] = ("per_adapter", "global")
#: GPU tenants' target tokens: tenant i says tokens [32 i, 32 i + 32) of the
#: 256-token vocabulary, an eighth of it (a fresh LoRA says them ~12% of the time).
GPU_TARGET_WIDTH = 32


@dataclasses.dataclass(frozen=True)
class Shape:
    """What a run trains: tenants and their target tokens, loop and learner."""

    tenants: dict[str, frozenset[int]]
    loop: LoopConfig
    learner: LearnerConfig
    modes: tuple[PauseMode, ...]


def cpu_shape() -> Shape:
    from skyrl_lora.server.embedded.builder import vocabulary

    words = vocabulary()
    tenants = {name: frozenset({words.index(w)}) for name, w in CPU_TENANTS.items()}
    return Shape(tenants, LoopConfig(), LearnerConfig(), CPU_MODES)


def gpu_shape(tenants: int = 8) -> Shape:
    """Sampling dominates a step, as in real RL: 2 groups of 8 samples of
    128-512 tokens per step and tenant, 4 groups in flight per tenant."""
    targets = {
        f"t{i}": frozenset(range(GPU_TARGET_WIDTH * i, GPU_TARGET_WIDTH * (i + 1)))
        for i in range(tenants)
    }
    loop = LoopConfig(
        steps=200,
        groups_per_step=2,
        group_size=8,
        max_tokens=512,
        min_tokens=128,
        prompt_words=16,
        in_flight=4,
        max_wall_s=80.0,
    )
    learner = LearnerConfig(
        rank=16, alpha=32, lr=3e-2, device="cuda", dtype="bfloat16", checkpointing=True
    )
    return Shape(targets, loop, learner, GPU_MODES)


def learner_device_error(
    device: str, gpu: bool, cuda_devices: int, handover: bool = False
) -> str | None:
    """Why ``--learner-device`` cannot be used here (None: it can).

    The GPU shape's learners go to any CUDA device of the machine: ``cuda``
    (the engine's, colocated) or ``cuda:N`` (a GPU of their own: the engine
    takes the first visible one, so ``cuda:1`` leaves it alone on GPU 0);
    weights travel over the push route (a CUDA IPC hand-over, ``--transfer
    handover``, needs the engine's GPU). The CPU shape trains the embedded
    model on the CPU only.
    """
    if not gpu:
        return None if device == "cpu" else "--learner-device is for the GPU shape (--gpu)"
    kind, _, index = device.partition(":")
    if kind != "cuda" or (index and not index.isdigit()):
        return f"--learner-device {device!r}: expected cuda or cuda:N"
    if cuda_devices == 0:
        return f"--learner-device {device}: this machine has no CUDA device"
    if index and int(index) >= cuda_devices:
        return f"--learner-device {device}: this machine has {cuda_devices} CUDA device(s)"
    if handover and index not in ("", "0"):
        return f"--learner-device {device}: --transfer handover needs the engine's GPU (cuda)"
    return None


def live_line(mode: str, log: TenantLog, steps: int, elapsed: float) -> str:
    """``[mode  t] tenant step k/n reward r vV stale 0:x% 1:y% ... N tok/s``."""
    result = log.steps[-1]
    counts = staleness_counts(result.tokens)
    total = max(sum(counts.values()), 1)
    stale = " ".join(f"{k}:{100 * v / total:.0f}%" for k, v in sorted(counts.items()))
    return (
        f"[{mode:11} {elapsed:5.1f}s] {log.name:8} step {len(log.steps):2}/{steps} "
        f"reward {result.mean_reward:.2f} v{log.versions[-1]} stale {stale} "
        f"{log.tokens / max(elapsed, 1e-9):4.0f} tok/s "
        f"sync {1000 * (log.swaps[-1].end - log.swaps[-1].start):.0f} ms"
    )


async def run_mode(
    url: str,
    mode: PauseMode,
    learners: dict[str, LearnerProcess],
    loop_cfg: LoopConfig,
    folders: Path,
) -> ModeRun:
    """All tenants at once from fresh LoRAs (the same seeds every mode)."""
    from skyrl_lora.server.embedded.builder import _word_ids

    await asyncio.gather(*(learner.reset() for learner in learners.values()))
    counter = EngineTokenCounter(url)
    gpu = GpuBusy.open()
    stop = asyncio.Event()
    polling = asyncio.gather(counter.run(stop), *([gpu.run(stop)] if gpu else []))
    async with RemoteInferenceClient(url) as client:
        start = time.monotonic()

        def show(log: TenantLog) -> None:
            print(live_line(mode, log, loop_cfg.steps, time.monotonic() - start), flush=True)

        logs = await asyncio.gather(
            *(
                run_tenant(
                    client,
                    name,
                    learner,
                    folders / name,
                    random_prompts(_word_ids(), loop_cfg.prompt_words, loop_cfg.seed + i),
                    loop_cfg,
                    mode,
                    start,
                    show,
                    random_lengths(loop_cfg, loop_cfg.seed + i),
                )
                for i, (name, learner) in enumerate(learners.items())
            )
        )
        end = time.monotonic()
    stop.set()
    await polling
    return ModeRun(mode, {log.name: log for log in logs}, counter, start, end, gpu)


async def warm_up(
    url: str, learners: dict[str, LearnerProcess], cfg: LoopConfig, root: Path
) -> None:
    """Every tenant's adapter loaded and one group sampled, before any clock
    runs: the first mode then pays no first-use cost the others do not."""
    from skyrl_lora.server.embedded.builder import _word_ids

    async with RemoteInferenceClient(url) as client:

        async def one(name: str, learner: LearnerProcess) -> None:
            folder = root / name
            if cfg.transfer != "handover":
                await learner.save(folder)
            await send_adapter(client, name, learner, folder, cfg.transfer, version=1)
            params = {"max_tokens": cfg.max_tokens, "temperature": 1.0, "ignore_eos": True}
            prompt = list(_word_ids())[: cfg.prompt_words]
            await client.sample_with_retry(
                prompt, num_samples=cfg.group_size, sampling_params=params, lora_name=name
            )

        await asyncio.gather(*(one(n, lp) for n, lp in learners.items()))


async def step_budget_of(url: str) -> dict[str, Any]:
    """The most tokens and sequences an engine step holds, and whether
    ``serve`` cut them to the largest CUDA graph."""
    async with RemoteInferenceClient(url) as client:
        info = await client.server_info()
    return {
        "tokens": info.engine_step_tokens,
        "sequences": info.engine_step_sequences,
        "graph_step_budget": info.graph_step_budget,
    }


async def run_all(
    server: contextlib.AbstractContextManager[tuple[str, Path]],
    shape: Shape,
    rounds: int,
    work: Path,
    settle_s: float,
    warm_up_s: float = 0.0,
) -> tuple[ModeRun | None, list[ModeRun], dict[str, Any]]:
    """The server first (nothing else allocates GPU memory while vLLM sizes
    its cache), then the learners, a warm-up, and every mode of every round.
    Also returns the engine's step budget as the server reports it, since
    ``serve``'s default budget differs by device and version.

    With ``warm_up_s``, a first mode of that length runs before the timed
    ones and is returned apart, not counted: in all nine GPU runs before it
    existed, whichever mode came first trained at about half speed (median
    learner step 0.93-1.27 s against 0.49-0.75 s in every later position),
    a cost of the learners' first minute on the GPU that the order of modes
    then charged to one mode."""
    with contextlib.ExitStack() as stack:
        url, model_dir = stack.enter_context(server)
        budget = await step_budget_of(url)
        learners = {
            name: stack.enter_context(
                LearnerProcess(
                    model_dir,
                    targets,
                    dataclasses.replace(shape.learner, seed=shape.learner.seed + i),
                )
            )
            for i, (name, targets) in enumerate(shape.tenants.items())
        }
        started = time.monotonic()
        await asyncio.gather(*(learner.ready() for learner in learners.values()))
        print(f"{len(learners)} learners ready in {time.monotonic() - started:.0f} s", flush=True)
        await warm_up(url, learners, shape.loop, work / "warm-up")
        warm = None
        if warm_up_s > 0:
            loop = dataclasses.replace(shape.loop, max_wall_s=warm_up_s)
            warm = await run_mode(url, shape.modes[0], learners, loop, work / "warm-up-mode")
            print(f"warm-up ({warm.mode}, not counted): {warm.wall_s:.1f} s\n", flush=True)
            await asyncio.sleep(settle_s)
        runs = []
        for r in range(rounds):
            for mode in shape.modes:
                run = await run_mode(url, mode, learners, shape.loop, work / f"{mode}-{r}")
                runs.append(run)
                print(f"{mode}: {run.wall_s:.1f} s\n", flush=True)
                await asyncio.sleep(settle_s)
        return warm, runs, budget


@contextlib.contextmanager
def cpu_server(trainer_root: Path, handover: bool = False) -> Iterator[tuple[str, Path]]:
    from skyrl_lora.server.cluster.local import embedded_server

    print("Starting a skyrl-lora server on the embedded model...", flush=True)
    # The server may load adapters only from the trainers' folder.
    flags = ["--adapter-root", str(trainer_root), *(["--allow-handover"] if handover else [])]
    with embedded_server(flags) as (url, model):
        print(f"Server ready at {url}\n", flush=True)
        yield url, model.model_dir


def gpu_server_log() -> Path:
    """Where the GPU server's log goes: beside the results (``$OUT``)."""
    return Path(os.environ.get("OUT") or tempfile.gettempdir()) / "rl_gpu_server.log"


def with_engine_events(
    runs: Sequence[ModeRun], log: Path, wall_minus_monotonic_s: float
) -> list[ModeRun]:
    """The runs, each with the server's events on its clock (the long steps
    of :func:`examples.rl.report.engine_steps`)."""
    with log.open(errors="replace") as lines:
        events = read_events(lines, wall_minus_monotonic_s)
    return [dataclasses.replace(run, engine_events=events) for run in runs]


@contextlib.contextmanager
def cuda_server(
    root: Path,
    gpu_mem: float,
    max_loras: int,
    handover: bool = False,
    flags: Sequence[str] = (),
) -> Iterator[tuple[str, Path]]:
    """``skyrl-lora serve --no-ray`` on the random 0.8B Llama, rank-16 slots,
    two per tenant (``finish_old`` keeps the old version next to the new);
    taking hand-overs where the learners hand their weights over; ``flags``
    after ours (an A/B of a vLLM setting)."""
    import torch

    from skyrl_lora.server.cluster.process import serving
    from skyrl_lora.server.embedded.random_model import build_random_model
    from skyrl_lora.server.presets import random_model_server_argv

    model = build_random_model(root, rank=16, size="0.8b")
    torch.cuda.empty_cache()
    argv = random_model_server_argv(
        model.model_dir,
        max_lora_rank=16,
        max_loras=max_loras,
        gpu_memory_utilization=gpu_mem,
        extra=[*(["--allow-handover"] if handover else []), *flags],
    )
    started = time.monotonic()
    print("Starting a skyrl-lora server on CUDA vLLM (random 0.8B Llama)...", flush=True)
    with serving(["--no-ray", *argv], gpu_server_log()) as server:
        took = time.monotonic() - started
        print(f"Server ready at {server.url} after {took:.0f} s\n", flush=True)
        yield server.url, model.model_dir


def warm_up_figures(warm: ModeRun, target: float, max_staleness: int) -> dict[str, Any]:
    """What the uncounted first mode measured, to show what it kept out."""
    data = summarize([warm], target, max_staleness)["modes"][warm.mode]
    medians = data["median_over_tenants"]
    return {
        "mode": warm.mode,
        "wall_s": data["wall_s"],
        "train_s_median": medians["train_s_median"],
        "seconds_per_step": medians["seconds_per_step"],
        "engine_tok_s": data["engine_tok_s"],
    }


#: The per-adapter pauses, in the order :func:`per_adapter_mode` prefers them.
PER_ADAPTER_MODES: tuple[PauseMode, ...] = (
    "per_adapter",
    "per_adapter_staged",
    "per_adapter_on_policy",
)


def per_adapter_mode(modes: Mapping[str, Any]) -> str | None:
    """The run's per-adapter pause: ``per_adapter`` (pause, send, resume),
    else the one-call ``per_adapter_staged``, else ``per_adapter_on_policy``
    (paused from the learner's step on); None if it ran none of them."""
    return next((m for m in PER_ADAPTER_MODES if m in modes), None)


def on_policy_every_tenant(modes: Mapping[str, Any], mode: str | None) -> bool | None:
    """Whether every tenant's on-policy share under ``mode`` is at least its
    share under the global pause, each the mean over the mode's positions
    (``mode``, ``mode#2``: an ABBA order puts each first once)."""
    if mode is None or mode not in modes or "global" not in modes:
        return None

    def share(base: str, tenant: str) -> float:
        runs = [d for m, d in modes.items() if m.split("#")[0] == base]
        return sum(d["tenants"][tenant]["on_policy_share"] for d in runs) / len(runs)

    return all(share(mode, n) >= share("global", n) for n in modes[mode]["tenants"])


def mode_ratios(modes: dict[str, Any], mode: str) -> dict[str, Any]:
    """``mode`` against the global pause: tokens/s and time to target as
    ratios of each mode's mean over its positions (:func:`order_balanced`),
    None where either mode lacks the figure or the run had no global pause;
    and whether every tenant was at least as on-policy."""
    balanced = order_balanced(modes)["ratios"]
    return {
        "tokens_per_s_over_global": balanced.get(f"tokens_per_s_{mode}_over_global"),
        "time_to_target_over_global": balanced.get(f"time_to_target_s_{mode}_over_global"),
        "on_policy_every_tenant": on_policy_every_tenant(modes, mode),
    }


def headline(summary: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    """The figures issue 30 asks for (medians over tenants), then the summary.
    ``per_adapter`` in the ratios and the swap figures is the run's
    per-adapter pause (:func:`per_adapter_mode`), named in ``per_adapter_mode``;
    ``by_per_adapter_mode`` gives the same ratios for every per-adapter pause
    the run held.

    The ratios are of each mode's mean over its positions (ABBA, or
    ABCCBA: every mode first once). A JSON without ``by_per_adapter_mode``
    (written before fef8358) compared the first positions alone, which
    one run's order moves by more than the gain: 1.34x tokens/s there
    against 1.20x over both positions (0b36222's ``a_default_1``)."""
    modes = summary["modes"]
    ours = per_adapter_mode(modes)
    compared = {
        mode: mode_ratios(modes, mode)
        for mode in (*PER_ADAPTER_MODES, "finish_old")
        if mode in modes
    }

    def per_mode(key: str) -> dict[str, Any]:
        return {m: d["median_over_tenants"][key] for m, d in modes.items()}

    def ratio(key: str, mode: str | None = ours) -> float | None:
        return compared[mode][key] if mode in compared else None

    pa = modes[ours]["median_over_tenants"] if ours else {}
    return {
        **meta,
        "per_adapter_mode": ours,
        "tenants": len(next(iter(modes.values()))["tenants"]),
        "target_reward": summary["target"],
        "time_to_target_s": per_mode("time_to_target_s"),
        "time_to_reward_s": {
            m: {
                r: median_time([t["time_to_reward_s"][r] for t in d["tenants"].values()])
                for r in next(iter(d["tenants"].values()))["time_to_reward_s"]
            }
            for m, d in modes.items()
        },
        "tenants_at_target": {m: d["tenants_at_target"] for m, d in modes.items()},
        "on_policy_share": per_mode("on_policy_share"),
        "tokens_per_s": per_mode("tokens_per_s"),
        "swap_ms": {
            "p50": pa.get("swap_ms_median"),
            "p99": pa.get("swap_ms_p99"),
            "by_mode_p50": per_mode("swap_ms_median"),
            "by_mode_p99": per_mode("swap_ms_p99"),
            "pooled": {m: d["swap_ms_pooled"] for m, d in modes.items()},
        },
        "sync_parts_ms_p50": {
            m: {k: d["median_over_tenants"][f"{k}_ms_median"] for k in ("pause", "push", "resume")}
            for m, d in modes.items()
        },
        "step_split_share": {m: d["step_split_share"] for m, d in modes.items()},
        "seconds_per_step": per_mode("seconds_per_step"),
        "engine_tok_s": {m: d["engine_tok_s"] for m, d in modes.items()},
        "engine_prefill": {m: d["engine_prefill"] for m, d in modes.items()},
        "engine_steps": {m: d["engine_steps"] for m, d in modes.items()},
        "warm_up_mode": summary.get("warm_up_mode"),
        "ratios": {
            "time_to_target_per_adapter_over_global": ratio("time_to_target_over_global"),
            "time_to_target_finish_old_over_global": ratio(
                "time_to_target_over_global", "finish_old"
            ),
            "tokens_per_s_per_adapter_over_global": ratio("tokens_per_s_over_global"),
            "tokens_per_s_finish_old_over_global": ratio("tokens_per_s_over_global", "finish_old"),
        },
        "on_policy_per_adapter_ge_global_every_tenant": on_policy_every_tenant(modes, ours),
        "by_per_adapter_mode": {m: r for m, r in compared.items() if m in PER_ADAPTER_MODES},
        "order_balanced": order_balanced(modes),
        "tokens_per_s_ceiling": sync_ceiling(modes),
        "learners_overlap": overlap_explains(modes),
        "summary": summary,
    }


def order_balanced(modes: dict[str, Any]) -> dict[str, Any]:
    """Each mode's mean over its positions in the run (``mode``, ``mode#2``,
    ...: an ABBA order puts every mode first once), and its ratio to the
    global pause's, for the figures a single order skews."""
    keys = ("time_to_target_s", "tokens_per_s", "on_policy_share", "seconds_per_step")

    def median_of(key: str) -> Callable[[Mapping[str, Any]], float | None]:
        return lambda data: data["median_over_tenants"][key]  # type: ignore[no-any-return]

    by_key = {key: position_means(modes, median_of(key)) for key in keys}
    bases = dict.fromkeys(mode.split("#")[0] for mode in modes)
    means = {
        base: {key: by_key[key][base] for key in keys if base in by_key[key]} for base in bases
    }
    means = {base: figures for base, figures in means.items() if figures}
    ratios = {
        f"{key}_{base}_over_global": means[base][key] / means["global"][key]
        for base in means
        if base != "global" and "global" in means
        for key in keys
        if key in means[base] and means["global"].get(key)
    }
    return {"means": means, "ratios": ratios}


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        )
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", action="store_true", help="the GPU shape on CUDA vLLM")
    parser.add_argument("--tenants", type=int, default=8, help="tenants of the GPU shape")
    parser.add_argument("--steps", type=int, help="most steps per tenant and mode")
    parser.add_argument("--lr", type=float)
    parser.add_argument("--target", type=float, help="target reward (default 0.9; GPU 0.2)")
    parser.add_argument("--max-wall-s", type=float, help="stop a mode's tenants after this")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds of the modes")
    parser.add_argument("--max-staleness", type=int, default=OffPolicyConfig.max_staleness)
    parser.add_argument(
        "--pin-rollouts",
        action="store_true",
        help="sample each group on the version current when it started (leased across the "
        "next sync), so no sample mixes versions",
    )
    parser.add_argument("--ratio-clip", type=float, default=OffPolicyConfig.ratio_clip)
    parser.add_argument(
        "--transfer",
        choices=["push", "load", "handover"],
        help="push the weights over HTTP (the default), have the server load the trainer's "
        "folder (CPU only), or hand them over from the learner's memory (same host)",
    )
    parser.add_argument("--modes", help="comma-separated pause modes (default: the shape's)")
    parser.add_argument(
        "--warm-up-s",
        type=float,
        help="run the first mode this long before the timed ones, not counted (GPU default 20)",
    )
    parser.add_argument("--gpu-mem", type=float, default=0.3, help="vLLM's share of the GPU")
    parser.add_argument(
        "--learner-device",
        help="GPU: the learners' device, cuda (the engine's, the default) or cuda:N "
        "(a GPU of their own; the engine takes the first)",
    )
    parser.add_argument(
        "--serve-flags",
        default="",
        help="GPU: more flags for the server, one string "
        '(e.g. "--no-graph-step-budget" for vLLM\'s own step budget)',
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--summary-json", type=Path, help="GPU: the headline JSON")
    parser.add_argument("--machine", default=os.environ.get("SKYRL_MACHINE", ""))
    parser.add_argument("--date", default=time.strftime("%Y-%m-%d"))
    parser.add_argument("--commit", default=os.environ.get("SKYRL_COMMIT") or _commit())
    args = parser.parse_args(argv)

    shape = gpu_shape(args.tenants) if args.gpu else cpu_shape()
    off_policy = OffPolicyConfig(args.max_staleness, args.ratio_clip)
    learner = dataclasses.replace(shape.learner, off_policy=off_policy)
    if args.lr is not None:
        learner = dataclasses.replace(learner, lr=args.lr)
    if args.learner_device is not None:
        import torch

        cuda_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
        why = learner_device_error(
            args.learner_device, args.gpu, cuda_devices, args.transfer == "handover"
        )
        if why:
            parser.error(why)
        learner = dataclasses.replace(learner, device=args.learner_device)
    if args.serve_flags and not args.gpu:
        parser.error("--serve-flags is for the GPU server")
    if args.gpu and args.transfer == "load":
        parser.error("--transfer load is for the CPU run (the GPU server has no adapter root)")
    loop = dataclasses.replace(shape.loop, transfer=args.transfer or "push")
    if args.steps is not None:
        loop = dataclasses.replace(loop, steps=args.steps)
    if args.pin_rollouts:
        loop = dataclasses.replace(loop, pin_rollouts=True)
    if args.max_wall_s is not None:
        loop = dataclasses.replace(loop, max_wall_s=args.max_wall_s)
    # GPU: every mode runs --max-wall-s whole (the same load throughout); the
    # time to target is that of the first step at the target.
    target = args.target if args.target is not None else (0.2 if args.gpu else 0.9)
    modes = shape.modes
    if args.modes:
        requested = [m for m in args.modes.split(",") if m]
        unknown = set(requested) - set(ALL_MODES)
        if unknown:
            parser.error(f"unknown modes {sorted(unknown)}; choose from {ALL_MODES}")
        modes = tuple(m for m in requested)  # type: ignore[misc]
    shape = dataclasses.replace(shape, loop=loop, learner=learner, modes=modes)
    name = "rl_gpu" if args.gpu else "rl"
    json_path = args.json or ROOT / "benchmarks" / "out" / f"{name}.json"
    plot_path = args.plot or ROOT / "docs" / (
        "gpu/rl_gpu.png" if args.gpu else "multi_tenant_rl.png"
    )

    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="skyrl-rl-") as tmp:
        work = Path(tmp)
        server = (
            cuda_server(
                work / "model",
                args.gpu_mem,
                2 * len(shape.tenants),
                loop.transfer == "handover",
                shlex.split(args.serve_flags),
            )
            if args.gpu
            else cpu_server(work, loop.transfer == "handover")
        )
        warm_up_s = args.warm_up_s if args.warm_up_s is not None else (20.0 if args.gpu else 0.0)
        settle_s = 3.0 if args.gpu else 0.0
        warm, runs, budget = asyncio.run(
            run_all(server, shape, args.rounds, work, settle_s, warm_up_s)
        )
    if args.gpu:
        runs = with_engine_events(runs, gpu_server_log(), time.time() - time.monotonic())
    summary = summarize(runs, target, off_policy.max_staleness)
    if warm is not None:
        summary["warm_up_mode"] = warm_up_figures(warm, target, off_policy.max_staleness)
    summary["end_to_end_s"] = time.monotonic() - began
    summary["shape"] = {
        "loop": dataclasses.asdict(loop),
        "learner": {k: v for k, v in dataclasses.asdict(learner).items() if k != "off_policy"},
        "off_policy": dataclasses.asdict(off_policy),
        "rounds": args.rounds,
        "serve_flags": args.serve_flags,
        "engine_step_budget": budget,
    }
    print("Reward per step:\n" + reward_rows(summary) + "\n")
    print(table(summary) + "\n")
    print(mode_table(summary))
    print(f"\nEnd to end (server start included): {summary['end_to_end_s']:.0f} s")
    write_json(summary, json_path)
    if args.summary_json:
        meta = {
            "commit": args.commit,
            "date": args.date,
            "machine": args.machine,
            "serve_flags": args.serve_flags,
            "engine_step_budget": budget,
        }
        top = headline(summary, meta)
        write_json(top, args.summary_json)
        print(json.dumps({k: v for k, v in top.items() if k != "summary"}, indent=1))
    try:
        plot(summary, plot_path)
    except ImportError as error:  # no matplotlib: the JSON holds everything
        print(f"no plot: {error}")
    print(f"Wrote {json_path} and {plot_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
