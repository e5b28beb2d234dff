"""Hand-overs without an engine: the client's buffer, the server's checks and copy.

The client packs tensors into one shared buffer and describes it; the
server checks the description and copies the buffer out. Both sides are
run here against each other on host memory (a shared-memory file), so the
layout they agree on is tested without vLLM; the real engine's side is in
``test_handover_engine.py``.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from pydantic import ValidationError

from skyrl_lora.client import AdapterHandover
from skyrl_lora.errors import BadRequestError, HandoverUnavailableError, PayloadTooLargeError
from skyrl_lora.server.adapters import snapshot_writer
from skyrl_lora.server.adapters.snapshot_writer import SnapshotWriter
from skyrl_lora.server.transfer import handover
from skyrl_lora.server.transfer.tensor_pickle import host_buffers
from skyrl_lora.types import HandoverRequest

CONFIG = {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"], "peft_type": "LORA"}


def lora_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "base_model.model.layers.0.q_proj.lora_A.weight": torch.randn(2, 8, generator=gen),
        "base_model.model.layers.0.q_proj.lora_B.weight": torch.randn(8, 2, generator=gen).to(
            torch.bfloat16
        ),
        "base_model.model.layers.1.q_proj.lora_A.weight": torch.randn(2, 8, generator=gen).half(),
    }


def request_of(adapter: AdapterHandover, **fields) -> HandoverRequest:
    return HandoverRequest.model_validate({"lora_name": "a", **adapter.request(), **fields})


def test_a_buffer_round_trips_through_the_servers_copy() -> None:
    tensors = lora_tensors()
    with AdapterHandover(CONFIG) as adapter:
        adapter.update(tensors)
        request = request_of(adapter)
        assert request.buffer.kind == "shm"
        access = handover.HandoverAccess(allowed=True, staging=True)
        access.check(request, max_bytes=1 << 20)
        description = {
            "buffer": request.buffer.model_dump(),
            "tensors": [t.model_dump() for t in request.tensors],
        }
        (host,) = handover.copy_out(description, host_buffers(False), handover.cuda_device_index)
        copied = handover.tensor_views(host, description)
    assert copied.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert copied[name].dtype == tensor.dtype
        assert torch.equal(copied[name], tensor)


def test_a_buffer_of_one_dtype_holds_each_tensor_cast_by_the_copy() -> None:
    """A float32 trainer hands over bfloat16 without casting first: the
    copy into the buffer casts."""
    tensors = {name: t.float() for name, t in lora_tensors().items()}
    with AdapterHandover(CONFIG, dtype="bfloat16") as adapter:
        adapter.update(tensors)
        request = request_of(adapter)
        assert {t.dtype for t in request.tensors} == {"bfloat16"}
        description = {
            "buffer": request.buffer.model_dump(),
            "tensors": [t.model_dump() for t in request.tensors],
        }
        (host,) = handover.copy_out(description, host_buffers(False), handover.cuda_device_index)
        copied = handover.tensor_views(host, description)
    for name, tensor in tensors.items():
        assert torch.equal(copied[name], tensor.bfloat16())
    with pytest.raises(ValueError, match="not 'int8'"):
        AdapterHandover(CONFIG, dtype="int8")


def test_the_buffer_is_reused_and_the_copy_is_the_servers_own() -> None:
    with AdapterHandover(CONFIG) as adapter:
        adapter.update(lora_tensors(0))
        name = request_of(adapter).buffer.name  # type: ignore[union-attr]
        description = {
            "buffer": request_of(adapter).buffer.model_dump(),
            "tensors": [t.model_dump() for t in request_of(adapter).tensors],
        }
        copies = handover.copy_out(
            description, host_buffers(False), handover.cuda_device_index, copies=2
        )
        assert copies[0].data_ptr() != copies[1].data_ptr()
        assert torch.equal(copies[0], copies[1])
        first = handover.tensor_views(copies[0], description)
        adapter.update(lora_tensors(1))  # same layout: same buffer, new values
        assert request_of(adapter).buffer.name == name  # type: ignore[union-attr]
        key = next(iter(first))
        assert torch.equal(first[key], lora_tensors(0)[key])  # the copy kept the old values
        assert (handover.SHM_DIR / name).exists()
    assert not (handover.SHM_DIR / name).exists()  # close() removes the shared file


def test_a_layout_is_planned_once_while_its_tensors_keep_their_shapes(monkeypatch) -> None:
    """A trainer's updates after the first skip planning (448 validated
    models for a rank-64 8B adapter); a new shape, dtype or order replans,
    and the copy still lands each tensor where its description says."""
    plans = []
    plan = AdapterHandover._plan
    monkeypatch.setattr(AdapterHandover, "_plan", lambda self, t: plans.append(1) or plan(self, t))
    with AdapterHandover(CONFIG) as adapter:
        adapter.update(lora_tensors(0))
        adapter.update(lora_tensors(1))
        assert len(plans) == 1
        reordered = dict(reversed(list(lora_tensors(2).items())))
        adapter.update(reordered)
        assert len(plans) == 2
        description = {"buffer": request_of(adapter).buffer.model_dump(), "tensors": []}
        description["tensors"] = [t.model_dump() for t in request_of(adapter).tensors]
        (copy,) = handover.copy_out(description, host_buffers(False), handover.cuda_device_index)
        for name, tensor in handover.tensor_views(copy, description).items():
            assert torch.equal(tensor, reordered[name])
        grown = {
            **lora_tensors(3),
            "base_model.model.layers.1.q_proj.lora_A.weight": torch.ones(4, 8),
        }
        adapter.update(grown)
        assert len(plans) == 3
        with pytest.raises(ValueError, match="one device"):
            adapter.update({**grown, "x": torch.zeros(1, device="meta")})


def test_the_bytes_fallback_holds_the_same_tensors() -> None:
    tensors = lora_tensors()
    with AdapterHandover(CONFIG) as adapter:
        adapter.update(tensors)
        memory = adapter.to_memory()
    assert memory.config == CONFIG
    assert isinstance(memory.weights, dict)
    for name, tensor in tensors.items():
        assert torch.equal(memory.weights[name], tensor)


def test_off_by_default_and_without_staging() -> None:
    with AdapterHandover(CONFIG) as adapter:
        adapter.update(lora_tensors())
        request = request_of(adapter)
        with pytest.raises(HandoverUnavailableError, match="allow-handover"):
            handover.NO_HANDOVERS.check(request, 1 << 20)
        with pytest.raises(HandoverUnavailableError, match="staging"):
            handover.HandoverAccess(allowed=True).check(request, 1 << 20)


def test_descriptions_that_point_outside_the_buffer_are_refused() -> None:
    access = handover.HandoverAccess(allowed=True, staging=True)
    with AdapterHandover(CONFIG) as adapter:
        adapter.update(lora_tensors())
        good = adapter.request()
        end = good["buffer"]["nbytes"]
        cases = {
            "past the buffer": [{**good["tensors"][0], "offset": end}],
            "not a multiple": [{**good["tensors"][0], "offset": 2}],
            "described twice": [good["tensors"][0], good["tensors"][0]],
            "has shape": [{**good["tensors"][0], "shape": [0, 8]}],
        }
        for message, tensors in cases.items():
            request = HandoverRequest.model_validate({**good, "lora_name": "a", "tensors": tensors})
            with pytest.raises(BadRequestError, match=message):
                access.check(request, 1 << 20)
        with pytest.raises(PayloadTooLargeError):
            access.check(request_of(adapter), max_bytes=end - 1)
        small = {**good["buffer"], "nbytes": end * 2}
        with pytest.raises(BadRequestError, match="holds"):
            access.check(request_of(adapter, buffer=small), 1 << 20)


def test_memory_out_of_reach_is_unavailable_not_bad() -> None:
    access = handover.HandoverAccess(allowed=True, staging=True, device_uuids=frozenset({"g0"}))
    with AdapterHandover(CONFIG) as adapter:
        adapter.update(lora_tensors())
        good = adapter.request()
    gone = request_of_dict(good, buffer={**good["buffer"], "name": "skyrl-handover-" + "0" * 32})
    with pytest.raises(HandoverUnavailableError, match="not on this server's host"):
        access.check(gone, 1 << 20)
    cuda = {
        "kind": "cuda_ipc",
        "nbytes": good["buffer"]["nbytes"],
        "device_uuid": "another-gpu",
        "handle": "AA==",
        "storage_size_bytes": good["buffer"]["nbytes"],
        "storage_offset_bytes": 0,
        "ref_counter_handle": "AA==",
        "ref_counter_offset": 0,
    }
    with pytest.raises(HandoverUnavailableError, match="another-gpu"):
        access.check(request_of_dict(good, buffer=cuda), 1 << 20)


def request_of_dict(good: dict, **fields) -> HandoverRequest:
    return HandoverRequest.model_validate({**good, "lora_name": "a", **fields})


def test_wire_refuses_names_that_are_not_capabilities_and_other_dtypes() -> None:
    with AdapterHandover(CONFIG) as adapter:
        adapter.update(lora_tensors())
        good = adapter.request()
    for buffer in (
        {**good["buffer"], "name": "../etc/passwd"},
        {**good["buffer"], "name": "skyrl-handover-short"},
        {**good["buffer"], "kind": "pickle"},
    ):
        with pytest.raises(ValidationError):
            request_of_dict(good, buffer=buffer)
    with pytest.raises(ValidationError):
        request_of_dict(good, tensors=[{**good["tensors"][0], "dtype": "int8"}])
    with pytest.raises(ValueError, match="a hand-over takes"):
        AdapterHandover(CONFIG).update({"x": torch.zeros(2, dtype=torch.int64)})


def test_the_snapshot_gets_a_weights_file_and_loses_the_description(tmp_path: Path) -> None:
    with AdapterHandover(CONFIG) as adapter:
        adapter.update(lora_tensors())
        request = request_of(adapter)
        handover.write_handover(tmp_path, request)
        description = handover.take_handover(tmp_path)
        assert description is not None
        (host,) = handover.copy_out(description, host_buffers(False), handover.cuda_device_index)
    writer = SnapshotWriter(handover.WEIGHTS_FILE, snapshot_writer.SNAPSHOT_MARKERS)
    tensors = description["tensors"]
    writer.submit(tmp_path, host, lambda: snapshot_writer.safetensors_layout(tensors))
    writer.wait(tmp_path)
    snapshot_writer.wait_for_weights(tmp_path, timeout_s=5)
    assert handover.take_handover(tmp_path) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        handover.CONFIG_FILE,
        handover.WEIGHTS_FILE,
    ]  # no partial file left
    from safetensors import safe_open
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / handover.WEIGHTS_FILE))
    assert saved.keys() == lora_tensors().keys()
    assert all(torch.equal(saved[k], v) for k, v in lora_tensors().items())
    with safe_open(str(tmp_path / handover.WEIGHTS_FILE), framework="pt") as opened:
        assert opened.metadata() == {"format": "pt"}


def test_a_snapshot_write_survives_short_writes(tmp_path: Path, monkeypatch) -> None:
    """``os.writev`` may write less than asked: the rest follows, in order."""
    tensors = lora_tensors()
    with AdapterHandover(CONFIG) as adapter:
        adapter.update(tensors)
        request = request_of(adapter)
        description = {
            "buffer": request.buffer.model_dump(),
            "tensors": [t.model_dump() for t in request.tensors],
        }
        (host,) = handover.copy_out(description, host_buffers(False), handover.cuda_device_index)
    real_writev = os.writev
    monkeypatch.setattr(os, "writev", lambda fd, chunks: real_writev(fd, [bytes(chunks[0])[:7]]))
    snapshot_writer.write_snapshot_file(
        tmp_path / "a.safetensors", host, snapshot_writer.safetensors_layout(description["tensors"])
    )
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "a.safetensors"))
    assert all(torch.equal(saved[k], v) for k, v in tensors.items())


def test_a_retired_folder_is_no_error_for_the_writer(tmp_path: Path) -> None:
    folder = tmp_path / "gone"
    writer = SnapshotWriter(handover.WEIGHTS_FILE, snapshot_writer.SNAPSHOT_MARKERS)
    writer.submit(folder, torch.zeros(4, dtype=torch.uint8), lambda: (b"", [(0, 4)]))
    writer.wait(folder)  # returns: nothing to write into, nothing raised


def share(event: str | None = None, handle: str = "aGFuZGxl") -> dict:
    """A CUDA share's fields as the wire carries them (base64 handles)."""
    return {
        "nbytes": 64,
        "handle": handle,
        "storage_size_bytes": 64,
        "storage_offset_bytes": 0,
        "ref_counter_handle": "cmVm",
        "ref_counter_offset": 0,
        "event_handle": event,
        "event_sync_required": event is not None,
    }


def test_a_cuda_share_reaches_torch_without_its_event_which_the_server_waits_for(
    monkeypatch,
) -> None:
    """Torch waits for a share's event only where it opens the share afresh,
    not where it finds it open already (:mod:`.open_shares` keeps shares
    open), so the server hands torch no event (as empty bytes: its
    ``_new_shared_cuda`` raised a TypeError for None on the H100, a080703)
    and makes its stream wait for the trainer's event itself."""
    from torch.multiprocessing import reductions

    opened: list[tuple] = []
    waited: list[tuple] = []

    class Event:
        @staticmethod
        def from_ipc_handle(device, handle):
            waited.append((device, handle))
            return SimpleNamespace(wait=lambda: None)

    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", lambda *args: opened.append(args))
    monkeypatch.setattr(torch.cuda, "Event", Event)
    handover.open_and_wait(share(), 0)
    handover.open_and_wait(share(event="ZXZlbnQ="), 1)
    assert [args[-2:] for args in opened] == [(b"", False), (b"", False)]
    assert waited == [(1, b"event")]
