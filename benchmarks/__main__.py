"""``python -m benchmarks`` (or ``scripts/dev.sh bench``): run every benchmark, print a table.

Every figure is the median over at least 3 rounds with min and max beside
it, each round's ratio taken against a baseline measured in the same round
(the machine is noisy, so only side-by-side numbers mean anything).
Latencies report p50, p99 and max. Writes ``benchmarks/out/results.json``
and the plot ``docs/swap_isolation.png``. If a sanity check fails (see
``benchmarks.stats``) the raw figures are still written, no table is
printed, and the exit code is 3.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from benchmarks import (
    adapter_read,
    client_overhead,
    engine_overhead,
    fanout,
    perf,
    plot,
    retry_overhead,
    slot_write,
)
from benchmarks.common import greeting_prompt
from benchmarks.isolation import IsolationConfig
from benchmarks.report import Row, spread_row, table
from benchmarks.retry_overhead import RetryOverhead
from benchmarks.stats import Spread, UntrustworthyRunError
from skyrl_lora.server.cluster.local import embedded_server

ROOT = Path(__file__).resolve().parent.parent
EXIT_UNTRUSTWORTHY = 3


def cpu_shape(quick: bool) -> perf.PerfShape:
    """The CPU machine's shape: 3 tenants x 8 streams; ``quick`` shortens every part."""
    three = IsolationConfig()
    if quick:
        three = replace(three, swaps_per_window=2, settle_s=0.5)
    return perf.PerfShape(
        isolation=three,
        # Eight tenants' first activations and prefills take the 2 cores longer
        # to absorb: the first no-swap window ran at half the rate of the rest.
        eight_tenants=replace(three, tenants=8, streams=3, warmup_s=6.0),
        pauses=20 if quick else 30,
        control_repeats=20 if quick else 50,
        swap_repeats=4 if quick else 6,
    )


def _client_rows(rps: dict[str, list[float]], fo: dict[int, list[float]]) -> list[Row]:
    ratio = client_overhead.ratios(rps)
    n = len(rps["raw aiohttp"])
    med = {k: Spread.of(v).median for k, v in rps.items()}
    sizes = sorted(fo)
    fan = Spread.of(b / a for a, b in zip(fo[sizes[0]], fo[sizes[-1]]))
    return [
        spread_row(
            "client rps, 256 concurrent: skyrl / raw aiohttp",
            ratio["vs_raw"],
            ".2f",
            "x",
            ">= 0.90x",
            f"{med['skyrl client']:.0f} vs {med['raw aiohttp']:.0f} req/s, {n} rounds",
        ),
        spread_row(
            "client CPU per request, 256 concurrent: skyrl / raw aiohttp",
            ratio["cpu_vs_raw"],
            ".2f",
            "x",
            "",
            f"{Spread.of(rps['skyrl client cpu_us']).median:.0f} vs"
            f" {Spread.of(rps['raw aiohttp cpu_us']).median:.0f} us of this process's CPU;"
            " immune to what else the machine runs",
        ),
        spread_row(
            "client rps: skyrl / OpenAI SDK",
            ratio["vs_sdk"],
            ".1f",
            "x",
            "> 1x",
            f"{med['openai sdk']:.0f} req/s for the SDK",
        ),
        spread_row(
            f"pause fan-out, 50 ms servers: {sizes[-1]} / {sizes[0]} server",
            fan,
            ".2f",
            "x",
            "flat",
            ", ".join(f"{k}: {Spread.of(fo[k]).median:.0f} ms" for k in sizes),
        ),
    ]


def _retry_row(r: RetryOverhead) -> Row:
    return spread_row(
        f"retry overhead, 3 interrupts, prefix caching {'on' if r.prefix_caching else 'off'}",
        r.ratio,
        ".3f",
        "x",
        "<= 1.05x" if r.prefix_caching else "",
        f"{Spread.of(r.interrupted_s).median:.2f} s vs"
        f" {Spread.of(r.uninterrupted_s).median:.2f} s uninterrupted,"
        f" {len(r.interrupted_s)} rounds",
    )


def _slot_write_rows(sw: slot_write.SlotWriteFigures) -> list[Row]:
    med = {f: {m: Spread.of(v).median for m, v in getattr(sw, f).items()} for f in sw.FIGURES}
    rounds = len(sw.write_ms["batched"])
    return [
        spread_row(
            "slot write beside a busy step loop: batched / vLLM's per-layer calls",
            sw.ratio("write_ms"),
            ".3f",
            "x",
            "< 1",
            f"{med['write_ms']['batched']:.1f} vs {med['write_ms']['per_layer']:.1f} ms"
            f" (idle {sw.idle_write_ms['batched']:.1f} vs {sw.idle_write_ms['per_layer']:.1f});"
            f" {sw.layers} vLLM LoRA layers, the GPU perf model's, rank 16; {rounds} rounds",
        ),
        spread_row(
            "the step loop's longest iteration during a slot write: batched / per-layer",
            sw.ratio("loop_max_ms"),
            ".3f",
            "x",
            "< 1",
            f"{med['loop_max_ms']['batched']:.1f} vs {med['loop_max_ms']['per_layer']:.1f} ms;"
            f" p99 between writes {sw.loop_outside_p99_ms:.1f} ms",
        ),
        spread_row(
            "a fresh slot's first write, idle: another slot's plan moved / recorded",
            sw.first_write_ratio(),
            ".3f",
            "x",
            "< 1",
            " vs ".join(
                f"{Spread.of(sw.first_write_ms[m]).median:.1f}"
                for m in ("moved", "recorded", "replayed")
            )
            + " ms (moved, recorded, a replay after)",
        ),
    ]


