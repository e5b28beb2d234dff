"""The adapter reader process (``server/transfer/adapter_reader.py``) with vLLM's real loader.

The reader runs vLLM's ``LoRAModel.from_local_checkpoint`` in a child
process and hands the model back in one buffer. What must hold: the model is
the one vLLM builds in process, bit for bit (after the scaling fold vLLM's
packing would do anyway); its tensors are views of one buffer; a load's
error arrives as the loader raised it; and a reader that is starting, gone or
given arguments that do not travel leaves the load to the engine process.
That a real server stages through the reader is checked in
``test_server_engine.py``.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
lora_model = pytest.importorskip("vllm.lora.lora_model")
peft_helper = pytest.importorskip("vllm.lora.peft_helper")

from skyrl_lora.server import compat  # noqa: E402
from skyrl_lora.server.adapters.scale_fold import multiply_in_place  # noqa: E402
from skyrl_lora.server.transfer import tensor_pickle  # noqa: E402
from skyrl_lora.server.transfer.adapter_reader import (  # noqa: E402
    AdapterReader,
    ReaderRoutedLoader,
    ReaderUnavailable,
)

#: The embedded model's LoRA targets (``server/embedded/builder.py``).
_MODULES = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def _load_args(path: Path) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments vLLM's worker passes to ``from_local_checkpoint`` (0.32's shape)."""
    helper = peft_helper.PEFTHelper.from_local_dir(str(path), 2048)
    kwargs = {"lora_model_id": 3, "device": "cpu", "dtype": torch.bfloat16}
    return (str(path), _MODULES, helper), kwargs


def _in_process(path: Path) -> Any:
    args, kwargs = _load_args(path)
    model = lora_model.LoRAModel.from_local_checkpoint(*args, **kwargs)
    compat.fold_lora_scalings(model, multiply_in_place)
    return model


@pytest.fixture(scope="module")
def reader() -> Any:
    started = AdapterReader(pin_memory=False)
    yield started
    started.close()


def _read_when_ready(reader: AdapterReader, path: Path) -> Any:
    """The first reads find the child still importing vLLM: wait until it takes one."""
    args, kwargs = _load_args(path)
    deadline = time.monotonic() + 120
    while True:
        try:
            model, child_ms = reader.read(lora_model.LoRAModel, args, kwargs)
            assert child_ms > 0
            return model
        except ReaderUnavailable as exc:
            assert "starting" in str(exc) and time.monotonic() < deadline
            time.sleep(0.2)


def test_tensors_travel_in_one_buffer_and_come_back_equal(tmp_path: Path) -> None:
    weights = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    graph = {
        "a": weights,
        "b": [weights.t(), None, torch.ones(5, dtype=torch.bfloat16)],
        "n": 7,
    }
    data = tmp_path / "buffer"
    with data.open("wb") as file:
        skeleton, nbytes = tensor_pickle.dump(graph, file)
    assert data.stat().st_size == nbytes
    buffer = tensor_pickle.read_buffer(
        str(data), nbytes, lambda n: torch.empty(n, dtype=torch.uint8)
    )
    back = tensor_pickle.load(skeleton, buffer)
    assert back["n"] == 7 and back["b"][1] is None
    assert torch.equal(back["a"], weights) and torch.equal(back["b"][0], weights.t())
    assert back["b"][2].dtype == torch.bfloat16 and torch.equal(back["b"][2], graph["b"][2])
    base = buffer.untyped_storage().data_ptr()
    for tensor in (back["a"], *back["b"][::2]):
        assert tensor.untyped_storage().data_ptr() == base  # views, no copies
        assert (tensor.data_ptr() - base) % tensor_pickle.ALIGNMENT == 0


def test_the_reader_builds_vllms_own_model_bit_for_bit(
    reader: AdapterReader, embedded_model
) -> None:
    path = embedded_model.adapters["meow"]
    expected = _in_process(path)
    model = _read_when_ready(reader, path)
    assert type(model) is type(expected) and model.id == expected.id == 3
    assert model.rank == expected.rank and sorted(model.loras) == sorted(expected.loras)
    base = None
    for name, weights in expected.loras.items():
        got = model.loras[name]
        assert got.scaling == weights.scaling == 1  # folded, as packing would
        for mine, theirs in ((got.lora_a, weights.lora_a), (got.lora_b, weights.lora_b)):
            assert mine.dtype == theirs.dtype == torch.bfloat16
            assert torch.equal(mine, theirs)
            storage = mine.untyped_storage().data_ptr()
            assert base in (None, storage)  # all of them views of one buffer
            base = storage


