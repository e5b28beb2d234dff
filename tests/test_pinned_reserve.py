"""The pinned reserve (``skyrl_lora.server.transfer.pinned_reserve``).

What must hold: the blocks are sized as one adapter of the asked rank on
every layer the engine's slots hold, counted on vLLM's real LoRA layers
against a real adapter file of that rank; all blocks are held at once
before any goes back (else torch's cache would end with one block); the
reserve never takes more than its share of the host, stops cleanly when an
allocation fails, and ``serve``'s flags size it from ``--max-loras``.
"""

from __future__ import annotations

import gc
import weakref
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm.lora.layers")

from benchmarks.vllm_layers import (  # noqa: E402
    DecoderShape,
    decoder_lora_layers,
    single_process_group,
    write_random_adapter,
)
from skyrl_lora.server.http.app import parse_server_args, pinned_reserve  # noqa: E402
from skyrl_lora.server.transfer.pinned_reserve import (  # noqa: E402
    IN_FLIGHT_BLOCKS,
    MAX_HOST_SHARE,
    PinnedReserve,
    reserve,
    slot_bytes,
)

SHAPE = DecoderShape(hidden=64, intermediate=96, heads=4, kv_heads=2, layers=2)
MAX_RANK = 16


def _data_bytes(adapter: Path) -> int:
    """The bytes of an adapter file's tensors (the file less its header)."""
    from safetensors.torch import load_file

    tensors = load_file(str(adapter / "adapter_model.safetensors")).values()
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors)


@pytest.mark.parametrize("rank", [MAX_RANK, 8])
def test_blocks_are_the_bytes_of_an_adapter_of_the_rank_on_every_slot_layer(
    tmp_path: Path, rank: int
) -> None:
    with single_process_group(tmp_path / "rendezvous"):
        layers = decoder_lora_layers(SHAPE, slots=3, max_rank=MAX_RANK, dtype=torch.bfloat16)
        adapter = write_random_adapter(SHAPE, tmp_path / "adapter", rank, seed=0, base_model="m")
        assert slot_bytes(layers.values(), rank) == _data_bytes(adapter)
        if rank == MAX_RANK:
            assert slot_bytes(layers.values()) == _data_bytes(adapter)  # None: the largest rank


def test_layers_without_slots_count_nothing() -> None:
    class Plain:
        lora_a_stacked = None

    assert slot_bytes([Plain(), object()]) == 0


class _Block:
    """Stands in for a pinned tensor: the test sees how many are alive."""


def test_every_block_is_held_at_once_then_all_go_back() -> None:
    alive: list[weakref.ref[_Block]] = []
    most_alive = 0

    sizes: set[int] = set()

    def allocate(nbytes: int) -> _Block:
        nonlocal most_alive
        sizes.add(nbytes)
        block = _Block()
        alive.append(weakref.ref(block))
        most_alive = max(most_alive, sum(r() is not None for r in alive))
        return block

    report = reserve((1 << 20) - 100, 5, allocate, host_bytes=1 << 40)
    gc.collect()
    # the size rounded up to a power of two, as torch's cache holds it
    assert (report.blocks, report.block_bytes, report.note) == (5, 1 << 20, "")
    assert sizes == {1 << 20}
    assert most_alive == 5  # all held together: torch's cache keeps five blocks
    assert all(r() is None for r in alive)  # and all went back to it
    assert report.total_bytes == 5 << 20


def test_the_reserve_keeps_to_its_share_of_the_host() -> None:
    host = 64 << 20
    report = reserve(4 << 20, 100, lambda n: bytearray(1), host_bytes=host)
    assert report.blocks == int(host * MAX_HOST_SHARE) // (4 << 20)
    assert "capped" in report.note


def test_a_failed_allocation_ends_the_reserve_with_what_it_took() -> None:
    taken: list[int] = []

    def allocate(nbytes: int) -> Any:
        if len(taken) == 2:
            raise RuntimeError("CUDA error: out of memory")
        taken.append(nbytes)
        return bytearray(1)

    report = reserve(1 << 20, 6, allocate, host_bytes=1 << 40)
    assert report.blocks == 2
    assert "stopped after 2 blocks" in report.note and "out of memory" in report.note


def test_nothing_is_taken_for_an_empty_reserve() -> None:
    def allocate(nbytes: int) -> Any:
        raise AssertionError("no allocation expected")

    assert reserve(1 << 20, 0, allocate).blocks == 0
    assert reserve(0, 4, allocate).blocks == 0
    assert PinnedReserve(adapters=0).blocks == 0
    assert PinnedReserve(adapters=8).blocks == 8 + IN_FLIGHT_BLOCKS


def test_serve_sizes_the_reserve_from_the_host_cache_of_adapters_unless_told() -> None:
    base = ["--model", "unused", "--enable-lora", "--max-loras", "6", "--max-lora-rank", "64"]
    # serve defaults --max-cpu-loras to twice --max-loras: vLLM may hold that many models
    assert pinned_reserve(parse_server_args(base)) == PinnedReserve(12, None)
    cache = [*base, "--max-cpu-loras", "9"]
    assert pinned_reserve(parse_server_args(cache)) == PinnedReserve(9, None)
    told = [*base, "--pinned-reserve-adapters", "10", "--pinned-reserve-rank", "32"]
    assert pinned_reserve(parse_server_args(told)) == PinnedReserve(10, 32)
    assert pinned_reserve(parse_server_args([*base, "--pinned-reserve-adapters", "0"])) is None


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--pinned-reserve-adapters", "-1"], "--pinned-reserve-adapters must be 0"),
        (["--pinned-reserve-rank", "0"], "--pinned-reserve-rank must be a LoRA rank"),
    ],
)
def test_serve_refuses_a_bad_reserve_flag_with_a_message(
    flags: list[str], message: str, capsys: Any
) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_server_args(["--model", "unused", "--enable-lora", *flags])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err
