"""Adapter weights pushed over the wire, for trainers that share no disk with the server.

``POST /skyrl/v1/adapters/push`` takes ``multipart/form-data``: the text
fields ``lora_name``, optionally ``sha256`` (hex digest of the weights file),
``swap_policy`` and ``version``, and the files ``adapter_config.json`` and
``adapter_model.safetensors``. The body is streamed straight into a folder
beside the server's snapshots (never into an adapter root, never held whole
in memory), checked (size limit, checksum, a well-formed safetensors file),
and then loaded exactly like a path load: same gate, versions, metrics and
event lines. Whatever fails, the folder is removed and the previous version
keeps serving.

The Ray path (:meth:`skyrl_lora.server.cluster.actor.ServerActor.push_adapter`)
hands the same files over as bytes from the object store and shares
:func:`load_pushed` with the HTTP route.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os
import shutil
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast, get_args

from python_multipart.multipart import MultipartParser, parse_options_header

from skyrl_lora.errors import BadRequestError, PayloadTooLargeError
from skyrl_lora.types import SwapPolicy

from ..adapters.adapter_file import Readable, read_header
from ..adapters.registry import AdapterRecord, PreparedVersion
from ..adapters.snapshot_writer import write_all
from ..engine.gated import GatedEngine, Preparer

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
FILES = (CONFIG_FILE, WEIGHTS_FILE)
TEXT_FIELDS = ("lora_name", "sha256", "swap_policy", "version", "keep_previous_s")
#: Text fields are names and digests: anything longer is not one of ours.
MAX_TEXT_FIELD_BYTES = 1024
#: ``--max-adapter-bytes`` default: a rank-64 adapter of a 70B model fits.
DEFAULT_MAX_ADAPTER_BYTES = 2 << 30


#: The form, for the OpenAPI document (the route reads the stream itself).
PUSH_FORM_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["lora_name", CONFIG_FILE, WEIGHTS_FILE],
    "properties": {
        "lora_name": {"type": "string"},
        "sha256": {"type": "string", "description": "hex sha256 of the weights file"},
        "swap_policy": {"type": "string", "enum": ["abort_resume", "finish_old"]},
        "version": {
            "type": "integer",
            "minimum": 1,
            "description": "exact version; above the current one, or the current one again "
            "with the same weights (a no-op)",
        },
        "keep_previous_s": {
            "type": "number",
            "exclusiveMinimum": 0,
            "maximum": 3600,
            "description": "keep the replaced version until commit or rollback (a group's "
            "atomic swap), at most this many seconds",
        },
        CONFIG_FILE: {"type": "string", "format": "binary"},
        WEIGHTS_FILE: {"type": "string", "format": "binary"},
    },
}


@dataclass(frozen=True)
class PushedAdapter:
    """A pushed adapter, written to ``folder`` and checked."""

    lora_name: str
    folder: Path
    sha256: str
    swap_policy: SwapPolicy = "abort_resume"
    version: int | None = None
    keep_previous_s: float | None = None
    #: What the version's record says it came from (default: the push and its digest).
    source: str | None = None


async def receive_push(
    headers: Mapping[str, str], body: AsyncIterator[bytes], folder: Path, max_bytes: int
) -> PushedAdapter:
    """Stream a multipart push into ``folder``; removes the folder on any failure."""
    try:
        writer = _FormWriter(folder, max_bytes)
        fields = await writer.write(headers, body)
        return checked_push(fields, folder, writer.weights_digest.hexdigest())
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise


def write_pushed_files(
    folder: Path,
    lora_name: str,
    files: Mapping[str, bytes],
    sha256: str | None = None,
    swap_policy: SwapPolicy = "abort_resume",
    version: int | None = None,
    keep_previous_s: float | None = None,
    max_bytes: int | None = None,
) -> PushedAdapter:
    """The object-store path: the same files as bytes, written and checked alike
    (``max_bytes``: the server's ``--max-adapter-bytes``, as for an HTTP push)."""
    try:
        unknown = set(files) - set(FILES)
        if unknown:
            raise BadRequestError(f"unknown adapter files {sorted(unknown)}; expected {FILES}")
        size = sum(len(data) for data in files.values())
        if max_bytes is not None and size > max_bytes:
            raise payload_too_large(max_bytes, size)
        for name, data in files.items():
            (folder / name).write_bytes(data)
        fields = {"lora_name": lora_name, "swap_policy": swap_policy}
        if sha256:
            fields["sha256"] = sha256
        if version is not None:
            fields["version"] = str(version)
        if keep_previous_s is not None:
            fields["keep_previous_s"] = str(keep_previous_s)
        digest = hashlib.sha256(files.get(WEIGHTS_FILE, b"")).hexdigest()
        return checked_push(fields, folder, digest)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise


async def load_pushed(
    engine: GatedEngine, pushed: PushedAdapter, prepare: Preparer | None = None
) -> SwapPolicy | None:
    """Load a checked push as the adapter's next version (or as its ``version``);
    returns the policy applied, None for a repeat of the current version.
    ``prepare``: how the version is snapshotted and staged, where not simply
    from the folder (a streamed push stages while its bytes arrive)."""
    source = pushed.source or f"push:sha256={pushed.sha256}"

    def from_folder(replaces: int | None) -> Awaitable[PreparedVersion | AdapterRecord]:
        return engine.registry.prepare_owned(
            pushed.lora_name, pushed.folder, source, pushed.version, replaces
        )

    try:
        return await engine.swap(
            pushed.lora_name, pushed.swap_policy, prepare or from_folder, pushed.keep_previous_s
        )
    finally:  # moved into its snapshot on success; gone in every other case
        shutil.rmtree(pushed.folder, ignore_errors=True)


def checked_push(
    fields: Mapping[str, str], folder: Path, digest: str, weights_written: bool = True
) -> PushedAdapter:
    """Check a written push; ``digest`` is the weights' sha256, taken as they
    were written (a streamed push's digest is checked before, and it sends
    no ``sha256`` field). A streamed push is checked before its weights
    arrive (``weights_written`` False): their header is checked as it lands."""
    name = fields.get("lora_name", "")
    if not name:
        raise BadRequestError("push needs the form field 'lora_name'")
    required = FILES if weights_written else (CONFIG_FILE,)  # streamed: the weights come apart
    missing = [f for f in required if not (folder / f).is_file()]
    if missing:
        raise BadRequestError(f"push needs the files {', '.join(missing)}")
    policy = cast(SwapPolicy, fields.get("swap_policy") or "abort_resume")
    if policy not in get_args(SwapPolicy):
        raise BadRequestError(f"unknown swap_policy {policy!r}; use one of {get_args(SwapPolicy)}")
    version = fields.get("version")
    if version is not None and not (version.isdigit() and int(version) >= 1):
        raise BadRequestError(f"version must be a positive integer, got {version!r}")
    keep_previous_s = _keep_previous_s(fields.get("keep_previous_s"))
    try:
        json.loads((folder / CONFIG_FILE).read_bytes())
    except ValueError as exc:
        raise BadRequestError(f"{CONFIG_FILE} is not valid JSON: {exc}") from exc
    expected = fields.get("sha256")
    if expected and expected.lower() != digest:
        raise BadRequestError(
            f"{WEIGHTS_FILE} has sha256 {digest}, the push said {expected}: "
            "the upload was damaged or truncated"
        )
    if weights_written:
        check_safetensors(folder / WEIGHTS_FILE)
    return PushedAdapter(
        name,
        folder,
        digest,
        policy,
        None if version is None else int(version),  # type: ignore[arg-type]
        keep_previous_s,
    )


def payload_too_large(max_bytes: int, size: int | None = None) -> PayloadTooLargeError:
    """The 413 of a push above ``--max-adapter-bytes`` (``size``: where it is known)."""
    what = "the pushed adapter" if size is None else f"the pushed adapter ({size} bytes)"
    return PayloadTooLargeError(
        f"{what} is larger than the server's limit of {max_bytes} bytes (--max-adapter-bytes)"
    )


def _keep_previous_s(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds <= 3600:  # also refuses nan
        raise BadRequestError(f"keep_previous_s must be in (0, 3600] seconds, got {text!r}")
    return seconds


def check_safetensors(path: Path) -> None:
    """Refuse a truncated or corrupt safetensors file with a message, before vLLM reads it."""
    with path.open("rb") as f:
        _check_header(f, path.stat().st_size, path.name)


def check_safetensors_head(head: bytes, size: int) -> None:
    """:func:`check_safetensors` from a weights file's first bytes (at least
    its header) and its size: a streamed push's, checked as they land."""
    _check_header(io.BytesIO(head), size, WEIGHTS_FILE)


def _check_header(file: Readable, size: int, name: str) -> None:
    try:
        header, data_len = read_header(file, size)
    except ValueError as exc:
        raise BadRequestError(f"{name} is {exc}") from exc
    for tensor, meta in header.items():
        if tensor == "__metadata__":
            continue
        offsets = meta.get("data_offsets") if isinstance(meta, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and offsets[1] <= data_len):
            raise BadRequestError(f"{name} is truncated: tensor {tensor!r} lies past its end")


class _FormWriter:
    """python-multipart callbacks that hand file parts to :class:`_FileSink` s as they arrive."""

    def __init__(self, folder: Path, max_bytes: int) -> None:
        self._folder = folder
        self._max_bytes = max_bytes
        self._received = 0
        self.fields: dict[str, str] = {}
        self._header_field = b""
        self._header_value = b""
        self._part_headers: dict[bytes, bytes] = {}
        self._part_name = ""
        self._sink: _FileSink | None = None
        self._sinks: list[_FileSink] = []
        #: sha256 of the weights file, updated as its bytes arrive (no second read).
        self.weights_digest = hashlib.sha256()
        self._text = bytearray()

    async def write(self, headers: Mapping[str, str], body: AsyncIterator[bytes]) -> dict[str, str]:
        content_type, options = parse_options_header(headers.get("content-type", ""))
        boundary = options.get(b"boundary")
        if content_type != b"multipart/form-data" or not boundary:
            raise BadRequestError("push needs a multipart/form-data body")
        declared = headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > self._max_bytes:
            raise self._too_large()
        callbacks: Any = {
            "on_part_begin": self._part_begin,
            "on_header_field": self._on_header_field,
            "on_header_value": self._on_header_value,
            "on_header_end": self._on_header_end,
            "on_headers_finished": self._headers_finished,
            "on_part_data": self._part_data,
            "on_part_end": self._part_end,
        }
        parser = MultipartParser(boundary, callbacks)
        try:
            async for chunk in body:
                self._received += len(chunk)
                if self._received > self._max_bytes:
                    raise self._too_large()
                parser.write(chunk)
                if self._sink is not None:
                    await self._sink.drain(_FileSink.MAX_IN_FLIGHT)
            parser.finalize()
            for sink in self._sinks:
                await sink.drain(0)
        finally:
            for sink in self._sinks:
                await sink.close()
        return self.fields

    def _too_large(self) -> PayloadTooLargeError:
        return payload_too_large(self._max_bytes)

    def _part_begin(self) -> None:
        self._part_headers = {}
        self._text = bytearray()

    def _on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._header_field += data[start:end]

    def _on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._header_value += data[start:end]

    def _on_header_end(self) -> None:
        self._part_headers[self._header_field.lower()] = self._header_value
        self._header_field = self._header_value = b""

    def _headers_finished(self) -> None:
        _, options = parse_options_header(self._part_headers.get(b"content-disposition", b""))
        self._part_name = options.get(b"name", b"").decode(errors="replace")
        if b"filename" in options:
            if self._part_name not in FILES:
                raise BadRequestError(
                    f"unexpected file field {self._part_name!r}; push takes {', '.join(FILES)}"
                )
            if (self._folder / self._part_name).exists():
                raise BadRequestError(f"file field {self._part_name!r} sent twice")
            digest = self.weights_digest if self._part_name == WEIGHTS_FILE else None
            self._sink = _FileSink(self._folder / self._part_name, digest)
            self._sinks.append(self._sink)
        elif self._part_name not in TEXT_FIELDS:
            raise BadRequestError(
                f"unexpected form field {self._part_name!r}; push takes {', '.join(TEXT_FIELDS)}"
            )

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        if self._sink is not None:
            self._sink.add(memoryview(data)[start:end])
            return
        self._text += data[start:end]
        if len(self._text) > MAX_TEXT_FIELD_BYTES:
            raise BadRequestError(f"form field {self._part_name!r} is too long")

    def _part_end(self) -> None:
        if self._sink is not None:
            self._sink.flush()
            self._sink = None
        else:
            self.fields[self._part_name] = self._text.decode(errors="replace").strip()


class _FileSink:
    """One pushed file's bytes, written (and, for the weights, hashed) on
    threads of their own, in order, while the event loop receives the rest.

    Written and hashed on the loop, the 336 MB rank-64 adapter of an 8B
    model held the API server's loop, and with it every tenant's stream,
    for about half a second (on a 2-core machine: 280 ms of sha256 and
    150 ms of writes); on two threads the two overlap each other and the
    receiving. Bytes are handed over in chunks of :data:`FLUSH_BYTES`, and
    the loop stops reading once :data:`MAX_IN_FLIGHT` are waiting.
    """

    FLUSH_BYTES = 4 << 20
    MAX_IN_FLIGHT = 8

    def __init__(self, path: Path, digest: Any = None) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        self._digest = digest
        self._pending: list[bytes | memoryview] = []
        self._pending_bytes = 0
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="skyrl-push-write")
        self._hasher = (
            ThreadPoolExecutor(1, thread_name_prefix="skyrl-push-sha256") if digest else None
        )
        self._in_flight: deque[Future[Any]] = deque()

    def add(self, data: bytes | memoryview) -> None:
        self._pending.append(data)
        self._pending_bytes += len(data)
        if self._pending_bytes >= self.FLUSH_BYTES:
            self.flush()

    def flush(self) -> None:
        """Hand what was added so far to the threads, as the pieces it came
        in (joined into one chunk on the loop, they cost it a copy of every
        byte: 0.14 s of a 336 MB push on a 2-core machine)."""
        if not self._pending:
            return
        pieces = self._pending
        self._pending = []
        self._pending_bytes = 0
        self._in_flight.append(self._writer.submit(write_all, self._fd, list(pieces)))
        if self._hasher is not None:
            self._in_flight.append(self._hasher.submit(_hash_all, self._digest, pieces))

    async def drain(self, keep: int) -> None:
        """Wait until at most ``keep`` chunks are in flight (raising a thread's error)."""
        while len(self._in_flight) > keep:
            await asyncio.wrap_future(self._in_flight.popleft())

    async def close(self) -> None:
        """Let the threads finish (their errors were raised by :meth:`drain`) and close the file."""
        for future in self._in_flight:
            future.cancel()
        pending = [asyncio.wrap_future(f) for f in self._in_flight if not f.cancelled()]
        await asyncio.gather(*pending, return_exceptions=True)
        self._in_flight.clear()
        for pool in (self._writer, self._hasher):
            if pool is not None:
                pool.shutdown(wait=False)
        os.close(self._fd)


def _hash_all(digest: Any, pieces: list[bytes | memoryview]) -> None:
    for piece in pieces:
        digest.update(piece)
