"""The transport benchmark's sync, split into its parts, on the real CPU engine.

``benchmarks.transport_swap.sync_once`` times a trainer's sync by each
transport and splits it (pause, the trainer's copy into its hand-over
buffer, the weights' call, resume), so a GPU run can say where a sync's
time goes outside the engine's staging. Here each transport syncs once
against the session's server, and the parts must add up to the whole.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.transport_swap import (
    TRANSPORTS,
    SyncTimes,
    TransportConfig,
    device_tensors,
    measure,
    summarise,
    sync_once,
)
from skyrl_lora.client import AdapterHandover, RemoteInferenceClient
from tests.conftest import EngineServer
from tests.test_push_engine import admin

pytestmark = pytest.mark.engine

__all__ = ["admin"]


async def test_every_transports_sync_splits_into_parts_that_add_up(
    engine_server: EngineServer, admin
) -> None:
    folder = Path(engine_server.model.adapters["meow"])
    await admin.load_lora_adapter("transport-swap", str(folder))
    config = json.loads((folder / "adapter_config.json").read_text())
    syncs: dict[str, list[list[SyncTimes]]] = {}
    with AdapterHandover(config) as handover:
        for transport in TRANSPORTS:
            sync = await sync_once(
                admin, "transport-swap", transport, folder, handover, device_tensors(folder)
            )
            parts = [getattr(sync, part) for part in SyncTimes.PARTS]
            assert min(parts) >= 0 and sync.weights > 0
            assert sum(parts) == pytest.approx(sync.total, abs=1.0)
            if transport in ("handover", "handover_swap"):
                assert sync.update > 0  # the trainer's copy is timed apart
            if transport == "handover_swap":
                assert sync.pause == sync.resume == 0  # inside the server's one call
            else:
                assert sync.pause > 0 and sync.resume > 0
            syncs[transport] = [[sync]]
    summary = summarise(syncs)
    assert set(summary) == set(TRANSPORTS)
    assert summary["path"]["over_path"]["median"] == 1.0
    assert summary["push"]["parts_ms_p50"]["weights"] == round(syncs["push"][0][0].weights, 2)
    listing = {a.lora_name: a for a in (await admin.list_adapters()).adapters}
    assert listing["transport-swap"].version == 1 + len(TRANSPORTS)
    await admin.unload_lora_adapter("transport-swap")


async def test_with_the_swapper_sampling_every_loaded_sync_resumes_its_own_requests(
    engine_server: EngineServer,
) -> None:
    """``swapper_samples``: under load the swapper's own streams run too, so
    its syncs abort requests (the client resumes them) and the figures say
    what a trainer pays that syncs while its rollouts run. Two transports."""
    folders = [Path(engine_server.model.adapters[n]) for n in ("meow", "woof")]
    cfg = TransportConfig(
        rounds=1,
        swaps=2,
        others=1,
        streams=2,
        max_tokens=64,
        swapper="transport-own",
        transports=("path", "handover_swap"),
        swapper_samples=True,
    )
    assert cfg.samplers == ["other0", "transport-own"]
    key = engine_server.admin_key
    result = await measure(engine_server.url, folders, cfg, strict=False, api_key=key)
    assert set(result["under_load"]) == {"path", "handover_swap"}
    assert result["resumed_segments"] > 0
    async with RemoteInferenceClient(engine_server.url, api_key=key) as client:
        for name in ("transport-own", "other0"):
            await client.unload_lora_adapter(name)


async def test_the_others_load_can_run_from_a_process_of_its_own(
    engine_server: EngineServer,
) -> None:
    """``under_load_apart``: the other tenants sample from a spawned process
    (with the caller's key), the swapper's own streams from the measuring
    one; the measure raises if that process got no tokens."""
    folders = [Path(engine_server.model.adapters[n]) for n in ("meow", "woof")]
    cfg = TransportConfig(
        rounds=1,
        swaps=1,
        others=1,
        streams=2,
        max_tokens=64,
        swapper="transport-apart",
        transports=("path",),
        swapper_samples=True,
        loads=("under_load_apart",),
    )
    key = engine_server.admin_key
    result = await measure(engine_server.url, folders, cfg, strict=False, api_key=key)
    assert set(result) >= {"under_load_apart"} and "under_load" not in result
    assert result["under_load_apart"]["path"]["sync_ms"]["median"] > 0
    assert result["resumed_segments"] > 0  # the swapper's own, resumed here
    async with RemoteInferenceClient(engine_server.url, api_key=key) as client:
        for name in ("transport-apart", "other0"):
            await client.unload_lora_adapter(name)


def test_a_transport_load_keeps_path_and_known_transports() -> None:
    assert TransportConfig(others=2).samplers == ["other0", "other1"]
    with pytest.raises(ValueError, match="path"):
        TransportConfig(transports=("handover",))
    with pytest.raises(ValueError, match="path"):
        TransportConfig(transports=("path", "carrier_pigeon"))
    with pytest.raises(ValueError, match="loads"):
        TransportConfig(loads=("idle", "rush_hour"))
