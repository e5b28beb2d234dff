"""Shared fixtures: the embedded model and real CPU vLLM servers on Ray.

Servers run in Ray actors, exactly as ``skyrl-lora serve`` runs them. They
start lazily, so the pure unit tests never pay for them. A server's start
costs 40-95 s on the 2-core CPU machine, most of the suite's time, so tests
share servers wherever their flags allow: the session's ``engine_server``,
and ``serves`` for the ``skyrl-lora serve`` processes of the step-watch and
shutdown tests (the shutdown tests stop the servers the others used, last).

Soak-length tests carry the ``soak`` marker: deselected by default
(pyproject's addopts), run by ``-m soak`` at full size and by ``.ci/run``
in the same session as the rest, scaled by ``SKYRL_TEST_SOAK_SCALE``.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

ADMIN_KEY = "test-admin-key"
#: Tenant keys of the session server: each may use only its own adapter.
TENANT_KEYS = {"sec-a": "tenant-a-key", "sec-b": "tenant-b-key"}
#: The session server's push limit: the embedded adapters are ~140 KB, and
#: the push stream's tests pad one to three 8 MiB chunks.
MAX_ADAPTER_BYTES = 24 << 20


#: How large the soak tests run: 1 is the full soak; ``.ci/run`` runs a bounded slice.
SOAK_SCALE = float(os.environ.get("SKYRL_TEST_SOAK_SCALE", "1"))


def soak_size(full: int, least: int = 1) -> int:
    """A soak's count (samples, cycles, requests) at ``SOAK_SCALE``."""
    return max(least, round(full * SOAK_SCALE))


#: ``skyrl-lora serve`` as a user starts it: the embedded model, a free port, nothing else.
SERVE_FLAGLESS = ("--embedded", "--port", "0")
#: The step watch's in-process server: every step logged, resumed requests one a step.
SERVE_STEP_WATCH = (
    *SERVE_FLAGLESS,
    *("--no-ray", "--long-step-ms", "1", "--max-num-seqs", "48", "--resume-tokens-per-step", "1"),
)
#: The step watch's control: the same pace, but following the running batch.
SERVE_STEP_WATCH_CONTROL = (
    *SERVE_FLAGLESS,
    *("--no-ray", "--long-step-ms", "1", "--resume-tokens-per-step", "1"),
    *("--resume-graph-tokens", "2"),
)

#: Tests moved to the session's end, in this order (by node id prefix), so
#: that each shared ``serve`` is stopped by a shutdown test right after its
#: last user, and at most two of them run beside the session's server.
LAST = (
    "tests/test_push_stream_default_engine.py::",  # the flag-less serve...
    "tests/test_shutdown_engine.py::test_serve_leaves_no_process_behind[SIGTERM-ray]",  # stops it
    "tests/test_step_watch_engine.py::",  # the two --no-ray serves...
    "tests/test_shutdown_engine.py::",  # ...stopped by the --no-ray cases
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        return next((i + 1 for i, p in enumerate(LAST) if item.nodeid.startswith(p)), 0)

    items.sort(key=rank)  # stable: every other test keeps its place


@dataclass(frozen=True)
class EngineServer:
    url: str
    model: Any  # skyrl_lora.server.embedded.EmbeddedModel
    tokenizer: Any
    admin_key: str | None = None
    adapter_root: Path | None = None  # a folder the server may load adapters from
    snapshot_dir: Path | None = None  # where the server keeps adapter versions and uploads

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def word_id(self, word: str) -> int:
        (token,) = self.encode(word)
        return token


@pytest.fixture(scope="session")
def embedded_model() -> Any:
    from skyrl_lora.server.embedded import ensure_embedded_model

    return ensure_embedded_model()


@pytest.fixture(scope="session")
def tokenizer(embedded_model: Any) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded_model.model_dir)


