"""The engine-rate benchmark's checks of its servers before any starts, and its
float32 reference set beside servers' first tokens (no GPU)."""

from __future__ import annotations

import pytest

from benchmarks.engine_rate import GPU_MEM_TOTAL, SERVERS, against_reference, memory_share
from benchmarks.greedy_reference import first_token_logprobs


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


def test_the_reference_is_set_beside_each_server_and_model(embedded_model) -> None:
    """``--reference``, on the embedded model: the base model's
    name takes the base reference, every adapter name the adapter's."""
    from skyrl_lora.server.presets import RANDOM_MODEL_NAME

    prompt, adapter = [5, 9, 11, 40], embedded_model.adapters["moo"]
    want = first_token_logprobs(embedded_model.model_dir, prompt, adapter)
    off = {token: logprob - 0.25 for token, logprob in want["adapter"].items()}
    outputs = {
        "greedy": {
            "ours": {RANDOM_MODEL_NAME: ([1], -1.0, want["base"]), "a0": ([1], -1.0, off)},
        }
    }
    got = against_reference(outputs, want)
    assert got["reference"] == want
    base, a0 = got["distance"]["ours"][RANDOM_MODEL_NAME], got["distance"]["ours"]["a0"]
    assert base["max_abs_gap"] == 0 and base["shared"] == 5
    assert a0["top_gap"] == -0.25 and a0["served_top"] == a0["reference_top"]
