"""Weight sync without a shared disk, and swaps that abort nothing.

``scripts/dev.sh bench-push`` (``python -m benchmarks.push_swap``): three
figures, each from interleaved rounds in one run (median, min-max):

* push of a rank-16 adapter to one server over a path load of the same files;
* push to 4 servers over push to 1 (the client streams to all concurrently);
* tenant A's own tokens/s while it swaps once a second, per swap policy, over
  windows without swaps: ``finish_old`` (no pause, nothing aborted),
  ``abort_resume`` (per-adapter pause) and vLLM's global keep-mode pause.
  Each swap spends ``hold`` seconds on the "weight transfer": under a pause
  while A is paused, under ``finish_old`` while A keeps sampling.

Writes ``benchmarks/out/push_swap.json`` and prints the table.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import TokenMeter
from benchmarks.report import Row, spread_row, table
from benchmarks.stats import Spread, check_count, median
from benchmarks.swap_time import build_rank_adapters
from skyrl_lora.client import RemoteInferenceClient
from skyrl_lora.server.cluster.local import embedded_server

ROOT = Path(__file__).resolve().parent.parent
MODES = ("no_swap", "finish_old", "abort_resume", "global")


@dataclass(frozen=True)
class PushSwapConfig:
    rounds: int = 3
    timed_calls: int = 4  # per side and round, for the push/load ratios
    window_s: float = 4.0
    settle_s: float = 1.0
    period_s: float = 1.0
    hold_s: float = 0.3
    streams: int = 8
    max_tokens: int = 32
    replicas: int = 4


async def _timed(call: Callable[[], Awaitable[Any]], times: int) -> float:
    """Median milliseconds of ``times`` calls."""
    samples = []
    for _ in range(times):
        started = time.perf_counter()
        await call()
        samples.append((time.perf_counter() - started) * 1000)
    return median(samples)


async def push_vs_load(
    url: str, paths: list[Path], cfg: PushSwapConfig
) -> tuple[list[float], list[float]]:
    """Per round: (push ms, load ms) medians, alternating within the round."""
    pushes, loads = [], []
    async with RemoteInferenceClient(url) as client:
        await client.load_lora_adapter("push-bench", str(paths[0]))
        flip = itertools.cycle(paths)
        for _ in range(cfg.rounds):
            load_ms = await _timed(
                lambda: client.load_lora_adapter("push-bench", str(next(flip))), cfg.timed_calls
            )
            push_ms = await _timed(
                lambda: client.push_lora_adapter("push-bench", next(flip)), cfg.timed_calls
            )
            pushes.append(push_ms)
            loads.append(load_ms)
    return pushes, loads


async def fan_out_push(urls: list[str], paths: list[Path], cfg: PushSwapConfig) -> list[float]:
    """Per round: push to every server over push to the first one."""
    ratios = []
    async with RemoteInferenceClient(urls) as many, RemoteInferenceClient(urls[0]) as one:
        await many.push_lora_adapter("fan-bench", paths[0])
        flip = itertools.cycle(paths)  # each push really changes the weights
        for _ in range(cfg.rounds):
            one_ms = await _timed(
                lambda: one.push_lora_adapter("fan-bench", next(flip)), cfg.timed_calls
            )
            many_ms = await _timed(
                lambda: many.push_lora_adapter("fan-bench", next(flip)), cfg.timed_calls
            )
            ratios.append(many_ms / one_ms)
    return ratios


@dataclass
class SwapWindow:
    mode: str
    round: int
    rate: float
    swaps: int
    aborted_samples: int


async def own_rate_by_policy(
    url: str, model: Any, prompt: list[int], cfg: PushSwapConfig
) -> list[SwapWindow]:
    """Tenant A samples throughout; windows of each mode alternate, round by round."""
    meter = TokenMeter()
    resumed: list[tuple[float, int]] = []  # (finished at, segments) of A's samples
    weights = [model.adapters["meow"], model.adapters["woof"]]
    params = {"max_tokens": cfg.max_tokens, "temperature": 0.0, "ignore_eos": True}
    async with RemoteInferenceClient(url) as client:
        await client.load_lora_adapter("own-a", str(weights[0]))
        stop = asyncio.Event()

        async def stream() -> None:
            while not stop.is_set():
                started = time.monotonic()
                out = await client.sample_with_retry(
                    prompt, sampling_params=params, lora_name="own-a"
                )
                meter.add("own-a", len(out.sequences[0].tokens), started)
                resumed.append((time.monotonic(), out.sequences[0].segments))

        async def swap(mode: str, index: int) -> None:
            path = str(weights[index % 2])
            if mode == "finish_old":
                await asyncio.sleep(cfg.hold_s)  # the transfer, while A keeps sampling
                await client.load_lora_adapter("own-a", path, swap_policy="finish_old")
                return
            lora = "own-a" if mode == "abort_resume" else None
            await client.pause_generation(lora_name=lora)
            await asyncio.sleep(cfg.hold_s)
            await client.load_lora_adapter("own-a", path)
            await client.resume_generation(lora_name=lora)

        load = [asyncio.create_task(stream()) for _ in range(cfg.streams)]
        windows: list[SwapWindow] = []
        swaps_done = 0
        try:
            for rnd in range(cfg.rounds):
                for mode in MODES:
                    await asyncio.sleep(cfg.settle_s)
                    start = time.monotonic()
                    swaps = 0
                    while time.monotonic() - start < cfg.window_s - cfg.period_s / 2:
                        tick = time.monotonic()
                        if mode != "no_swap":
                            await swap(mode, swaps_done)
                            swaps += 1
                            swaps_done += 1
                        await asyncio.sleep(max(0.0, cfg.period_s - (time.monotonic() - tick)))
                    end = time.monotonic()
                    aborted = sum(1 for t, seg in resumed if start <= t <= end + 1 and seg > 1)
                    windows.append(
                        SwapWindow(mode, rnd, meter.rate(["own-a"], start, end), swaps, aborted)
                    )
        finally:
            stop.set()
            await asyncio.gather(*load)
    for w in windows:
        if w.mode != "no_swap":
            check_count(f"{w.mode} swaps", w.swaps, int(cfg.window_s / cfg.period_s) - 1, "swaps")
    return windows


def _ratios(windows: list[SwapWindow], mode: str) -> list[float]:
    base = {w.round: w.rate for w in windows if w.mode == "no_swap"}
    return [w.rate / base[w.round] for w in windows if w.mode == mode]


def report(
    pushes: list[float],
    loads: list[float],
    fan: list[float],
    windows: list[SwapWindow],
    cfg: PushSwapConfig,
) -> tuple[list[Row], dict[str, Any]]:
    ratio = Spread.of(p / q for p, q in zip(pushes, loads))
    rows = [
        spread_row(
            "push of a rank-16 adapter / path load of the same files, one server",
            ratio,
            ".2f",
            "x",
            "<= 1.3x",
            f"push {median(pushes):.0f} ms, load {median(loads):.0f} ms (medians)",
        ),
        spread_row(
            f"push to {cfg.replicas} servers / push to 1",
            Spread.of(fan),
            ".2f",
            "x",
            "<= 1.5x",
            f"{cfg.replicas} CPU replicas on this machine's 2 cores",
        ),
    ]
    result: dict[str, Any] = {
        "push_over_load": ratio.to_json(),
        "push_ms": pushes,
        "load_ms": loads,
        "fan_out_4_over_1": Spread.of(fan).to_json(),
    }
    for mode, target in (("finish_old", ">= 0.95x"), ("abort_resume", ""), ("global", "")):
        spread = Spread.of(_ratios(windows, mode))
        aborted = sum(w.aborted_samples for w in windows if w.mode == mode)
        rows.append(
            spread_row(
                f"tenant A's own tok/s while it swaps once a second, {mode} / no swap",
                spread,
                ".2f",
                "x",
                target,
                f"{aborted} of A's samples aborted and resumed",
            )
        )
        result[f"own_ratio_{mode}"] = {**spread.to_json(), "aborted_samples": aborted}
    return rows, result


def main() -> int:
    import ray

    cfg = PushSwapConfig()
    # One logical CPU per server actor: declare enough for every replica
    # (the replicas mostly idle; the 2 real cores are shared either way).
    ray.init(num_cpus=cfg.replicas + 1, include_dashboard=False, log_to_driver=False)
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(embedded_server()) for _ in range(cfg.replicas)]
        (url, model), urls = servers[0], [u for u, _ in servers]
        paths = build_rank_adapters(model, (16,))[16]
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model.model_dir)
        prompt = list(tokenizer.encode("hello there how are you", add_special_tokens=False))
        pushes, loads = asyncio.run(push_vs_load(url, paths, cfg))
        fan = asyncio.run(fan_out_push(urls, paths, cfg))
        windows = asyncio.run(own_rate_by_policy(url, model, prompt, cfg))
    rows, result = report(pushes, loads, fan, windows, cfg)
    out = ROOT / "benchmarks" / "out"
    out.mkdir(parents=True, exist_ok=True)
    (out / "push_swap.json").write_text(json.dumps(result, indent=2))
    print("\n" + table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
