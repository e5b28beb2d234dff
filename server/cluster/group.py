"""A group of server replicas on Ray, one placement group per replica, that heals itself.

Each replica's resources (CPUs, and on GPU clusters ``gpus_per_replica``
times the tensor-parallel size) are reserved as one placement group, so a
replica is placed whole or not at all, on a local Ray instance or an existing
cluster (``ray.init(address=...)`` before :meth:`ServerGroup.start`).

A supervisor thread asks every replica for its adapter state once per
``health_interval_s`` (:meth:`ServerActor.state`, which fails when the actor
died or its engine did). The answers keep the group's record of what the
group serves: per adapter, the newest version any replica serves, its source
and whether it is paused (:func:`~skyrl_lora.server.cluster.replay.newest`). A
replica that fails the check is replaced by a new actor in its placement
group, on the same port, which replays the record before its HTTP server
accepts anything; clients find it again through their health re-check.

The supervisor also catches up any replica that stays behind the others for
two rounds in a row: a reload or a resume it missed (a fan-out that reached
it while it was starting). Versions are counted per replica, so one missed
reload would otherwise leave a replica's version numbers one behind for
good. A missed pause is left alone (see
:func:`~skyrl_lora.server.cluster.replay.restore`).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import urlparse

from skyrl_lora.errors import ReplicaStartError
from skyrl_lora.types import AdapterInfo, SwapPolicy

from ..telemetry.observability import log_event
from .actor import ServerActor, error_line
from .replay import (
    PUSHED_PREFIX,
    AdapterState,
    PushedSource,
    merge,
    newest,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GroupConfig:
    """Shape of a replica group.

    ``argv`` are the ``vllm serve`` flags of every replica (``--port`` is set
    per replica by Ray's free-port choice: leave it out or use 0; a rebuilt
    replica keeps the port its predecessor had). ``heal`` turns the
    supervisor on. A replica whose actor or engine is dead is rebuilt at
    once; one whose health check only times out, after
    ``timeouts_before_rebuild`` checks in a row (a busy replica is not killed).
    ``replica_argv`` adds flags to some replicas, by index (a canary with
    other limits). ``commit_timeout_s``: how long a replica keeps its previous
    version for a push that the group neither commits nor rolls back (the
    group's process died mid-push): then the push commits there on its own.
    """

    num_replicas: int
    argv: Sequence[str]
    cpus_per_replica: float = 1
    gpus_per_replica: float = 0
    tensor_parallel_size: int = 1
    env: Mapping[str, str] = field(default_factory=dict)
    start_timeout_s: float = 600
    heal: bool = True
    health_interval_s: float = 1.0
    health_timeout_s: float = 10.0
    timeouts_before_rebuild: int = 3
    replica_argv: Mapping[int, Sequence[str]] = field(default_factory=dict)
    commit_timeout_s: float = 600.0
    rebuild_attempts: int = 3


@dataclass
class ReplicaHandle:
    index: int
    actor: Any
    placement_group: Any
    url: str
    restarted_at: float | None = None  # monotonic time it last came back


@dataclass(frozen=True)
class Restart:
    """One rebuilt replica, for operators and tests."""

    index: int
    url: str
    detected_at: float  # time.monotonic() when the check failed
    seconds: float  # from the failed check to serving again with its adapters
    adapters: int


class ServerGroup:
    """Starts, supervises, reports and stops N server actors."""

    def __init__(self, config: GroupConfig) -> None:
        if config.num_replicas < 1:
            raise ValueError("a server group needs at least one replica")
        self.config = config
        self.replicas: list[ReplicaHandle] = []
        self.restarts: list[Restart] = []
        self._record: dict[str, AdapterState] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._supervisor: threading.Thread | None = None
        self._behind: dict[int, set[str]] = {}  # names behind in the last round
        self._slow: dict[int, int] = {}  # consecutive health checks that timed out
        self._rebuild_failures: dict[int, int] = {}  # failed rebuilds in a row
        #: Replicas the group gave up rebuilding, by index: why their last start failed.
        self.failed: dict[int, str] = {}

    @property
    def urls(self) -> list[str]:
        return [r.url for r in self.replicas]

    def record(self) -> dict[str, AdapterState]:
        """The group's record: every adapter at its newest version (a copy)."""
        with self._lock:
            return dict(self._record)

    def _argv(self, index: int, port: int | None = None) -> list[str]:
        argv = [*self.config.argv, *self.config.replica_argv.get(index, ())]
        if self.config.tensor_parallel_size > 1:
            argv += ["--tensor-parallel-size", str(self.config.tensor_parallel_size)]
        if port is not None:
            argv = [*_without_flag(argv, "--port"), "--port", str(port)]
        return argv

    def _new_actor(self, index: int, pg: Any, port: int | None = None) -> Any:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        cfg = self.config
        remote_cls: Any = ray.remote(ServerActor)
        return remote_cls.options(
            num_cpus=cfg.cpus_per_replica,
            num_gpus=cfg.gpus_per_replica * cfg.tensor_parallel_size,
            max_concurrency=16,
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg),
            runtime_env={"env_vars": dict(cfg.env)} if cfg.env else None,
        ).remote(self._argv(index, port), dict(cfg.env))

    def start(self) -> list[str]:
        """Start every replica concurrently; return their URLs once all are healthy.

        If any replica fails to start, every replica is stopped at once (a
        half-started group is of no use to the caller) and
        :class:`~skyrl_lora.errors.ReplicaStartError` names the ones that
        failed, with why.
        """
        from ray.util.placement_group import placement_group

        cfg = self.config
        gpus = cfg.gpus_per_replica * cfg.tensor_parallel_size
        bundle = {"CPU": cfg.cpus_per_replica, **({"GPU": gpus} if gpus else {})}
        pending: list[tuple[int, Any, Any]] = []
        for index in range(cfg.num_replicas):
            pg = placement_group([bundle], strategy="STRICT_PACK")
            pending.append((index, self._new_actor(index, pg), pg))
        urls, failures = _started(
            {index: actor.start.remote() for index, actor, _ in pending}, cfg.start_timeout_s
        )
        if failures:
            for _, actor, pg in pending:
                _kill(actor, pg)
            raise ReplicaStartError(
                f"{len(failures)} of {cfg.num_replicas} replicas did not start: "
                + "; ".join(f"replica {i}: {why}" for i, why in sorted(failures.items())),
                failures,
            )
        self.replicas = [ReplicaHandle(i, a, pg, urls[i]) for i, a, pg in pending]
        if cfg.heal:
            self._stop.clear()
            self._supervisor = threading.Thread(
                target=self._supervise, name="skyrl-group-supervisor", daemon=True
            )
            self._supervisor.start()
        return self.urls

    # -- supervision -------------------------------------------------------
    def _supervise(self) -> None:
        while not self._stop.wait(self.config.health_interval_s):
            try:
                self.check()
            except Exception:  # keep supervising whatever one round hit
                logger.exception("replica supervision round failed")

    def _poll(self) -> tuple[dict[int, list[AdapterState]], dict[int, Exception]]:
        """Every replica's state, or why it failed the check."""
        import ray

        refs = {r.index: r.actor.state.remote() for r in self.replicas}
        states: dict[int, list[AdapterState]] = {}
        failed: dict[int, Exception] = {}
        deadline = time.monotonic() + self.config.health_timeout_s
        for index, ref in refs.items():
            try:
                states[index] = ray.get(ref, timeout=max(0.1, deadline - time.monotonic()))
            except Exception as exc:
                failed[index] = exc
        return states, failed

    def check(self) -> None:
        """One supervision round: refresh the record, rebuild failed replicas,
        and reconcile recently rebuilt ones with the rest."""
        states, failed = self._poll()
        if states:
            with self._lock:
                self._record = _keep_pushed_files(
                    self._record, merge(self._record, newest(states.values()))
                )
        for index in states:
            self._slow.pop(index, None)
        for index, exc in failed.items():
            if self._stop.is_set():
                return
            if index in self.failed:  # given up on: reported, not retried
                continue
            if _is_timeout(exc):  # busy, or hung: only a hang that lasts is rebuilt
                self._slow[index] = self._slow.get(index, 0) + 1
                if self._slow[index] < self.config.timeouts_before_rebuild:
                    continue
            self._slow.pop(index, None)
            self._rebuild(index, exc)
            return  # the states of this round are old by now
        self._catch_up(states)

    def _rebuild(self, index: int, reason: Exception) -> None:
        import ray

        detected = time.monotonic()
        replica = self.replicas[index]
        log_event("replica_down", index=index, url=replica.url, error=repr(reason)[:300])
        try:
            ray.kill(replica.actor, no_restart=True)
        except Exception:
            pass
        live, _ = self._poll_others(index)
        with self._lock:
            if live:
                self._record = _keep_pushed_files(
                    self._record, merge(self._record, newest(live.values()))
                )
            target = list(self._record.values())
        actor = self._new_actor(index, replica.placement_group, urlparse(replica.url).port)
        peers = [r.actor for r in self.replicas if r.index != index]
        try:
            url = ray.get(actor.start.remote(target, peers), timeout=self.config.start_timeout_s)
        except Exception as exc:  # the next round tries again, up to rebuild_attempts
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                pass
            self._rebuild_failed(index, replica.url, exc)
            return
        self._rebuild_failures.pop(index, None)
        seconds = time.monotonic() - detected
        self.replicas[index] = ReplicaHandle(
            index, actor, replica.placement_group, url, restarted_at=time.monotonic()
        )
        self.restarts.append(Restart(index, url, detected, seconds, len(target)))
        log_event(
            "replica_rebuilt", index=index, url=url, seconds=round(seconds, 2), adapters=len(target)
        )

    def _rebuild_failed(self, index: int, url: str, exc: Exception) -> None:
        attempts = self._rebuild_failures.get(index, 0) + 1
        self._rebuild_failures[index] = attempts
        why = error_line(exc)
        if attempts < self.config.rebuild_attempts:
            logger.warning("rebuilding replica %d failed (%d): %s", index, attempts, why)
            return
        self.failed[index] = why
        logger.error(
            "replica %d (%s) did not start in %d rebuilds; no longer rebuilt: %s",
            index, url, attempts, why,
        )  # fmt: skip
        log_event("replica_failed", index=index, url=url, attempts=attempts, error=why)

    def _poll_others(
        self, index: int
    ) -> tuple[dict[int, list[AdapterState]], dict[int, Exception]]:
        states, failed = self._poll()
        states.pop(index, None)
        failed.pop(index, None)
        return states, failed

    def _catch_up(self, states: Mapping[int, list[AdapterState]]) -> None:
        """Reconcile each replica that is behind the others on the same adapter
        in two rounds in a row (a fan-out on its way to every replica shows
        as behind for one round only), to what the others serve now."""
        import ray

        for replica in self.replicas:
            own = states.get(replica.index)
            others = [s for i, s in states.items() if i != replica.index]
            if own is None or not others:
                continue
            target = newest(others)
            behind = {t.lora_name for t in target.values() if not _serves(own, t)}
            again = behind & self._behind.get(replica.index, set())
            self._behind[replica.index] = behind - again
            if not again:
                continue
            report = ray.get(
                replica.actor.reconcile.remote([target[n] for n in sorted(again)]),
                timeout=self.config.health_timeout_s,
            )
            log_event(
                "replica_caught_up",
                index=replica.index,
                loaded=list(report.loaded),
                resumed=list(report.resumed),
            )

    # -- weights -------------------------------------------------------------
    def push_lora_adapter(
        self,
        lora_name: str,
        files: Mapping[str, bytes] | Any,
        swap_policy: SwapPolicy = "abort_resume",
        version: int | None = None,
    ) -> list[AdapterInfo]:
        """Load adapter files on every replica through Ray's object store.

        ``files`` maps ``adapter_config.json`` and ``adapter_model.safetensors``
        to their bytes, or is an ``ObjectRef`` of such a mapping (a trainer
        actor's ``ray.put``: the bytes then never pass through this process).
        It is put once; each replica's node fetches it once. No shared disk,
        no HTTP. The group keeps the ref as the version's source, so a
        replica rebuilt later replays these exact bytes.

        Every replica gets the same explicit ``version`` (by default one past
        the newest any replica or the record holds), so a replica that missed
        a reload cannot serve a version number that means other weights.

        Atomic: each replica loads the version keeping the one it replaces
        (``keep_previous_s``), and only once every replica has it does the
        group commit it everywhere. If any replica fails, the others roll back
        to the version they had and the error of the first replica that
        failed is raised (with a note naming it): no replica serves a version
        the others never got, and the same ``version`` may be pushed again.
        """
        import ray

        ref = files if isinstance(files, ray.ObjectRef) else ray.put(dict(files))
        if version is None:
            version = self._next_version(lora_name)
        replicas = list(self.replicas)
        refs = [
            r.actor.push_adapter.remote(
                lora_name, ref, swap_policy, version, self.config.commit_timeout_s
            )
            for r in replicas
        ]
        answers = _gather(refs, self.config.start_timeout_s)
        failed = [(r, a) for r, a in zip(replicas, answers) if isinstance(a, Exception)]
        if failed:
            self._settle(replicas, "rollback", lora_name, version)
            replica, error = failed[0]
            log_event(
                "group_swap_rolled_back",
                lora_name=lora_name,
                version=version,
                failed=[r.index for r, _ in failed],
                error=repr(error)[:300],
            )
            error.add_note(
                f"replica {replica.index} ({replica.url}) failed to load version {version} of "
                f"{lora_name!r}; every replica was rolled back to the version it had"
            )
            raise error
        infos = [a for a in answers if isinstance(a, AdapterInfo)]
        self._settle(replicas, "commit", lora_name, version)
        info = infos[0]
        sha256 = info.lora_path.removeprefix(PUSHED_PREFIX)
        with self._lock:
            self._record[lora_name] = AdapterState(
                lora_name, info.version, PushedSource(sha256, files=ref), info.paused
            )
        return infos

    def _settle(
        self, replicas: Sequence[ReplicaHandle], step: str, lora_name: str, version: int
    ) -> None:
        """Commit or roll back ``version`` on every replica (a no-op where it did
        not land). A replica that cannot be reached is logged: if it is dead
        the supervisor rebuilds it from the record, which never holds a
        rolled back version; a live one commits on its own after
        ``commit_timeout_s``."""
        refs = [getattr(r.actor, step).remote(lora_name, version) for r in replicas]
        for replica, answer in zip(replicas, _gather(refs, self.config.health_timeout_s)):
            if isinstance(answer, Exception):
                logger.warning(
                    "%s of %s version %d on replica %d failed: %r",
                    step,
                    lora_name,
                    version,
                    replica.index,
                    answer,
                )

    def _next_version(self, lora_name: str) -> int:
        """One past the newest version of ``lora_name`` any live replica or the record holds."""
        states, _ = self._poll()
        held = [s.version for found in states.values() for s in found if s.lora_name == lora_name]
        with self._lock:
            kept = self._record.get(lora_name)
        if kept is not None:
            held.append(kept.version)
        return max(held, default=0) + 1

    # -- drills and shutdown ------------------------------------------------
    def kill(self, index: int) -> None:
        """Kill one replica's actor abruptly (failure drill); the others keep
        serving, and the supervisor (if on) rebuilds it in its placement group."""
        import ray

        ray.kill(self.replicas[index].actor, no_restart=True)

    def kill_engine(self, index: int) -> list[int]:
        """Kill one replica's engine processes, leaving its actor and HTTP server up
        (failure drill for an engine crash or OOM kill); returns the killed pids."""
        import ray

        return list(ray.get(self.replicas[index].actor.kill_engine.remote(), timeout=60))

    def wait_restarts(self, count: int, timeout: float) -> list[Restart]:
        """Block until ``count`` replicas have been rebuilt in all (for drills)."""
        deadline = time.monotonic() + timeout
        while len(self.restarts) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{len(self.restarts)} of {count} replica rebuilds in {timeout} s"
                )
            time.sleep(0.1)
        return list(self.restarts)

    def shutdown(self) -> None:
        """Stop supervising, then stop every replica cleanly (engine and HTTP
        server) and free its resources."""
        import ray

        self._stop.set()
        if self._supervisor is not None:
            self._supervisor.join(timeout=self.config.start_timeout_s)
            self._supervisor = None

        def stop(replica: ReplicaHandle) -> None:
            try:
                ray.get(replica.actor.shutdown.remote(), timeout=120)
            except Exception:  # already dead (killed in a drill) or stuck: kill below
                pass
            _kill(replica.actor, replica.placement_group)

        with concurrent.futures.ThreadPoolExecutor(max(1, len(self.replicas))) as pool:
            list(pool.map(stop, self.replicas))
        self.replicas = []

    def __enter__(self) -> ServerGroup:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _keep_pushed_files(
    old: Mapping[str, AdapterState], new: dict[str, AdapterState]
) -> dict[str, AdapterState]:
    """Give each pushed version in the record a Ray ``ObjectRef`` of its files,
    fetched once from a replica that serves it, so the group can rebuild a
    replica even after every replica that held those bytes is gone."""
    for name, state in new.items():
        source = state.source
        if not isinstance(source, PushedSource) or source.files is not None:
            continue
        kept = old.get(name)
        if (
            kept is not None
            and kept.version == state.version
            and isinstance(kept.source, PushedSource)
            and kept.source.files is not None
        ):
            files = kept.source.files
        else:
            files = source.files_ref(name, state.version)
        new[name] = replace(state, source=PushedSource(source.sha256, files=files))
    return new


