"""The staging thread's naps (``skyrl_lora.server.loading.staging_yield``) on their own,
and their yield points in vLLM's real adapter read.

That a real server's staging naps under load and not when idle is checked in
``test_server_engine.py``.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from skyrl_lora.server import compat
from skyrl_lora.server.loading.staging_yield import StagingYield, YieldPoints, install_yield_points

#: Every pass through a yield point ends a slice; naps are short.
EVERY_PASS = StagingYield(slice_s=0.0, nap_s=0.0005, busy_within_s=60.0)


def _pass(points: YieldPoints, times: int) -> None:
    for _ in range(times):
        points()


def test_a_staging_naps_at_its_yield_points_while_the_engine_steps() -> None:
    points = YieldPoints(EVERY_PASS)
    points.note_step()
    with points.yielding() as naps:
        _pass(points, 3)
    assert naps.count == 3
    assert naps.slept_s >= 3 * EVERY_PASS.nap_s


def test_an_idle_engine_lets_the_staging_run_without_naps() -> None:
    points = YieldPoints(StagingYield(slice_s=0.0, nap_s=0.0005, busy_within_s=0.001))
    with points.yielding() as never_stepped:
        _pass(points, 3)
    points.note_step()
    threading.Event().wait(0.01)  # the last step began longer ago than busy_within_s
    with points.yielding() as stepped_long_ago:
        _pass(points, 3)
    assert never_stepped.count == stepped_long_ago.count == 0


def test_only_slices_longer_than_the_limit_end_in_a_nap() -> None:
    points = YieldPoints(StagingYield(slice_s=60.0, nap_s=0.0005, busy_within_s=60.0))
    points.note_step()
    with points.yielding() as naps:
        _pass(points, 100)
    assert naps.count == 0


def test_only_the_staging_thread_naps_and_none_when_off() -> None:
    """A load the step loop runs itself passes the same points: it must never sleep."""
    points = YieldPoints(EVERY_PASS)
    points.note_step()
    _pass(points, 3)  # outside ``yielding``: returns at once
    other_thread_naps: list[int] = []
    with points.yielding() as naps:
        worker = threading.Thread(target=_pass, args=(points, 3))
        worker.start()
        worker.join()
        other_thread_naps.append(naps.count)
        points.config = None
        _pass(points, 3)
    assert other_thread_naps == [0]
    assert naps.count == 0


class _Runner:
    def __init__(self) -> None:
        self.steps = 0

    def execute_model(self, batch: Any) -> str:
        self.steps += 1
        return f"ran {batch}"


class _ModelManager:
    def _get_lora_layer_weights(self, lora_model: Any, name: str) -> str:
        return f"{lora_model}.{name}"


def test_installed_points_see_the_steps_and_the_packing_and_are_not_stacked() -> None:
    points = YieldPoints(EVERY_PASS)
    runner, manager = _Runner(), _ModelManager()
    for _ in range(2):  # placed twice (a second worker start): still one hook each
        assert install_yield_points(points, manager, runner)
    assert runner.execute_model(7) == "ran 7" and runner.steps == 1
    with points.yielding() as naps:
        assert manager._get_lora_layer_weights("m", "q_proj") == "m.q_proj"
    assert naps.count == 1
    assert not install_yield_points(points, manager, None)  # no steps to see: never naps


def test_vllms_adapter_read_passes_a_yield_point_per_tensor_name(embedded_model: Any) -> None:
    """The real loader of the installed vLLM calls the name parser we hook."""
    import torch
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    from skyrl_lora.server.embedded.builder import TARGET_MODULES

    passes: list[int] = []
    compat.call_before_lora_name_parses(lambda: passes.append(1))
    try:
        adapter = Path(embedded_model.adapters["meow"])
        helper = PEFTHelper.from_local_dir(str(adapter), 4096)
        model = LoRAModel.from_local_checkpoint(
            str(adapter), set(TARGET_MODULES), helper, lora_model_id=1, device="cpu"
        )
    finally:
        compat.call_before_lora_name_parses(lambda: None)
    assert model.loras
    assert len(passes) >= 2 * len(model.loras)  # A and B of every layer, at least
    assert torch.is_tensor(next(iter(model.loras.values())).lora_a)
