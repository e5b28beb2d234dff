"""What zeroing every new KV block costs the CPU build's engine.

``python -m benchmarks.kv_zeroing --json out.json`` (CPU): two servers on
the embedded model, one with skyrl-lora's scheduler, which has every newly
allocated KV block zeroed (:mod:`skyrl_lora.server.engine.kv_zeroing`, the
CPU build's default), and one with vLLM's own. The same load (every
embedded adapter's ``--streams`` loops of greedy samples of 64-192 tokens
from a short prompt: each a new request with new blocks) runs on each in
turn, ``--rounds`` rounds in the order ABBA..., ``--round-s`` seconds each
after a settle. The figure is each round's tokens/s ratio, median and
spread over rounds. Exit status 1 if a server does not say it runs the
scheduler it was given.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import platform
from pathlib import Path
from typing import Any

from benchmarks.common import (
    current_commit,
    finish_ab,
    greeting_prompt,
    interleaved_rates,
    serving_rate,
)
from benchmarks.stats import Spread
from skyrl_lora.client import RemoteInferenceClient

#: serve flags of each variant; ``zeroed`` is what ``serve`` does by itself
VARIANTS: dict[str, tuple[str, ...]] = {
    "zeroed": (),
    "vllm": ("--scheduler-cls", "vllm.v1.core.sched.scheduler.Scheduler"),
}


async def measure(
    urls: dict[str, str], tenants: list[str], prompt: list[int], args: argparse.Namespace
) -> dict[str, Any]:
    zeroed = {}
    for variant, url in urls.items():
        async with RemoteInferenceClient(url) as client:
            zeroed[variant] = (await client.server_info()).new_kv_blocks_zeroed

    async def rate(variant: str) -> float:
        return await serving_rate(
            urls[variant], tenants, prompt, args.streams, args.settle_s, args.round_s, 128
        )

    rates = await interleaved_rates(list(urls), args.rounds, rate)
    ratios = [z / v for z, v in zip(rates["zeroed"], rates["vllm"], strict=True)]
    return {
        "new_kv_blocks_zeroed": zeroed,
        "as_given": zeroed == {"zeroed": True, "vllm": False},
        "tokens_per_s": rates,
        "zeroed_over_vllm": dataclasses.asdict(Spread.of(ratios)),
        "rounds": ratios,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=8, help="sample loops per adapter")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--round-s", type=float, default=20.0)
    parser.add_argument("--settle-s", type=float, default=5.0)
    parser.add_argument("--machine", default=f"{platform.machine()}, {os.cpu_count()} cores")
    parser.add_argument("--commit", default=current_commit())
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    from skyrl_lora.server.cluster.local import embedded_server

    with contextlib.ExitStack() as stack:
        urls = {}
        for variant, extra in VARIANTS.items():
            urls[variant], model = stack.enter_context(embedded_server(extra))
        tenants = sorted(model.adapters)
        result = asyncio.run(measure(urls, tenants, greeting_prompt(model), args))
    return finish_ab(
        result,
        args,
        tenants=len(tenants),
        ratio="zeroed_over_vllm",
        what="zeroed / vLLM's scheduler",
        check="as_given",
    )


if __name__ == "__main__":
    raise SystemExit(main())
