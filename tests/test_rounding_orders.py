"""benchmarks.rounding_orders: its Llama is transformers' in float32, and its
orders differ only where they should (CPU, a small grouped-query Llama)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.greedy_reference import first_token_logprobs
from benchmarks.rounding_orders import ORDERS, first_token_orders

PROMPT = [5, 9, 11, 40, 77, 3, 120, 64]


@pytest.fixture(scope="module")
def small_llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two layers, four query heads on two key-value heads, a rope base of
    its own, random norms (ones would hide a norm applied wrong) and an
    adapter on every projection."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from skyrl_lora.server.embedded.random_model import write_model_adapter

    root = tmp_path_factory.mktemp("llama")
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=500.0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(3)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.uniform_(0.5, 1.5)
    model.save_pretrained(root / "model")
    adapter = write_model_adapter(root / "model", root / "adapter", rank=8, seed=7)
    return root / "model", adapter


def test_float32_is_transformers_llama(small_llama) -> None:
    model_dir, adapter = small_llama
    want = first_token_logprobs(model_dir, PROMPT, adapter, top=10)
    got = first_token_orders(model_dir, PROMPT, adapter, top=10)
    for which in ("base", "adapter"):
        assert got[which]["float32"].keys() == want[which].keys()
        for token, logprob in want[which].items():
            assert got[which]["float32"][token] == pytest.approx(logprob, abs=1e-4)
    assert want["adapter"] != pytest.approx(want["base"], abs=1e-3)  # the adapter counts


def test_the_orders_differ_only_where_the_lora_is_added(small_llama) -> None:
    model_dir, adapter = small_llama
    got = first_token_orders(model_dir, PROMPT, adapter, top=10)
    assert set(got["base"]) == set(got["adapter"]) == set(ORDERS)
    # Without an adapter the two LoRA orders are one computation.
    assert got["base"]["lora_after_round"] == got["base"]["lora_in_accumulator"]
    # With one, rounding the base output first moves the logits.
    assert got["adapter"]["lora_after_round"] != got["adapter"]["lora_in_accumulator"]
    for which in ("base", "adapter"):
        exact = got[which]["float32"]
        for order in ORDERS[1:]:
            rounded = got[which][order]
            shared = exact.keys() & rounded.keys()
            assert len(shared) >= 8
            assert max(abs(exact[t] - rounded[t]) for t in shared) < 0.1
            assert any(exact[t] != rounded[t] for t in shared)  # bf16 did round


def test_an_unknown_order_is_refused(small_llama) -> None:
    from benchmarks.rounding_orders import _Llama

    with pytest.raises(ValueError, match="unknown order 'bf16'"):
        _Llama(small_llama[0], "cpu").top_after(PROMPT, "bf16", 5)
