"""What ``RemoteInferenceClient.push_lora_adapter`` sends: adapter files as a multipart form.

An adapter comes as a PEFT folder (``adapter_config.json`` and
``adapter_model.safetensors``) or in memory (:class:`InMemoryAdapter`). A
folder's weights are streamed from disk once per replica, never read whole
into memory; in-memory bytes are shared by every replica's request, not
copied. Serialising tensors needs the ``safetensors`` package (and torch or
numpy, whichever the tensors are); the client itself needs neither.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

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
    sha256: str

    @contextmanager
    def form(
        self,
        lora_name: str,
        swap_policy: str,
        version: int | None = None,
        keep_previous_s: float | None = None,
    ) -> Iterator[aiohttp.FormData]:
        """A fresh form for one request (a file is opened per request and closed after)."""
        form = aiohttp.FormData()
        form.add_field("lora_name", lora_name)
        form.add_field("sha256", self.sha256)
        form.add_field("swap_policy", swap_policy)
        if version is not None:
            form.add_field("version", str(version))
        if keep_previous_s is not None:
            form.add_field("keep_previous_s", str(keep_previous_s))
        form.add_field(
            CONFIG_FILE, self.config, filename=CONFIG_FILE, content_type="application/json"
        )
        if isinstance(self.weights, Path):
            with self.weights.open("rb") as weights:
                form.add_field(WEIGHTS_FILE, weights, filename=WEIGHTS_FILE)
                yield form
        else:
            form.add_field(WEIGHTS_FILE, self.weights, filename=WEIGHTS_FILE)
            yield form


def adapter_payload(adapter: str | os.PathLike[str] | InMemoryAdapter) -> AdapterPayload:
    """Read (a folder's config) or serialise (in-memory tensors) once, for every replica."""
    if isinstance(adapter, InMemoryAdapter):
        config = adapter.config
        config_bytes = config if isinstance(config, bytes) else json.dumps(dict(config)).encode()
        weights = adapter.weights
        data = weights if isinstance(weights, bytes) else serialize_tensors(weights)
        return AdapterPayload(config_bytes, data, hashlib.sha256(data).hexdigest())
    folder = Path(adapter)
    missing = [f for f in (CONFIG_FILE, WEIGHTS_FILE) if not (folder / f).is_file()]
    if missing:
        raise ValueError(f"adapter folder {folder} lacks {', '.join(missing)}")
    digest = hashlib.sha256()
    with (folder / WEIGHTS_FILE).open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return AdapterPayload(
        (folder / CONFIG_FILE).read_bytes(), folder / WEIGHTS_FILE, digest.hexdigest()
    )


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
