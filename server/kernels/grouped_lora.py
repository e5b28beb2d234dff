"""Grouped LoRA shrink and expand: work only for the adapters a step holds.

vLLM 0.26's Punica kernels (``lora_shrink``, ``lora_expand``) launch, for
each of a layer's slices, ``split_k x cdiv(M, BLOCK_M) x cdiv(N, BLOCK_N)``
blocks for *every* adapter slot the server has (``--max-loras`` + 1, unless
``--specialize-active-lora``), where ``M`` is the step's whole token count.
A block whose slot is empty, or whose rows belong to another adapter,
returns at once, but it is still scheduled: at 8 to 32 adapters and 64 to
256 tokens a step, hundreds of thousands of such blocks run per decode step
for a few hundred that do work, and the step grows with slots x tokens
instead of with the adapter bytes it must read.

These kernels run a fixed, persistent grid (a few blocks per SM, the same
for every step, so CUDA graphs capture them as they do vLLM's) that walks a
list of work items: one per (chunk of ``block_m`` rows of one adapter,
slice, K block) for the shrink and (row chunk, slice, N block) for the
expand. Which rows make a chunk is worked out once per step, not in every
launch: :func:`fill_plan` (one small kernel) writes the step's
:class:`RowChunkPlan`, each chunk's slot and its row indices in one cache
line, and every shrink and expand of the step reads it. An item then runs
one short dependent chain: its chunk's entry, the rows' inputs and the
adapter's tile, one ``tl.dot``, one store. Groups without an adapter (the
base model's rows, the empty padding of a graph captured for more adapters
than the step holds) get no chunks at all. ``serve`` fills the plan as
vLLM prepares the step's metadata (:mod:`.punica_ops`); a call given no
plan fills one of its own first.
Earlier versions found the chunk's group inside every item (a reduction
over the group table, then the group's entries, then its row indices:
three more dependent rounds per item, in each of a step's 256 launches),
and before that walked an adapter's rows 16 at a time inside one item.
They take the same arguments as vLLM's ops, so they replace
them in ``PunicaWrapperGPU`` without touching the LoRA layers
(:mod:`.punica_ops`).

The shrink adds split-K partial products with atomics into the fp32 buffer,
as vLLM's does; the expand adds in fp32 and rounds once, where vLLM rounds
the LoRA term and then adds in the output's dtype (so the two differ by at
most one rounding of the output, checked in the tests).

Pure Triton and torch: runs on a GPU, and on the CPU under Triton's
interpreter (``TRITON_INTERPRET=1``), which is how the CPU tests check it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

import torch
import triton
import triton.language as tl

#: Slices one launch takes (q/k/v is three); wider packed layers fall back to vLLM's ops.
MAX_SLICES = 3


@dataclass(frozen=True)
class GroupedConfig:
    """Tile sizes and grid of the grouped kernels (one per step shape class).

    ``block_m``: token rows per chunk (a decode step holds few per adapter,
    so small; prefill holds many). ``block_k``: the shrink's K tile, the
    unit of its split-K work. ``block_n``: the expand's output columns per
    item. ``blocks_per_sm``: the persistent grid's size per multiprocessor.
    """

    block_m: int = 16
    block_k: int = 256
    block_n: int = 128
    num_warps: int = 4
    blocks_per_sm: int = 4

    def for_tokens(self, tokens: int) -> GroupedConfig:
        """Prefill-sized steps use wider row chunks (fewer passes per item)."""
        if tokens > 512 and self.block_m < 64:
            return replace(self, block_m=64)
        return self


DEFAULT_CONFIG = GroupedConfig()


@triton.jit
def _pick(s, v0, v1, v2):
    """``(v0, v1, v2)[s]`` for a runtime slice index (pointers or ints)."""
    if s == 0:
        v = v0
    elif s == 1:
        v = v1
    else:
        v = v2
    return v


@triton.jit
def _chunk_table(count_ptr, slot_ptr, num_groups, BLOCK_M: tl.constexpr, GROUPS_P2: tl.constexpr):
    """Each group's row chunks and their running end, as vectors (loaded once
    per program; a group without an adapter, the base model's rows or the
    empty padding up to the captured count, gets none)."""
    offs = tl.arange(0, GROUPS_P2)
    valid = offs < num_groups
    slots = tl.load(slot_ptr + offs, mask=valid, other=-1)
    counts = tl.load(count_ptr + offs, mask=valid, other=0)
    chunks = tl.where(slots >= 0, (counts + BLOCK_M - 1) // BLOCK_M, 0)
    return chunks, tl.cumsum(chunks, axis=0)


@triton.jit
def _fill_table(
    table_ptr,
    capacity,
    sorted_ptr,
    count_ptr,
    start_ptr,
    slot_ptr,
    num_groups,
    BLOCK_M: tl.constexpr,
    GROUPS_P2: tl.constexpr,
    CHUNKS: tl.constexpr,
):
    """This program's ``CHUNKS`` entries of one plan table (see :class:`RowChunkPlan`).

    A chunk's group is how many groups end at or before it, and the group's
    first chunk is their chunks: one reduction finds both, packed in one
    integer. Chunks past the step's count are left as they were (no kernel
    reads them)."""
    chunks, ends = _chunk_table(count_ptr, slot_ptr, num_groups, BLOCK_M, GROUPS_P2)
    total = tl.sum(chunks, axis=0)
    if tl.program_id(0) == 0:
        tl.store(table_ptr, total)
    chunk = tl.program_id(0) * CHUNKS + tl.arange(0, CHUNKS)
    live = (chunk < total) & (chunk < capacity)
    before = ends[None, :] <= chunk[:, None]
    packed = tl.sum(tl.where(before, chunks[None, :] * GROUPS_P2 + 1, 0), axis=1)
    group = packed % GROUPS_P2
    slot = tl.load(slot_ptr + group, mask=live, other=-1)
    rows_n = tl.load(count_ptr + group, mask=live, other=0)
    first = tl.load(start_ptr + group, mask=live, other=0)
    offs_m = (chunk - packed // GROUPS_P2)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
    in_group = live[:, None] & (offs_m < rows_n[:, None])
    rows = tl.load(sorted_ptr + first[:, None] + offs_m, mask=in_group, other=-1)
    entry = table_ptr + (chunk + 1) * (2 * BLOCK_M)
    tl.store(entry, slot, mask=live)
    tl.store(
        entry[:, None] + BLOCK_M + tl.arange(0, BLOCK_M)[None, :],
        tl.where(in_group, rows, -1),
        mask=live[:, None],
    )


@triton.jit
def _plan_kernel(
    small_ptr,
    large_ptr,
    small_capacity,
    large_capacity,
    sorted_ptr,
    count_ptr,
    start_ptr,
    slot_ptr,
    num_groups,
    SMALL: tl.constexpr,
    LARGE: tl.constexpr,
    GROUPS_P2: tl.constexpr,
    CHUNKS: tl.constexpr,
):
    """Both tables of a plan in one launch (grid axis 1: which chunk height)."""
    if tl.program_id(1) == 0:
        _fill_table(
            small_ptr, small_capacity, sorted_ptr, count_ptr, start_ptr, slot_ptr, num_groups,
            SMALL, GROUPS_P2, CHUNKS,
        )  # fmt: skip
    else:
        _fill_table(
            large_ptr, large_capacity, sorted_ptr, count_ptr, start_ptr, slot_ptr, num_groups,
            LARGE, GROUPS_P2, CHUNKS,
        )  # fmt: skip


@triton.jit
def _plan_entry(table_ptr, chunk, BLOCK_M: tl.constexpr):
    """Chunk ``chunk``'s slot and its rows (token indices; -1 past the group's
    end) with their mask: two loads from one cache line, neither waiting."""
    entry = table_ptr + (chunk + 1) * (2 * BLOCK_M)
    slot = tl.load(entry)
    rows = tl.load(entry + BLOCK_M + tl.arange(0, BLOCK_M))
    return slot, rows, rows >= 0


@triton.jit
def _grouped_shrink_kernel(
    x_ptr,
    w0_ptr,
    w1_ptr,
    w2_ptr,
    out_ptr,
    plan_ptr,
    K,
    N,
    scaling,
    x_s0,
    x_s1,
    ws0_0,
    ws0_1,
    ws0_2,
    w_s1,
    w_s2,
    o_s0,
    o_s1,
    o_s2,
    SLICES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[s, t, :] += scaling * x[t, :] @ W_s[slot(t)].T.

    One item per (row chunk, slice, K block)."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    k_blocks = tl.cdiv(K, BLOCK_K)
    per_chunk = SLICES * k_blocks
    total = tl.load(plan_ptr) * per_chunk
    offs_n = tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    for item in range(pid, total, programs):
        chunk = item // per_chunk
        rest = item % per_chunk
        s = rest // k_blocks
        kb = rest % k_blocks
        slot, rows, m_mask = _plan_entry(plan_ptr, chunk, BLOCK_M)
        w_ptr = _pick(s, w0_ptr, w1_ptr, w2_ptr)
        w_s0 = _pick(s, ws0_0, ws0_1, ws0_2)
        offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        b = tl.load(
            w_ptr + slot * w_s0 + offs_n[None, :] * w_s1 + offs_k[:, None] * w_s2,
            mask=k_mask[:, None] & n_mask[None, :],
            other=0.0,
        )
        a = tl.load(
            x_ptr + rows[:, None] * x_s0 + offs_k[None, :] * x_s1,
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        acc = tl.dot(a, b) * scaling
        tl.atomic_add(
            out_ptr + s * o_s0 + rows[:, None] * o_s1 + offs_n[None, :] * o_s2,
            acc,
            mask=m_mask[:, None] & n_mask[None, :],
            sem="relaxed",
        )


@triton.jit
def _grouped_expand_kernel(
    in_ptr,
    w0_ptr,
    w1_ptr,
    w2_ptr,
    out_ptr,
    plan_ptr,
    n_blocks,
    R,
    n0,
    n1,
    n2,
    col0,
    col1,
    col2,
    i_s0,
    i_s1,
    i_s2,
    ws0_0,
    ws0_1,
    ws0_2,
    w_s1,
    w_s2,
    o_s0,
    o_s1,
    SLICES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    ADD_INPUTS: tl.constexpr,
):
    """out[t, col_s + n] (+)= in[s, t, :] @ W_s[slot(t)][n, :].

    One item per (row chunk, slice, N block)."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    per_chunk = SLICES * n_blocks
    total = tl.load(plan_ptr) * per_chunk
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    for item in range(pid, total, programs):
        chunk = item // per_chunk
        rest = item % per_chunk
        s = rest // n_blocks
        nb = rest % n_blocks
        n_s = _pick(s, n0, n1, n2)
        if nb * BLOCK_N < n_s:
            slot, rows, m_mask = _plan_entry(plan_ptr, chunk, BLOCK_M)
            w_ptr = _pick(s, w0_ptr, w1_ptr, w2_ptr)
            w_s0 = _pick(s, ws0_0, ws0_1, ws0_2)
            col = _pick(s, col0, col1, col2)
            offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
            n_mask = offs_n < n_s
            b = tl.load(
                w_ptr + slot * w_s0 + offs_n[None, :] * w_s1 + offs_r[:, None] * w_s2,
                mask=r_mask[:, None] & n_mask[None, :],
                other=0.0,
            )
            a = tl.load(
                in_ptr + s * i_s0 + rows[:, None] * i_s1 + offs_r[None, :] * i_s2,
                mask=m_mask[:, None] & r_mask[None, :],
                other=0.0,
            )
            acc = tl.dot(a.to(b.dtype), b)
            o_ptrs = out_ptr + rows[:, None] * o_s0 + (col + offs_n)[None, :] * o_s1
            mask = m_mask[:, None] & n_mask[None, :]
            if ADD_INPUTS:
                acc += tl.load(o_ptrs, mask=mask, other=0.0).to(tl.float32)
            tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _as_slot_rows_cols(weight: torch.Tensor) -> torch.Tensor:
    """vLLM's stacked weights are (slots, 1, rows, cols) or (slots, rows, cols)."""
    if weight.ndim == 4:
        if weight.size(1) != 1:
            raise ValueError(f"stacked LoRA weight of shape {tuple(weight.shape)}")
        return weight[:, 0]
    if weight.ndim != 3:
        raise ValueError(f"stacked LoRA weight of shape {tuple(weight.shape)}")
    return weight


