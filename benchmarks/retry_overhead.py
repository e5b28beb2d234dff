"""Retry overhead: a sample interrupted 3 times versus the same sample uninterrupted.

Uninterrupted and interrupted runs alternate, and each round's ratio comes
from its own pair, so drift of the machine between rounds does not enter a
ratio. Generation time of the interrupted sample excludes the time spent
paused. Run once against a server with prefix caching (vLLM's default) and
once against one without, where every resume re-prefills prompt + tokens so
far.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from benchmarks.common import greeting_prompt, wait_engine_requests
from benchmarks.stats import Spread, check_count
from skyrl_lora.client import RemoteInferenceClient


@dataclass
class RetryOverhead:
    prefix_caching: bool
    uninterrupted_s: list[float]
    interrupted_s: list[float]

    @property
    def ratio(self) -> Spread:
        return Spread.of(i / u for i, u in zip(self.interrupted_s, self.uninterrupted_s))

    def to_json(self) -> dict[str, Any]:
        return {
            "prefix_caching": self.prefix_caching,
            "ratio": self.ratio.to_json(),
            "uninterrupted_s": self.uninterrupted_s,
            "interrupted_s": self.interrupted_s,
        }


async def _interrupted(
    client: RemoteInferenceClient,
    prompt: list[int],
    params: dict[str, Any],
    interrupts: int,
    gap: float,
) -> float | None:
    """Seconds generating (paused time excluded), or None if an interrupt missed."""
    started = time.perf_counter()
    task = asyncio.create_task(
        client.sample_with_retry(prompt, sampling_params=params, lora_name="retry")
    )
    paused = 0.0
    for _ in range(interrupts):
        running = asyncio.create_task(wait_engine_requests(client, "retry", 1))
        await asyncio.wait({running, task}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():  # finished before this pause: the round will be measured again
            running.cancel()
            break
        await running
        await asyncio.sleep(gap)
        pause_at = time.perf_counter()
        await client.pause_generation(lora_name="retry")
        await client.resume_generation(lora_name="retry")
        paused += time.perf_counter() - pause_at
    result = await task
    if result.sequences[0].segments - 1 < interrupts:
        return None  # it finished before the last pause landed: the round says nothing
    return time.perf_counter() - started - paused


async def run(
    url: str,
    model: Any,
    prompt: list[int],
    prefix_caching: bool,
    max_tokens: int = 600,
    rounds: int = 3,
) -> RetryOverhead:
    params = {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    async with RemoteInferenceClient(url) as client:
        await client.load_lora_adapter("retry", str(model.adapters["babble"]))
        plain: list[float] = []
        interrupted: list[float] = []
        attempts = 2 * rounds
        for _ in range(attempts):
            if len(interrupted) == rounds:
                break
            started = time.perf_counter()
            await client.sample(prompt, sampling_params=params, lora_name="retry")
            took = time.perf_counter() - started
            # a pause every fifth of the uninterrupted time; a round where the
            # sample outran the third pause is measured again
            again = await _interrupted(client, prompt, params, 3, took / 5)
            if again is not None:
                plain.append(took)
                interrupted.append(again)
    check_count(
        "planned interrupts",
        len(interrupted),
        rounds,
        f"rounds had all 3 interrupts land (in {attempts} attempts)",
    )
    return RetryOverhead(prefix_caching, plain, interrupted)


def main() -> None:
    """``python -m benchmarks.retry_overhead``: this benchmark alone, prefix caching on and off."""
    import argparse
    import json

    from skyrl_lora.server.cluster.local import embedded_server

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    out = {}
    for caching, extra in ((True, []), (False, ["--no-enable-prefix-caching"])):
        with embedded_server(extra=extra) as (url, model):
            prompt = greeting_prompt(model)
            result = asyncio.run(run(url, model, prompt, caching, rounds=args.rounds))
        out[str(caching)] = result.to_json()
        ratio = result.ratio
        print(
            f"prefix caching {'on' if caching else 'off'}: {ratio.median:.3f}x "
            f"({ratio.min:.3f}-{ratio.max:.3f}) over {len(result.interrupted_s)} rounds",
            flush=True,
        )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
