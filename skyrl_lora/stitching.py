"""Pure logic that turns aborted segments back into one complete sample.

When an adapter is paused its in-flight requests come back with
``stop_reason="abort"`` and whatever they had generated. The caller resubmits
``prompt + tokens so far`` with the remaining budget; :class:`SequenceStitcher`
keeps the running tokens, logprobs and version ranges of one sequence and
decides when there is nothing left to resubmit. It does no I/O so that every
edge case (budget exhausted on the abort boundary, a stop token as the last
partial token, the context window filling up) is unit-testable.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field

from skyrl_lora.types import SampledSequence, StopReason, VersionRange


def merge_version_ranges(ranges: Iterable[VersionRange]) -> list[VersionRange]:
    """Join adjacent ranges of the same version; drop empty ones."""
    merged: list[VersionRange] = []
    for r in ranges:
        if r.end <= r.start:
            continue
        if merged and merged[-1].version == r.version and merged[-1].end == r.start:
            merged[-1] = VersionRange(start=merged[-1].start, end=r.end, version=r.version)
        else:
            merged.append(r)
    return merged


def resumed_seed(seed: int | None, generated: int) -> int | None:
    """The seed of a resubmitted segment that starts after ``generated`` tokens.

    A resubmission with the original seed restarts the same random stream, so
    the resumed part would repeat the first part's draws token for token. A
    seed derived from the original seed and the tokens already generated
    gives every segment draws of its own, and the same sample aborted at the
    same points draws the same again (reproducible). ``None`` stays ``None``;
    0 tokens keeps the original seed.
    """
    if seed is None or generated == 0:
        return seed
    digest = hashlib.sha256(f"skyrl-lora:{seed}:{generated}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & (2**63 - 1)


@dataclass
class SequenceStitcher:
    """Accumulates the segments of one sequence across aborts.

    ``max_tokens`` is the caller's original budget, ``stop_token_ids`` the
    explicit stop tokens (a partial segment that already ends in one is
    complete), ``max_model_len`` the server's context limit.
    """

    prompt_len: int
    max_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    max_model_len: int | None = None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[VersionRange] = field(default_factory=list)
    stop_reason: StopReason | None = None
    #: Server answers that added tokens; an abort that caught a request
    #: before its first token is not a segment of the sample.
    segments: int = 0
    #: Every server answer, empty ones included: what a retry limit counts.
    attempts: int = 0

    @property
    def done(self) -> bool:
        return self.stop_reason is not None

    @property
    def remaining(self) -> int:
        """Tokens still allowed by both ``max_tokens`` and the context window."""
        budget = self.max_tokens - len(self.tokens)
        if self.max_model_len is not None:
            budget = min(budget, self.max_model_len - self.prompt_len - len(self.tokens))
        return max(budget, 0)

    def add_segment(self, segment: SampledSequence, version: int | None) -> None:
        """Append one server answer and decide whether the sequence is finished."""
        if self.done:
            raise RuntimeError("sequence already finished; nothing to add")
        room = self.remaining
        new_tokens = segment.tokens[:room]
        start = len(self.tokens)
        self.tokens.extend(new_tokens)
        self.logprobs.extend(segment.logprobs[: len(new_tokens)])
        ranges = segment.versions or [VersionRange(start=0, end=len(new_tokens), version=version)]
        shifted = (
            VersionRange(
                start=start + min(r.start, len(new_tokens)),
                end=start + min(r.end, len(new_tokens)),
                version=r.version,
            )
            for r in ranges
        )
        self.versions = merge_version_ranges([*self.versions, *shifted])
        self.attempts += 1
        if new_tokens:
            self.segments += 1

        truncated = len(new_tokens) < len(segment.tokens)
        if segment.stop_reason != "abort" and not truncated:
            self.stop_reason = segment.stop_reason
        elif self.tokens and self.tokens[-1] in self.stop_token_ids:
            self.stop_reason = "stop"
        elif self.remaining == 0:
            self.stop_reason = "length"

    def result(self) -> SampledSequence:
        if self.stop_reason is None:
            raise RuntimeError("sequence is not finished yet")
        return SampledSequence(
            tokens=list(self.tokens),
            logprobs=list(self.logprobs),
            stop_reason=self.stop_reason,
            versions=list(self.versions),
            segments=max(self.segments, 1),
        )
