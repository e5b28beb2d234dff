"""The first token's log-probabilities after a prompt, in float32: what a greedy server should say.

``python -m benchmarks.greedy_reference --model DIR [--adapter DIR]`` (the GPU
where there is one) prints the top tokens after ``bench_prompt`` (the
prompt :mod:`benchmarks.engine_rate` samples from) for the base model and,
given an adapter, for the model with it; ``--url`` puts a running server's
top tokens beside them.

Why: a server computes in bf16, and the order its kernels round in moves
the logits. On the random 8B shape tokens tie near the top, so one
adapter's greedy samples differ between servers and between slots of one
server, and two adapter paths of ours (``--lora-overlap on`` and ``fused``)
put the first token's logprob 0.2 apart (``docs/gpu.md``). Rounding or a
defect? This is the exact end of the answer: the stored weights computed in
float32, the adapter's LoRA beside them in float32 (the embedded model's
loader, :func:`skyrl_lora.server.embedded.builder.apply_adapter`), through
transformers' Llama, independent of our code. A bf16 path may lie 0.2 from
it by its rounding order alone, so :mod:`benchmarks.rounding_orders` adds
each order beside it. On the CPU build, whose embedded model runs in
float32, a server must match it to rounding (``tests/test_greedy_reference_engine.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp

#: How vLLM names a token in ``top_logprobs`` when asked for ids (``return_tokens_as_token_ids``).
_ID_PREFIX = "token_id:"


def bench_prompt(tokens: int = 32) -> list[int]:
    """The prompt the engine-rate benchmark streams and samples greedily from."""
    return list(range(3, 3 + tokens))


def first_token_logprobs(
    model_dir: Path, prompt: list[int], adapter_dir: Path | None = None, top: int = 5
) -> dict[str, dict[int, float]]:
    """The ``top`` tokens after ``prompt`` with their log-probabilities, in
    float32: ``base`` for the model as stored, ``adapter`` with the adapter's
    LoRA (given one). The model is loaded once (14 GB in bf16 at the 8B
    shape, 28 GB in float32 on the device)."""
    import torch
    from transformers import AutoModelForCausalLM

    from skyrl_lora.server.embedded.builder import apply_adapter

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(model_dir).float().eval().requires_grad_(False)
    ids = torch.tensor([prompt], device=device)

    def top_after(model: Any) -> dict[int, float]:
        with torch.no_grad():
            logits = model.to(device)(ids).logits[0, -1].float()
        return top_tokens(torch.log_softmax(logits, dim=-1), top)

    found = {"base": top_after(model)}
    if adapter_dir is not None:
        apply_adapter(model, adapter_dir)
        found["adapter"] = top_after(model)
    # Servers may start in this process's wake: hand torch's cache back.
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return found


def top_tokens(logprobs: Any, top: int) -> dict[int, float]:
    """A vector of log-probabilities' ``top`` tokens, ``{token id: logprob}``."""
    values, tokens = logprobs.topk(top)
    return dict(zip(tokens.tolist(), values.tolist()))


def top_of_choice(choice: dict[str, Any]) -> dict[int, float]:
    """A completion choice's first position's top tokens, as ids (the request
    asked for ``logprobs`` and ``return_tokens_as_token_ids``)."""
    first = choice["logprobs"]["top_logprobs"][0]
    return {int(token.removeprefix(_ID_PREFIX)): float(lp) for token, lp in first.items()}


async def served_first_token(
    session: aiohttp.ClientSession, url: str, model: str, prompt: list[int], top: int = 5,
    max_tokens: int = 16,
) -> tuple[list[int], float, dict[int, float]]:  # fmt: skip
    """A server's greedy sample of ``max_tokens`` after ``prompt``: its token
    ids, its first token's logprob and that position's ``top`` tokens."""
    body = {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        "logprobs": top, "return_token_ids": True, "return_tokens_as_token_ids": True,
    }  # fmt: skip
    async with session.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url} answered {resp.status}: {await resp.text()}")
        choice = (await resp.json())["choices"][0]
    return choice.get("token_ids"), choice["logprobs"]["token_logprobs"][0], top_of_choice(choice)


def distance(reference: dict[int, float], served: dict[int, float]) -> dict[str, Any]:
    """How far a server's top tokens lie from the reference's: whether their
    first choice agrees, and the largest logprob gap over the tokens both list."""
    shared = reference.keys() & served.keys()
    best = max(reference, key=reference.__getitem__)
    return {
        "reference_top": best,
        "served_top": max(served, key=served.__getitem__),
        "top_gap": round(served[best] - reference[best], 4) if best in served else None,
        "max_abs_gap": round(max((abs(served[t] - reference[t]) for t in shared), default=0), 4),
        "shared": len(shared),
    }


async def _served(url: str, models: list[str], prompt: list[int], top: int, key: str | None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession(headers=headers) as session:
        return [(await served_first_token(session, url, m, prompt, top))[2] for m in models]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="the model's folder")
    parser.add_argument("--adapter", type=Path, help="a PEFT adapter's folder")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--top", type=int, default=5)
    parser.add_argument("--url", help="a server to compare: its base model and --served names")
    parser.add_argument("--served", nargs=2, metavar=("BASE", "ADAPTER"), default=None)
    parser.add_argument("--api-key")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    prompt = bench_prompt(args.prompt_tokens)
    reference = first_token_logprobs(args.model, prompt, args.adapter, args.top)
    result: dict[str, Any] = {"prompt": prompt, "reference": reference}
    if args.url and args.served:
        names = args.served[: len(result["reference"])]
        served = asyncio.run(_served(args.url, names, prompt, args.top, args.api_key))
        result["served"] = dict(zip(names, served))
        result["distance"] = {
            name: distance(ref, got)
            for name, ref, got in zip(names, result["reference"].values(), served)
        }
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
