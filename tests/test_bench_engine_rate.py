"""The engine-rate benchmark's checks of its servers before any starts, and its
references set beside servers' first tokens (no GPU)."""

from __future__ import annotations

import pytest

from benchmarks.engine_rate import GPU_MEM_TOTAL, SERVERS, against_reference, memory_share
from benchmarks.rounding_orders import ORDERS, first_token_references


def test_servers_side_by_side_split_the_memory_by_default() -> None:
    assert memory_share(["ours", "ours_fused"], None) == 0.47
    assert memory_share(list(SERVERS), None) * len(SERVERS) <= GPU_MEM_TOTAL
    assert memory_share(["ours"], 0.85) == 0.85


def test_shares_past_the_gpu_are_refused_before_a_server_starts() -> None:
    with pytest.raises(ValueError, match=r"--gpu-mem 0\.85 for each of 2 servers"):
        memory_share(["ours", "ours_fused"], 0.85)


def test_an_unknown_server_is_named() -> None:
    with pytest.raises(ValueError, match=r"no server fused .*known: ours"):
        memory_share(["ours", "fused"], None)


def test_the_references_are_set_beside_each_server_and_model(embedded_model) -> None:
    """``--reference``, on the embedded model: the base model's name takes
    each reference's base entry, every adapter name its adapter entry, and
    the nearest reference is the one the served tokens match."""
    from skyrl_lora.server.presets import RANDOM_MODEL_NAME

    prompt, adapter = [5, 9, 11, 40], embedded_model.adapters["moo"]
    references = first_token_references(embedded_model.model_dir, prompt, adapter)
    assert set(references) == {"transformers_float32", *ORDERS}
    exact = references["transformers_float32"]
    assert references["float32"]["adapter"] == pytest.approx(exact["adapter"], abs=1e-4)
    off = {token: logprob - 0.25 for token, logprob in exact["adapter"].items()}
    outputs = {
        "greedy": {
            "ours": {
                RANDOM_MODEL_NAME: ([1], -1.0, references["lora_after_round"]["base"]),
                "a0": ([1], -1.0, off),
            },
        }
    }
    got = against_reference(outputs, references)
    assert got["reference"] is references
    base = got["distance"]["ours"][RANDOM_MODEL_NAME]
    assert base["lora_after_round"]["max_abs_gap"] == 0 and base["lora_after_round"]["shared"] == 5
    assert base["float32"]["max_abs_gap"] > 0  # the embedded model's bf16 rounding shows
    a0 = got["distance"]["ours"]["a0"]["transformers_float32"]
    assert a0["top_gap"] == -0.25 and a0["served_top"] == a0["reference_top"]
    assert got["nearest"]["ours"][RANDOM_MODEL_NAME] in ("lora_after_round", "lora_in_accumulator")
