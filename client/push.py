"""What ``RemoteInferenceClient.push_lora_adapter`` sends: adapter files as a multipart form.

An adapter comes as a PEFT folder (``adapter_config.json`` and
``adapter_model.safetensors``) or in memory (:class:`InMemoryAdapter`). A
folder's weights are streamed from disk once per replica, never read whole
into memory; in-memory bytes are shared by every replica's request, not
copied. Each request's body is streamed (:class:`StreamedForm`) and
ends with the sha256 of the weights it carried. Serialising tensors needs
the ``safetensors`` package (and torch or numpy, whichever the tensors
are); the client itself needs neither.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import secrets
from collections import deque
from collections.abc import AsyncIterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


@dataclass(frozen=True)
class InMemoryAdapter:
    """An adapter that never touched a disk.

    ``weights``: the bytes of a safetensors file, or a ``{name: tensor}``
    mapping (torch or numpy) in PEFT's naming. ``config``: the PEFT
    ``adapter_config.json`` as a mapping or as its bytes.
    """

    weights: bytes | Mapping[str, Any]
    config: Mapping[str, Any] | bytes


@dataclass(frozen=True)
class AdapterPayload:
    """One adapter, ready to be sent to any number of servers."""

    config: bytes
    weights: bytes | Path

    @property
    def weights_bytes(self) -> int:
        """The size of the safetensors file."""
        return weights_size(self.weights)

    def form(
        self,
        lora_name: str,
        swap_policy: str,
        version: int | None = None,
        keep_previous_s: float | None = None,
    ) -> StreamedForm:
        """A fresh body for one request (a file is opened when it is sent)."""
        fields = {"lora_name": lora_name, "swap_policy": swap_policy}
        if version is not None:
            fields["version"] = str(version)
        if keep_previous_s is not None:
            fields["keep_previous_s"] = str(keep_previous_s)
        return StreamedForm(fields, self.config, self.weights)


class StreamedForm:
    """A push's ``multipart/form-data`` body, streamed in large chunks, with
    the weights' sha256 as its last field, taken as they are sent.

    The digest is worked out on a thread of its own while the chunks go out
    (``hashlib`` lets the GIL go for large updates), so it costs no time of
    its own: hashed before the send, the 336 MB rank-64 adapter of an 8B
    model spent about a quarter of a second in it. The server checks it
    against its own digest of what it received.
    """

    #: Bytes per chunk sent (and hashed).
    CHUNK_BYTES = 4 << 20
    #: Chunks handed to the hashing thread and not yet hashed, at most.
    HASH_AHEAD = 8

    def __init__(self, fields: Mapping[str, str], config: bytes, weights: bytes | Path) -> None:
        self._boundary = secrets.token_hex(16)
        head = b"".join(self._part(name, value.encode()) for name, value in fields.items())
        head += self._part(CONFIG_FILE, config, "application/json", CONFIG_FILE)
        self._head = head + self._part_head(WEIGHTS_FILE, "application/octet-stream", WEIGHTS_FILE)
        self._weights = weights
        self._weights_bytes = weights_size(weights)
        self._tail_bytes = len(self._tail("0" * 64))

    @property
    def content_type(self) -> str:
        return f"multipart/form-data; boundary={self._boundary}"

    @property
    def length(self) -> int:
        """The body's size in bytes (sent as its ``Content-Length``)."""
        return len(self._head) + self._weights_bytes + self._tail_bytes

    async def chunks(self) -> AsyncIterator[bytes | memoryview]:
        """The body, chunk by chunk."""
        loop = asyncio.get_running_loop()
        digest = hashlib.sha256()
        hashing: deque[asyncio.Future[None]] = deque()
        yield self._head
        with ThreadPoolExecutor(1, thread_name_prefix="skyrl-push-sha256") as hasher:
            async for chunk in self._weight_chunks():
                hashing.append(loop.run_in_executor(hasher, digest.update, chunk))
                if len(hashing) > self.HASH_AHEAD:
                    await hashing.popleft()
                yield chunk
            for pending in hashing:
                await pending
        yield self._tail(digest.hexdigest())

    async def _weight_chunks(self) -> AsyncIterator[bytes | memoryview]:
        if not isinstance(self._weights, Path):
            view = memoryview(self._weights)
            for start in range(0, len(view), self.CHUNK_BYTES):
                yield view[start : start + self.CHUNK_BYTES]
            return
        with self._weights.open("rb", buffering=0) as file:
            sent = 0
            while sent < self._weights_bytes:
                chunk = await asyncio.to_thread(file.read, self.CHUNK_BYTES)
                if not chunk:
                    raise ValueError(f"{self._weights} shrank while it was being sent")
                sent += len(chunk)
                yield chunk

    def _part_head(self, name: str, content_type: str | None, filename: str | None) -> bytes:
        disposition = f'form-data; name="{name}"'
        if filename is not None:
            disposition += f'; filename="{filename}"'
        lines = [f"--{self._boundary}", f"Content-Disposition: {disposition}"]
        if content_type is not None:
            lines.append(f"Content-Type: {content_type}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode()

    def _part(
        self,
        name: str,
        value: bytes,
        content_type: str | None = None,
        filename: str | None = None,
    ) -> bytes:
        return self._part_head(name, content_type, filename) + value + b"\r\n"

    def _tail(self, sha256: str) -> bytes:
        closing = f"--{self._boundary}--\r\n".encode()
        return b"\r\n" + self._part("sha256", sha256.encode()) + closing


def weights_size(weights: bytes | Path) -> int:
    """The size of a safetensors file, in memory or on disk."""
    return weights.stat().st_size if isinstance(weights, Path) else len(weights)


def adapter_payload(adapter: str | os.PathLike[str] | InMemoryAdapter) -> AdapterPayload:
    """Read (a folder's config) or serialise (in-memory tensors) once, for every replica."""
    if isinstance(adapter, InMemoryAdapter):
        config = adapter.config
        config_bytes = config if isinstance(config, bytes) else json.dumps(dict(config)).encode()
        weights = adapter.weights
        data = weights if isinstance(weights, bytes) else serialize_tensors(weights)
        return AdapterPayload(config_bytes, data)
    folder = Path(adapter)
    missing = [f for f in (CONFIG_FILE, WEIGHTS_FILE) if not (folder / f).is_file()]
    if missing:
        raise ValueError(f"adapter folder {folder} lacks {', '.join(missing)}")
    return AdapterPayload((folder / CONFIG_FILE).read_bytes(), folder / WEIGHTS_FILE)


def serialize_tensors(tensors: Mapping[str, Any]) -> bytes:
    """``{name: tensor}`` to safetensors bytes, with torch's or numpy's writer."""
    if not tensors:
        raise ValueError("an adapter needs at least one tensor")
    first = next(iter(tensors.values()))
    flavour = "torch" if type(first).__module__.startswith("torch") else "numpy"
    try:
        if flavour == "torch":
            from safetensors.torch import save
        else:
            from safetensors.numpy import save  # type: ignore[assignment]
    except ImportError as exc:
        raise TypeError(
            "serialising tensors needs the 'safetensors' package; "
            "install it or pass the safetensors file's bytes"
        ) from exc
    return bytes(save({k: v.contiguous() if flavour == "torch" else v for k, v in tensors.items()}))
