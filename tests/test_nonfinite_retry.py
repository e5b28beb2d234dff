"""A sample drawn from non-finite logits runs again on the version it was admitted on.

The sample route runs a sample drawn from NaN logits a second time (on the
CPU engine such a NaN once came from a KV block an overflowing request had
left, before new blocks were zeroed). That second run must stay inside the
first admission: a request admitted before
a ``finish_old`` load keeps its old version to the end, and a fresh
admission would have taken the new one (a fresh-clone CI run at b727ca7
answered such a request with 360 tokens of the new version). The engine is
stood in for; the retry itself runs on the real engine in
``tests/test_nonfinite_logits_engine.py``.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import SimpleNamespace
from typing import Any

import pytest

from skyrl_lora.errors import NonFiniteLogitsError
from skyrl_lora.server.http.sample import NONFINITE_ATTEMPTS, Sampler
from skyrl_lora.types import SampleRequest


def _output(logprob: float) -> Any:
    step = {7: SimpleNamespace(logprob=logprob)}
    sequence = SimpleNamespace(index=0, token_ids=[7], logprobs=[step], finish_reason="length")
    return SimpleNamespace(outputs=[sequence], prompt_logprobs=None)


class _Engine:
    """Admits at the current version (bumped by a ``finish_old`` load
    between the two runs) and answers with the logprobs given, in order."""

    def __init__(self, logprobs: list[float]) -> None:
        self.logprobs = logprobs
        self.current = 1
        self.admissions: list[int] = []
        self.request_ids: list[str] = []
        self.gate = SimpleNamespace(counters=SimpleNamespace(resumed_segments=0))

    @asynccontextmanager
    async def admitted(
        self, lora_name: str, request_id: str, *_: Any, **__: Any
    ) -> AsyncIterator[Any]:
        self.admissions.append(self.current)
        yield SimpleNamespace(version=self.current, lora_request=lora_name)

    async def final_output(self, prompt: Any, params: Any, request_id: str, lora: Any) -> Any:
        self.request_ids.append(request_id)
        self.current = 2  # a finish_old load lands while the first run is in flight
        return _output(self.logprobs.pop(0))


def _request() -> SampleRequest:
    return SampleRequest(
        prompt_token_ids=[1, 2, 3], lora_name="tenant", sampling_params={"max_tokens": 1}
    )


async def test_the_retry_runs_in_the_same_admission_on_the_same_version() -> None:
    engine = _Engine([math.nan, -0.5])
    answer = await Sampler(engine, max_model_len=64).sample(_request())  # type: ignore[arg-type]
    assert engine.admissions == [1]
    assert answer.adapter_version == 1
    assert [r.version for r in answer.sequences[0].versions] == [1]
    assert answer.sequences[0].logprobs == [-0.5]
    assert len(set(engine.request_ids)) == 1 and len(engine.request_ids) == 2


async def test_still_non_finite_after_the_last_attempt_is_refused() -> None:
    engine = _Engine([math.nan] * NONFINITE_ATTEMPTS)
    with pytest.raises(NonFiniteLogitsError, match="adapter 'tenant' v1"):
        await Sampler(engine, max_model_len=64).sample(_request())  # type: ignore[arg-type]
    assert engine.admissions == [1]
