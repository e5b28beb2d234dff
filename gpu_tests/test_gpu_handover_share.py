"""A trainer's CUDA share, handed over from another process and kept open.

The trainer (a process of its own, as it runs beside a server) hands over
through :class:`skyrl_lora.client.AdapterHandover`; this process copies
each hand-over out as the engine does (:func:`.handover.copy_out`, the
share kept open by :class:`.open_shares.OpenShares`). The copies must hold
the trainer's newest values, through a share found open as well as one
opened afresh, and once the trainer made a new buffer and the old share
closed, the trainer's torch must free the old buffer (every share it made
counted one reader; a count never given back keeps the memory). No server;
a few seconds.

Nothing on a CPU opens a CUDA share: a hand-over's first call on the H100
failed where torch's ``_new_shared_cuda`` took no ``None`` for a missing
event (a080703), which this test would have caught.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.multiprocessing as mp

from skyrl_lora.server.transfer import handover
from skyrl_lora.server.transfer.open_shares import OpenShares


def trainer(conn: Any) -> None:
    """Hands over two tensors of ``shape`` filled with ``value`` per request
    (``(shape, value, cycles)``: the copy queued on a side stream behind a
    GPU sleep of ``cycles``, and not waited for); ``"allocated"`` answers
    its torch's allocated bytes, after collecting the buffers no reader
    holds any more."""
    from skyrl_lora.client import AdapterHandover

    adapter = AdapterHandover({"r": 8})
    while (message := conn.recv()) is not None:
        if message == "allocated":
            torch.cuda.ipc_collect()
            conn.send(torch.cuda.memory_allocated())
            continue
        shape, value, *late = message
        stream = torch.cuda.Stream() if late else torch.cuda.current_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # made, copied and freed on one stream
            if late:  # the copy queued behind ~0.5 s of GPU work
                torch.cuda._sleep(late[0])
            weights = {
                name: torch.full(shape, value, dtype=torch.bfloat16, device="cuda")
                for name in ("layer.lora_A.weight", "layer.lora_B.weight")
            }
            adapter.update(weights)
            del weights
        conn.send(adapter.request())  # on the default stream, the copy maybe not yet run
    adapter.close()


def copied(shares: OpenShares, description: dict[str, Any], lora_id: int) -> dict[str, Any]:
    """The hand-over copied out as the engine copies it, by tensor name."""
    times: dict[str, float] = {}
    (out,) = handover.copy_out(
        description,
        lambda nbytes: torch.empty(nbytes, dtype=torch.uint8, device="cuda"),
        handover.cuda_device_index,
        times=times,
        open_share=functools.partial(shares.open, "tenant", lora_id),
    )
    assert set(times) == {"open_ms", "copies_ms", "close_ms"}
    return handover.tensor_views(out, description)


def test_a_share_kept_open_sees_new_values_and_frees_the_trainers_old_buffer() -> None:
    context = mp.get_context("spawn")
    conn, child_conn = context.Pipe()
    child = context.Process(target=trainer, args=(child_conn,))
    child.start()
    shares = OpenShares(limit=4)
    try:

        def hand_over(shape: tuple[int, int], value: float) -> dict[str, Any]:
            conn.send((shape, value))
            return conn.recv()

        first = hand_over((64, 64), 1.0)
        for tensor in copied(shares, first, lora_id=1).values():
            assert torch.all(tensor == 1.0)
        second = hand_over((64, 64), 2.0)  # the same buffer, new values
        assert second["buffer"]["handle"] == first["buffer"]["handle"]
        for tensor in copied(shares, second, lora_id=2).values():
            assert torch.all(tensor == 2.0)
        assert shares.retired == 0 and list(shares.held()) == ["tenant"]

        third = hand_over((128, 64), 3.0)  # a new layout: the trainer makes a new buffer
        for tensor in copied(shares, third, lora_id=3).values():
            assert torch.all(tensor == 3.0)
        assert shares.retired == 1
        assert shares.close_retired() == 1
        conn.send("allocated")
        allocated = conn.recv()
        # the first buffer (2 x 8 KiB) is freed; the third (2 x 16 KiB) is held
        assert allocated < third["buffer"]["nbytes"] + first["buffer"]["nbytes"]

        assert shares.forget(3) and shares.close_retired() == 1
        conn.send(None)
        child.join(timeout=60)
        assert child.exitcode == 0
    finally:
        if child.is_alive():
            child.kill()


def test_a_hand_over_reads_the_trainers_copy_that_had_not_yet_run() -> None:
    """:meth:`AdapterHandover.update` does not wait for its copy, so the
    server must: the share's event is recorded on the stream of the copy,
    even where the request is made on another, and the copy out waits for
    it. Without the wait the copy out reads the old values (the copy runs
    about half a second later)."""
    context = mp.get_context("spawn")
    conn, child_conn = context.Pipe()
    child = context.Process(target=trainer, args=(child_conn,))
    child.start()
    shares = OpenShares(limit=4)
    try:
        conn.send(((256, 256), 1.0))
        first = conn.recv()
        for tensor in copied(shares, first, lora_id=1).values():
            assert torch.all(tensor == 1.0)
        conn.send(((256, 256), 2.0, 1_000_000_000))
        late = conn.recv()
        assert late["buffer"]["event_sync_required"]
        for tensor in copied(shares, late, lora_id=2).values():
            assert torch.all(tensor == 2.0)
        conn.send(None)
        child.join(timeout=60)
        assert child.exitcode == 0
    finally:
        if child.is_alive():
            child.kill()
