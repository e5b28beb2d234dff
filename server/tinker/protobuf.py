"""A hand-written proto3 encoder for the Tinker ``SampleResponse`` message.

The SDK accepts a sample's result only as protobuf (it rejects JSON for
``SampleResponse``). The schema is tiny and we only ever write it, so a few
functions over the wire format beat a generated-code dependency: each
message is a run of ``tag, value`` pairs, nested messages and arrays are
length-delimited. Token and logprob arrays are ``bytes`` fields holding
little-endian int32 / float32 values (not repeated varints), which the SDK
reads with ``numpy.frombuffer``.

Field numbers (tinker 0.38.0's ``tinker_public.proto``)::

    SampleResponse  1 sequences (repeated SampledSequence), 2 prompt_logprobs (bytes f32),
                    3 topk_prompt_logprobs (TopkLogprobs), 4 prompt_cache_hit_tokens (int32)
    SampledSequence 1 stop_reason (enum: STOP=0, LENGTH=1), 2 tokens (bytes i32),
                    3 logprobs (bytes f32)
    TopkLogprobs    1 token_ids (bytes i32, length x k), 2 logprobs (bytes f32, length x k),
                    3 k (uint32), 4 length (uint32)
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

#: The SDK's enum values; ``abort`` never reaches it (the runner resumes those).
STOP_REASONS = {"stop": 0, "length": 1}
#: What an empty top-k cell holds (the SDK reads a row of these as "no logprobs").
MASK_TOKEN = 0
MASK_LOGPROB = -99999.0

_VARINT = 0
_LENGTH_DELIMITED = 2


@dataclass(frozen=True)
class EncodedSequence:
    """One finished sequence as the SDK receives it."""

    stop_reason: str
    tokens: Sequence[int]
    logprobs: Sequence[float]


@dataclass(frozen=True)
class EncodedSample:
    """Everything a ``SampleResponse`` carries that we fill in.

    ``prompt_logprobs`` has one entry per prompt token, None where there is no
    logprob (the first token always); ``topk_prompt_logprobs`` one list of
    ``(token, logprob)`` per prompt token, None where there is none.
    """

    sequences: Sequence[EncodedSequence]
    prompt_logprobs: Sequence[float | None] | None = None
    topk_prompt_logprobs: Sequence[Sequence[tuple[int, float]] | None] | None = None
    topk: int = 0


def encode_sample_response(sample: EncodedSample) -> bytes:
    out = bytearray()
    for seq in sample.sequences:
        _field_bytes(out, 1, _sequence(seq))
    if sample.prompt_logprobs is not None:
        values = [math.nan if v is None else v for v in sample.prompt_logprobs]
        _field_bytes(out, 2, _float32s(values))
    if sample.topk_prompt_logprobs is not None and sample.topk > 0:
        _field_bytes(out, 3, _topk(sample.topk_prompt_logprobs, sample.topk))
    return bytes(out)


def _sequence(seq: EncodedSequence) -> bytes:
    if seq.stop_reason not in STOP_REASONS:
        raise ValueError(f"a finished sequence cannot stop for {seq.stop_reason!r}")
    if len(seq.tokens) != len(seq.logprobs):
        raise ValueError(f"{len(seq.tokens)} tokens but {len(seq.logprobs)} logprobs")
    out = bytearray()
    _field_varint(out, 1, STOP_REASONS[seq.stop_reason])
    _field_bytes(out, 2, _int32s(seq.tokens))
    _field_bytes(out, 3, _float32s(seq.logprobs))
    return bytes(out)


def _topk(rows: Sequence[Sequence[tuple[int, float]] | None], k: int) -> bytes:
    tokens: list[int] = []
    logprobs: list[float] = []
    for row in rows:
        cells = list(row or [])[:k]
        cells += [(MASK_TOKEN, MASK_LOGPROB)] * (k - len(cells))
        tokens.extend(t for t, _ in cells)
        logprobs.extend(lp for _, lp in cells)
    out = bytearray()
    _field_bytes(out, 1, _int32s(tokens))
    _field_bytes(out, 2, _float32s(logprobs))
    _field_varint(out, 3, k)
    _field_varint(out, 4, len(rows))
    return bytes(out)


def _int32s(values: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(values)}i", *values)


def _float32s(values: Sequence[float]) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


def _varint(out: bytearray, value: int) -> None:
    if value < 0:
        raise ValueError("only non-negative varints are written here")
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return


def _field_varint(out: bytearray, number: int, value: int) -> None:
    if value == 0:
        return  # proto3: a zero scalar is not written
    _varint(out, number << 3 | _VARINT)
    _varint(out, value)


def _field_bytes(out: bytearray, number: int, payload: bytes) -> None:
    _varint(out, number << 3 | _LENGTH_DELIMITED)
    _varint(out, len(payload))
    out += payload
