"""Which trainers' CUDA shares a worker keeps open, and when it lets one go.

Pure bookkeeping, with a stand-in for torch's opening of a share: the
real share, from a trainer process, is opened in
``gpu_tests/test_gpu_handover_share.py``.
"""

from __future__ import annotations

import gc
import threading
import weakref
from pathlib import Path

import pytest

from skyrl_lora.server.adapters.registry import adapter_of, engine_name
from skyrl_lora.server.adapters.snapshot_writer import SNAPSHOT_MARKERS, SnapshotWriter
from skyrl_lora.server.transfer import handover
from skyrl_lora.server.transfer.open_shares import OpenShares
from tests.test_handover import share


class Mapping:
    """What torch's open returns; a weak reference to it says when it closed."""


class Opener:
    """Opens each share as a :class:`Mapping`; one that is still open is
    found again by its handle, as torch's cache of opened shares finds it."""

    def __init__(self) -> None:
        self.calls = 0
        self._open: dict[str, weakref.ref[Mapping]] = {}

    def __call__(self, buffer: dict, index: int) -> Mapping:
        self.calls += 1
        found = self._open.get(buffer["handle"])
        mapping = found() if found is not None else None
        if mapping is None:
            mapping = Mapping()
            self._open[buffer["handle"]] = weakref.ref(mapping)
        return mapping

    def is_open(self, handle: str) -> bool:
        gc.collect()
        found = self._open.get(handle)
        return found is not None and found() is not None


def test_a_buffer_handed_over_again_stays_open_and_is_opened_every_time() -> None:
    opener = Opener()
    shares = OpenShares(limit=4, open_share=opener)
    first = shares.open("a", 1, share(handle="eA=="), 0)
    del first
    again = shares.open("a", 2, share(handle="eA=="), 0)
    del again
    # opened every time: torch gives the trainer's count for each share back
    assert opener.calls == 2
    assert opener.is_open("eA==") and shares.retired == 0
    assert list(shares.held()) == ["a"]


def test_a_new_buffer_retires_the_last_one_which_closes_only_when_asked() -> None:
    opener = Opener()
    shares = OpenShares(limit=4, open_share=opener)
    shares.open("a", 1, share(handle="eA=="), 0)
    shares.open("b", 2, share(handle="eQ=="), 0)
    shares.open("a", 3, share(handle="eg=="), 0)  # the trainer of a made a new buffer
    assert shares.retired == 1
    assert opener.is_open("eA==")  # not closed during the staging
    assert shares.close_retired() == 1
    assert not opener.is_open("eA==")
    assert opener.is_open("eQ==") and opener.is_open("eg==")


def test_the_least_recently_handed_over_is_retired_past_the_limit() -> None:
    opener = Opener()
    shares = OpenShares(limit=2, open_share=opener)
    for lora_id, (adapter, handle) in enumerate([("a", "eA=="), ("b", "eQ=="), ("a", "eA==")]):
        shares.open(adapter, lora_id, share(handle=handle), 0)
    shares.open("c", 9, share(handle="eg=="), 0)
    assert list(shares.held()) == ["a", "c"]
    shares.close_retired()
    assert not opener.is_open("eQ==")


def test_removing_an_adapters_newest_version_retires_its_share_an_older_one_does_not() -> None:
    opener = Opener()
    shares = OpenShares(limit=4, open_share=opener)
    shares.open("a", 1, share(handle="eA=="), 0)
    shares.open("a", 2, share(handle="eA=="), 0)
    assert not shares.forget(1)  # the old version, retired after the swap
    assert shares.forget(2)  # the adapter unloaded
    assert shares.close_retired() == 1 and not opener.is_open("eA==")


def test_no_limit_keeps_nothing_open() -> None:
    opener = Opener()
    shares = OpenShares(limit=0, open_share=opener)
    mapping = shares.open("a", 1, share(handle="eA=="), 0)
    assert shares.held() == {} and shares.retired == 0
    del mapping
    assert not opener.is_open("eA==")
    with pytest.raises(ValueError, match="0 or more"):
        OpenShares(limit=-1)


def test_the_engine_names_a_version_and_the_worker_finds_its_adapter() -> None:
    assert engine_name("tenant@v2", 7) == "tenant@v2@v7"
    assert adapter_of(engine_name("tenant@v2", 7)) == "tenant@v2"
    assert adapter_of("tenant") == "tenant"
    assert adapter_of("tenant@vx") == "tenant@vx"


def test_work_after_a_swap_runs_after_the_writes_before_it_and_a_failure_is_logged(
    tmp_path: Path, caplog
) -> None:
    import torch

    writer = SnapshotWriter(handover.WEIGHTS_FILE, SNAPSHOT_MARKERS)
    folder = tmp_path / "v1"
    folder.mkdir()
    release = threading.Event()

    def slow_buffer() -> torch.Tensor:
        release.wait(5)
        return torch.zeros(4, dtype=torch.uint8)

    order: list[str] = []
    writer.submit(folder, slow_buffer, lambda: (b"", [(0, 4)]))
    writer.later(
        lambda: order.append("after" if (folder / handover.WEIGHTS_FILE).exists() else "before")
    )
    writer.later(lambda: 1 / 0)
    done = threading.Event()
    writer.later(done.set)
    release.set()
    assert done.wait(5)
    assert order == ["after"]
    assert "could not run" in caplog.text
