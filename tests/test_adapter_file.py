"""The one-call adapter file read (``skyrl_lora.server.adapters.adapter_file``) against
safetensors and vLLM's real loader.

What must hold: every tensor is the one safetensors reads, bit for bit, in
dtype and shape, and a view of one buffer; vLLM's ``from_local_checkpoint``
builds the same model through it; writing to a tensor never reaches the
file; a file it cannot map exactly is left to safetensors, never misread;
and the staging thread is the only one whose reads it takes. That real
servers stage through it is checked in ``test_group_engine.py`` (the
replicas' ``skyrl_adapter_reads_total{read="one_buffer"}``).
"""

from __future__ import annotations

import json
import struct
import threading
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
safetensors = pytest.importorskip("safetensors")
lora_model = pytest.importorskip("vllm.lora.lora_model")
peft_helper = pytest.importorskip("vllm.lora.peft_helper")
from safetensors.torch import save_file  # noqa: E402

from skyrl_lora.server import compat  # noqa: E402
from skyrl_lora.server.adapters import chunked  # noqa: E402
from skyrl_lora.server.adapters.adapter_file import OneBufferFile, UnsupportedFile  # noqa: E402
from skyrl_lora.server.loading.staging import _WorkerStaging  # noqa: E402
from skyrl_lora.server.loading.staging_status import ONE_BUFFER, READY  # noqa: E402
from skyrl_lora.server.transfer import tensor_pickle  # noqa: E402

_HOST = tensor_pickle.host_buffers(pin_memory=False)


def _mixed_file(path: Path) -> dict[str, Any]:
    """Tensors of several dtypes and shapes, odd sizes between them."""
    generator = torch.Generator().manual_seed(0)
    tensors = {
        "b.lora_B.weight": torch.randn(7, 3, generator=generator).to(torch.bfloat16),
        "a.lora_A.weight": torch.randn(3, 5, generator=generator),
        "h": torch.randn(1, generator=generator).to(torch.float16),
        "i": torch.arange(3, dtype=torch.int64),
        "u": torch.tensor([1, 2, 3], dtype=torch.uint8),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.zeros(0, 4),
    }
    save_file(tensors, str(path), metadata={"format": "pt"})
    return tensors


def test_every_tensor_is_safetensors_own_and_a_view_of_one_buffer(tmp_path: Path) -> None:
    path = tmp_path / "adapter_model.safetensors"
    _mixed_file(path)
    with (
        safetensors.safe_open(str(path), framework="pt") as theirs,
        OneBufferFile(str(path), _HOST) as ours,
    ):
        assert ours.keys() == list(theirs.keys())
        assert ours.metadata() == theirs.metadata()
        storages = set()
        for name in theirs.keys():  # noqa: SIM118 (a safetensors file, not a dict)
            expected, got = theirs.get_tensor(name), ours.get_tensor(name)
            assert (got.dtype, got.shape) == (expected.dtype, expected.shape), name
            assert torch.equal(got, expected), name
            if got.numel():
                storages.add(got.untyped_storage().data_ptr())
    assert len(storages) == 1


def test_writing_to_a_tensor_never_reaches_the_file(tmp_path: Path) -> None:
    path = tmp_path / "adapter_model.safetensors"
    tensors = _mixed_file(path)
    before = path.read_bytes()
    with OneBufferFile(str(path), _HOST) as ours:
        ours.get_tensor("a.lora_A.weight").mul_(3)  # vLLM folds scalings in place
    assert path.read_bytes() == before
    with OneBufferFile(str(path), _HOST) as again:
        assert torch.equal(again.get_tensor("a.lora_A.weight"), tensors["a.lora_A.weight"])


