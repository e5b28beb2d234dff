"""Stop strings that straddle an abort boundary, with the embedded tokenizer."""

from __future__ import annotations

from skyrl_lora.types import SampledSequence, VersionRange


def ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def segment(tokens: list[int]) -> SampledSequence:
    return SampledSequence(
        tokens=tokens,
        logprobs=[-1.0] * len(tokens),
        stop_reason="length",
        versions=[VersionRange(start=0, end=len(tokens), version=3)],
    )


def test_stop_string_across_boundary_cuts_the_new_segment(tokenizer) -> None:
    from skyrl_lora.server.http.sample import _cut_at_boundary_stop

    prefix = ids(tokenizer, "hello meow")
    new = ids(tokenizer, "woof moo quack")
    out = _cut_at_boundary_stop(segment(new), prefix, ["meow woof"], tokenizer)
    assert out.tokens == new[:1] and out.logprobs == [-1.0]
    assert out.stop_reason == "stop"
    assert out.versions == [VersionRange(start=0, end=1, version=3)]


def test_stop_string_inside_the_prefix_or_segment_alone_is_not_a_boundary_match(tokenizer) -> None:
    from skyrl_lora.server.http.sample import _cut_at_boundary_stop

    prefix = ids(tokenizer, "hello meow")
    new = ids(tokenizer, "woof moo quack")
    assert _cut_at_boundary_stop(segment(new), prefix, ["hello"], tokenizer).stop_reason == "length"
    assert _cut_at_boundary_stop(segment(new), prefix, ["moo quack"], tokenizer).tokens == new
