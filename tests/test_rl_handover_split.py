"""Where an RL sync's hand-over push goes, as the RL report splits it.

The tenant times a hand-over's push around the learner process's call; the
learner process times its state dict, its copy into the hand-over buffer
and the HTTP call. The report's medians must add those parts up to the
push, the rest being the trip to the learner process and back, and leave
them out (None) for a transfer that is not a hand-over.
"""

from __future__ import annotations

import pytest

from examples.rl.learner import HandOver
from examples.rl.report import handover_split
from examples.rl.tenant import Swap


def swap(push_s: float, handover: HandOver | None) -> Swap:
    return Swap(0.0, push_s, 2, 0, 0.0, push_s=push_s, handover=handover)


def test_the_parts_and_the_rest_add_up_to_the_push() -> None:
    swaps = [
        swap(0.060, HandOver(2, state_s=0.004, update_s=0.003, request_s=0.030)),
        swap(0.070, HandOver(3, state_s=0.005, update_s=0.002, request_s=0.040)),
        swap(0.050, HandOver(4, state_s=0.003, update_s=0.004, request_s=0.025)),
    ]
    split = handover_split(swaps)
    assert split["handover_state_ms_median"] == pytest.approx(4.0)
    assert split["handover_update_ms_median"] == pytest.approx(3.0)
    assert split["handover_request_ms_median"] == pytest.approx(30.0)
    # 60 - 37, 70 - 47, 50 - 32: the trip to the learner process and back
    assert split["handover_elsewhere_ms_median"] == pytest.approx(23.0)


def test_no_split_without_hand_overs() -> None:
    split = handover_split([swap(0.05, None), swap(0.06, None)])
    assert set(split) == {
        "handover_state_ms_median",
        "handover_update_ms_median",
        "handover_request_ms_median",
        "handover_elsewhere_ms_median",
    }
    assert all(value is None for value in split.values())
