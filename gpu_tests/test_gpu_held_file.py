"""A path load's weights file, handed to a GPU worker open.

The registry opens the file instead of copying it into the snapshot
(:func:`skyrl_lora.server.adapters.registry.snapshot_adapter_dir` with
``held``). The worker reads it once into pinned memory and builds the
model from a pinned copy (its scalings folded on the GPU, as pinned
tensors are), from the layout's template; the bytes as read become the
snapshot's weights file after the swap. The model must equal vLLM's own
build of the file, and the snapshot the file, byte for byte. No server;
seconds. (``tests/test_held_weights.py`` is the same on a CPU worker.)
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from skyrl_lora.server.adapters import registry, snapshot_writer
from skyrl_lora.server.loading.staged_buffer import BufferSource
from skyrl_lora.server.transfer import handover
from skyrl_lora.server.transfer.handover_template import HandoverTemplates
from skyrl_lora.server.transfer.tensor_pickle import host_buffers
from tests.test_handover_template import CONFIG, adapter_tensors, flat, vllm_build


@dataclass(frozen=True)
class _Request:
    lora_int_id: int
    lora_path: str


def _adapter(folder: Path, seed: int) -> bytes:
    folder.mkdir(parents=True)
    (folder / handover.CONFIG_FILE).write_text(json.dumps(CONFIG))
    save_file(adapter_tensors(seed), str(folder / handover.WEIGHTS_FILE))
    return (folder / handover.WEIGHTS_FILE).read_bytes()


def _take(source: BufferSource, folder: Path, snapshot: Path, lora_id: int):
    held: dict[str, int] = {}
    registry.snapshot_adapter_dir(str(folder), snapshot, None, held)
    try:
        return source.take_file(_Request(lora_id, str(snapshot)), held[handover.WEIGHTS_FILE])
    finally:
        os.close(held[handover.WEIGHTS_FILE])


def test_a_held_file_built_on_a_gpu_worker_equals_vllms_and_its_snapshot_the_file(
    tmp_path: Path,
) -> None:
    templates = HandoverTemplates()
    source = BufferSource(host_buffers(True), "cuda:0", templates)

    first_bytes = _adapter(tmp_path / "a", seed=0)
    first = _take(source, tmp_path / "a", tmp_path / "snap-a", lora_id=1)
    assert first is not None and not first.on_device  # no template yet: built on the host
    model, folded = vllm_build(first.description, first.model_buffer, lora_id=1)
    templates.learn(first.layout, model, first.model_buffer, folded)
    snapshot_writer.write_snapshot_file(
        tmp_path / "snap-a" / handover.WEIGHTS_FILE,
        first.snapshot_buffer,
        first.snapshot_layout(),
    )
    assert (tmp_path / "snap-a" / handover.WEIGHTS_FILE).read_bytes() == first_bytes

    second_bytes = _adapter(tmp_path / "b", seed=1)
    second = _take(source, tmp_path / "b", tmp_path / "snap-b", lora_id=7)
    assert second is not None and second.writes_snapshot and not second.on_device
    assert second.model_buffer.is_pinned() and second.snapshot_buffer.is_pinned()
    template = templates.get(second.layout)
    assert template is not None
    expected, _ = vllm_build(second.description, second.snapshot_buffer.clone(), lora_id=7)
    built = template.instantiate(second.model_buffer, lora_model_id=7, device="cuda:0").model
    torch.cuda.synchronize()
    for name, weights in expected.loras.items():
        for got, want in zip(flat(built.loras[name]), flat(weights), strict=True):
            assert torch.equal(got.cpu(), want), name
    snapshot_writer.write_snapshot_file(  # after the swap, from the bytes as read
        tmp_path / "snap-b" / handover.WEIGHTS_FILE,
        second.snapshot_buffer,
        second.snapshot_layout(),
    )
    assert (tmp_path / "snap-b" / handover.WEIGHTS_FILE).read_bytes() == second_bytes
