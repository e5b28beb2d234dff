"""What a step budget cut to the CUDA graphs costs a long prompt, beside a decoding batch.

``python -m benchmarks.step_budget --json out.json`` (CUDA: a random perf
model, ``--size``); ``--embedded`` runs the same on the CPU's tiny model, to
check the benchmark itself, not to measure.

Why: RL on a GPU ran 1.11-1.39x faster with ``--max-num-batched-tokens 512
--max-num-seqs 512`` (docs/gpu.md, 0b36222): the samples a sync aborts then
re-prefill in chunks that fit vLLM's CUDA graphs beside the decodes, instead
of in eager steps. A long prompt pays for the same cut: vLLM gives it only
the room the decodes leave in each step, so its first token waits for
several steps. This measures the price, and what the decoders gain; on an
H100 at db2dbc1 (docs/gpu.md) the gain was 1.50x and the price 1.20x at the
p50, so ``serve`` now makes the cut by itself on a GPU
(``skyrl_lora.server.engine.step_budget``).

Two servers on one GPU, started one after the other: vLLM's default budget
(``serve --no-graph-step-budget``) and ``--budget`` tokens a step. Each
round, every tenant keeps ``--streams`` greedy sample loops of about
``--max-tokens`` tokens running, and one client sends prompts of
``--prompt-tokens`` random tokens (never the same twice, so the prefix cache
cannot answer them) one at a time, each asking for one token. Rounds run in the
order AB, BA, ...; per server and round: the decoders' tokens/s, and the
long prompts' latency (p50, p99, max, in ms, through the client and the HTTP
surface as a caller sees it). Ratios are the budget's over the default's,
round by round.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    TokenMeter,
    add_ab_flags,
    finish_ab,
    interleaved_rounds,
    keep_sampling,
    serve_side_by_side,
    tenants_on_random_model,
)
from benchmarks.stats import Spread, Tail, tails_spread
from skyrl_lora.client import RemoteInferenceClient

#: Token ids below this are the models' special tokens.
FIRST_PLAIN_ID = 3
#: Fewer long prompts a round than this, and the round's p99 is its max of a handful.
MIN_PROMPTS_PER_ROUND = 5


@dataclasses.dataclass(frozen=True)
class Round:
    """One server's round: the decoders' rate and the long prompts' latency."""

    tokens_per_s: float
    first_token_ms: Tail


def variants(budget: int) -> dict[str, list[str]]:
    """Each server's extra flags: vLLM's own budget (``serve`` cuts it on a
    GPU unless told not to) and the cut. vLLM refuses a budget below
    ``max_num_seqs``."""
    cut = ["--max-num-batched-tokens", str(budget), "--max-num-seqs", str(budget)]
    return {"default": ["--no-graph-step-budget"], f"budget{budget}": cut}


async def long_prompts(
    client: RemoteInferenceClient,
    tenant: str,
    length: int,
    vocab: int,
    rng: random.Random,
    waits_ms: list[float],
    stop: asyncio.Event,
) -> None:
    """Fresh prompts of ``length`` tokens, one at a time, one token each, until ``stop``."""
    while not stop.is_set():
        prompt = [rng.randrange(FIRST_PLAIN_ID, vocab) for _ in range(length)]
        began = time.monotonic()
        await client.sample(
            prompt, sampling_params={"max_tokens": 1, "temperature": 0.0}, lora_name=tenant
        )
        waits_ms.append((time.monotonic() - began) * 1000)


async def one_round(
    url: str, tenants: list[str], prompt: list[int], args: argparse.Namespace, seed: int
) -> Round:
    meter = TokenMeter()
    stop = asyncio.Event()
    waits_ms: list[float] = []
    async with RemoteInferenceClient(url) as client:
        load = [
            asyncio.create_task(
                keep_sampling(client, t, prompt, meter, stop, args.streams, args.max_tokens, 0.5)
            )
            for t in tenants
        ]
        await asyncio.sleep(args.settle_s)
        start = time.monotonic()
        rng = random.Random(seed)
        probe = asyncio.create_task(
            long_prompts(client, tenants[0], args.prompt_tokens, args.vocab, rng, waits_ms, stop)
        )
        await asyncio.sleep(args.round_s)
        end = time.monotonic()
        stop.set()
        await asyncio.gather(*load, probe)
    return Round(meter.rate(tenants, start, end), Tail.of(waits_ms))


