"""One adapter's LoRA inside the base GEMM: ``[x | x A^T] @ [W | B]^T``.

A decode step's LoRA costs the base model's step most in the launches that
run *after* each GEMM (the expand reads and rewrites the layer's whole
output, 6 us a layer at 64 tokens on an H200) and in the second stream's
fork and join around it. Neither is bandwidth: one rank-64 adapter is 0.07
ms of HBM time per step. Here the expand runs inside the base GEMM itself:
the layer's weight is stored ``rank`` columns wider per slice (``[W | B_s]``,
:func:`widen`, :func:`stage`), and one kernel before the GEMM
(:func:`shrink_pack`) writes the GEMM's input as ``[x | scaling * x A_s^T]``.
cuBLAS then reads ``B`` with ``W`` (1.6% more bytes at K 4096, three slices)
and adds the LoRA term in its fp32 accumulator, rounding once, where vLLM
rounds the base output and the LoRA term apart.

It serves the rows of one slot (the packed adapter): rows of any other slot
or of the base model get a zero LoRA input, so their output is the base
model's. The base GEMM alone reads the first ``K`` columns (a strided view,
which cuBLAS takes as is).

The shrink splits ``K`` over the grid and adds partial products with atomics
into an fp32 workspace; the program that finishes a slice last (a counter
per slice) rounds the slice's sums into the packed input and clears the
workspace and counter for the next launch, so one launch is the whole
shrink: no memset before it, no second kernel after it.

Pure Triton and torch: runs on a GPU, and on the CPU under Triton's
interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .grouped_lora import _pick

#: Slices a packed layer holds (q/k/v is three).
MAX_SLICES = 3


@dataclass(frozen=True)
class PackConfig:
    """The shrink's tiles: ``block_m`` rows per pass, ``block_k`` columns of
    ``K`` per program (its split-K unit: K / block_k programs per slice)."""

    block_m: int = 64
    block_k: int = 256
    num_warps: int = 4
    atomic_sem: str = "relaxed"
    fence: bool = True


DEFAULT_PACK = PackConfig()


@dataclass(frozen=True)
class PackScratch:
    """The shrink's fp32 workspace (slices x rows x rank, zero between
    launches) and one int32 counter per slice (zero between launches).
    Launches that share it must be ordered (one stream)."""

    sums: torch.Tensor
    counters: torch.Tensor


def new_scratch(tokens: int, rank: int, device: torch.device) -> PackScratch:
    """Scratch for launches of up to ``tokens`` rows at ``rank``."""
    return PackScratch(
        torch.zeros(MAX_SLICES, tokens, rank, dtype=torch.float32, device=device),
        torch.zeros(MAX_SLICES, dtype=torch.int32, device=device),
    )


def packed_width(k: int, slices: int, rank: int) -> int:
    """Columns of a packed layer's weight and input: ``K`` then ``rank`` per slice."""
    return k + slices * rank


def widen(weight: torch.Tensor, slices: int, rank: int) -> torch.Tensor:
    """``weight`` (N x K) copied into an N x (K + slices * rank) tensor whose
    extra columns are zero (no adapter staged)."""
    n, k = weight.shape
    wide = torch.zeros(n, packed_width(k, slices, rank), dtype=weight.dtype, device=weight.device)
    wide[:, :k].copy_(weight)
    return wide


def base_view(wide: torch.Tensor, k: int) -> torch.Tensor:
    """The base weight inside a widened one (row stride ``K + slices * rank``)."""
    return wide[:, :k]


def stage(wide: torch.Tensor, k: int, widths: Sequence[int], b: Sequence[torch.Tensor]) -> None:
    """Write one adapter's ``B`` into ``wide``: slice ``s`` (rows of width
    ``widths[s]``, in order) gets ``b[s]`` (width x rank) in its own ``rank``
    columns, zero in the other slices' (queued on the current stream)."""
    rank = b[0].size(-1)
    wide[:, k:].zero_()
    row = 0
    for s, (width, part) in enumerate(zip(widths, b)):
        wide[row : row + width, k + s * rank : k + (s + 1) * rank].copy_(part)
        row += width


