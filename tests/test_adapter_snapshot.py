"""The adapter snapshot copy: exact bytes, links kept inside, kernel copy with a fallback."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from skyrl_lora.errors import BadRequestError
from skyrl_lora.server.adapters import registry as adapters
from skyrl_lora.server.adapters.registry import snapshot_adapter_dir


def _adapter(folder: Path) -> dict[str, bytes]:
    """An adapter folder with a multi-chunk weights file and a nested file."""
    contents = {
        "adapter_config.json": b'{"r": 8}',
        "adapter_model.safetensors": os.urandom(3 * (1 << 20) + 17),
        "extra/notes.txt": b"nested",
    }
    for name, data in contents.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    return contents


def _read(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_snapshot_copies_every_byte(tmp_path: Path) -> None:
    contents = _adapter(tmp_path / "src")
    target = snapshot_adapter_dir(str(tmp_path / "src"), tmp_path / "snap" / "v1")
    assert _read(target) == contents


def test_snapshot_falls_back_when_the_kernel_cannot_copy(tmp_path: Path, monkeypatch) -> None:
    contents = _adapter(tmp_path / "src")

    def no_sendfile(*args: object) -> int:
        raise OSError(errno.EINVAL, "sendfile unsupported here")

    monkeypatch.setattr(adapters.os, "sendfile", no_sendfile)
    target = snapshot_adapter_dir(str(tmp_path / "src"), tmp_path / "snap" / "v1")
    assert _read(target) == contents


def test_snapshot_failing_midway_leaves_nothing(tmp_path: Path, monkeypatch) -> None:
    _adapter(tmp_path / "src")
    real_sendfile = os.sendfile
    calls = iter(range(1000))

    def failing_second_call(out_fd: int, in_fd: int, offset: int, count: int) -> int:
        if next(calls) == 0:
            return real_sendfile(out_fd, in_fd, offset, min(count, 1 << 20))
        raise OSError(errno.EIO, "disk went away")

    monkeypatch.setattr(adapters.os, "sendfile", failing_second_call)
    target = tmp_path / "snap" / "v1"
    with pytest.raises(BadRequestError, match="could not be copied"):
        snapshot_adapter_dir(str(tmp_path / "src"), target)
    assert not target.exists()


def test_snapshot_refuses_a_link_out_of_the_roots(tmp_path: Path) -> None:
    _adapter(tmp_path / "src")
    (tmp_path / "secret").write_bytes(b"not yours")
    (tmp_path / "src" / "leak").symlink_to(tmp_path / "secret")
    with pytest.raises(BadRequestError, match="outside the allowed adapter roots"):
        snapshot_adapter_dir(
            str(tmp_path / "src"), tmp_path / "snap" / "v1", roots=[tmp_path / "src"]
        )
    assert not (tmp_path / "snap" / "v1").exists()


def test_a_path_the_os_refuses_to_look_up_is_a_bad_request(tmp_path: Path) -> None:
    """``Path.is_dir`` raises for a name over the file system's limit (found by the fuzz test)."""
    with pytest.raises(BadRequestError, match="cannot be read"):
        snapshot_adapter_dir("0" * 300, tmp_path / "snap" / "v1")
    assert not (tmp_path / "snap").exists()
