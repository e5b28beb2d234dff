"""SequenceStitcher: the pure part of sample_with_retry."""

from __future__ import annotations

import pytest

from skyrl_lora.stitching import SequenceStitcher, merge_version_ranges, resumed_seed
from skyrl_lora.types import SampledSequence, VersionRange


def seg(tokens: list[int], reason: str, version: int | None = 1) -> SampledSequence:
    return SampledSequence(
        tokens=tokens,
        logprobs=[-float(t) / 10 for t in tokens],
        stop_reason=reason,  # type: ignore[arg-type]
        versions=[VersionRange(start=0, end=len(tokens), version=version)],
    )


def test_stitches_tokens_logprobs_and_versions() -> None:
    s = SequenceStitcher(prompt_len=3, max_tokens=10)
    s.add_segment(seg([1, 2, 3], "abort", 1), 1)
    assert not s.done and s.remaining == 7
    s.add_segment(seg([4, 5], "abort", 1), 1)
    s.add_segment(seg([6, 7, 8], "stop", 2), 2)
    out = s.result()
    assert out.tokens == [1, 2, 3, 4, 5, 6, 7, 8]
    assert out.logprobs == pytest.approx([-0.1 * t for t in out.tokens])
    assert out.stop_reason == "stop"
    assert out.versions == [
        VersionRange(start=0, end=5, version=1),
        VersionRange(start=5, end=8, version=2),
    ]
    assert s.segments == 3


def test_budget_exhausted_on_abort_boundary_is_length() -> None:
    s = SequenceStitcher(prompt_len=3, max_tokens=4)
    s.add_segment(seg([1, 2, 3, 4], "abort"), 1)
    assert s.result().stop_reason == "length"


def test_never_more_than_max_tokens() -> None:
    s = SequenceStitcher(prompt_len=3, max_tokens=4)
    s.add_segment(seg([1, 2], "abort"), 1)
    s.add_segment(seg([3, 4, 5, 6], "length"), 1)
    out = s.result()
    assert out.tokens == [1, 2, 3, 4] and len(out.logprobs) == 4
    assert out.stop_reason == "length"
    assert out.versions == [VersionRange(start=0, end=4, version=1)]


def test_stop_token_on_abort_boundary_is_stop() -> None:
    s = SequenceStitcher(prompt_len=3, max_tokens=10, stop_token_ids=frozenset({7}))
    s.add_segment(seg([1, 7], "abort"), 1)
    assert s.result().stop_reason == "stop"


def test_context_window_full_is_length() -> None:
    s = SequenceStitcher(prompt_len=6, max_tokens=100, max_model_len=10)
    assert s.remaining == 4
    s.add_segment(seg([1, 2, 3, 4], "abort"), 1)
    assert s.result().stop_reason == "length"


def test_empty_abort_segment_keeps_going() -> None:
    s = SequenceStitcher(prompt_len=3, max_tokens=5)
    s.add_segment(seg([], "abort"), 1)
    assert not s.done and s.versions == []


def test_merge_version_ranges_drops_empty_and_joins() -> None:
    ranges = [
        VersionRange(start=0, end=2, version=1),
        VersionRange(start=2, end=2, version=3),
        VersionRange(start=2, end=5, version=1),
        VersionRange(start=5, end=6, version=None),
    ]
    assert merge_version_ranges(ranges) == [
        VersionRange(start=0, end=5, version=1),
        VersionRange(start=5, end=6, version=None),
    ]


def test_empty_aborts_are_attempts_not_segments() -> None:
    s = SequenceStitcher(prompt_len=3, max_tokens=5)
    s.add_segment(seg([], "abort"), 1)  # paused before its first token
    s.add_segment(seg([1, 2], "abort"), 1)
    s.add_segment(seg([], "abort"), 2)
    s.add_segment(seg([3], "stop"), 2)
    assert (s.segments, s.attempts) == (2, 4)
    assert s.result().segments == 2


def test_a_sample_that_produced_nothing_is_one_segment() -> None:
    s = SequenceStitcher(prompt_len=3, max_tokens=5)
    s.add_segment(seg([], "stop"), 1)
    assert s.result().segments == 1


def test_resumed_seeds_differ_per_segment_and_repeat_for_the_same_point() -> None:
    assert resumed_seed(None, 7) is None
    assert resumed_seed(42, 0) == 42
    seeds = {resumed_seed(42, n) for n in range(1, 200)}
    assert len(seeds) == 199 and 42 not in seeds
    assert resumed_seed(42, 17) == resumed_seed(42, 17)
    assert resumed_seed(42, 17) != resumed_seed(43, 17)
    assert all(0 <= s < 2**63 for s in seeds if s is not None)