def summarize(rounds: dict[str, list[Round]], budget_variant: str) -> dict[str, Any]:
    """Per server the spreads over rounds; the budget's ratios to the default, round by round."""
    base, cut = rounds["default"], rounds[budget_variant]

    def ratios(figure: Any) -> dict[str, float]:
        return dataclasses.asdict(
            Spread.of(figure(c) / figure(b) for c, b in zip(cut, base, strict=True))
        )

    fewest = min(r.first_token_ms.count for rs in rounds.values() for r in rs)
    return {
        "rounds": {
            v: [{"tokens_per_s": r.tokens_per_s, **r.first_token_ms.to_json()} for r in rs]
            for v, rs in rounds.items()
        },
        "tokens_per_s": {
            v: dataclasses.asdict(Spread.of(r.tokens_per_s for r in rs)) for v, rs in rounds.items()
        },
        "first_token_ms": {
            v: {k: dataclasses.asdict(s) for k, s in tails_spread(tails).items()}
            for v, tails in ((v, [r.first_token_ms for r in rs]) for v, rs in rounds.items())
        },
        "budget_over_default_tokens_per_s": ratios(lambda r: r.tokens_per_s),
        "budget_over_default_first_token_p50": ratios(lambda r: r.first_token_ms.p50),
        "budget_over_default_first_token_p99": ratios(lambda r: r.first_token_ms.p99),
        "fewest_prompts_in_a_round": fewest,
        "enough_prompts": fewest >= MIN_PROMPTS_PER_ROUND,
    }


async def measure(urls: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    async with RemoteInferenceClient(next(iter(urls.values()))) as client:
        tenants = sorted(a.lora_name for a in (await client.list_adapters()).adapters)
    tenants = tenants[: args.tenants]
    prompt = [FIRST_PLAIN_ID + i % 7 for i in range(16)]
    seeds = itertools.count()  # a fresh prompt stream each round

    async def run(variant: str) -> Round:
        return await one_round(urls[variant], tenants, prompt, args, next(seeds))

    def show(r: Round) -> str:
        t = r.first_token_ms
        return (
            f"{r.tokens_per_s:.0f} tok/s; {t.count} long prompts, "
            f"p50 {t.p50:.0f} / p99 {t.p99:.0f} / max {t.max:.0f} ms"
        )

    rounds = await interleaved_rounds(list(urls), args.rounds, run, show)
    return {"tenants_served": tenants, **summarize(rounds, list(urls)[1])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--embedded", action="store_true", help="the CPU's tiny model (a check)")
    parser.add_argument("--size", default="0.8b", help="the random perf model's shape (CUDA)")
    parser.add_argument("--budget", type=int, default=512, help="tokens a step, cut")
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=256, help="the decoders' mean length")
    parser.add_argument(
        "--prompt-tokens", type=int, help="the long prompts' length (default 1536; 768 embedded)"
    )
    add_ab_flags(parser, streams=16)
    args = parser.parse_args(argv)

    if args.prompt_tokens is None:  # within each model's --max-model-len (1024 and 2048)
        args.prompt_tokens = 768 if args.embedded else 1536
    work = args.work or Path(tempfile.mkdtemp(prefix="skyrl-step-budget-"))
    flags = variants(args.budget)
    if args.embedded:
        from skyrl_lora.server.embedded.builder import VOCAB_SIZE

        args.vocab = VOCAB_SIZE
        argv_of = {v: ["--embedded", "--port", "0", *extra] for v, extra in flags.items()}
    else:
        _, argv_of = tenants_on_random_model(args, work, flags, size=args.size, preload=True)
    result = serve_side_by_side(argv_of, work, lambda urls: measure(urls, args))
    result.update(
        model="embedded" if args.embedded else args.size,
        servers=flags,
        prompt_tokens=args.prompt_tokens,
        decode_max_tokens=args.max_tokens,
    )
    for tail in ("p50", "p99"):
        spread = result[f"budget_over_default_first_token_{tail}"]
        print(
            f"budget {args.budget} / default long-prompt latency {tail}: {spread['median']:.2f} "
            f"({spread['min']:.2f}-{spread['max']:.2f})",
            flush=True,
        )
    return finish_ab(
        result,
        args,
        tenants=len(result["tenants_served"]),
        ratio="budget_over_default_tokens_per_s",
        what=f"budget {args.budget} / default",
        check="enough_prompts",
    )


if __name__ == "__main__":
    raise SystemExit(main())