def _handmade(path: Path, header: dict[str, Any], data: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


@pytest.mark.parametrize(
    ("header", "data", "why"),
    [
        ({"x": {"dtype": "F32", "shape": [1], "data_offsets": [2, 6]}}, b"\0" * 8, "aligned"),
        ({"x": {"dtype": "F8_E4M3", "shape": [2], "data_offsets": [0, 2]}}, b"\0" * 2, "F8"),
        ({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8, "fit"),
        ({"x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, "fit"),
        ({"x": {"dtype": "F32", "shape": [2]}}, b"\0" * 8, "data_offsets"),
    ],
)
def test_a_file_it_cannot_map_exactly_is_refused(
    tmp_path: Path, header: dict[str, Any], data: bytes, why: str
) -> None:
    path = tmp_path / "odd.safetensors"
    _handmade(path, header, data)
    with pytest.raises(UnsupportedFile, match=why):
        OneBufferFile(str(path), _HOST)


def test_a_header_that_does_not_fit_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "short.safetensors"
    path.write_bytes(struct.pack("<Q", 10**6) + b"{}")
    with pytest.raises(UnsupportedFile, match="bad header length"):
        OneBufferFile(str(path), _HOST)


def test_a_header_is_parsed_once_per_bytes_and_a_changed_one_again(tmp_path: Path) -> None:
    """An RL trainer pushes one layout every step: the staging parses its
    header once and keys its layout once, never serving an older file's."""
    first, same, moved = (tmp_path / n for n in ("first", "same", "moved"))
    _mixed_file(first)
    _mixed_file(same)
    tensors = {"a": torch.zeros(4, 2), "b": torch.ones(2, 4)}
    save_file(tensors, str(moved))
    with OneBufferFile(str(first), _HOST) as one, OneBufferFile(str(same), _HOST) as two:
        assert one.header is two.header  # two files, one parse of their bytes
    with OneBufferFile(str(moved), _HOST) as three:
        assert three.header is not one.header
        assert torch.equal(three.get_tensor("b"), tensors["b"])
        assert three.layout() == {
            "buffer": {"nbytes": 64},
            "tensors": [
                {"name": "a", "dtype": "float32", "shape": [4, 2], "offset": 0},
                {"name": "b", "dtype": "float32", "shape": [2, 4], "offset": 32},
            ],
        }


def test_a_files_layout_key_is_worked_out_once_per_header_and_config(
    tmp_path: Path, monkeypatch
) -> None:
    from skyrl_lora.server.loading import staged_buffer

    keyed: list[str] = []

    def counted(description: dict[str, Any], config: str, extra: Any = None) -> str:
        keyed.append(config)
        return layout_key(description, config, extra)

    layout_key = staged_buffer.layout_key
    monkeypatch.setattr(staged_buffer, "layout_key", counted)
    staged_buffer._file_layout_key.cache_clear()
    path = tmp_path / "adapter_model.safetensors"
    save_file({"a": torch.zeros(4, 2)}, str(path))
    with OneBufferFile(str(path), _HOST) as opened:
        header = opened.header
    key = staged_buffer.file_layout_key(header, "{}", (None, None))
    assert staged_buffer.file_layout_key(header, "{}", (None, None)) == key
    assert keyed == ["{}"]
    assert staged_buffer.file_layout_key(header, '{"r": 8}', (None, None)) != key
    # a tensorizer config (a dict) cannot be a cache's key: keyed each time, the same
    unhashable = (None, {"tensorizer_uri": "x"})
    assert staged_buffer.file_layout_key(header, "{}", unhashable) == (
        staged_buffer.file_layout_key(header, "{}", unhashable)
    )
    assert keyed == ["{}", '{"r": 8}', "{}", "{}"]


_MODULES = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def _vllm_read(path: Path) -> Any:
    """vLLM's ``from_local_checkpoint`` as the worker calls it (0.32's arguments)."""
    helper = peft_helper.PEFTHelper.from_local_dir(str(path), 2048)
    return lora_model.LoRAModel.from_local_checkpoint(
        str(path), _MODULES, helper, lora_model_id=5, device="cpu", dtype=torch.float32
    )


@pytest.fixture
def routed_here() -> Any:
    """Route vLLM's file opens to the one-call read on this thread only; undone after."""
    module: Any = lora_model
    original = module.safetensors
    reader_thread = threading.current_thread()
    opened: list[str] = []

    def open_file(path: str) -> OneBufferFile | None:
        if threading.current_thread() is not reader_thread:
            return None
        opened.append(path)
        return OneBufferFile(path, _HOST)

    compat.route_lora_file_opens(open_file)
    yield opened
    module.safetensors = original


def test_vllms_loader_builds_the_same_model_through_it(embedded_model, routed_here) -> None:
    adapter = embedded_model.adapters["meow"]
    ours = _vllm_read(adapter)
    assert routed_here == [str(adapter / "adapter_model.safetensors")]
    theirs: dict[str, Any] = {}
    worker = threading.Thread(target=lambda: theirs.update(model=_vllm_read(adapter)))
    worker.start()
    worker.join()
    assert routed_here == [str(adapter / "adapter_model.safetensors")]  # not the other thread's
    assert ours.loras.keys() == theirs["model"].loras.keys()
    for name, weights in ours.loras.items():
        expected = theirs["model"].loras[name]
        assert torch.equal(weights.lora_a, expected.lora_a), name
        assert torch.equal(weights.lora_b, expected.lora_b), name
        assert weights.scaling == expected.scaling
    storages = {w.lora_a.untyped_storage().data_ptr() for w in ours.loras.values()}
    assert len(storages) == 1


def test_a_declined_open_is_safetensors_own(tmp_path: Path) -> None:
    module: Any = lora_model
    original = module.safetensors
    # safetensors itself, also where an earlier test's staging routed the opens already
    unwrapped = getattr(original, "_safetensors", original)
    compat.route_lora_file_opens(lambda path: None)
    try:
        path = tmp_path / "adapter_model.safetensors"
        _mixed_file(path)
        with module.safetensors.safe_open(str(path), framework="pt") as opened:
            assert not isinstance(opened, OneBufferFile)
            assert "i" in opened.keys()  # noqa: SIM118 (a safetensors file, not a dict)
        compat.route_lora_file_opens(lambda path: None)  # routing again never wraps twice
        assert module.safetensors._safetensors is unwrapped
    finally:
        module.safetensors = original


class _VllmLoader:
    """The worker LoRA manager's parts staging wraps, with vLLM's real loader."""

    def remove_adapter(self, lora_id: int) -> bool:
        return False

    def add_adapter(self, request: Any) -> bool:
        return True

    def list_adapters(self) -> set[int]:
        return set()

    def _load_adapter(self, request: Any) -> Any:
        return _vllm_read(Path(request.lora_path))


class _Request:
    def __init__(self, lora_int_id: int, lora_path: Path) -> None:
        self.lora_int_id, self.lora_path, self.lora_name = lora_int_id, str(lora_path), "a"


def _staged(staging: _WorkerStaging, lora_id: int) -> dict[str, Any]:
    for _ in range(1000):
        status = staging.status(lora_id)
        if status["state"] == READY:
            return status
        threading.Event().wait(0.01)
    raise AssertionError(f"staging {lora_id} never got ready: {status}")


def test_staging_reads_in_one_call_and_the_step_loop_by_safetensors(
    embedded_model, tmp_path: Path
) -> None:
    """The staging thread's read is one buffer; a read in the step loop (here:
    this thread) stays safetensors', tensor by tensor; so does an odd file."""
    module: Any = lora_model
    original = module.safetensors
    try:
        manager = _VllmLoader()
        staging = _WorkerStaging(manager, slot_prefill=False)
        staging.stage(_Request(1, embedded_model.adapters["meow"]))
        assert _staged(staging, 1)["read"] == ONE_BUFFER
        staged = manager._load_adapter(_Request(1, embedded_model.adapters["meow"]))
        in_loop = manager._load_adapter(_Request(2, embedded_model.adapters["meow"]))
        assert {w.lora_a.untyped_storage().data_ptr() for w in staged.loras.values()} != {
            w.lora_a.untyped_storage().data_ptr() for w in in_loop.loras.values()
        }
        assert len({w.lora_a.untyped_storage().data_ptr() for w in in_loop.loras.values()}) > 1

        meow_file = str(embedded_model.adapters["meow"] / "adapter_model.safetensors")
        odd = tmp_path / "odd.safetensors"  # a dtype the one-call read leaves to safetensors
        save_file({"x": torch.zeros(2, dtype=torch.float8_e4m3fn)}, str(odd))
        assert staging._open_in_one_buffer(meow_file) is None  # not the staging thread
        staging._loading_thread = threading.get_ident()  # this thread, as if it were staging
        try:
            assert isinstance(staging._open_in_one_buffer(meow_file), OneBufferFile)
            assert staging._open_in_one_buffer(str(odd)) is None
            with module.safetensors.safe_open(str(odd), framework="pt") as opened:
                assert opened.get_tensor("x").dtype == torch.float8_e4m3fn
        finally:
            staging._loading_thread = None
    finally:
        module.safetensors = original


def test_a_large_read_goes_in_parallel_chunks_and_lands_whole(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(chunked, "PARALLEL_BYTES", 4096)
    data = torch.randint(0, 256, (1_000_003,), dtype=torch.uint8)
    path = tmp_path / "big.bin"
    path.write_bytes(b"head" + data.numpy().tobytes() + b"tail")
    buffer = torch.empty(len(data), dtype=torch.uint8)
    with open(path, "rb", buffering=0) as file:
        file.seek(4)
        chunked.read_exactly(file, buffer, len(data), str(path))
        assert file.read() == b"tail"  # left just after the read
    assert torch.equal(buffer, data)
    with open(path, "rb", buffering=0) as file, pytest.raises(EOFError, match="ended"):
        file.seek(1000)
        chunked.read_exactly(file, buffer, len(data), str(path))