def supports(weights: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> bool:
    """Whether these kernels take a layer's stacked weights (else vLLM's ops run):
    at most three slices of one dtype, laid out alike but for their row counts."""
    if not 1 <= len(weights) <= MAX_SLICES:
        return False
    try:
        views = [_as_slot_rows_cols(w) for w in weights]
    except ValueError:
        return False
    first = views[0]
    return all(
        v.stride()[1:] == first.stride()[1:]
        and v.dtype == first.dtype
        and v.size(2) == first.size(2)
        for v in views
    )


T = TypeVar("T")


def _three(values: Sequence[T], pad: T) -> list[T]:
    """One value per slice argument of the kernels; the unused ones are never read."""
    return [*values, *[pad] * (MAX_SLICES - len(values))]


def _slot_strides(views: list[torch.Tensor]) -> list[int]:
    """Each slice's stride between slots (slices of other widths differ)."""
    strides = [int(v.stride(0)) for v in views]
    return _three(strides, strides[0])


@functools.lru_cache(maxsize=8)
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 2  # the interpreter: a few programs, so the item loop is exercised
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def _grid(items: int, device: torch.device, config: GroupedConfig) -> tuple[int]:
    return (max(1, min(items, _multiprocessors(device) * config.blocks_per_sm)),)


def _chunks_at_most(tokens: int, groups: int, block_m: int) -> int:
    """The most row chunks ``tokens`` rows in ``groups`` groups can make (each
    group's last chunk may be partial): the grid's bound, whatever the step holds."""
    return triton.cdiv(tokens, block_m) + min(groups, tokens)


def _padded(n: int, least: int = 16) -> int:
    """A power of two for a block edge (``tl.dot`` wants at least 16)."""
    return max(least, triton.next_power_of_2(n))


#: The chunk heights of the plan ``serve`` fills once per step: a decode-sized
#: step's and a prefill-sized one's (:meth:`GroupedConfig.for_tokens`).
PLAN_HEIGHTS = (DEFAULT_CONFIG.block_m, DEFAULT_CONFIG.for_tokens(1 << 30).block_m)
#: Chunks per program of :func:`fill_plan`'s kernel.
_PLAN_CHUNKS = 32


@dataclass(frozen=True)
class RowChunkPlan:
    """A step's row chunks, worked out once for all of its LoRA launches.

    One int32 table per chunk height (``heights``): entry 0 holds the
    step's chunk count, entry ``c + 1`` chunk ``c``: its slot, then (from
    offset ``block_m``) the token indices of its rows, -1 past its group's
    end. An entry is ``2 * block_m`` values, at 16 rows one 128-byte line, so
    an item's two loads of it come from one line. Sized for ``tokens`` rows
    in ``groups`` groups, however they split.
    """

    heights: tuple[int, ...]
    tables: tuple[torch.Tensor, ...]

    def table(self, block_m: int) -> torch.Tensor | None:
        """The table of chunks ``block_m`` rows high, if this plan has one."""
        for height, table in zip(self.heights, self.tables):
            if height == block_m:
                return table
        return None


def new_plan(
    tokens: int, groups: int, device: torch.device, heights: Sequence[int] = PLAN_HEIGHTS
) -> RowChunkPlan:
    """An empty plan (no chunks) for steps of up to ``tokens`` rows in ``groups`` groups."""
    if not 1 <= len(heights) <= 2:
        raise ValueError(f"a plan holds one or two chunk heights, not {tuple(heights)}")
    tables = tuple(
        torch.zeros(
            (1 + _chunks_at_most(max(tokens, 1), groups, h)) * 2 * h,
            dtype=torch.int32,
            device=device,
        )
        for h in heights
    )
    return RowChunkPlan(tuple(heights), tables)


def fill_plan(
    plan: RowChunkPlan,
    token_indices_sorted_by_lora_ids: torch.Tensor,
    num_tokens_per_lora: torch.Tensor,
    lora_token_start_loc: torch.Tensor,
    lora_ids: torch.Tensor,
    num_groups: int,
) -> None:
    """Write the step's chunks (vLLM's kernel metadata: its first ``num_groups``
    groups) into every table of ``plan``: one launch, queued like the step's
    other work, so a CUDA graph replayed after it reads this step's plan."""
    heights, tables = plan.heights, plan.tables
    capacities = [t.numel() // (2 * h) - 1 for h, t in zip(heights, tables)]
    grid = (triton.cdiv(max(capacities), _PLAN_CHUNKS), len(heights))
    _plan_kernel[grid](
        tables[0],
        tables[-1],
        capacities[0],
        capacities[-1],
        token_indices_sorted_by_lora_ids,
        num_tokens_per_lora,
        lora_token_start_loc,
        lora_ids,
        num_groups,
        SMALL=heights[0],
        LARGE=heights[-1],
        GROUPS_P2=_padded(num_groups, 1),
        CHUNKS=_PLAN_CHUNKS,
    )


def _table_for(
    plan: RowChunkPlan | None,
    block_m: int,
    tokens: int,
    num_groups: int,
    sorted_ids: torch.Tensor,
    counts: torch.Tensor,
    starts: torch.Tensor,
    lora_ids: torch.Tensor,
) -> torch.Tensor:
    """``plan``'s table of ``block_m``-row chunks, or one filled now from the
    metadata for this launch alone (no plan given, or none of that height)."""
    table = plan.table(block_m) if plan is not None else None
    if table is not None:
        return table
    own = new_plan(tokens, num_groups, sorted_ids.device, (block_m,))
    fill_plan(own, sorted_ids, counts, starts, lora_ids, num_groups)
    return own.tables[0]


def grouped_shrink(
    inputs: torch.Tensor,
    lora_a_weights: list[torch.Tensor],
    output_tensor: torch.Tensor,
    token_indices_sorted_by_lora_ids: torch.Tensor,
    num_tokens_per_lora: torch.Tensor,
    lora_token_start_loc: torch.Tensor,
    lora_ids: torch.Tensor,
    num_groups: int,
    scaling: float,
    config: GroupedConfig = DEFAULT_CONFIG,
    plan: RowChunkPlan | None = None,
) -> None:
    """``output[s] = scaling * inputs @ A_s[slot].T`` per token (output zeroed first).

    ``num_groups``: how many entries of ``lora_ids`` to walk (vLLM's
    ``num_active_loras``: the captured count, or every slot plus the base).
    ``plan``: the step's row chunks (:func:`fill_plan`) of this metadata.
    """
    views = [_as_slot_rows_cols(w) for w in lora_a_weights]
    n, k = views[0].shape[-2:]
    slices = len(views)
    tokens = inputs.size(0)
    config = config.for_tokens(tokens)
    table = _table_for(
        plan, config.block_m, tokens, num_groups, token_indices_sorted_by_lora_ids,
        num_tokens_per_lora, lora_token_start_loc, lora_ids,
    )  # fmt: skip
    output_tensor.zero_()
    ptrs = _three(views, views[0])
    chunks = _chunks_at_most(tokens, num_groups, config.block_m)
    items = chunks * slices * triton.cdiv(k, config.block_k)
    _grouped_shrink_kernel[_grid(items, inputs.device, config)](
        inputs,
        *ptrs,
        output_tensor,
        table,
        k,
        n,
        scaling,
        inputs.stride(0),
        inputs.stride(1),
        *_slot_strides(views),
        views[0].stride(1),
        views[0].stride(2),
        output_tensor.stride(0),
        output_tensor.stride(1),
        output_tensor.stride(2),
        SLICES=slices,
        BLOCK_M=config.block_m,
        BLOCK_N=_padded(n),
        BLOCK_K=config.block_k,
        num_warps=config.num_warps,
    )


def grouped_expand(
    inputs: torch.Tensor,
    lora_b_weights: list[torch.Tensor],
    output_tensor: torch.Tensor,
    token_indices_sorted_by_lora_ids: torch.Tensor,
    num_tokens_per_lora: torch.Tensor,
    lora_token_start_loc: torch.Tensor,
    lora_ids: torch.Tensor,
    num_groups: int,
    offset_start: int = 0,
    add_inputs: bool = False,
    config: GroupedConfig = DEFAULT_CONFIG,
    plan: RowChunkPlan | None = None,
) -> None:
    """``output[:, col_s:col_s + n_s] (+)= inputs[s] @ B_s[slot].T`` per token.

    Slice ``s`` writes the columns after ``offset_start`` and the slices
    before it, as vLLM's ``lora_expand`` does.
    """
    views = [_as_slot_rows_cols(w) for w in lora_b_weights]
    slices = len(views)
    widths = [int(v.size(1)) for v in views]
    rank = int(views[0].size(2))
    cols = [offset_start + sum(widths[:i]) for i in range(slices)]
    tokens = inputs.size(1)
    config = config.for_tokens(tokens)
    table = _table_for(
        plan, config.block_m, tokens, num_groups, token_indices_sorted_by_lora_ids,
        num_tokens_per_lora, lora_token_start_loc, lora_ids,
    )  # fmt: skip
    n_blocks = triton.cdiv(max(widths), config.block_n)
    output = output_tensor.view(-1, output_tensor.size(-1))
    items = _chunks_at_most(tokens, num_groups, config.block_m) * slices * n_blocks
    _grouped_expand_kernel[_grid(items, inputs.device, config)](
        inputs,
        *_three(views, views[0]),
        output,
        table,
        n_blocks,
        rank,
        *_three(widths, 0),
        *_three(cols, 0),
        inputs.stride(0),
        inputs.stride(1),
        inputs.stride(2),
        *_slot_strides(views),
        views[0].stride(1),
        views[0].stride(2),
        output.stride(0),
        output.stride(1),
        SLICES=slices,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_R=_padded(rank),
        ADD_INPUTS=add_inputs,
        num_warps=config.num_warps,
    )