@pytest.fixture(scope="session")
def local_ray() -> Iterator[Any]:
    """One local Ray instance for every engine test (4 logical CPUs: the
    single server and a two-replica group fit side by side)."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=4, include_dashboard=False, ignore_reinit_error=True, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def engine_server(
    embedded_model: Any, local_ray: Any, tokenizer: Any, tmp_path_factory: Any
) -> Iterator[EngineServer]:
    """The session's server, as in production: API keys on, adapter paths confined
    to the embedded model's folder and one scratch folder the tests write to."""
    from skyrl_lora.server.cluster.actor import ActorOptions, start_server_actor
    from skyrl_lora.server.presets import CPU_ENV, embedded_server_argv

    config = tmp_path_factory.mktemp("server-config")
    keys = [{"key": ADMIN_KEY, "admin": True}]
    keys += [{"key": k, "adapters": [name]} for name, k in TENANT_KEYS.items()]
    (config / "keys.json").write_text(json.dumps({"keys": keys}))
    scratch = tmp_path_factory.mktemp("adapter-root")
    snapshots = tmp_path_factory.mktemp("snapshots")
    argv = embedded_server_argv(
        embedded_model,
        extra=[
            "--api-keys",
            str(config / "keys.json"),
            "--adapter-root",
            str(embedded_model.root),
            "--adapter-root",
            str(scratch),
            "--adapter-snapshot-dir",
            str(snapshots),
            "--max-adapter-bytes",
            str(MAX_ADAPTER_BYTES),
            "--adapter-reader",  # opt-in; the route-walk server runs without
            "--allow-handover",  # opt-in; the route-walk server refuses hand-overs
        ],
    )
    handle, url = start_server_actor(argv, ActorOptions(env=CPU_ENV))
    try:
        yield EngineServer(url, embedded_model, tokenizer, ADMIN_KEY, scratch, snapshots)
    finally:
        local_ray.get(handle.shutdown.remote(), timeout=120)


@contextmanager
def replica_group(
    embedded_model: Any, replica_argv: dict[int, list[str]] | None = None
) -> Iterator[Any]:
    """Two healing CPU replicas of the embedded model (for a module's group
    fixture); ``replica_argv`` adds flags to a replica, by index."""
    from skyrl_lora.server.cluster.group import GroupConfig, ServerGroup
    from skyrl_lora.server.presets import CPU_ENV, embedded_server_argv

    config = GroupConfig(
        num_replicas=2,
        argv=embedded_server_argv(embedded_model),
        env=CPU_ENV,
        health_interval_s=0.5,
        replica_argv=replica_argv or {},
    )
    with ServerGroup(config) as group:
        yield group


class Serves:
    """``skyrl-lora serve`` processes shared by argv: ``use`` gives the running
    server for those flags (started on first use); ``take`` hands it to a test
    that stops it, so a later ``use`` or ``take`` starts another."""

    def __init__(self, folder: Path) -> None:
        self._folder = folder
        self._running: dict[tuple[str, ...], Any] = {}  # argv -> ServeProcess

    def use(self, argv: tuple[str, ...]) -> Any:
        from skyrl_lora.server.cluster.process import start_serve

        if argv not in self._running:
            log = self._folder / f"serve-{len(list(self._folder.iterdir()))}.log"
            self._running[argv] = start_serve(argv, log)
        return self._running[argv]

    def take(self, argv: tuple[str, ...]) -> Any:
        server = self.use(argv)
        del self._running[argv]
        return server

    def close(self) -> None:
        for server in self._running.values():
            if server.proc.poll() is None:
                server.stop()
            server.kill_all()


@pytest.fixture(scope="session")
def serves(embedded_model: Any, tmp_path_factory: Any) -> Iterator[Serves]:
    shared = Serves(tmp_path_factory.mktemp("serves"))
    try:
        yield shared
    finally:
        shared.close()


@pytest.fixture
async def http(engine_server: EngineServer) -> AsyncIterator[aiohttp.ClientSession]:
    """A session that authenticates as the admin (where the server has keys)."""
    headers = (
        {"Authorization": f"Bearer {engine_server.admin_key}"} if engine_server.admin_key else {}
    )
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout, headers=headers) as session:
        yield session


#: How a staging reads an adapter's file in one call (``skyrl_adapter_reads_total``'s labels).
FILE_READS = ("one_buffer", "file_template")


async def until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Return once ``condition()`` holds; fail the test after ``timeout_s``."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "not within the timeout"
        await asyncio.sleep(0.01)


async def counts_by_label(http: aiohttp.ClientSession, url: str, counter: str) -> dict[str, float]:
    """A counter (``skyrl_adapter_stagings_total``...) from a server's
    ``/metrics``, by its labels' values (joined by ``/`` where it has several)."""
    async with http.get(url + "/metrics") as resp:
        text = await resp.text()
    counts = {}
    for line in text.splitlines():
        if line.startswith(counter + "{"):
            labels, value = line.split("} ")
            counts["/".join(labels.split('"')[1::2])] = float(value)
    return counts


async def staged_file_reads(url: str, reads: tuple[str, ...] = FILE_READS) -> float:
    """Files one replica staged by one read (of the kinds ``reads``): one
    per version loaded from a file."""
    async with aiohttp.ClientSession() as http:
        counts = await counts_by_label(http, url, "skyrl_adapter_reads_total")
    return sum(counts.get(read, 0.0) for read in reads)
