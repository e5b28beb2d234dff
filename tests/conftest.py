"""Shared fixtures: the embedded model and real CPU vLLM servers on Ray.

Servers run in Ray actors, exactly as ``skyrl-lora serve`` runs them. They
start only where the selected tests need them, so the pure unit tests never
pay for them. A server's start costs 40-95 s on the 2-core CPU machine,
most of the suite's time, so tests share servers wherever their flags
allow: the session's ``engine_server`` and ``dev_server``, and ``serves``
for the ``skyrl-lora serve`` processes of the step-watch and shutdown tests
(the shutdown tests stop the servers the others used, last). Where the
selected tests need several, they start two at a time
(``tests/server_starts.py`` says why that costs about one start's time):
the session's two as the session begins, beside its first unit tests, each
stopped after the last test that uses it (the route walk, ``dev_server``'s
only user, runs before the other engine tests); the ``serve`` processes as
soon as the first is needed.

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

from tests.server_starts import ActorRecipe, ActorStarts, Serves, serve_plan

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
#: last user (they start ahead of their users, two at a time: ``serves``).
#: Both Ray-mode cases come first: the two flag-less serves start together,
#: and the step watch's two start while those are used and stopped (a
#: shutdown case mostly waits on a stopping server, which leaves a core idle).
LAST = (
    "tests/test_push_stream_default_engine.py::",  # the flag-less serve...
    "tests/test_shutdown_engine.py::test_serve_leaves_no_process_behind[SIGTERM-ray]",  # stops it
    "tests/test_shutdown_engine.py::test_serve_leaves_no_process_behind[SIGKILL-ray]",  # another
    "tests/test_step_watch_engine.py::",  # the two --no-ray serves...
    "tests/test_shutdown_engine.py::",  # ...stopped by the --no-ray cases
)


#: The session actors' fixtures (``actor_starts``).
SESSION_ACTORS = ("engine_server", "dev_server")
#: Tests moved to just before the first test that needs a session actor: the
#: route walk's server serves no other test, so it is stopped right after
#: them (``ActorStarts.release``) instead of idling through the session.
FIRST = ("tests/test_route_walk_engine.py::",)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        return next((i + 1 for i, p in enumerate(LAST) if item.nodeid.startswith(p)), 0)

    items.sort(key=rank)  # stable: every other test keeps its place
    first = [item for item in items if item.nodeid.startswith(FIRST)]
    rest = [item for item in items if not item.nodeid.startswith(FIRST)]
    at = next((i for i, item in enumerate(rest) if _actors_used(item)), len(rest))
    items[:] = rest[:at] + first + rest[at:]


def _actors_used(item: pytest.Item) -> list[str]:
    return [name for name in SESSION_ACTORS if name in getattr(item, "fixturenames", ())]


#: What the selected tests need, read once they are known (after ``-m`` and ``-k``).
SERVE_PLAN = pytest.StashKey[list[tuple[str, ...]]]()
FIXTURES_USED = pytest.StashKey[set[str]]()
#: The session actors each test is the last user of, by its node id.
LAST_USERS = pytest.StashKey[dict[str, list[str]]]()
#: The session's ``actor_starts``, once made.
ACTORS = pytest.StashKey[ActorStarts]()


def pytest_collection_finish(session: pytest.Session) -> None:
    session.config.stash[SERVE_PLAN] = serve_plan(session.items)
    session.config.stash[FIXTURES_USED] = {
        name for item in session.items for name in getattr(item, "fixturenames", ())
    }
    items = session.items
    last = {name: i for i, item in enumerate(items) for name in _actors_used(item)}
    users: dict[str, list[str]] = {}
    for name, i in last.items():
        # the module's last test: its module-scoped fixtures may use the actor as they end
        while i + 1 < len(items) and items[i + 1].path == items[i].path:
            i += 1
        users.setdefault(items[i].nodeid, []).append(name)
    session.config.stash[LAST_USERS] = users


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    """After the last test that uses a session actor (its fixtures torn down
    too), stop the actor."""
    yield
    starts = item.config.stash.get(ACTORS, None)
    for name in item.config.stash.get(LAST_USERS, {}).get(item.nodeid, []):
        if starts is not None:
            starts.release(name)


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
    session's two servers and a two-replica group fit side by side)."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=4, include_dashboard=False, ignore_reinit_error=True, log_to_driver=False)
    yield ray
    ray.shutdown()


#: The route-walk server's tenant key: ``meow`` only, and the base model.
DEV_TENANT = "tenant-meow-key"
#: How the vLLM and TRL docs tell RL users to run the server: vLLM adds
#: ``/collective_rpc``, its global ``/pause``, ``/sleep`` and its own adapter routes.
DEV_ENV = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}


class DevServer:
    """The route-walk server (``tests/test_route_walk_engine.py``)."""

    def __init__(self, handle: Any, url: str, model: Any, store: Path) -> None:
        self.handle = handle
        self.url = url
        self.model = model
        self.store = store

    async def call(
        self, method: str, path: str, key: str | None, body: Any = None
    ) -> tuple[int, Any]:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        async with aiohttp.ClientSession(headers=headers) as session:
            async with session.request(method, self.url + path, json=body) as resp:
                text = await resp.text()
        try:
            return resp.status, json.loads(text) if text else None
        except ValueError:
            return resp.status, text


def _keys_file(folder: Path, keys: list[dict[str, Any]]) -> str:
    (folder / "keys.json").write_text(json.dumps({"keys": keys}))
    return str(folder / "keys.json")


@pytest.fixture(scope="session")
def actor_starts(
    embedded_model: Any, local_ray: Any, tokenizer: Any, tmp_path_factory: Any, request: Any
) -> Iterator[ActorStarts]:
    """The session's server actors: each starts when a test first needs it,
    beside the other if the selected tests need both (their starts overlap)."""
    from skyrl_lora.server.presets import CPU_ENV, embedded_server_argv

    def session_server() -> ActorRecipe:
        """As in production: API keys on, adapter paths confined to the
        embedded model's folder and one scratch folder the tests write to."""
        keys = [{"key": ADMIN_KEY, "admin": True}]
        keys += [{"key": k, "adapters": [name]} for name, k in TENANT_KEYS.items()]
        scratch = tmp_path_factory.mktemp("adapter-root")
        snapshots = tmp_path_factory.mktemp("snapshots")
        argv = embedded_server_argv(
            embedded_model,
            extra=[
                *("--api-keys", _keys_file(tmp_path_factory.mktemp("server-config"), keys)),
                *("--adapter-root", str(embedded_model.root)),
                *("--adapter-root", str(scratch)),
                *("--adapter-snapshot-dir", str(snapshots)),
                *("--max-adapter-bytes", str(MAX_ADAPTER_BYTES)),
                "--adapter-reader",  # opt-in; the route-walk server runs without
                "--allow-handover",  # opt-in; the route-walk server refuses hand-overs
            ],
        )

        def made(handle: Any, url: str) -> EngineServer:
            return EngineServer(url, embedded_model, tokenizer, ADMIN_KEY, scratch, snapshots)

        # No peer shares pushes with it: a shared push naming a share nobody
        # lends (the fuzz's) gets its 422 after 1 s, not 30.
        return argv, {**CPU_ENV, "SKYRL_PUSH_SHARE_WAIT_S": "1"}, made

    def route_walk_server() -> ActorRecipe:
        """The route walk's set-up (``VLLM_SERVER_DEV_MODE``): a tenant key
        scoped to ``meow`` that may also use the base model."""
        keys = [
            {"key": ADMIN_KEY, "admin": True},
            {"key": DEV_TENANT, "adapters": ["meow"], "base_model": True},
        ]
        store = tmp_path_factory.mktemp("dev-store")
        argv = embedded_server_argv(
            embedded_model,
            # Slot prefill, the reader process and the staging naps off here: the
            # session's server runs with all three on, so CI covers both ways.
            extra=[
                *("--api-keys", _keys_file(tmp_path_factory.mktemp("dev-config"), keys)),
                *("--adapter-root", str(store)),
                "--no-slot-prefill",
                "--no-staging-yield",
                "--no-gc-freeze",
                "--no-push-stream",  # the session's server has one: pushes go in the body here
            ],
        )

        def made(handle: Any, url: str) -> DevServer:
            return DevServer(handle, url, embedded_model, store)

        return argv, {**CPU_ENV, **DEV_ENV}, made

    recipes = {"engine_server": session_server, "dev_server": route_walk_server}
    starts = ActorStarts(local_ray, recipes, request.config.stash.get(FIXTURES_USED, set()))
    request.config.stash[ACTORS] = starts
    try:
        yield starts
    finally:
        del request.config.stash[ACTORS]  # the session's end: nothing left to release
        starts.shutdown()


@pytest.fixture(scope="session", autouse=True)
def session_actors_launched(request: Any) -> None:
    """The session actors the selected tests need start as the session
    begins, beside its first tests (unit tests, that leave a core idle)."""
    if set(SESSION_ACTORS) & request.config.stash.get(FIXTURES_USED, set()):
        request.getfixturevalue("actor_starts").launch()


@pytest.fixture(scope="session")
def engine_server(actor_starts: ActorStarts) -> EngineServer:
    """The session's server (most engine tests share it)."""
    server: EngineServer = actor_starts.get("engine_server")
    return server


@pytest.fixture(scope="session")
def dev_server(actor_starts: ActorStarts) -> DevServer:
    """The route walk's server: vLLM's dev mode on, and the opt-in features
    the session's server turns on left off."""
    server: DevServer = actor_starts.get("dev_server")
    return server


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


@pytest.fixture(scope="session")
def serves(embedded_model: Any, tmp_path_factory: Any, request: Any) -> Iterator[Serves]:
    """Every ``serve`` the selected tests use (their ``serve`` markers), started
    two at a time from the first test that needs one."""
    shared = Serves(tmp_path_factory.mktemp("serves"))
    shared.start(request.config.stash.get(SERVE_PLAN, []))
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
