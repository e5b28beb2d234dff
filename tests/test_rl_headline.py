"""The GPU RL run's headline JSON names the per-adapter pause it ran,
compares each tenant's on-policy share over every position of a mode, and
takes its ratios over every position, not the first alone."""

from __future__ import annotations

from typing import Any

import pytest

from examples.multi_tenant_rl import mode_ratios, on_policy_every_tenant, per_adapter_mode


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


def position(tokens_per_s: float, time_to_target_s: float, share: float) -> dict[str, Any]:
    medians = {
        "tokens_per_s": tokens_per_s,
        "time_to_target_s": time_to_target_s,
        "on_policy_share": share,
        "seconds_per_step": 4.0,
    }
    return {"median_over_tenants": medians, **shares(t0=share)}


def test_ratios_are_of_each_modes_mean_over_its_positions() -> None:
    # ABCCBA: the first positions alone would say 1.20x tokens/s and 0.50x to target
    modes = {
        "per_adapter_staged": position(1200.0, 20.0, 0.30),
        "per_adapter_on_policy": position(1100.0, 30.0, 0.42),
        "global": position(1000.0, 40.0, 0.34),
        "global#2": position(1200.0, 20.0, 0.36),
        "per_adapter_on_policy#2": position(1100.0, 30.0, 0.40),
        "per_adapter_staged#2": position(1000.0, 40.0, 0.30),
    }
    assert mode_ratios(modes, "per_adapter_staged") == {
        "tokens_per_s_over_global": 1.0,
        "time_to_target_over_global": 1.0,
        "on_policy_every_tenant": False,
    }
    on_policy = mode_ratios(modes, "per_adapter_on_policy")
    assert on_policy["tokens_per_s_over_global"] == 1.0
    assert on_policy["on_policy_every_tenant"] is True
    assert mode_ratios(modes, "finish_old") == {
        "tokens_per_s_over_global": None,
        "time_to_target_over_global": None,
        "on_policy_every_tenant": None,
    }


def test_the_learners_device_is_checked_before_anything_starts() -> None:
    """``--learner-device``: any CUDA device of the machine for the GPU shape
    (``cuda:1``: the engine alone on GPU 0), the CPU for the CPU shape, and a
    message that names what is wrong otherwise."""
    from examples.multi_tenant_rl import learner_device_error

    assert learner_device_error("cuda", gpu=True, cuda_devices=1) is None
    assert learner_device_error("cuda:1", gpu=True, cuda_devices=2) is None
    assert learner_device_error("cpu", gpu=False, cuda_devices=0) is None
    assert "2 CUDA device" in str(learner_device_error("cuda:2", gpu=True, cuda_devices=2))
    assert "no CUDA device" in str(learner_device_error("cuda:1", gpu=True, cuda_devices=0))
    assert "cuda or cuda:N" in str(learner_device_error("gpu1", gpu=True, cuda_devices=2))
    assert "cuda or cuda:N" in str(learner_device_error("cuda:x", gpu=True, cuda_devices=2))
    assert "GPU shape" in str(learner_device_error("cuda", gpu=False, cuda_devices=1))
    assert "handover" in str(learner_device_error("cuda:1", True, 2, handover=True))
    assert learner_device_error("cuda:0", True, 2, handover=True) is None


def test_a_learner_device_this_machine_lacks_is_a_usage_error(capsys: Any) -> None:
    """Refused by the argument parser, before a model is built or a server starts."""
    from examples.multi_tenant_rl import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--gpu", "--learner-device", "cuda:7"])
    assert exit_info.value.code == 2
    assert "--learner-device cuda:7" in capsys.readouterr().err
