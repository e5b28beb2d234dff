"""The push's streamed body against the route's parser, without a server.

The client's :class:`StreamedForm` (weights in chunks, their sha256 last)
must be what ``receive_push`` reads: the fields, both files byte for byte,
the digest taken as the bytes arrived, and the ``Content-Length`` it
declares. The real route is exercised in ``test_push_engine.py``.
"""

from __future__ import annotations

import asyncio
import json
import struct
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from skyrl_lora.client.push import InMemoryAdapter, StreamedForm, adapter_payload
from skyrl_lora.errors import BadRequestError
from skyrl_lora.server.http.push import receive_push


def _safetensors(nbytes: int) -> bytes:
    header = json.dumps({"w": {"dtype": "U8", "shape": [nbytes], "data_offsets": [0, nbytes]}})
    head = header.encode() + b" " * (-len(header) % 8)
    return struct.pack("<Q", len(head)) + head + bytes(range(256)) * (nbytes // 256)


async def _body(form: StreamedForm, chunk_bytes: int) -> AsyncIterator[bytes]:
    """The form as a server receives it: re-cut into chunks of another size."""
    pending = b""
    async for piece in form.chunks():
        pending += bytes(piece)
        while len(pending) >= chunk_bytes:
            yield pending[:chunk_bytes]
            pending = pending[chunk_bytes:]
    if pending:
        yield pending


async def _received(form: StreamedForm, folder: Path, chunk_bytes: int = 65536) -> bytes:
    sent = b"".join([bytes(p) async for p in form.chunks()])
    assert len(sent) == form.length
    headers = {"content-type": form.content_type, "content-length": str(form.length)}
    pushed = await receive_push(headers, _body(form, chunk_bytes), folder, 1 << 30)
    assert pushed.lora_name == "a" and pushed.version == 3
    return (folder / "adapter_model.safetensors").read_bytes()


@pytest.mark.parametrize("chunk_bytes", [1000, 65536, 5 << 20])
def test_a_folder_pushed_in_chunks_arrives_whole_with_its_digest(tmp_path, chunk_bytes) -> None:
    weights = _safetensors(9 << 20)  # more than two of the client's chunks
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "adapter_config.json").write_text('{"r": 8}')
    (tmp_path / "src" / "adapter_model.safetensors").write_bytes(weights)
    form = adapter_payload(str(tmp_path / "src")).form("a", "abort_resume", version=3)
    (tmp_path / "in").mkdir()
    got = asyncio.run(_received(form, tmp_path / "in", chunk_bytes))
    assert got == weights
    assert (tmp_path / "in" / "adapter_config.json").read_bytes() == b'{"r": 8}'


def test_in_memory_bytes_push_the_same(tmp_path) -> None:
    weights = _safetensors(1 << 20)
    payload = adapter_payload(InMemoryAdapter(weights=weights, config={"r": 8}))
    (tmp_path / "in").mkdir()
    got = asyncio.run(_received(payload.form("a", "finish_old", version=3), tmp_path / "in"))
    assert got == weights


def test_a_body_damaged_on_the_way_is_refused_by_its_digest(tmp_path) -> None:
    weights = _safetensors(1 << 20)
    form = adapter_payload(InMemoryAdapter(weights=weights, config={})).form("a", "abort_resume")

    async def damaged() -> AsyncIterator[bytes]:
        async for piece in form.chunks():
            data = bytes(piece)
            if len(data) > 4096:  # a weights chunk: flip one byte in its data
                data = data[:4000] + bytes([data[4000] ^ 1]) + data[4001:]
            yield data

    headers = {"content-type": form.content_type}
    (tmp_path / "in").mkdir()
    with pytest.raises(BadRequestError, match="damaged or truncated"):
        asyncio.run(receive_push(headers, damaged(), tmp_path / "in", 1 << 30))
    assert not (tmp_path / "in").exists()  # nothing left behind