def _gather(refs: Sequence[Any], timeout_s: float) -> list[Any]:
    """Every ref's answer, or the exception it raised, within one deadline."""
    import ray

    deadline = time.monotonic() + timeout_s
    answers: list[Any] = []
    for ref in refs:
        try:
            answers.append(ray.get(ref, timeout=max(0.1, deadline - time.monotonic())))
        except Exception as exc:
            answers.append(exc)
    return answers


def _started(refs: Mapping[int, Any], timeout_s: float) -> tuple[dict[int, str], dict[int, str]]:
    """Each replica's URL as its start answers, until the first that fails
    (a group that cannot start all of them stops them all, so the others'
    starts are not awaited); (urls, why each failed one did) by index."""
    import ray

    by_ref = {ref: index for index, ref in refs.items()}
    waiting = list(by_ref)
    urls: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    while waiting:
        ready, waiting = ray.wait(
            waiting, num_returns=1, timeout=max(0.0, deadline - time.monotonic())
        )
        if not ready:
            return urls, {by_ref[r]: f"not started in {timeout_s:g} s" for r in waiting}
        for ref in ready:
            try:
                urls[by_ref[ref]] = ray.get(ref)
            except Exception as exc:
                return urls, {by_ref[ref]: error_line(exc)}
    return urls, {}


def _is_timeout(exc: Exception) -> bool:
    return isinstance(exc, TimeoutError)  # ray's GetTimeoutError is one


def _serves(states: Sequence[AdapterState], target: AdapterState) -> bool:
    for state in states:
        if state.lora_name == target.lora_name:
            # a missed pause is not caught up (see replay.restore); a missed resume is
            return state.version > target.version or (
                state.version == target.version and (target.paused or not state.paused)
            )
    return False


def _without_flag(argv: Sequence[str], flag: str) -> list[str]:
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == flag:
            skip = True
        elif not arg.startswith(flag + "="):
            out.append(arg)
    return out


def _kill(actor: Any, pg: Any) -> None:
    import ray
    from ray.util.placement_group import remove_placement_group

    try:
        ray.kill(actor)
    except Exception:
        pass
    try:
        remove_placement_group(pg)
    except Exception:
        pass
