"""What the Tinker runner needs from the engine, in one narrow interface.

The runner only samples, scores prompts and asks whether an adapter is
paused; keeping that behind :class:`Backend` lets it be tested without vLLM
and keeps this package below ``http`` (the ``/skyrl/v1/sample`` sampler is
injected by the app rather than imported).
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from skyrl_lora.errors import BadRequestError, InternalServerError
from skyrl_lora.types import SampleRequest, SampleResponse

from .. import compat
from ..engine.gated import GatedEngine

SampleFn = Callable[[SampleRequest], Awaitable[SampleResponse]]

#: A scoring request a pause aborted is simply run again; this many times at most.
MAX_SCORING_ATTEMPTS = 100


@dataclass(frozen=True)
class PromptScores:
    """Per prompt token: its logprob (None for the first) and its top-k alternatives."""

    logprobs: list[float | None]
    topk: list[list[tuple[int, float]] | None]


class Backend(Protocol):
    async def sample(self, request: SampleRequest) -> SampleResponse: ...

    async def score_prompt(
        self, prompt: list[int], lora_name: str | None, version: int | None, k: int
    ) -> PromptScores:
        """Logprobs (and the top ``k``) of every prompt token, in one prefill."""

    def is_paused(self, lora_name: str) -> bool: ...

    def check_servable(self, lora_name: str, version: int) -> None:
        """Raise ``VersionGoneError`` (410) unless a sample pinned to ``version`` can run:
        it is current, draining under ``finish_old``, or leased."""

    def adapter_names(self) -> list[str]: ...


class EngineBackend:
    """:class:`Backend` over the gated engine and the ``/skyrl/v1/sample`` sampler."""

    def __init__(self, sample: SampleFn, engine: GatedEngine) -> None:
        self._sample = sample
        self._engine = engine

    async def sample(self, request: SampleRequest) -> SampleResponse:
        return await self._sample(request)

    def is_paused(self, lora_name: str) -> bool:
        return self._engine.gate.is_paused(lora_name)

    def check_servable(self, lora_name: str, version: int) -> None:
        self._engine.registry.servable(lora_name, version)

    def adapter_names(self) -> list[str]:
        return self._engine.registry.names()

    async def score_prompt(
        self, prompt: list[int], lora_name: str | None, version: int | None, k: int
    ) -> PromptScores:
        """A one-token request with vLLM's prompt logprobs, through the adapter's gate.

        ``/skyrl/v1/sample`` asks vLLM for the chosen token's prompt logprob
        only; top-k alternatives need ``prompt_logprobs=k``, so they come
        from this request of their own. One that a pause aborted before its
        prefill finished is run again once the gate lets it in.
        """
        for _ in range(MAX_SCORING_ATTEMPTS):
            final = await self._prefill(prompt, lora_name, version, k)
            steps = final.prompt_logprobs or []
            if len(steps) == len(prompt):
                return _scores(prompt, steps, k)
        raise InternalServerError(
            f"scoring the prompt was aborted {MAX_SCORING_ATTEMPTS} times; giving up"
        )

    async def _prefill(
        self, prompt: list[int], lora_name: str | None, version: int | None, k: int
    ) -> Any:
        try:
            params = compat.sampling_params(
                n=1, max_tokens=1, temperature=0.0, prompt_logprobs=k, detokenize=False
            )
        except ValueError as exc:
            raise BadRequestError(f"invalid prompt logprobs request: {exc}") from exc
        request_id = f"skyrl-tinker-score-{uuid.uuid4().hex}"
        tokens = compat.tokens_prompt(list(prompt))
        if lora_name is None:
            return await self._engine.final_output(tokens, params, request_id, None)
        async with self._engine.admitted(lora_name, request_id, version, len(prompt)) as record:
            return await self._engine.final_output(tokens, params, request_id, record.lora_request)


def _scores(prompt: list[int], steps: list[Any], k: int) -> PromptScores:
    logprobs: list[float | None] = []
    topk: list[list[tuple[int, float]] | None] = []
    for token, step in zip(prompt, steps):
        if step is None:
            logprobs.append(None)
            topk.append(None)
            continue
        logprobs.append(float(step[token].logprob))
        ranked = sorted(step.items(), key=lambda item: _rank(item[1]))[:k]
        topk.append([(int(t), float(lp.logprob)) for t, lp in ranked])
    return PromptScores(logprobs, topk)


def _rank(logprob: Any) -> float:
    rank = getattr(logprob, "rank", None)
    return float("inf") if rank is None else float(rank)