def test_the_batched_fold_is_vllms_optimize_bit_for_bit(embedded_model) -> None:
    args, kwargs = _load_args(embedded_model.adapters["meow"])
    folded, optimized = (
        lora_model.LoRAModel.from_local_checkpoint(*args, **kwargs) for _ in range(2)
    )
    for model in (folded, optimized):  # scalings of all kinds, 1 (no-op) included
        for i, weights in enumerate(model.loras.values()):
            weights.scaling = (1, 0.37, 2.5, 1 / 3)[i % 4]
    compat.fold_lora_scalings(folded, multiply_in_place)
    for weights in optimized.loras.values():
        weights.optimize()
    assert sorted(folded.loras) == sorted(optimized.loras)
    for name, weights in optimized.loras.items():
        assert folded.loras[name].scaling == weights.scaling == 1
        assert torch.equal(folded.loras[name].lora_b, weights.lora_b), name
        assert torch.equal(folded.loras[name].lora_a, weights.lora_a), name


def test_a_bad_adapter_fails_as_it_would_in_process(
    reader: AdapterReader, embedded_model, tmp_path: Path
) -> None:
    _read_when_ready(reader, embedded_model.adapters["moo"])
    broken = tmp_path / "broken"
    shutil.copytree(embedded_model.adapters["moo"], broken)
    (broken / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00not safetensors")
    with pytest.raises(Exception) as in_process:
        _in_process(broken)
    args, kwargs = _load_args(broken)
    with pytest.raises(type(in_process.value)):
        reader.read(lora_model.LoRAModel, args, kwargs)
    assert reader.alive  # the child survives a bad load
    assert _read_when_ready(reader, embedded_model.adapters["moo"]).rank == 8


def test_arguments_that_do_not_travel_are_read_in_process(
    reader: AdapterReader, embedded_model
) -> None:
    args, kwargs = _load_args(embedded_model.adapters["meow"])
    with pytest.raises(ReaderUnavailable, match="do not pickle"):
        reader.read(lora_model.LoRAModel, args, {**kwargs, "weights_mapper": lambda n: n})
    assert reader.alive


def test_only_the_routed_thread_uses_the_reader(reader: AdapterReader, embedded_model) -> None:
    path = embedded_model.adapters["meow"]
    _read_when_ready(reader, path)
    args, kwargs = _load_args(path)
    routed = ReaderRoutedLoader(lora_model.LoRAModel, reader, route=lambda: False)
    routed.from_local_checkpoint(*args, **kwargs)
    assert routed.last_read is None  # the step loop's own loads stay in process
    assert routed.from_lora_tensors == lora_model.LoRAModel.from_lora_tensors  # the rest is vLLM's
    routed = ReaderRoutedLoader(lora_model.LoRAModel, reader, route=lambda: True)
    routed.from_local_checkpoint(*args, **kwargs)
    assert routed.last_read is not None and routed.last_read.total_ms >= routed.last_read.child_ms


def test_a_dead_reader_leaves_every_load_to_the_engine_process(
    reader: AdapterReader, embedded_model
) -> None:
    """The module's reader, killed: so this test runs last (a reader of its
    own cost the suite another start, 11 s of one core importing vLLM)."""
    path = embedded_model.adapters["meow"]
    _read_when_ready(reader, path)
    reader._process.kill()
    reader._process.wait()
    routed = ReaderRoutedLoader(lora_model.LoRAModel, reader, route=lambda: True)
    args, kwargs = _load_args(path)
    model = routed.from_local_checkpoint(*args, **kwargs)  # read here instead
    assert routed.last_read is None and not reader.alive and "gone" in str(reader.failure)
    assert sorted(model.loras) == sorted(_in_process(path).loras)
