"""The staging's CUDA streams run at the device's highest priority; what runs
after a swap keeps the default (:mod:`skyrl_lora.server.weights.cuda_streams`).
No server; a second."""

from __future__ import annotations

import torch

from skyrl_lora.server.weights.cuda_streams import (
    AFTER_SWAP,
    STAGING,
    side_stream,
    urgent_stream,
)

DEVICE = torch.device("cuda", 0)


def test_the_stagings_streams_have_the_highest_priority_and_the_aftermath_the_default() -> None:
    highest = torch.cuda.Stream(device=DEVICE, priority=-(1 << 20)).priority
    assert highest < 0, "this device has no stream above the default priority"
    assert side_stream(DEVICE, STAGING).priority == highest
    assert urgent_stream(DEVICE).priority == highest
    assert side_stream(DEVICE, AFTER_SWAP).priority == 0
    assert side_stream(DEVICE, STAGING) is side_stream(DEVICE)  # one per device and purpose
