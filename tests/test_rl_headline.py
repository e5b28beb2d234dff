"""The GPU RL run's headline JSON names the per-adapter pause it ran and
compares each tenant's on-policy share over every position of a mode."""

from __future__ import annotations

from typing import Any

from examples.multi_tenant_rl import on_policy_every_tenant, per_adapter_mode


def shares(**by_tenant: float) -> dict[str, Any]:
    return {"tenants": {n: {"on_policy_share": s} for n, s in by_tenant.items()}}


def test_the_per_adapter_pause_is_the_plain_one_else_the_one_call_one() -> None:
    assert per_adapter_mode({"per_adapter": {}, "per_adapter_staged": {}}) == "per_adapter"
    assert per_adapter_mode({"per_adapter_staged#2": {}, "per_adapter_staged": {}}) == (
        "per_adapter_staged"
    )
    assert per_adapter_mode({"per_adapter_on_policy": {}, "global": {}}) == (
        "per_adapter_on_policy"
    )
    assert per_adapter_mode({"global": {}, "finish_old": {}}) is None


def test_every_tenant_is_compared_on_its_mean_over_positions() -> None:
    modes = {
        "per_adapter_staged": shares(t0=0.40, t1=0.30),
        "global": shares(t0=0.38, t1=0.36),
        "global#2": shares(t0=0.38, t1=0.30),
        "per_adapter_staged#2": shares(t0=0.40, t1=0.36),
    }
    # t1: 0.33 against 0.33 in the means, though each first position differs
    assert on_policy_every_tenant(modes, "per_adapter_staged") is True
    modes["per_adapter_staged#2"] = shares(t0=0.40, t1=0.34)
    assert on_policy_every_tenant(modes, "per_adapter_staged") is False
    assert on_policy_every_tenant(modes, None) is None
    assert on_policy_every_tenant({"per_adapter": shares(t0=1.0)}, "per_adapter") is None
