"""Per-token staleness and off-policy weights for a trainer fed by skyrl-lora.

An asynchronous RL trainer learns from samples that older adapter versions
produced, and with per-adapter pauses one sample can span several versions
(:attr:`SampledSequence.versions`). This module turns those version ranges
and the two logprobs of every token (the sampler's, returned by the server,
and the trainer's, computed on the current weights) into the coefficient of
that token in a policy-gradient loss:

* staleness = trainer version - the version that produced the token;
* tokens staler than ``max_staleness`` are dropped (weight 0): their
  importance ratio is too noisy to correct them;
* the others get the importance ratio ``pi_trainer / pi_sampler`` truncated at
  ``ratio_clip`` (truncated importance sampling), times the sequence's
  group-normalised advantage (GRPO).

It lives in the core package, not in an example, because every trainer that
consumes ``versions`` needs the same bookkeeping, and it is pure Python on
the wire types (no torch), so a trainer that installs only the client has it
and the unit tests can check it on hand-built batches.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from skyrl_lora.types import SampledSequence


@dataclass(frozen=True)
class OffPolicyConfig:
    """``max_staleness``: oldest usable token, in versions behind the trainer.
    ``ratio_clip``: upper bound of the importance ratio (no lower bound: a
    ratio near 0 already shrinks the token's weight)."""

    max_staleness: int = 2
    ratio_clip: float = 2.0

    def __post_init__(self) -> None:
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, not {self.max_staleness}")
        if self.ratio_clip <= 0:
            raise ValueError(f"ratio_clip must be > 0, not {self.ratio_clip}")


@dataclass(frozen=True)
class TokenWeights:
    """Accounting of one sequence, one entry per generated token.

    ``ratios`` are the raw importance ratios (for diagnostics), ``weights``
    the clipped ones with dropped tokens at 0: what multiplies the advantage.
    """

    staleness: tuple[int, ...]
    kept: tuple[bool, ...]
    ratios: tuple[float, ...]
    weights: tuple[float, ...]

    @property
    def kept_count(self) -> int:
        return sum(self.kept)


def token_versions(seq: SampledSequence) -> list[int]:
    """The adapter version of every token, read from ``seq.versions``.

    Raises ``ValueError`` when the ranges do not tile the tokens exactly or a
    range has no version (base-model tokens cannot be charged to an adapter).
    """
    versions: list[int] = []
    for r in seq.versions:
        if r.start != len(versions) or r.end < r.start:
            raise ValueError(f"version ranges do not tile the tokens: {seq.versions}")
        if r.version is None:
            raise ValueError(f"tokens {r.start}-{r.end} come from the base model, not an adapter")
        versions.extend([r.version] * (r.end - r.start))
    if len(versions) != len(seq.tokens):
        raise ValueError(f"version ranges cover {len(versions)} of {len(seq.tokens)} tokens")
    return versions


def token_staleness(seq: SampledSequence, trainer_version: int) -> list[int]:
    """``trainer_version - version`` per token; negative means the trainer is
    behind the server, which no correction can fix, so it raises."""
    staleness = [trainer_version - v for v in token_versions(seq)]
    if staleness and min(staleness) < 0:
        raise ValueError(
            f"a token was produced by version {trainer_version - min(staleness)}, "
            f"newer than the trainer's {trainer_version}"
        )
    return staleness


def token_weights(
    seq: SampledSequence,
    trainer_logprobs: Sequence[float],
    trainer_version: int,
    config: OffPolicyConfig,
) -> TokenWeights:
    """Staleness, keep mask and clipped importance weights of one sequence."""
    if len(trainer_logprobs) != len(seq.tokens):
        raise ValueError(f"{len(trainer_logprobs)} trainer logprobs for {len(seq.tokens)} tokens")
    staleness = token_staleness(seq, trainer_version)
    kept = [s <= config.max_staleness for s in staleness]
    ratios = [math.exp(t - s) for t, s in zip(trainer_logprobs, seq.logprobs)]
    weights = [min(r, config.ratio_clip) if k else 0.0 for r, k in zip(ratios, kept)]
    return TokenWeights(tuple(staleness), tuple(kept), tuple(ratios), tuple(weights))


def group_advantages(rewards: Sequence[float], eps: float = 1e-6) -> list[float]:
    """GRPO: each reward minus its group's mean, over the group's std.

    A group whose rewards are all equal carries no signal and gets zeros.
    """
    if not rewards:
        return []
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    return [(r - mean) / (std + eps) for r in rewards]


def staleness_counts(batch: Iterable[TokenWeights]) -> Counter[int]:
    """Tokens by staleness over a batch (dropped ones included)."""
    counts: Counter[int] = Counter()
    for weights in batch:
        counts.update(weights.staleness)
    return counts


__all__ = [
    "OffPolicyConfig",
    "TokenWeights",
    "group_advantages",
    "staleness_counts",
    "token_staleness",
    "token_versions",
    "token_weights",
]
