"""A hand-over's GPU buffers are not taken from under the engine's queued kernels.

torch's caching allocator hands a freed block out again at once to the
stream it was freed on, though kernels queued earlier on that stream may
still write it: safe for that stream's own work, not for a copy on a side
stream. The staging copies a trainer's buffer on a side stream, so it must
allocate there (:func:`skyrl_lora.server.transfer.handover.copies_on_stream`).
First the hazard itself (so the test can fail), then the staging's copies.
No server; a second.
"""

from __future__ import annotations

import torch

from skyrl_lora.server.adapters.cuda_streams import side_stream
from skyrl_lora.server.loading.staged_buffer import device_buffers
from skyrl_lora.server.transfer.handover import copies_on_stream

NBYTES = 64 << 20


def free_while_a_write_is_queued() -> None:
    """On the current stream (the engine's): free a block that a kernel queued
    behind about 0.1 s of sleep will still fill with 7s."""
    doomed = torch.empty(NBYTES, dtype=torch.uint8, device="cuda")
    torch.cuda._sleep(200_000_000)  # GPU cycles
    doomed.fill_(7)
    del doomed


def test_the_stagings_copies_survive_a_block_freed_with_a_write_queued() -> None:
    device = torch.device("cuda", 0)
    source = torch.full((NBYTES,), 3, dtype=torch.uint8, device=device)
    allocate = device_buffers(device)
    assert allocate is not None
    stream = side_stream(device)
    torch.cuda.synchronize()

    free_while_a_write_is_queued()
    taken_on_the_engines_stream = allocate(NBYTES)
    with torch.cuda.stream(stream):
        taken_on_the_engines_stream.copy_(source, non_blocking=True)
    stream.synchronize()
    torch.cuda.synchronize()
    assert bool((taken_on_the_engines_stream == 7).all()), "the hazard did not reproduce"
    del taken_on_the_engines_stream

    free_while_a_write_is_queued()
    copies = copies_on_stream(source, allocate, 2, stream)
    torch.cuda.synchronize()
    for copy in copies:
        assert torch.equal(copy, source)
