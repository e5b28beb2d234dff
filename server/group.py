"""A group of server replicas on Ray, one placement group per replica.

Each replica's resources (CPUs, and on GPU clusters ``gpus_per_replica``
times the tensor-parallel size) are reserved as one placement group, so a
replica is placed whole or not at all, on a local Ray instance or an existing
cluster (``ray.init(address=...)`` before :meth:`ServerGroup.start`).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from skyrl_lora.server.actor import ServerActor


@dataclass(frozen=True)
class GroupConfig:
    """Shape of a replica group.

    ``argv`` are the ``vllm serve`` flags of every replica (``--port`` is set
    per replica by Ray's free-port choice: leave it out or use 0).
    """

    num_replicas: int
    argv: Sequence[str]
    cpus_per_replica: float = 1
    gpus_per_replica: float = 0
    tensor_parallel_size: int = 1
    env: Mapping[str, str] = field(default_factory=dict)
    start_timeout_s: float = 600


@dataclass
class ReplicaHandle:
    index: int
    actor: Any
    placement_group: Any
    url: str


class ServerGroup:
    """Starts, reports and stops N server actors."""

    def __init__(self, config: GroupConfig) -> None:
        if config.num_replicas < 1:
            raise ValueError("a server group needs at least one replica")
        self.config = config
        self.replicas: list[ReplicaHandle] = []

    @property
    def urls(self) -> list[str]:
        return [r.url for r in self.replicas]

    def _argv(self) -> list[str]:
        argv = list(self.config.argv)
        if self.config.tensor_parallel_size > 1:
            argv += ["--tensor-parallel-size", str(self.config.tensor_parallel_size)]
        return argv

    def start(self) -> list[str]:
        """Start every replica concurrently; return their URLs once all are healthy.

        If any replica fails to start, the ones that did are stopped again and
        the error is raised: a half-started group is of no use to the caller.
        """
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        cfg = self.config
        gpus = cfg.gpus_per_replica * cfg.tensor_parallel_size
        bundle = {"CPU": cfg.cpus_per_replica, **({"GPU": gpus} if gpus else {})}
        remote_cls: Any = ray.remote(ServerActor)
        pending: list[tuple[int, Any, Any]] = []
        for index in range(cfg.num_replicas):
            pg = placement_group([bundle], strategy="STRICT_PACK")
            actor = remote_cls.options(
                num_cpus=cfg.cpus_per_replica,
                num_gpus=gpus,
                max_concurrency=16,
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg),
                runtime_env={"env_vars": dict(cfg.env)} if cfg.env else None,
            ).remote(self._argv(), dict(cfg.env))
            pending.append((index, actor, pg))
        try:
            urls = ray.get([a.start.remote() for _, a, _ in pending], timeout=cfg.start_timeout_s)
        except Exception:
            for _, actor, pg in pending:
                _kill(actor, pg)
            raise
        self.replicas = [ReplicaHandle(i, a, pg, u) for (i, a, pg), u in zip(pending, urls)]
        return self.urls

    def kill(self, index: int) -> None:
        """Kill one replica abruptly (for failure drills); the others keep serving."""
        replica = self.replicas[index]
        _kill(replica.actor, replica.placement_group)

    def shutdown(self) -> None:
        """Stop every replica cleanly (engine and HTTP server), then free its resources."""
        import ray

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
