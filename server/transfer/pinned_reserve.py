"""Pinned host memory for stagings, taken before the server serves.

A staging builds its adapter's model in pinned host memory (vLLM pins
adapters' host copies, so that their copies into engine slots run
asynchronously), taken from torch's caching host allocator. When that cache
has no free block of the size asked for, torch asks the driver
(``cudaHostAlloc``), and the driver holds every other CUDA call of the
process until it is done: the engine's step loop, which runs in the same
process, makes no progress, and no tenant gets a token. On an H200 a block
for the rank-64 adapter of the 8B model (336 MB, 512 MB as torch rounds it)
took 314 ms, and a step loop beside it stalled for all of it
(``scripts/probes/pinned_alloc_stall.py``, 2026-11-26,
``docs/gpu/pinned_alloc_stall_h200.txt``). In the tenant curve at 84abe52 the
one reload whose model pinned fresh memory (206 ms) held the other tenants'
longest gap of the run (234 ms), and each swap-cost run's path p99 was the
one sync that did (200-290 ms).

So each worker asks, once at start-up, for the blocks its stagings hold in
steady state, and gives them straight back to torch's cache: later stagings
take cached blocks and the step loop never waits on the driver for them.
torch keeps blocks by power-of-two size and hands out a block of a request's
own size class only, so a reserve sized for rank ``r`` serves the adapters
whose bytes round to the same power of two; smaller or larger ones pin
their own blocks at first use, as before.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

#: Blocks a worker holds beyond one model per adapter in vLLM's host cache:
#: the model of the staging in flight, and the snapshot copies its file is
#: read into (the one being read while the last is still being written to
#: disk). One model per engine slot plus these was too few: at 8 tenants of
#: the 8B model 11 blocks left two of 33 stagings pinning fresh memory (H200,
#: 8fd58c8), hence the host cache's size as the default.
IN_FLIGHT_BLOCKS = 3
#: The reserve never takes more than this share of the host's memory.
MAX_HOST_SHARE = 0.25


@dataclass(frozen=True)
class PinnedReserve:
    """How much pinned host memory each worker takes before serving.

    ``adapters``: the models held at once; vLLM's host cache of adapters
    (``--max-cpu-loras``) holds at most that many, each in a block of its
    own. 0 turns the reserve off. ``rank``: the rank the blocks are sized
    for, on every layer the engine's slots hold; None means the server's
    largest (``--max-lora-rank``).
    """

    adapters: int
    rank: int | None = None

    @property
    def blocks(self) -> int:
        return self.adapters + IN_FLIGHT_BLOCKS if self.adapters > 0 else 0


@dataclass(frozen=True)
class ReserveReport:
    """What a worker reserved: ``blocks`` of ``block_bytes`` each, in ``ms``."""

    blocks: int = 0
    block_bytes: int = 0
    ms: float = 0.0
    #: Why fewer blocks than asked (or none) were taken; empty when all were.
    note: str = ""

    @property
    def total_bytes(self) -> int:
        return self.blocks * self.block_bytes


def slot_bytes(modules: Iterable[Any], rank: int | None = None) -> int:
    """Bytes of one adapter of ``rank`` on every layer of ``modules`` (a
    ``LoRAModelManager``'s layers), counted from the engine slots' own
    tensors: each layer's ``lora_a_stacked`` (slots x 1 x max rank x in) and
    ``lora_b_stacked`` (slots x 1 x out x max rank), one per slice of a packed
    layer. Both are linear in the rank, so a lower rank scales them."""
    total = 0
    max_rank = 0
    for module in modules:
        for name in ("lora_a_stacked", "lora_b_stacked"):
            stacked = getattr(module, name, None)
            tensors = stacked if isinstance(stacked, (tuple, list)) else (stacked,)
            for tensor in tensors:
                if tensor is None or tensor.dim() < 4:
                    continue
                total += tensor[0].numel() * tensor.element_size()
                if name == "lora_a_stacked":
                    max_rank = max(max_rank, int(tensor.shape[2]))
    if rank is None or max_rank == 0:
        return total
    return total * min(rank, max_rank) // max_rank


def host_memory_bytes() -> int:
    """The host's physical memory (0 where the platform does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def reserve(
    block_bytes: int,
    blocks: int,
    allocate: Callable[[int], Any],
    host_bytes: int | None = None,
) -> ReserveReport:
    """Take ``blocks`` blocks of ``block_bytes`` (rounded up to a power of
    two, as torch's cache rounds them) from ``allocate`` (a pinned
    allocation through torch's caching host allocator) all at once, then let
    them go back to its cache. All are held together before any goes back:
    allocated one after another, each would be the last one's block again.

    Never more than :data:`MAX_HOST_SHARE` of ``host_bytes`` (the host's
    memory unless given); an allocation that fails ends the reserve with
    what was taken so far, and the report says why.
    """
    if blocks <= 0 or block_bytes <= 0:
        return ReserveReport()
    # torch's cache holds a block of the power of two at or above the size
    # asked (and hands it out for any size that rounds to it): ask for that,
    # so the report and the cap count what is pinned.
    block_bytes = 1 << (block_bytes - 1).bit_length()
    host = host_memory_bytes() if host_bytes is None else host_bytes
    note = ""
    if host > 0 and blocks * block_bytes > host * MAX_HOST_SHARE:
        blocks = int(host * MAX_HOST_SHARE) // block_bytes
        note = f"capped at {MAX_HOST_SHARE:.0%} of the host's {host >> 20} MiB"
    started = time.perf_counter()
    held: list[Any] = []
    try:
        for _ in range(blocks):
            held.append(allocate(block_bytes))
    except (RuntimeError, MemoryError) as exc:
        note = f"stopped after {len(held)} blocks: {exc}"
    taken = len(held)
    held.clear()
    return ReserveReport(
        blocks=taken,
        block_bytes=block_bytes,
        ms=round((time.perf_counter() - started) * 1000, 1),
        note=note,
    )
