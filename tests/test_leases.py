"""Versions and leases without an engine: the lease table, version checks, pinned admissions."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from skyrl_lora.errors import (
    BadRequestError,
    ConflictError,
    LeaseNotFoundError,
    VersionGoneError,
    error_class_for,
)
from skyrl_lora.server.adapters.leases import LeaseTable
from skyrl_lora.server.adapters.registry import check_version, weights_sha256
from skyrl_lora.server.engine.gate import AdapterGate
from skyrl_lora.types import LeaseRequest, LoadAdapterRequest, SampleRequest, VersionRef


def test_a_lease_lives_until_its_ttl_or_its_release() -> None:
    table = LeaseTable(max_versions=4)
    first = table.grant("a", 1, ttl_s=10, now=100.0)
    second = table.grant("a", 1, ttl_s=30, now=100.0)
    assert first.lease_id != second.lease_id and first.expires_in(105.0) == 5.0
    assert table.versions("a") == {1} and table.is_leased("a", 1)
    assert table.expired(109.9) == []
    assert table.expired(110.0) == [first]
    assert table.is_leased("a", 1), "the second lease still keeps version 1"
    assert table.release(second.lease_id) == second
    assert not table.is_leased("a", 1) and len(table) == 0
    with pytest.raises(LeaseNotFoundError, match=second.lease_id):
        table.release(second.lease_id)
    with pytest.raises(LeaseNotFoundError):
        table.get("lease-never")


def test_a_rolled_back_version_loses_its_leases_only() -> None:
    table = LeaseTable(max_versions=4)
    old, new = table.grant("a", 1, ttl_s=10, now=0.0), table.grant("a", 2, ttl_s=10, now=0.0)
    other = table.grant("b", 2, ttl_s=10, now=0.0)
    assert table.drop_version("a", 2) == [new]
    assert table.versions("a") == {1} and table.get(old.lease_id) == old
    assert table.get(other.lease_id) == other


def test_leases_keep_room_for_the_current_version() -> None:
    """--max-versions-per-adapter 3: two leased versions plus the current one."""
    table = LeaseTable(max_versions=3)
    table.grant("a", 1, 60, now=0.0)
    table.grant("a", 2, 60, now=0.0)
    table.grant("a", 2, 60, now=0.0)  # an already leased version costs nothing
    table.grant("b", 7, 60, now=0.0)  # other adapters have their own bound
    with pytest.raises(ConflictError, match=r"versions 1, 2.*version 3.*=3"):
        table.grant("a", 3, 60, now=0.0)
    assert table.versions("a") == {1, 2}
    assert [lease.version for lease in table.drop_adapter("a")] == [1, 2, 2]
    assert table.versions("b") == {7}
    with pytest.raises(ConflictError):
        LeaseTable(max_versions=1).grant("a", 1, 60, now=0.0)
    with pytest.raises(ValueError):
        LeaseTable(max_versions=0)
    with pytest.raises(ValueError):
        table.grant("a", 1, 0, now=0.0)


def test_versions_only_go_up() -> None:
    assert check_version("a", last=0, requested=None) == 1
    assert check_version("a", last=3, requested=None) == 4
    assert check_version("a", last=3, requested=10) == 10
    for requested in (3, 2):
        with pytest.raises(ConflictError, match=f"at version 3; version {requested} is not"):
            check_version("a", last=3, requested=requested)
    with pytest.raises(BadRequestError):
        check_version("a", last=0, requested=0)


def test_a_repeat_is_told_by_the_weights_sha256(tmp_path: Path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    for folder, data in ((one, b"weights"), (two, b"weights")):
        folder.mkdir()
        (folder / "adapter_model.safetensors").write_bytes(data)
    assert weights_sha256(one) == weights_sha256(two) is not None
    (two / "adapter_model.safetensors").write_bytes(b"other weights")
    assert weights_sha256(one) != weights_sha256(two)
    assert weights_sha256(tmp_path) is None


def test_wire_types_refuse_bad_versions_and_ttls() -> None:
    for bad in ({"version": 0}, {"ttl_s": -1}, {"ttl_s": 0}):
        with pytest.raises(ValueError):
            LeaseRequest(lora_name="a", **bad)  # type: ignore[arg-type]
    for keep in (0, -1, 3601):
        with pytest.raises(ValueError):
            LoadAdapterRequest(lora_name="a", lora_path="/p", keep_previous_s=keep)
    with pytest.raises(ValueError):
        VersionRef(lora_name="a", version=0)
    with pytest.raises(ValueError, match="lora_version needs a lora_name"):
        SampleRequest(prompt_token_ids=[1], lora_version=2)
    with pytest.raises(ValueError):
        SampleRequest(prompt_token_ids=[1], lora_name="a", lora_version=0)
    assert error_class_for(410, None) is VersionGoneError
    assert error_class_for(404, "lease_not_found") is LeaseNotFoundError


async def test_a_pinned_admission_runs_on_its_version_and_holds_through_a_pause() -> None:
    gate = AdapterGate(version_of=lambda name: 5, pacing=None, answer_pacing=None)
    current = await gate.admit("a", "r1")
    pinned = await gate.admit("a", "r2", version=3)
    assert (current.version, pinned.version) == (5, 3)
    assert gate.in_flight_of_version("a", 3) == 1 and gate.busy_versions() == 2
    gate.release(current)
    gate.release(pinned)

    async def no_abort(_: object) -> None:
        return None

    await gate.pause("a", no_abort)
    held = asyncio.create_task(gate.admit("a", "r3", version=3))
    await asyncio.sleep(0.01)
    assert not held.done() and gate.held("a") == 1
    gate.resume("a")
    assert (await held).version == 3


async def test_a_name_never_loaded_can_be_paused_and_asking_creates_nothing() -> None:
    def unknown(name: str) -> int:
        raise KeyError(name)

    gate = AdapterGate(version_of=unknown, pacing=None, answer_pacing=None)
    assert not gate.is_paused("new")
    assert gate.held_by_adapter() == {} and "new" not in gate._states