def _adapter_read_rows(ar: adapter_read.AdapterReadFigures) -> list[Row]:
    med = {m: Spread.of(v).median for m, v in ar.read_ms.items()}
    loop = {m: Spread.of(v).median for m, v in ar.loop_max_ms.items()}
    pinned = "pinned" if ar.pinned else "not pinned here (no CUDA)"
    return [
        spread_row(
            "adapter read beside a busy step loop: one buffer / vLLM's per-tensor read",
            ar.ratio("read_ms"),
            ".3f",
            "x",
            "< 1 where vLLM pins",
            f"{med['one_buffer']:.1f} vs {med['safetensors']:.1f} ms"
            f" (idle {ar.idle_read_ms['one_buffer']:.1f} vs {ar.idle_read_ms['safetensors']:.1f});"
            f" {ar.tensors} tensors, {ar.adapter_mb} MB, {pinned}; {len(ar.read_ms['safetensors'])}"
            " rounds",
        ),
        spread_row(
            "the step loop's longest iteration during an adapter read: one buffer / per-tensor",
            ar.ratio("loop_max_ms"),
            ".3f",
            "x",
            "",
            f"{loop['one_buffer']:.1f} vs {loop['safetensors']:.1f} ms;"
            f" p99 between reads {ar.loop_outside_p99_ms:.1f} ms",
        ),
    ]


def main() -> int:
    """Run everything; on a failed sanity check write the raw figures, print no table."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer pauses, shorter windows")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    results: dict[str, Any] = {"quick": args.quick}
    out = ROOT / "benchmarks" / "out"
    out.mkdir(parents=True, exist_ok=True)
    try:
        rows, run = _measure(args.quick, results)
        run.check()
    except UntrustworthyRunError as exc:
        results["untrustworthy"] = {"check": exc.check, "why": exc.why}
        (out / "results.json").write_text(json.dumps(results, indent=2, default=str))
        print(f"benchmark run NOT trustworthy, no table: {exc}", file=sys.stderr)
        print("raw figures so far: benchmarks/out/results.json", file=sys.stderr)
        return EXIT_UNTRUSTWORTHY
    except BaseException:
        results["crashed"] = True  # keep what was measured before the crash
        (out / "results.json").write_text(json.dumps(results, indent=2, default=str))
        raise
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    plot_path = plot.plot(run.isolation, ROOT / "docs" / "swap_isolation.png")
    print("\n" + table(rows))
    print(results["engine_overhead"]["verdict"])
    print(
        f"\n{results['seconds']:.0f} s in all   plot: {plot_path.relative_to(ROOT)}"
        "   raw: benchmarks/out/results.json"
    )
    return 0


def _measure(quick: bool, results: dict[str, Any]) -> tuple[list[Row], perf.PerfRun]:
    """Every measurement, filling ``results`` as it goes (so a failure keeps the rest)."""
    began = time.monotonic()
    shape = cpu_shape(quick)
    rps = asyncio.run(client_overhead.run(rounds=3 if quick else 5))
    fo = asyncio.run(fanout.run())
    results["client_rps"] = rps
    results["client_ratio"] = {k: s.to_json() for k, s in client_overhead.ratios(rps).items()}
    results["fanout_ms"] = fo
    rows = _client_rows(rps, fo)
    sw = slot_write.run()
    results["slot_write"] = asdict(sw)
    rows += _slot_write_rows(sw)
    ar = adapter_read.run()
    results["adapter_read"] = asdict(ar)
    rows += _adapter_read_rows(ar)

    with embedded_server(extra=["--max-loras", "8"]) as (url, model):
        prompt = greeting_prompt(model)
        run = asyncio.run(perf.collect(url, model, prompt, shape))
        results["perf"] = run.figures()
        missing = perf.missing_keys(results["perf"])
        if missing:  # the GPU test writes the same figures: fail here first, not there
            raise RuntimeError(f"perf figures lack {missing}")
        ro = asyncio.run(retry_overhead.run(url, model, prompt, prefix_caching=True))
    with embedded_server(extra=["--no-enable-prefix-caching"]) as (url2, _):
        ro_off = asyncio.run(retry_overhead.run(url2, model, prompt, prefix_caching=False))
    results["retry_overhead"] = {str(r.prefix_caching): r.to_json() for r in (ro, ro_off)}
    rows += [*run.rows(), _retry_row(ro), _retry_row(ro_off)]
    # Ours against plain vLLM, same flags and load: a slower step anywhere in
    # what serve adds shows here (the row says REGRESSION below 0.90x).
    eo = engine_overhead.run(
        engine_overhead.Load(rounds=4 if quick else 6),
        ROOT / "benchmarks" / "out" / "engine_overhead",
    )
    results["engine_overhead"] = eo.to_json()
    rows += eo.rows()
    results["seconds"] = time.monotonic() - began
    return rows, run


if __name__ == "__main__":
    raise SystemExit(main())
