"""``python -m benchmarks`` (or ``scripts/dev.sh bench``): run every benchmark, print a table.

Every number is a ratio against a baseline measured in the same run, or a
latency with its target; the machine is noisy, so only side-by-side numbers
mean anything. Writes ``benchmarks/out/results.json`` and the plot
``docs/swap_isolation.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
from pathlib import Path
from typing import Any

from benchmarks import (
    client_overhead,
    fanout,
    isolation,
    pause_latency,
    plot,
    retry_overhead,
    swap_time,
)
from benchmarks.common import embedded_server

ROOT = Path(__file__).resolve().parent.parent


def _prompt(model: Any) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model.model_dir)
    return list(tokenizer.encode("hello there how are you", add_special_tokens=False))


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer rounds, shorter phases")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    rounds = 20 if args.quick else 50
    seconds = 5.0 if args.quick else 8.0
    rows: list[tuple[str, str, str, str]] = []
    results: dict[str, Any] = {}

    results["client_overhead"] = co = asyncio.run(client_overhead.run())
    rows.append(
        (
            "client rps, 256 concurrent: skyrl / raw aiohttp",
            f"{co['skyrl client'] / co['raw aiohttp']:.2f}x",
            ">= 0.90x",
            f"{co['skyrl client']:.0f} vs {co['raw aiohttp']:.0f} req/s",
        )
    )
    rows.append(
        (
            "client rps: skyrl / OpenAI SDK",
            f"{co['skyrl client'] / co['openai sdk']:.1f}x",
            "> 1x",
            f"{co['openai sdk']:.0f} req/s for the SDK",
        )
    )
    results["fanout_ms"] = fo = asyncio.run(fanout.run())
    rows.append(
        (
            "pause fan-out, 50 ms servers: 32 / 1 server",
            f"{fo[32] / fo[1]:.2f}x",
            "flat",
            ", ".join(f"{n}: {t:.0f} ms" for n, t in fo.items()),
        )
    )

    with embedded_server() as (url, model):
        prompt = _prompt(model)
        phases, meter = asyncio.run(isolation.run(url, model, prompt, seconds=seconds))
        base = phases[0].others_rate
        for phase in phases[1:]:
            rows.append(
                (
                    f"isolation: others' tok/s during swaps, {phase.name} pause",
                    f"{phase.others_rate / base:.2f}x",
                    ">= 0.95x" if phase.name == "per_adapter" else "(baseline design)",
                    f"{phase.others_rate:.0f} vs {base:.0f} tok/s, {phase.swaps} swaps",
                )
            )
        results["isolation"] = {
            p.name: {"others_tok_s": p.others_rate, "swaps": p.swaps} for p in phases
        }
        plot_path = plot.plot(phases, meter, ROOT / "docs" / "swap_isolation.png")

        lat = asyncio.run(pause_latency.run(url, model, prompt, rounds=rounds))
        s = lat.summary
        results["pause_latency"] = s
        rows.append(
            (
                f"pause latency, {lat.in_flight} in flight, {lat.rounds} pauses: p50 / p99",
                f"{s['median_ms']:.1f} / {s['p99_ms']:.1f} ms",
                "p99 <= 50 ms",
                f"server-side drain {s['server_median_ms']:.1f} / {s['server_p99_ms']:.1f} ms;"
                " reference design: 5000 ms sleep",
            )
        )

        ro = asyncio.run(retry_overhead.run(url, model, prompt, prefix_caching=True))
        swaps = asyncio.run(swap_time.run(url, model))
    with embedded_server(extra=["--no-enable-prefix-caching"]) as (url2, _):
        ro_off = asyncio.run(retry_overhead.run(url2, model, prompt, prefix_caching=False))
    for r in (ro, ro_off):
        rows.append(
            (
                f"retry overhead, 3 interrupts, prefix caching {'on' if r.prefix_caching else 'off'}",  # noqa: E501
                f"{r.ratio:.3f}x",
                "<= 1.05x" if r.prefix_caching else "",
                f"{r.interrupted_s:.2f} s vs {r.uninterrupted_s:.2f} s uninterrupted",
            )
        )
    results["retry_overhead"] = {str(r.prefix_caching): r.__dict__ for r in (ro, ro_off)}
    results["swap_ms"] = swaps
    rows.append(
        (
            "swap: pause + reload in place + resume, rank 8 / 16 / 64",
            " / ".join(f"{swaps[r]:.0f}" for r in (8, 16, 64)) + " ms",
            "",
            "median of 6",
        )
    )

    out = ROOT / "benchmarks" / "out"
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    print("\n| measure | result | target | detail |\n| --- | --- | --- | --- |")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print(f"\nplot: {plot_path.relative_to(ROOT)}   raw: benchmarks/out/results.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
