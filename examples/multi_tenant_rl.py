"""Multi-tenant asynchronous RL on one skyrl-lora server, end to end, on CPU.

Three tenants each train a fresh LoRA on the embedded tiny model (PEFT and
torch, on the CPU) with GRPO to say their own animal word: the reward of a
sample is the share of its words that are the tenant's word. Each tenant's
samplers keep ``sample_with_retry`` calls in flight while its trainer
updates; after every step the trainer saves its adapter and syncs it
(pause -> push -> resume) while the other tenants keep sampling. Tokens
carry the adapter version that produced them; the trainer weights each
token by its truncated importance ratio and drops tokens more than
``--max-staleness`` versions old (:mod:`skyrl_lora.rl_accounting`).

The run is done twice with the same seeds and steps: with the per-adapter
pause, then with vLLM's global keep-mode pause. It prints a live line per
tenant and step, a summary table, and writes ``benchmarks/out/rl.json`` and
``docs/multi_tenant_rl.png``. Run it with ``scripts/dev.sh rl``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from examples.rl.engine_rate import EngineTokenCounter
from examples.rl.learner import LearnerConfig, LearnerProcess
from examples.rl.report import ModeRun, plot, reward_rows, summarize, table, write_json
from examples.rl.tenant import LoopConfig, PauseMode, TenantLog, random_prompts, run_tenant
from skyrl_lora.client import RemoteInferenceClient
from skyrl_lora.rl_accounting import OffPolicyConfig, staleness_counts
from skyrl_lora.server.cluster.local import embedded_server

ROOT = Path(__file__).resolve().parent.parent
TENANTS = {"rl-meow": "meow", "rl-woof": "woof", "rl-moo": "moo"}
MODES: tuple[PauseMode, ...] = ("per_adapter", "global")


def live_line(mode: str, log: TenantLog, steps: int, elapsed: float) -> str:
    """``[mode  t] tenant step k/n reward r vV stale 0:x% 1:y% ... N tok/s``."""
    result = log.steps[-1]
    counts = staleness_counts(result.tokens)
    total = max(sum(counts.values()), 1)
    stale = " ".join(f"{k}:{100 * v / total:.0f}%" for k, v in sorted(counts.items()))
    return (
        f"[{mode:11} {elapsed:5.1f}s] {log.name:8} step {len(log.steps):2}/{steps} "
        f"reward {result.mean_reward:.2f} v{log.versions[-1]} stale {stale} "
        f"{log.tokens / max(elapsed, 1e-9):4.0f} tok/s"
    )


async def run_mode(
    url: str,
    model: Any,
    mode: PauseMode,
    loop_cfg: LoopConfig,
    learner_cfg: LearnerConfig,
    trainer_root: Path,
) -> ModeRun:
    """All tenants at once, fresh LoRAs from the same seeds, one pause mode."""
    from skyrl_lora.server.embedded.builder import vocabulary

    words = vocabulary()
    counter = EngineTokenCounter(url)
    stop = asyncio.Event()
    polling = asyncio.create_task(counter.run(stop))
    with contextlib.ExitStack() as stack:
        learners = {
            name: stack.enter_context(
                LearnerProcess(
                    model.model_dir,
                    frozenset({words.index(word)}),
                    dataclasses.replace(learner_cfg, seed=learner_cfg.seed + i),
                )
            )
            for i, (name, word) in enumerate(TENANTS.items())
        }
        await asyncio.gather(*(learner.ready() for learner in learners.values()))
        logs, start, end = await _train_all(url, mode, learners, loop_cfg, trainer_root)
    stop.set()
    await polling
    return ModeRun(mode, {log.name: log for log in logs}, counter, start, end)


async def _train_all(
    url: str,
    mode: PauseMode,
    learners: dict[str, LearnerProcess],
    loop_cfg: LoopConfig,
    trainer_root: Path,
) -> tuple[list[TenantLog], float, float]:
    from skyrl_lora.server.embedded.builder import _word_ids

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
                    trainer_root / mode / name,
                    random_prompts(_word_ids(), loop_cfg.prompt_words, loop_cfg.seed + i),
                    loop_cfg,
                    mode,
                    start,
                    show,
                )
                for i, (name, learner) in enumerate(learners.items())
            )
        )
        return list(logs), start, time.monotonic()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=LoopConfig.steps)
    parser.add_argument("--lr", type=float, default=LearnerConfig.lr)
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--max-staleness", type=int, default=OffPolicyConfig.max_staleness)
    parser.add_argument("--ratio-clip", type=float, default=OffPolicyConfig.ratio_clip)
    parser.add_argument(
        "--transfer",
        choices=["push", "load"],
        default=LoopConfig.transfer,
        help="push the weights over HTTP, or have the server load the trainer's folder",
    )
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated pause modes")
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "out" / "rl.json")
    parser.add_argument("--plot", type=Path, default=ROOT / "docs" / "multi_tenant_rl.png")
    args = parser.parse_args(argv)
    requested = {m for m in args.modes.split(",") if m}
    modes = [m for m in MODES if m in requested]
    unknown = requested - set(MODES)
    if unknown:
        parser.error(f"unknown modes {sorted(unknown)}; choose from {MODES}")

    off_policy = OffPolicyConfig(args.max_staleness, args.ratio_clip)
    learner_cfg = LearnerConfig(lr=args.lr, off_policy=off_policy)
    loop_cfg = LoopConfig(steps=args.steps, transfer=args.transfer)
    began = time.monotonic()
    runs: list[ModeRun] = []
    with tempfile.TemporaryDirectory(prefix="skyrl-rl-") as tmp:
        trainer_root = Path(tmp)
        print("Starting a skyrl-lora server on the embedded model...", flush=True)
        # The server may load adapters only from the trainers' folder.
        with embedded_server(["--adapter-root", str(trainer_root)]) as (url, model):
            print(f"Server ready at {url} after {time.monotonic() - began:.0f} s\n", flush=True)
            for mode in modes:
                run = asyncio.run(run_mode(url, model, mode, loop_cfg, learner_cfg, trainer_root))
                runs.append(run)
                print(f"{mode}: {run.wall_s:.1f} s\n", flush=True)
    summary = summarize(runs, args.target, off_policy.max_staleness)
    summary["end_to_end_s"] = time.monotonic() - began
    print("Reward per step:\n" + reward_rows(summary) + "\n")
    print(table(summary))
    print(f"\nEnd to end (server start included): {summary['end_to_end_s']:.0f} s")
    write_json(summary, args.json)
    plot(summary, args.plot)
    print(f"Wrote {args.json} and {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
