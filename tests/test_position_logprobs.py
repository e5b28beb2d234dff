"""compat.position_logprobs reads both forms vLLM keeps logprobs in, alike."""

from __future__ import annotations

import math

from vllm.logprobs import FlatLogprobs, Logprob

from skyrl_lora.server import compat

#: Per position: the sampled token first, then a top-k alternative; None: a prompt's first.
POSITIONS = [
    None,
    {7: Logprob(-0.25, rank=1), 3: Logprob(-2.0, rank=2)},
    {5: Logprob(float("nan"), rank=4), 9: Logprob(-0.1, rank=1)},
    {2: Logprob(-1.5, rank=1)},
]
TOKENS = [11, 7, 5, 2]


def test_flat_and_dict_logprobs_read_the_same() -> None:
    flat = FlatLogprobs()
    for position in POSITIONS:
        flat.append(position)
    as_dicts = compat.position_logprobs(TOKENS, POSITIONS)
    as_flat = compat.position_logprobs(TOKENS, flat)
    expected = [None, -0.25, "nan", -1.5]
    for got in (as_dicts, as_flat):
        assert [("nan" if v is not None and math.isnan(v) else v) for v in got] == expected


def test_a_token_not_first_is_found_in_its_position() -> None:
    flat = FlatLogprobs()
    flat.append({4: Logprob(-3.0), 8: Logprob(-0.5)})
    assert compat.position_logprobs([8], flat) == [-0.5]
    assert compat.position_logprobs([8], [{4: Logprob(-3.0), 8: Logprob(-0.5)}]) == [-0.5]


def test_no_logprobs_reads_empty() -> None:
    assert compat.position_logprobs([1, 2], None) == []


def test_sampling_params_keep_logprobs_flat_where_asked() -> None:
    assert compat.sampling_params(logprobs=0, flat_logprobs=True).flat_logprobs
    assert not compat.sampling_params(logprobs=0).flat_logprobs
