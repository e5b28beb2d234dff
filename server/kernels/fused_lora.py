"""A LoRA layer in one launch: shrink, a grid barrier, then expand.

Why: with the grouped kernels (:mod:`.grouped_lora`) one decode step of the
8B shape runs 128 LoRA layers as 384 dependent graph nodes (the shrink
buffer's zeroing, the shrink, the expand), each a launch plus two or three
dependent memory rounds: 1.56 ms of a 6.6 ms step at one adapter, whose
bytes take 0.07 ms to read. This kernel does a layer's LoRA in one node:

1. the shrink's split-K items (one per row chunk of one adapter, slice and K
   block, as :func:`.grouped_lora.grouped_shrink`) add their products into
   a float32 workspace with atomics;
2. every program waits at a grid barrier (an arrival counter and a
   generation, both on the device) until the shrink is whole;
3. the expand's items (row chunk, slice, N block) read the shrunk rows back
   and add ``shrunk @ B`` into the layer's output.

A spinning barrier is safe only if every program of the grid is resident at
once, so the grid is sized from the compiled kernel's registers and shared
memory (:func:`_resident_programs`), never above the device's room.

The workspace has two halves that alternate by the barrier's generation:
a launch adds into the half the launch before it zeroed, and zeroes the half
that launch used (its extent kept on the device), so no launch waits for a
memset and nothing lives on the host. CUDA graphs capture and replay it as
they are; every launch on a device's workspace must run in stream order
(one stream, as vLLM's forward pass does).

Under Triton's interpreter (the CPU tests) programs run one after another,
so the grid is one program there: the barrier passes at once and the phases
still run in order.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .grouped_lora import (
    DEFAULT_CONFIG,
    GroupedConfig,
    RowChunkPlan,
    _as_slot_rows_cols,
    _chunks_at_most,
    _multiprocessors,
    _padded,
    _pick,
    _plan_entry,
    _slot_strides,
    _table_for,
    _three,
    supports,
)

#: Float32 values each program zeroes per pass over the stale workspace half.
_ZERO_BLOCK = 1024
#: The sync tensor: arrivals, generation, then each half's used extent.
_SYNC_FIELDS = 4


@dataclass(frozen=True)
class FusedWorkspace:
    """A device's shrink workspace and barrier state (see the module's docstring).

    ``work``: two halves of ``half`` float32 values, zero but for what the
    last launch used; ``sync``: int32 arrivals, generation, extent of half 0,
    extent of half 1.
    """

    work: torch.Tensor
    sync: torch.Tensor

    @property
    def half(self) -> int:
        return self.work.numel() // 2

    def fits(self, slices: int, tokens: int, rank: int) -> bool:
        """Whether a launch of ``slices`` x ``tokens`` x ``rank`` shrunk values fits a half."""
        return slices * tokens * rank <= self.half


def new_workspace(tokens: int, rank: int, device: torch.device) -> FusedWorkspace:
    """A zeroed workspace for layers of up to three slices, ``tokens`` rows and ``rank``."""
    half = 3 * max(tokens, 1) * max(rank, 1)
    return FusedWorkspace(
        work=torch.zeros(2 * half, dtype=torch.float32, device=device),
        sync=torch.zeros(_SYNC_FIELDS, dtype=torch.int32, device=device),
    )


@triton.jit
def _grid_barrier(sync_ptr, generation, programs):
    """Wait until every program of the grid has arrived (cooperative groups'
    grid sync: block barrier, one thread's release/acquire, block barrier).
    The last to arrive resets the count and moves the generation on."""
    tl.debug_barrier()
    arrived = tl.atomic_add(sync_ptr, 1, sem="acq_rel")
    if arrived == programs - 1:
        tl.atomic_xchg(sync_ptr, 0, sem="relaxed")
        tl.atomic_add(sync_ptr + 1, 1, sem="release")
    else:
        seen = generation
        while seen == generation:
            seen = tl.atomic_add(sync_ptr + 1, 0, sem="acquire")
    tl.debug_barrier()


@triton.jit
def _fused_lora_kernel(
    x_ptr,
    a0_ptr,
    a1_ptr,
    a2_ptr,
    b0_ptr,
    b1_ptr,
    b2_ptr,
    y_ptr,
    plan_ptr,
    work_ptr,
    sync_ptr,
    tokens,
    half,
    K,
    R,
    n0,
    n1,
    n2,
    col0,
    col1,
    col2,
    n_blocks,
    scaling,
    x_s0,
    x_s1,
    as0_0,
    as0_1,
    as0_2,
    a_s1,
    a_s2,
    bs0_0,
    bs0_1,
    bs0_2,
    b_s1,
    b_s2,
    y_s0,
    y_s1,
    SLICES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    ZERO_BLOCK: tl.constexpr,
    ADD_INPUTS: tl.constexpr,
):
    """y[t, col_s + n] (+)= (scaling * x[t] @ A_s[slot(t)].T) @ B_s[slot(t)][n].T."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    generation = tl.atomic_add(sync_ptr + 1, 0, sem="relaxed")
    parity = generation & 1
    work = work_ptr + parity * half
    # The half the launch before this one used: zeroed now for the next launch.
    stale = work_ptr + (1 - parity) * half
    dirty = tl.atomic_add(sync_ptr + 3 - parity, 0, sem="relaxed")
    offs_z = tl.arange(0, ZERO_BLOCK)
    for start in range(pid * ZERO_BLOCK, dirty, programs * ZERO_BLOCK):
        tl.store(
            stale + start + offs_z, tl.zeros([ZERO_BLOCK], tl.float32), mask=start + offs_z < dirty
        )
    if pid == 0:
        tl.store(sync_ptr + 2 + parity, SLICES * tokens * R)

    chunks = tl.load(plan_ptr)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    k_blocks = tl.cdiv(K, BLOCK_K)
    shrink_items = SLICES * k_blocks
    for item in range(pid, chunks * shrink_items, programs):
        chunk = item // shrink_items
        rest = item % shrink_items
        s = rest // k_blocks
        kb = rest % k_blocks
        slot, rows, m_mask = _plan_entry(plan_ptr, chunk, BLOCK_M)
        a_ptr = _pick(s, a0_ptr, a1_ptr, a2_ptr)
        a_s0 = _pick(s, as0_0, as0_1, as0_2)
        offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a = tl.load(
            a_ptr + slot * a_s0 + offs_r[None, :] * a_s1 + offs_k[:, None] * a_s2,
            mask=k_mask[:, None] & r_mask[None, :],
            other=0.0,
        )
        x = tl.load(
            x_ptr + rows[:, None] * x_s0 + offs_k[None, :] * x_s1,
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        tl.atomic_add(
            work + s * tokens * R + rows[:, None] * R + offs_r[None, :],
            tl.dot(x, a) * scaling,
            mask=m_mask[:, None] & r_mask[None, :],
            sem="relaxed",
        )

    _grid_barrier(sync_ptr, generation, programs)

    expand_items = SLICES * n_blocks
    for item in range(pid, chunks * expand_items, programs):
        chunk = item // expand_items
        rest = item % expand_items
        s = rest // n_blocks
        nb = rest % n_blocks
        n_s = _pick(s, n0, n1, n2)
        if nb * BLOCK_N < n_s:
            slot, rows, m_mask = _plan_entry(plan_ptr, chunk, BLOCK_M)
            b_ptr = _pick(s, b0_ptr, b1_ptr, b2_ptr)
            b_s0 = _pick(s, bs0_0, bs0_1, bs0_2)
            col = _pick(s, col0, col1, col2)
            offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
            n_mask = offs_n < n_s
            b = tl.load(
                b_ptr + slot * b_s0 + offs_n[None, :] * b_s1 + offs_r[:, None] * b_s2,
                mask=r_mask[:, None] & n_mask[None, :],
                other=0.0,
            )
            # Written by other programs' atomics (in L2): read past L1.
            shrunk = tl.load(
                work + s * tokens * R + rows[:, None] * R + offs_r[None, :],
                mask=m_mask[:, None] & r_mask[None, :],
                other=0.0,
                cache_modifier=".cg",
            )
            acc = tl.dot(shrunk.to(b.dtype), b)
            y_ptrs = y_ptr + rows[:, None] * y_s0 + (col + offs_n)[None, :] * y_s1
            mask = m_mask[:, None] & n_mask[None, :]
            if ADD_INPUTS:
                acc += tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
            tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)


@functools.lru_cache(maxsize=64)
def _resident_per_sm(device_index: int, regs: int, shared: int, num_warps: int) -> int:
    """How many programs of a kernel with these needs one SM holds at once."""
    props = torch.cuda.get_device_properties(device_index)
    threads = num_warps * 32
    by_threads = int(getattr(props, "max_threads_per_multi_processor", 2048)) // threads
    regs_per_warp = -(-max(regs, 1) * 32 // 256) * 256
    by_regs = int(getattr(props, "regs_per_multiprocessor", 65536)) // (regs_per_warp * num_warps)
    smem = int(getattr(props, "shared_memory_per_multiprocessor", 233472))
    by_smem = smem // (shared + 1024) if shared else by_threads
    return max(1, min(by_threads, by_regs, by_smem, 32))


#: Programs per SM that each compiled variant's grid may use (filled after its
#: first launch, which runs one program per SM: always resident).
_per_sm: dict[tuple[object, ...], int] = {}


def _resident_programs(device: torch.device, key: tuple[object, ...], config: GroupedConfig) -> int:
    """The grid: every program resident at once (the barrier needs it)."""
    if device.type != "cuda":
        return 1  # the interpreter runs programs one after another
    per_sm = min(config.blocks_per_sm, _per_sm.get(key, 1))
    return _multiprocessors(device) * per_sm


def fused_lora(
    output: torch.Tensor,
    inputs: torch.Tensor,
    lora_a_weights: list[torch.Tensor] | tuple[torch.Tensor, ...],
    lora_b_weights: list[torch.Tensor] | tuple[torch.Tensor, ...],
    scaling: float,
    token_indices_sorted_by_lora_ids: torch.Tensor,
    num_tokens_per_lora: torch.Tensor,
    lora_token_start_loc: torch.Tensor,
    lora_ids: torch.Tensor,
    num_groups: int,
    workspace: FusedWorkspace,
    offset_start: int = 0,
    add_inputs: bool = True,
    config: GroupedConfig = DEFAULT_CONFIG,
    plan: RowChunkPlan | None = None,
) -> None:
    """``output[:, col_s:col_s + n_s] (+)= (scaling * inputs @ A_s.T) @ B_s.T``
    per token with its adapter's slot: vLLM's ``add_lora_linear`` in one launch.

    The arguments are ``grouped_shrink``'s and ``grouped_expand``'s;
    ``workspace`` must fit the launch (:meth:`FusedWorkspace.fits`, checked)
    and belong to the device.
    """
    a_views = [_as_slot_rows_cols(w) for w in lora_a_weights]
    b_views = [_as_slot_rows_cols(w) for w in lora_b_weights]
    slices = len(a_views)
    if not (supports(a_views) and supports(b_views) and len(b_views) == slices):
        raise ValueError("fused_lora takes 1 to 3 slices laid out alike (see supports())")
    rank, k = (int(d) for d in a_views[0].shape[-2:])
    widths = [int(v.size(1)) for v in b_views]
    tokens = inputs.size(0)
    if not workspace.fits(slices, tokens, rank):
        raise ValueError(
            f"fused_lora: {slices} x {tokens} x {rank} shrunk values exceed the workspace's "
            f"{workspace.half}"
        )
    config = config.for_tokens(tokens)
    table = _table_for(
        plan, config.block_m, tokens, num_groups, token_indices_sorted_by_lora_ids,
        num_tokens_per_lora, lora_token_start_loc, lora_ids,
    )  # fmt: skip
    cols = [offset_start + sum(widths[:i]) for i in range(slices)]
    n_blocks = triton.cdiv(max(widths), config.block_n)
    out = output.view(-1, output.size(-1))
    block_r = _padded(rank)
    constexprs = {
        "SLICES": slices,
        "BLOCK_M": config.block_m,
        "BLOCK_K": config.block_k,
        "BLOCK_N": config.block_n,
        "BLOCK_R": block_r,
        "ZERO_BLOCK": _ZERO_BLOCK,
        "ADD_INPUTS": add_inputs,
    }
    key = (inputs.device, inputs.dtype, out.dtype, config.num_warps, *constexprs.values())
    chunks = _chunks_at_most(tokens, num_groups, config.block_m)
    items = chunks * slices * max(triton.cdiv(k, config.block_k), n_blocks)
    grid = (max(1, min(items, _resident_programs(inputs.device, key, config))),)
    compiled = _fused_lora_kernel[grid](
        inputs,
        *_three(a_views, a_views[0]),
        *_three(b_views, b_views[0]),
        out,
        table,
        workspace.work,
        workspace.sync,
        tokens,
        workspace.half,
        k,
        rank,
        *_three(widths, 0),
        *_three(cols, 0),
        n_blocks,
        scaling,
        inputs.stride(0),
        inputs.stride(1),
        *_slot_strides(a_views),
        a_views[0].stride(1),
        a_views[0].stride(2),
        *_slot_strides(b_views),
        b_views[0].stride(1),
        b_views[0].stride(2),
        out.stride(0),
        out.stride(1),
        num_warps=config.num_warps,
        **constexprs,
    )
    if key not in _per_sm and inputs.device.type == "cuda":
        index = inputs.device.index if inputs.device.index is not None else 0
        _per_sm[key] = _resident_per_sm(
            index, int(compiled.n_regs), int(compiled.metadata.shared), config.num_warps
        )
