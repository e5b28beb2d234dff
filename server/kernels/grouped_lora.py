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
list of work items: one per (adapter present in the step, slice, K block)
for the shrink and (adapter, slice, N block) for the expand. An item loads
its tile of the adapter's weights once and applies it to every token of
that adapter, in chunks of ``block_m`` rows. The walk stops after the
last group that holds tokens (vLLM lists a step's adapters first), so the
empty slots of a graph captured for more adapters than the step holds cost
nothing but one vector load. They take the same arguments as vLLM's ops, so they replace
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
    ``walk_active``: walk the groups only up to the last one that holds
    tokens (vLLM lists a step's adapters first, then empty padding up to
    the captured count), not every captured group: with one adapter in a
    graph captured for 33 groups, the walk over every group spent most of
    its time on the empty groups' scalar loads.
    """

    block_m: int = 16
    block_k: int = 256
    block_n: int = 128
    num_warps: int = 4
    blocks_per_sm: int = 4
    walk_active: bool = True

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
def _groups_to_walk(count_ptr, num_groups, GROUPS_P2: tl.constexpr, WALK_ACTIVE: tl.constexpr):
    """How many of the ``num_groups`` groups to walk: all, or up to the last
    that holds tokens (one vector load, the same in every program)."""
    if WALK_ACTIVE:
        offs = tl.arange(0, GROUPS_P2)
        counts = tl.load(count_ptr + offs, mask=offs < num_groups, other=0)
        walked = tl.max(tl.where(counts > 0, offs + 1, 0), axis=0)
    else:
        walked = num_groups
    return walked


@triton.jit
def _grouped_shrink_kernel(
    x_ptr,
    w0_ptr,
    w1_ptr,
    w2_ptr,
    out_ptr,
    sorted_ptr,
    count_ptr,
    start_ptr,
    slot_ptr,
    num_groups,
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
    GROUPS_P2: tl.constexpr,
    WALK_ACTIVE: tl.constexpr,
):
    """out[s, t, :] += scaling * x[t, :] @ W_s[slot(t)].T, one item per (group, slice, K block)."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    k_blocks = tl.cdiv(K, BLOCK_K)
    per_group = SLICES * k_blocks
    total = _groups_to_walk(count_ptr, num_groups, GROUPS_P2, WALK_ACTIVE) * per_group
    offs_n = tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    for item in range(pid, total, programs):
        group = item // per_group
        rest = item % per_group
        s = rest // k_blocks
        kb = rest % k_blocks
        # The three loads in flight at once: none waits for another's answer.
        slot = tl.load(slot_ptr + group)
        rows_n = tl.load(count_ptr + group)
        first = tl.load(start_ptr + group)
        if (slot >= 0) & (rows_n > 0):
            w_ptr = _pick(s, w0_ptr, w1_ptr, w2_ptr)
            w_s0 = _pick(s, ws0_0, ws0_1, ws0_2)
            offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
            k_mask = offs_k < K
            b = tl.load(
                w_ptr + slot * w_s0 + offs_n[None, :] * w_s1 + offs_k[:, None] * w_s2,
                mask=k_mask[:, None] & n_mask[None, :],
                other=0.0,
            )
            for m0 in range(0, rows_n, BLOCK_M):
                offs_m = m0 + tl.arange(0, BLOCK_M)
                m_mask = offs_m < rows_n
                rows = tl.load(sorted_ptr + first + offs_m, mask=m_mask, other=0)
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
    sorted_ptr,
    count_ptr,
    start_ptr,
    slot_ptr,
    num_groups,
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
    GROUPS_P2: tl.constexpr,
    WALK_ACTIVE: tl.constexpr,
):
    """out[t, col_s + n] (+)= in[s, t, :] @ W_s[slot(t)][n, :].

    One item per (group, slice, N block)."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    per_group = SLICES * n_blocks
    total = _groups_to_walk(count_ptr, num_groups, GROUPS_P2, WALK_ACTIVE) * per_group
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    for item in range(pid, total, programs):
        group = item // per_group
        rest = item % per_group
        s = rest // n_blocks
        nb = rest % n_blocks
        slot = tl.load(slot_ptr + group)
        rows_n = tl.load(count_ptr + group)
        first = tl.load(start_ptr + group)
        n_s = _pick(s, n0, n1, n2)
        if (slot >= 0) & (rows_n > 0) & (nb * BLOCK_N < n_s):
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
            for m0 in range(0, rows_n, BLOCK_M):
                offs_m = m0 + tl.arange(0, BLOCK_M)
                m_mask = offs_m < rows_n
                rows = tl.load(sorted_ptr + first + offs_m, mask=m_mask, other=0)
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


def _padded(n: int, least: int = 16) -> int:
    """A power of two for a block edge (``tl.dot`` wants at least 16)."""
    return max(least, triton.next_power_of_2(n))


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
) -> None:
    """``output[s] = scaling * inputs @ A_s[slot].T`` per token (output zeroed first).

    ``num_groups``: how many entries of ``lora_ids`` to walk (vLLM's
    ``num_active_loras``: the captured count, or every slot plus the base).
    """
    views = [_as_slot_rows_cols(w) for w in lora_a_weights]
    n, k = views[0].shape[-2:]
    slices = len(views)
    config = config.for_tokens(inputs.size(0))
    output_tensor.zero_()
    ptrs = _three(views, views[0])
    items = num_groups * slices * triton.cdiv(k, config.block_k)
    _grouped_shrink_kernel[_grid(items, inputs.device, config)](
        inputs,
        *ptrs,
        output_tensor,
        token_indices_sorted_by_lora_ids,
        num_tokens_per_lora,
        lora_token_start_loc,
        lora_ids,
        num_groups,
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
        GROUPS_P2=_padded(num_groups, 1),
        WALK_ACTIVE=config.walk_active,
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
    config = config.for_tokens(inputs.size(1))
    n_blocks = triton.cdiv(max(widths), config.block_n)
    output = output_tensor.view(-1, output_tensor.size(-1))
    items = num_groups * slices * n_blocks
    _grouped_expand_kernel[_grid(items, inputs.device, config)](
        inputs,
        *_three(views, views[0]),
        output,
        token_indices_sorted_by_lora_ids,
        num_tokens_per_lora,
        lora_token_start_loc,
        lora_ids,
        num_groups,
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
        GROUPS_P2=_padded(num_groups, 1),
        WALK_ACTIVE=config.walk_active,
        num_warps=config.num_warps,
    )
