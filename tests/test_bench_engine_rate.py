"""The engine-rate benchmark's checks of its servers before any starts (no GPU)."""

from __future__ import annotations

import pytest

from benchmarks.engine_rate import GPU_MEM_TOTAL, SERVERS, memory_share


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
