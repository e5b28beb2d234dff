"""Staleness and off-policy weights on hand-built batches whose versions are known."""

from __future__ import annotations

import math

import pytest

from skyrl_lora.rl_accounting import (
    OffPolicyConfig,
    group_advantages,
    staleness_counts,
    token_staleness,
    token_versions,
    token_weights,
)
from skyrl_lora.types import SampledSequence, VersionRange


def _seq(ranges: list[tuple[int, int, int | None]], logprobs: list[float]) -> SampledSequence:
    return SampledSequence(
        tokens=list(range(len(logprobs))),
        logprobs=logprobs,
        stop_reason="length",
        versions=[VersionRange(start=s, end=e, version=v) for s, e, v in ranges],
        segments=len(ranges),
    )


# A sample aborted twice: 3 tokens from v5, 3 from v6, 2 from v7.
STITCHED = _seq([(0, 3, 5), (3, 6, 6), (6, 8, 7)], [-1.0] * 8)


def test_versions_and_staleness_per_token() -> None:
    assert token_versions(STITCHED) == [5, 5, 5, 6, 6, 6, 7, 7]
    assert token_staleness(STITCHED, trainer_version=7) == [2, 2, 2, 1, 1, 1, 0, 0]
    assert token_staleness(STITCHED, trainer_version=9) == [4, 4, 4, 3, 3, 3, 2, 2]


def test_weights_drop_old_tokens_and_clip_ratios() -> None:
    # Trainer logprobs differ from the sampler's by log(3), 0, log(0.5) per version.
    trainer = [-1.0 + math.log(3)] * 3 + [-1.0] * 3 + [-1.0 + math.log(0.5)] * 2
    config = OffPolicyConfig(max_staleness=1, ratio_clip=2.0)
    w = token_weights(STITCHED, trainer, trainer_version=7, config=config)
    assert w.staleness == (2, 2, 2, 1, 1, 1, 0, 0)
    assert w.kept == (False,) * 3 + (True,) * 5
    assert w.kept_count == 5
    assert w.ratios == pytest.approx([3.0] * 3 + [1.0] * 3 + [0.5] * 2)
    # v5 tokens are dropped (their ratio 3 would have been clipped to 2 otherwise).
    assert w.weights == pytest.approx([0.0] * 3 + [1.0] * 3 + [0.5] * 2)
    looser = token_weights(STITCHED, trainer, 7, OffPolicyConfig(max_staleness=2, ratio_clip=2.0))
    assert looser.weights == pytest.approx([2.0] * 3 + [1.0] * 3 + [0.5] * 2)


def test_staleness_counts_over_a_batch() -> None:
    fresh = _seq([(0, 4, 7)], [-0.5] * 4)
    config = OffPolicyConfig(max_staleness=1)
    batch = [token_weights(s, s.logprobs, 7, config) for s in (STITCHED, fresh)]
    assert staleness_counts(batch) == {0: 6, 1: 3, 2: 3}
    # On-policy tokens (same logprobs) weigh exactly 1.
    assert batch[1].weights == (1.0,) * 4


def test_token_newer_than_the_trainer_is_an_error() -> None:
    with pytest.raises(ValueError, match="newer than the trainer's 6"):
        token_staleness(STITCHED, trainer_version=6)


@pytest.mark.parametrize(
    ("ranges", "message"),
    [
        ([(0, 3, 5), (4, 8, 6)], "do not tile"),
        ([(0, 3, 5)], "cover 3 of 8"),
        ([(0, 8, None)], "base model"),
    ],
)
def test_malformed_versions_are_rejected(
    ranges: list[tuple[int, int, int | None]], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        token_versions(_seq(ranges, [-1.0] * 8))


def test_trainer_logprobs_must_align() -> None:
    with pytest.raises(ValueError, match="7 trainer logprobs for 8 tokens"):
        token_weights(STITCHED, [-1.0] * 7, 7, OffPolicyConfig())


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="max_staleness"):
        OffPolicyConfig(max_staleness=-1)
    with pytest.raises(ValueError, match="ratio_clip"):
        OffPolicyConfig(ratio_clip=0.0)


def test_group_advantages_are_normalised_per_group() -> None:
    adv = group_advantages([0.0, 0.0, 1.0, 1.0])
    assert adv == pytest.approx([-1.0, -1.0, 1.0, 1.0], abs=1e-5)
    assert sum(group_advantages([0.1, 0.5, 0.9])) == pytest.approx(0.0)
    assert group_advantages([0.3, 0.3, 0.3]) == [0.0, 0.0, 0.0]
    assert group_advantages([]) == []
