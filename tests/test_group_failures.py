"""A server group whose replica cannot start names it, rather than hiding it.

A real CPU group of two replicas of the embedded model, replica 1 with an
engine setting the engine refuses at start (a context longer than the
model's: what a GPU out of memory is to a GPU replica, an engine that
raises while it starts). The group stops the replica that was starting
beside it and raises :class:`~skyrl_lora.errors.ReplicaStartError` naming
replica 1 and the engine's reason, without waiting for replica 0's start.
(A replica that cannot be *rebuilt* is the last drill of
``test_group_engine.py``: it reuses that module's running group.)
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from skyrl_lora.errors import ReplicaStartError

pytestmark = pytest.mark.engine

#: A context far beyond the embedded model's: vLLM refuses it as the engine starts.
REFUSED = ["--max-model-len", "10000000"]


def test_a_replica_that_cannot_start_is_named_with_its_reason(
    embedded_model: Any, local_ray: Any
) -> None:
    from skyrl_lora.server.cluster.group import GroupConfig, ServerGroup
    from skyrl_lora.server.presets import CPU_ENV, embedded_server_argv

    config = GroupConfig(
        num_replicas=2,
        argv=embedded_server_argv(embedded_model),
        env=CPU_ENV,
        replica_argv={1: REFUSED},
        start_timeout_s=300,
    )
    group = ServerGroup(config)
    started = time.monotonic()
    with pytest.raises(ReplicaStartError) as raised:
        group.start()
    assert list(raised.value.failures) == [1]
    assert "max_model_len" in raised.value.failures[1].lower().replace("-", "_")
    assert "replica 1" in str(raised.value)
    assert group.replicas == []
    assert time.monotonic() - started < 120, "waited for the replica that could start"
    # Nothing of the group is left holding the cluster: both replicas' placement
    # groups are removed (Ray frees them a moment later).
    from ray.util.placement_group import placement_group_table

    deadline = time.monotonic() + 30
    while True:
        alive = [pg for pg in placement_group_table().values() if pg.get("state") != "REMOVED"]
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not alive, alive
