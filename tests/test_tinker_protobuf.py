"""Our hand-written ``SampleResponse`` encoder, decoded by the Tinker SDK's own decoder."""

from __future__ import annotations

import math

import numpy as np
import pytest

from skyrl_lora.server.tinker.protobuf import (
    EncodedSample,
    EncodedSequence,
    encode_sample_response,
)

# The test extra pins tinker==0.38.0; CI installs it, so this really runs there.
response_conv = pytest.importorskip("tinker.proto.response_conv")
decode = response_conv.deserialize_sample_response


def test_sequences_tokens_logprobs_and_stop_reasons() -> None:
    sample = EncodedSample(
        sequences=[
            EncodedSequence("stop", [5, 0, 70000, 2**31 - 1], [-0.5, -1.25, -3.0, 0.0]),
            EncodedSequence("length", [1, 2], [-0.1, -0.2]),
        ]
    )
    decoded = decode(encode_sample_response(sample))
    assert [s.stop_reason for s in decoded.sequences] == ["stop", "length"]
    assert decoded.sequences[0].tokens == [5, 0, 70000, 2**31 - 1]
    assert decoded.sequences[0].logprobs == [-0.5, -1.25, -3.0, 0.0]
    assert decoded.sequences[1].tokens == [1, 2]
    assert decoded.prompt_logprobs is None
    assert decoded.topk_prompt_logprobs is None


def test_logprobs_are_float32() -> None:
    sample = EncodedSample(sequences=[EncodedSequence("stop", [3], [-0.1])])
    decoded = decode(encode_sample_response(sample))
    assert decoded.sequences[0].logprobs_np.dtype == np.float32
    assert decoded.sequences[0].logprobs[0] == pytest.approx(-0.1, rel=1e-6)


def test_an_empty_sequence_and_no_sequences() -> None:
    decoded = decode(encode_sample_response(EncodedSample([EncodedSequence("length", [], [])])))
    assert decoded.sequences[0].tokens == []
    assert decoded.sequences[0].stop_reason == "length"
    assert decode(encode_sample_response(EncodedSample([]))).sequences == []


def test_prompt_logprobs_with_none_first() -> None:
    sample = EncodedSample(
        sequences=[EncodedSequence("length", [9], [-2.0])],
        prompt_logprobs=[None, -1.5, -0.25, None],
    )
    decoded = decode(encode_sample_response(sample))
    assert decoded.prompt_logprobs == [None, -1.5, -0.25, None]
    assert math.isnan(decoded.prompt_logprobs_np[0])


def test_topk_prompt_logprobs_pad_short_rows_and_keep_empty_ones() -> None:
    rows = [None, [(7, -0.5), (8, -1.5)], [(9, -0.25)]]
    sample = EncodedSample(
        sequences=[EncodedSequence("stop", [1], [-0.5])],
        prompt_logprobs=[None, -0.5, -0.25],
        topk_prompt_logprobs=rows,
        topk=2,
    )
    decoded = decode(encode_sample_response(sample))
    assert decoded.topk_prompt_logprobs == [None, [(7, -0.5), (8, -1.5)], [(9, -0.25)]]
    assert decoded.topk_prompt_logprobs_np.token_ids.shape == (3, 2)


def test_many_tokens_need_multi_byte_lengths() -> None:
    tokens = list(range(5000))
    logprobs = [-float(i % 7) for i in tokens]
    decoded = decode(
        encode_sample_response(EncodedSample([EncodedSequence("length", tokens, logprobs)]))
    )
    assert decoded.sequences[0].tokens == tokens
    assert decoded.sequences[0].logprobs == logprobs


def test_abort_and_misaligned_sequences_are_refused() -> None:
    with pytest.raises(ValueError, match="abort"):
        encode_sample_response(EncodedSample([EncodedSequence("abort", [1], [-1.0])]))
    with pytest.raises(ValueError, match="logprobs"):
        encode_sample_response(EncodedSample([EncodedSequence("stop", [1, 2], [-1.0])]))
