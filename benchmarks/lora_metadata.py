"""The engine's tokens/s with the LoRA kernels' metadata prepared on the host
against vLLM's own preparation, which waits for the GPU twice a step.

``python -m benchmarks.lora_metadata --json out.json`` (CUDA only): two
servers on one GPU, the random 0.8B Llama with ``--tenants`` rank-16
adapters each, one with the host preparation (skyrl-lora's default,
:mod:`skyrl_lora.server.lora_metadata`) and one with
``--no-host-lora-metadata``. Both first answer the same prompts with one
greedy token, every tenant's prompts sent at once so the batches mix
adapters: tokens and logprobs must agree to within what batching
noise gives (a token read with another tenant's adapter differs by far
more, which the run also measures). Then
the same load (every tenant ``--streams`` loops of greedy samples) runs on
each in turn, ``--rounds`` rounds in the order ABBA..., ``--round-s``
seconds each after a settle; the figure is each round's tokens/s ratio,
median and spread over rounds. Both servers stay up for the whole run, the
idle one using no GPU time (they start one after the other).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import (
    add_ab_flags,
    finish_ab,
    interleaved_rates,
    serve_side_by_side,
    serving_rate,
    tenants_on_random_model,
)
from benchmarks.stats import Spread
from skyrl_lora.client import RemoteInferenceClient

VARIANTS = {"host": [], "vllm": ["--no-host-lora-metadata"]}
PROMPT_TOKENS = 64
PROMPTS = 4
#: What batching alone may change between two servers (bf16 kernels over
#: batches of other shapes): a near tie's arg-max, a logprob's last digits.
#: A token read with another tenant's adapter differs by far more, which
#: the run measures beside it (``vllm_vs_other_adapter``).
AGREE_SHARE = 0.9
AGREE_WITHIN = 0.1


def _prompts(tenants: list[str], vocab: int) -> dict[str, list[list[int]]]:
    rng = random.Random(0)
    return {
        t: [[rng.randrange(3, vocab) for _ in range(PROMPT_TOKENS)] for _ in range(PROMPTS)]
        for t in tenants
    }


async def first_tokens(
    client: RemoteInferenceClient, prompts: dict[str, list[list[int]]], shift: int = 0
) -> dict[tuple[str, int], tuple[int, float]]:
    """Every tenant's prompts at once, each read with tenant ``i + shift``'s
    adapter: the greedy first token and its logprob."""
    names = list(prompts)

    async def one(i: int, name: str, k: int) -> tuple[tuple[str, int], tuple[int, float]]:
        out = await client.sample(
            prompts[name][k],
            sampling_params={"max_tokens": 1, "temperature": 0.0},
            lora_name=names[(i + shift) % len(names)],
        )
        (seq,) = out.sequences
        return (name, k), (seq.tokens[0], seq.logprobs[0])

    pairs = await asyncio.gather(
        *(one(i, n, k) for i, n in enumerate(names) for k in range(PROMPTS))
    )
    return dict(pairs)


def compare(
    a: dict[tuple[str, int], tuple[int, float]], b: dict[tuple[str, int], tuple[int, float]]
) -> dict[str, float]:
    """The share of equal first tokens, and the largest logprob difference among them."""
    same = [key for key in a if a[key][0] == b[key][0]]
    return {
        "same_token_share": len(same) / len(a),
        "largest_logprob_difference": max((abs(a[k][1] - b[k][1]) for k in same), default=0.0),
    }


async def measure(
    urls: dict[str, str], adapters: dict[str, Path], args: argparse.Namespace
) -> dict[str, Any]:
    tenants = list(adapters)
    info = {}
    for variant, url in urls.items():
        async with RemoteInferenceClient(url) as client:
            info[variant] = (await client.server_info()).model_dump()
            for name, path in adapters.items():
                await client.load_lora_adapter(name, str(path))
    prompts = _prompts(tenants, args.vocab)
    read = {}
    for variant, url in urls.items():
        async with RemoteInferenceClient(url) as client:
            read[variant] = await first_tokens(client, prompts)
            if variant == "vllm":
                read["other_adapter"] = await first_tokens(client, prompts, shift=1)
    same = compare(read["host"], read["vllm"])
    agreement = {
        "host_vs_vllm": same,
        "vllm_vs_other_adapter": compare(read["vllm"], read["other_adapter"]),
        "prompts": len(read["host"]),
    }
    print(f"greedy first tokens, host against vLLM's metadata: {agreement}", flush=True)
    prompt = prompts[tenants[0]][0][:16]

    async def rate(variant: str) -> float:
        return await serving_rate(
            urls[variant], tenants, prompt, args.streams, args.settle_s, args.round_s
        )

    rates = await interleaved_rates(list(urls), args.rounds, rate)
    ratios = [h / v for h, v in zip(rates["host"], rates["vllm"], strict=True)]
    return {
        "servers": {v: {"host_lora_metadata": info[v].get("host_lora_metadata")} for v in urls},
        "agreement": agreement,
        "agree": same["same_token_share"] >= AGREE_SHARE
        and same["largest_logprob_difference"] <= AGREE_WITHIN,
        "tokens_per_s": {v: rates[v] for v in urls},
        "host_over_vllm": dataclasses.asdict(Spread.of(ratios)),
        "rounds": ratios,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tenants", type=int, default=8)
    add_ab_flags(parser, streams=32)
    args = parser.parse_args(argv)

    work = args.work or Path(tempfile.mkdtemp(prefix="skyrl-lora-metadata-"))
    adapters, argv_of = tenants_on_random_model(args, work, VARIANTS)
    result = serve_side_by_side(argv_of, work, lambda urls: measure(urls, adapters, args))
    return finish_ab(
        result,
        args,
        tenants=args.tenants,
        ratio="host_over_vllm",
        what="host / vLLM metadata",
        check="agree",
    )


if __name__ == "__main__":
    raise SystemExit(main())