@triton.jit
def _fence(like):
    """``fence.acq_rel.gpu`` in every thread holding an element of ``like``:
    each thread's atomics into the workspace are performed before the
    program's counter moves (a barrier alone orders only their issue; on an
    H200 a 256-row shrink lost partial sums without it, and with it run
    over a 64-element vector at 8 warps, where some threads hold none)."""
    tl.inline_asm_elementwise(
        "fence.acq_rel.gpu;\nmov.b32 $0, $1;", "=r,r", [like], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def _shrink_pack_kernel(
    x_ptr,
    a0_ptr,
    a1_ptr,
    a2_ptr,
    out_ptr,
    sums_ptr,
    counters_ptr,
    mapping_ptr,
    slot_ptr,
    M,
    K,
    R,
    scaling,
    x_s0,
    x_s1,
    as0_0,
    as0_1,
    as0_2,
    a_s1,
    a_s2,
    out_s0,
    sums_s0,
    sums_s1,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    FENCE: tl.constexpr,
    ATOMIC_SEM: tl.constexpr,
):
    """Program (slice s, K block kb): out[:, kb-block] = x's (slice 0 only);
    sums[s] += scaling * x[:, kb-block] @ A_s[slot][:, kb-block].T on the
    packed slot's rows; the slice's last program writes
    out[:, K + s*R + r] = sums[s] and clears sums[s] and its counter."""
    pid = tl.program_id(0)
    k_blocks = tl.cdiv(K, BLOCK_K)
    s = pid // k_blocks
    kb = pid % k_blocks
    slot = tl.load(slot_ptr)
    # Slot -1 packs nothing: no row's slot matches -2 (the base model's is -1).
    target = tl.where(slot >= 0, slot, -2)
    slot = tl.maximum(slot, 0)
    a_ptr = _pick(s, a0_ptr, a1_ptr, a2_ptr)
    a_s0 = _pick(s, as0_0, as0_1, as0_2)
    offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, BLOCK_R)
    k_mask = offs_k < K
    r_mask = offs_r < R
    a = tl.load(
        a_ptr + slot * a_s0 + offs_r[None, :] * a_s1 + offs_k[:, None] * a_s2,
        mask=k_mask[:, None] & r_mask[None, :],
        other=0.0,
    )
    # Each thread's atomics return before the program's counter moves: the
    # count below depends on every value they return (the compiler cannot
    # know it is zero), so no partial sum lands after the slice's last
    # program has read the sums.
    landed = pid * 0  # an int32 the loop carries (a literal would be a constexpr)
    for m0 in range(0, M, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        m_mask = rows < M
        x = tl.load(
            x_ptr + rows[:, None] * x_s0 + offs_k[None, :] * x_s1,
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        if s == 0:
            tl.store(
                out_ptr + rows[:, None] * out_s0 + offs_k[None, :],
                x,
                mask=m_mask[:, None] & k_mask[None, :],
            )
        mine = tl.load(mapping_ptr + rows, mask=m_mask, other=-1) == target
        part = tl.dot(x, a) * scaling
        before = tl.atomic_add(
            sums_ptr + s * sums_s0 + rows[:, None] * sums_s1 + offs_r[None, :],
            part,
            mask=(m_mask & mine)[:, None] & r_mask[None, :],
            sem=ATOMIC_SEM,
        )
        landed += tl.sum(tl.sum(tl.where(before == before, 0, 1), axis=1), axis=0)
    if FENCE:  # over a tile as wide as the atomics', so that every thread runs it
        _fence(tl.arange(0, BLOCK_M)[:, None] + offs_r[None, :])
    tl.debug_barrier()
    arrived = tl.atomic_add(counters_ptr + s, 1 + tl.minimum(landed, 0), sem="acq_rel")
    if arrived == k_blocks - 1:
        if FENCE:
            _fence(tl.arange(0, BLOCK_M)[:, None] + offs_r[None, :])
        for m0 in range(0, M, BLOCK_M):
            rows = m0 + tl.arange(0, BLOCK_M)
            mask = (rows < M)[:, None] & r_mask[None, :]
            at = sums_ptr + s * sums_s0 + rows[:, None] * sums_s1 + offs_r[None, :]
            total = tl.load(at, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(
                out_ptr + rows[:, None] * out_s0 + K + s * R + offs_r[None, :],
                total.to(out_ptr.dtype.element_ty),
                mask=mask,
            )
            tl.store(at, tl.zeros_like(total), mask=mask)
        tl.atomic_xchg(counters_ptr + s, 0, sem="relaxed")


def _slot_view(weight: torch.Tensor) -> torch.Tensor:
    """vLLM's stacked A is (slots, 1, rank, K) or (slots, rank, K)."""
    return weight[:, 0] if weight.ndim == 4 else weight


def shrink_pack(
    x: torch.Tensor,
    lora_a: Sequence[torch.Tensor],
    out: torch.Tensor,
    slot: torch.Tensor,
    token_slots: torch.Tensor,
    scratch: PackScratch,
    scaling: float = 1.0,
    config: PackConfig = DEFAULT_PACK,
) -> None:
    """Write ``out`` (M x (K + slices * rank), contiguous rows) as ``x`` then,
    per slice ``s``, ``scaling * x @ A_s[slot].T`` on the rows whose
    ``token_slots`` entry is ``slot`` (a one-element int32 device tensor;
    -1: no adapter) and zero on the others. ``lora_a``: one stacked A per
    slice, as vLLM holds them."""
    views = [_slot_view(a) for a in lora_a]
    if not 1 <= len(views) <= MAX_SLICES:
        raise ValueError(f"{len(views)} slices: a packed layer holds 1 to {MAX_SLICES}")
    m, k = x.shape
    rank = views[0].size(1)
    if out.shape != (m, packed_width(k, len(views), rank)) or out.stride(1) != 1:
        raise ValueError(f"packed input of shape {tuple(out.shape)} for x {tuple(x.shape)}")
    if scratch.sums.size(1) < m or scratch.sums.size(2) < rank:
        raise ValueError(f"scratch for {scratch.sums.size(1)} rows, rank {scratch.sums.size(2)}")
    padded = [*views, *[views[0]] * (MAX_SLICES - len(views))]
    grid = (len(views) * triton.cdiv(k, config.block_k),)
    _shrink_pack_kernel[grid](
        x,
        *padded,
        out,
        scratch.sums,
        scratch.counters,
        token_slots,
        slot,
        m,
        k,
        rank,
        scaling,
        x.stride(0),
        x.stride(1),
        *[v.stride(0) for v in padded],
        views[0].stride(1),
        views[0].stride(2),
        out.stride(0),
        scratch.sums.stride(0),
        scratch.sums.stride(1),
        BLOCK_M=min(config.block_m, max(16, triton.next_power_of_2(m))),
        BLOCK_K=config.block_k,
        BLOCK_R=max(16, triton.next_power_of_2(rank)),
        FENCE=x.is_cuda and config.fence,  # the interpreter runs programs one after another
        ATOMIC_SEM=config.atomic_sem,
        num_warps=config.num_warps,
    )
