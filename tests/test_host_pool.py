"""The pool of snapshot copies: a block is handed out again only once nothing
else holds its storage, whatever holds it (a view, a numpy array), and a
buffer dropped without a word (a staging that failed) is reused all the same."""

from __future__ import annotations

import torch

from skyrl_lora.server.transfer.host_pool import HostBufferPool
from skyrl_lora.server.transfer.tensor_pickle import host_buffers


def _pool(max_idle_bytes: int = 1 << 20) -> HostBufferPool:
    pool = HostBufferPool(host_buffers(False), max_idle_bytes)
    assert pool.enabled  # the torch of every machine we run says how many hold a storage
    return pool


def test_a_dropped_buffer_is_handed_out_again() -> None:
    pool = _pool()
    first = pool.take(1000)
    assert first.numel() == 1000 and first.dtype == torch.uint8
    pointer = first.data_ptr()
    del first
    second = pool.take(900)
    assert second.numel() == 900 and second.data_ptr() == pointer
    assert (pool.allocated, pool.reused) == (1, 1)


def test_a_buffer_anything_still_holds_is_never_handed_out() -> None:
    pool = _pool()
    buffer = pool.take(1000)
    view = buffer[10:20].view(torch.int16)  # a tensor of the model, say
    array = buffer.numpy()  # the snapshot writer's memoryview
    pointer = buffer.data_ptr()
    del buffer
    others = [pool.take(1000)]
    assert others[-1].data_ptr() != pointer
    del view
    others.append(pool.take(1000))
    assert others[-1].data_ptr() != pointer  # the array holds it still
    del array
    assert pool.take(1000).data_ptr() == pointer
    assert (pool.allocated, pool.reused) == (3, 1)


def test_two_buffers_held_at_once_never_share_a_block() -> None:
    pool = _pool()
    held = [pool.take(1000) for _ in range(3)]
    for number, buffer in enumerate(held):
        buffer.fill_(number)
    assert [int(buffer[0]) for buffer in held] == [0, 1, 2]
    assert len({buffer.data_ptr() for buffer in held}) == 3


def test_a_block_much_larger_than_asked_is_not_wasted_on_a_small_buffer() -> None:
    pool = _pool()
    big = pool.take(10_000)
    pointer = big.data_ptr()
    del big
    assert pool.take(1000).data_ptr() != pointer  # 10x: a fresh block
    assert pool.take(6000).data_ptr() == pointer  # within 2x: the idle one


def test_idle_blocks_beyond_the_cap_go_back_to_torch() -> None:
    pool = _pool(max_idle_bytes=2500)
    buffers = [pool.take(1000) for _ in range(3)]
    del buffers
    assert pool.idle_bytes == 3000  # trimmed only when a block is allocated
    keep = pool.take(5000)  # no idle block fits: allocated, and the idle ones trimmed
    assert pool.idle_bytes <= 2500
    del keep


def test_a_torch_that_cannot_count_holders_allocates_every_time(monkeypatch) -> None:
    monkeypatch.delattr(torch._C, "_storage_Use_Count")
    pool = HostBufferPool(host_buffers(False))
    assert not pool.enabled
    pool.take(100)  # dropped at once
    assert pool.take(100).numel() == 100
    assert (pool.allocated, pool.reused) == (2, 0)


def test_threads_taking_at_once_never_share_a_block() -> None:
    """The staging thread and the snapshot writer's thread both take buffers."""
    import threading

    pool = _pool(max_idle_bytes=1 << 16)
    errors: list[str] = []

    def work(number: int) -> None:
        for _ in range(200):
            buffer = pool.take(512)
            buffer.fill_(number)
            if int(buffer.min()) != number or int(buffer.max()) != number:
                errors.append(f"thread {number} saw another thread's bytes")

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert pool.reused > 0 and pool.allocated <= 4 * 200
