"""The finite check on its own: one fused max per device and dtype, NaN and infinities caught."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from skyrl_lora.server.adapters.finite_check import (
    NonFiniteWeights,
    ensure_finite,
    model_tensors,
    nonfinite_count,
)


def test_counts_tensors_with_nan_or_infinity_in_every_dtype() -> None:
    good = [torch.randn(4, 8).to(d) for d in (torch.float32, torch.bfloat16, torch.float16)]
    nan = torch.randn(3, 5).bfloat16()
    nan[2, 4] = float("nan")
    inf = torch.randn(7).float()
    inf[0] = float("-inf")
    big = torch.full((2, 2), 3.0e38, dtype=torch.float32)  # finite, near the top of the range
    assert nonfinite_count([*good, big, torch.empty(0), None]) == 0
    assert nonfinite_count([*good, nan, inf]) == 2


def test_ensure_finite_says_how_many_and_what() -> None:
    bad = torch.ones(4)
    bad[1] = float("nan")
    ensure_finite([torch.ones(3)], "adapter t@v1")
    with pytest.raises(
        NonFiniteWeights, match=r"1 of the 2 weight tensors checked of adapter t@v2"
    ):
        ensure_finite([torch.ones(3), bad], "adapter t@v2")


def test_model_tensors_cover_packed_layers_and_skip_absent_parts() -> None:
    a, b, c = torch.ones(1), torch.ones(2), torch.ones(3)
    model = SimpleNamespace(
        loras={
            "q": SimpleNamespace(lora_a=a, lora_b=b),
            "qkv": SimpleNamespace(lora_a=[a, None, c], lora_b=[b, None, None]),
        }
    )
    assert [t.numel() for t in model_tensors(model)] == [1, 2, 1, 3, 2]
