"""Takes one Tinker sample to completion on the server, across adapter pauses.

The Tinker SDK knows nothing of our pauses: a sequence that came back
aborted would read to it as finished, and a pause must look like a wait.
So the server does what the client's ``sample_with_retry`` does: each
aborted sequence is resubmitted as ``prompt + tokens so far`` with the
remaining ``max_tokens`` (waiting at the adapter's gate while it is paused),
and :class:`~skyrl_lora.stitching.SequenceStitcher` joins the segments'
tokens and logprobs. With greedy decoding and unchanged weights the result
equals the uninterrupted answer token for token, however many pauses hit it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from skyrl_lora.stitching import SequenceStitcher, resumed_seed
from skyrl_lora.types import SampleRequest, SampleResponse, SamplingParams

from .backend import Backend
from .protobuf import EncodedSample, EncodedSequence
from .wire import TinkerError

ACTIVE = "active"
PAUSED = "paused_rate_limit"


@dataclass(frozen=True)
class RunnerConfig:
    #: Resubmissions of one sequence before it fails (each pause costs one).
    max_resubmits: int = 1000


@dataclass(frozen=True)
class SampleJob:
    """One validated ``asample``: what to run and what to send back."""

    prompt: list[int]
    lora_name: str | None
    version: int | None  # a pinned adapter version (``lora_version``), or None for the newest
    num_samples: int
    params: SamplingParams  # ``max_tokens`` already resolved
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0
    prompt_logprobs_last_n: int | None = None
    #: Asked before each resubmission: True returns the aborted sequence as
    #: it is, ``abort`` and all (SkyRL's abort-mode pause: its callers are
    #: told, not resumed). None resumes every abort.
    keep_aborted: Callable[[], bool] | None = None


class SampleRunner:
    def __init__(
        self, backend: Backend, max_model_len: int, config: RunnerConfig = RunnerConfig()
    ) -> None:
        self._backend = backend
        self._max_model_len = max_model_len
        self._config = config

    def queue_state(self, lora_name: str | None) -> str:
        """``paused_rate_limit`` while the adapter is paused: the SDK waits, quietly."""
        if lora_name is not None and self._backend.is_paused(lora_name):
            return PAUSED
        return ACTIVE

    async def run(self, job: SampleJob) -> EncodedSample:
        first = await self._backend.sample(
            SampleRequest(
                prompt_token_ids=job.prompt,
                lora_name=job.lora_name,
                lora_version=job.version,
                num_samples=job.num_samples,
                sampling_params=job.params,
                prompt_logprobs=job.prompt_logprobs and job.topk_prompt_logprobs == 0,
            )
        )
        stitchers = [self._stitcher(job) for _ in range(job.num_samples)]
        for stitcher, seq in zip(stitchers, first.sequences):
            stitcher.add_segment(seq, first.adapter_version)
        # A parallel request aborted early may return fewer sequences than
        # asked: the missing ones start afresh, like any aborted one.
        resumes = [asyncio.ensure_future(self._resume(job, s)) for s in stitchers if not s.done]
        try:
            await asyncio.gather(*resumes)
        except BaseException:  # one failed: the sample failed, stop the others' work
            for task in resumes:
                task.cancel()
            raise
        sequences = [
            EncodedSequence(r.stop_reason, r.tokens, r.logprobs)
            for r in (s.result() for s in stitchers)
        ]
        kept_aborted = any(seq.stop_reason == "abort" for seq in sequences)
        if not (job.prompt_logprobs or job.topk_prompt_logprobs) or kept_aborted:
            return EncodedSample(sequences)
        logprobs, topk = await self._prompt_scores(job, first)
        return EncodedSample(
            sequences,
            prompt_logprobs=logprobs,
            topk_prompt_logprobs=topk,
            topk=job.topk_prompt_logprobs,
        )

    def _stitcher(self, job: SampleJob) -> SequenceStitcher:
        return SequenceStitcher(
            prompt_len=len(job.prompt),
            max_tokens=job.params.max_tokens,
            stop_token_ids=frozenset(job.params.stop_token_ids),
            max_model_len=self._max_model_len,
        )

    async def _resume(self, job: SampleJob, stitcher: SequenceStitcher) -> None:
        while not stitcher.done:
            if job.keep_aborted is not None and job.keep_aborted():
                stitcher.stop_reason = "abort"
                return
            if stitcher.attempts > self._config.max_resubmits:
                raise TinkerError(
                    f"the sequence was aborted {stitcher.attempts} times; giving up",
                    category="server",
                    status=500,
                )
            response = await self._backend.sample(
                SampleRequest(
                    prompt_token_ids=[*job.prompt, *stitcher.tokens],
                    lora_name=job.lora_name,
                    lora_version=job.version,  # a pinned sample never moves version
                    num_samples=1,
                    sampling_params=job.params.model_copy(
                        update={
                            "max_tokens": stitcher.remaining,
                            "seed": resumed_seed(job.params.seed, len(stitcher.tokens)),
                        }
                    ),
                    generated_prefix_len=len(stitcher.tokens),
                )
            )
            stitcher.add_segment(response.sequences[0], response.adapter_version)

    async def _prompt_scores(
        self, job: SampleJob, first: SampleResponse
    ) -> tuple[list[float | None], list[list[tuple[int, float]] | None] | None]:
        k = job.topk_prompt_logprobs
        given = first.prompt_logprobs
        if k == 0 and given is not None and len(given) == len(job.prompt):
            logprobs: list[float | None] = list(given)
            topk = None
        else:  # top-k wanted, or a pause cut the first request's prefill short
            scores = await self._backend.score_prompt(job.prompt, job.lora_name, job.version, k)
            logprobs, topk = scores.logprobs, (scores.topk if k else None)
        last_n = job.prompt_logprobs_last_n
        if last_n is not None:
            skip = len(job.prompt) - last_n
            logprobs = [*([None] * skip), *logprobs[skip:]]
            if topk is not None:
                topk = [*([None] * skip), *topk[skip:]]
        return logprobs, topk

    def check_version(self, lora_name: str, version: int | None) -> None:
        """A sampler pinned to a version may be created while that version is held
        (current, draining or leased); its samples fail with 410 once it is not."""
        if version is not None:
            self._backend.check_servable(lora_name, version)
