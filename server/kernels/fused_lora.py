"""A linear LoRA layer's base GEMM with its LoRA inside: one launch a layer.

Why: in a decode step a layer's LoRA shrink and expand are tiny and bound
by latency. Beside the base GEMM on a second stream (:mod:`.overlap`) they
still add about 8 us a layer, 1 ms of the 8B model's 6.6 ms step at one
adapter. Here the GEMM's own launch does both: the expand in its epilogue,
the shrink in split-K pieces that the launch's first programs run while
the others stream the weights (``benchmarks.lora_in_gemm`` has the figures;
``docs/gpu.md`` the story).

One launch: its programs are ``P`` pieces, then the output tiles.

* Every program takes a ticket (one 64-bit atomic add): the low half
  numbers the launch's programs, the high half counts launches. The program
  holding a launch's last ticket moves the high half on and clears the low
  one, so nothing is reset at the end and each program knows its launch's
  number. Roles follow program ids, the pieces first (the hardware starts
  programs in id order in practice, so tiles that wait do not keep the
  pieces off the SMs), and the ticket is awaited only where its launch number is needed;
  ``ticket_roles``: roles follow tickets, whatever the start order, at the
  price of the ticket's round trip before any work.
* A piece, (slice, ``PIECE`` columns of K), adds ``x[:, cols] A_a[:, cols]^T``
  for each adapter ``a`` in the step into that adapter's rows of an fp32
  workspace, then counts itself done.
* A tile computes ``x W[tile]^T`` (plus the bias), waits until every piece
  is counted, then adds ``shrunk rows of a`` times ``B_a[tile]^T`` for each
  adapter ``a``.
* The workspace and count come twice, for launches of even and of odd
  number; each launch zeroes the copy the next one uses, a share per
  program, so no program tidies up after the others.

**One wave.** A decode step's layer is a few microseconds of HBM reads:
a second wave of programs costs about as much as the first. Two things
keep the launch in one: the registers (``Tiles.max_registers``: Triton
gives the program up to 146 a thread on the 8B model's gate/up tiles,
ptxas for sm_90, three programs an SM where their shared memory allows
four, and its 448 tiles then need two waves of 132 SMs; capped at 128 a
thread, four fit), and the lanes (by default as many as the wave's free
slots take: :func:`lanes_for`).

One workspace per device and rank serves every layer: launches on one
stream run one after another, so a launch's zeroing is done before the
next starts (vLLM runs a model's layers, and replays its CUDA graphs, on
one stream). :func:`supports` says which layers and steps it takes
(unquantized weights, at most three slices, at most :data:`MAX_TOKENS`
rows, ranks 16 to 128); the caller runs its other path for the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .grouped_lora import MAX_SLICES, _as_slot_rows_cols, _pick, _three

#: The most rows a step may have here: one row block (decode-sized steps).
MAX_TOKENS = 64
#: The ranks the pieces' and the epilogue's ``tl.dot`` take.
RANKS = (16, 32, 64, 128)
#: Columns of K a piece reads at once: it holds no more shared memory than
#: the GEMM's tiles (wider reads doubled it at 256, sm_90).
CHUNK_K = 64
#: A piece's columns of K, the widest of these that divides K: fewer pieces,
#: fewer atomics (512 was faster than 256 on every layer of the 8B shape).
PIECE_KS = (512, 256, 128, 64)
#: Rows of the workspace per slice: a launch's zeroing covers the whole copy,
#: so launches of any row count and slice count may follow each other.
_WORKSPACE_ROWS = MAX_TOKENS
#: The most pieces a (slice, columns) of the shrink is split over by adapter:
#: one adapter's shrink is one piece's work, several adapters' are spread.
MAX_LANES = 4
#: Warps a program runs (128 threads), and the 32-bit registers of an SM
#: (sm_80 and sm_90): what bounds the registers a thread may use.
NUM_WARPS = 4
_SM_REGISTERS = 65536
#: An SM's shared memory on sm_90, whose tiles these are (228 KiB), and what
#: each resident program reserves beside its own.
_SM_SHARED_BYTES = 228 * 1024
_PROGRAM_RESERVED_SHARED = 1024


@dataclass(frozen=True)
class Tiles:
    """A tile's width (columns of N), its K step and its pipeline depth."""

    block_n: int
    block_k: int
    stages: int

    @property
    def shared_bytes(self) -> int:
        """The pipeline's shared memory: ``stages`` blocks of x (up to
        :data:`MAX_TOKENS` rows) and of W, ``block_k`` deep, 16-bit floats."""
        return self.stages * (MAX_TOKENS + self.block_n) * self.block_k * 2

    def per_sm(self) -> int:
        """Programs an SM holds, as their shared memory allows."""
        return max(1, _SM_SHARED_BYTES // (self.shared_bytes + _PROGRAM_RESERVED_SHARED))

    def max_registers(self) -> int | None:
        """The registers a thread may use so that the registers hold as many
        programs as the shared memory does (a multiple of 8; None: no bound
        under the hardware's 255)."""
        bound = _SM_REGISTERS // (self.per_sm() * NUM_WARPS * 32) // 8 * 8
        return bound if bound < 255 else None


def tiles_for(widths: tuple[int, ...], k: int) -> Tiles | None:
    """The tiles for a layer of these slice widths and fan-in (None: none fit).

    The best per layer of the 8B shape at 64 tokens on an H200: 64 x 128 in
    6 stages, but 64 x 64 in 3 for the wide gate/up layer (28,672 columns);
    narrower tiles only where a slice's width asks for them."""
    block_n = next((bn for bn in (64, 32, 16) if all(w % bn == 0 for w in widths)), None)
    if block_n is None:
        return None
    wide = sum(widths) >= 16384
    block_k = next((bk for bk in ((64,) if wide else (128, 64)) if k % bk == 0), None)
    if block_k is None:
        return None
    return Tiles(block_n, block_k, 3 if wide else 6)


def lanes_for(tiles: int, pieces_per_lane: int, slots: int) -> int:
    """The most lanes (up to :data:`MAX_LANES`, at least one) whose pieces fit
    beside ``tiles`` output tiles in one wave of ``slots`` resident programs."""
    return max(1, min(MAX_LANES, (slots - tiles) // pieces_per_lane))


def _device_slots(device: torch.device, tiles: Tiles) -> int | None:
    """Programs of these tiles resident at once on the device (None off CUDA):
    as many an SM as :meth:`Tiles.per_sm`, the count the register bound of
    :func:`launch_options` keeps."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).multi_processor_count * tiles.per_sm()


@triton.jit
def _fused_lora_linear(
    x_ptr, stride_xm, w_ptr, stride_wn, bias_ptr, y_ptr,
    a0, a1, a2, a_slot_stride, b0, b1, b2, b_slot0, b_slot1, b_slot2,
    slot_of_row_ptr, active_ptr, entries,
    sums_ptr, count_ptr, ticket_ptr,
    M, N, K, n0, n1, zero_share, scale,
    HAS_BIAS: tl.constexpr, R: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    BK: tl.constexpr, PIECE: tl.constexpr, CHUNK: tl.constexpr, KP: tl.constexpr,
    LANES: tl.constexpr, P: tl.constexpr, G: tl.constexpr, ZB: tl.constexpr,
    ROWS: tl.constexpr, COPY: tl.constexpr, TICKET_ROLES: tl.constexpr,
):  # fmt: skip
    ticket = tl.atomic_add(ticket_ptr, 1, sem="relaxed")
    # By ticket, a program waits for it before any work; by program id, the
    # ticket is needed only once the work is done.
    mine = (ticket & 0xFFFFFFFF).to(tl.int32) if TICKET_ROLES else tl.program_id(0)

    offs_m = tl.arange(0, BM)
    row_ok = offs_m < M
    slot = tl.load(slot_of_row_ptr + offs_m, mask=row_ok, other=-1)
    offs_r = tl.arange(0, R)
    # The step's adapters: vLLM's sorted list, the base rows' -1 first where
    # there are any, then -1s to its end. Every one has rows in the step's
    # one row block.
    first_adapter = (tl.load(active_ptr) < 0).to(tl.int32)
    if mine < P:  # a piece of the shrink: (lane, slice, PIECE columns of K)
        lane = mine // (P // LANES)
        sl = (mine % (P // LANES)) // KP
        k0 = (mine % KP) * PIECE
        a_ptr = _pick(sl, a0, a1, a2)
        landed = mine * 0
        parity = ((ticket >> 32) & 1).to(tl.int32)
        at = sums_ptr + parity * COPY + sl * ROWS * R + offs_m[:, None] * R + offs_r[None, :]
        e = first_adapter + lane  # this lane's adapters: every LANES-th
        a = tl.load(active_ptr + e, mask=e < entries, other=-1)
        while a >= 0:
            hit = row_ok & (slot == a)
            part = tl.zeros((BM, R), tl.float32)
            for kk in range(0, PIECE, CHUNK):
                offs_k = k0 + kk + tl.arange(0, CHUNK)
                xs = tl.load(
                    x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=row_ok[:, None],
                    other=0.0,
                )
                av = tl.load(a_ptr + a * a_slot_stride + offs_r[None, :] * K + offs_k[:, None])
                part = tl.dot(xs, av, part)
            before = tl.atomic_add(at, part * scale, mask=hit[:, None], sem="relaxed")
            # The count below moves only once these adds have returned (it uses their values).
            landed += tl.sum(tl.sum(tl.where(before == before, 0, 1), axis=1), axis=0)
            e += LANES
            a = tl.load(active_ptr + e, mask=e < entries, other=-1)
        tl.atomic_add(count_ptr + parity, 1 + tl.minimum(landed, 0), sem="acq_rel")
        # Each piece zeroes a share of the copy the next launch adds into.
        offs_z = mine * zero_share + tl.arange(0, ZB)
        ours = (tl.arange(0, ZB) < zero_share) & (offs_z < COPY)
        tl.store(sums_ptr + (1 - parity) * COPY + offs_z, tl.zeros([ZB], tl.float32), mask=ours)
        if mine == 0:
            tl.store(count_ptr + 1 - parity, 0)
    else:  # an output tile
        tile = mine - P
        offs_n = tile * BN + tl.arange(0, BN)
        offs_k = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), tl.float32)
        for k in range(0, K, BK):
            xv = tl.load(
                x_ptr + offs_m[:, None] * stride_xm + (k + offs_k)[None, :],
                mask=row_ok[:, None],
                other=0.0,
            )
            wv = tl.load(w_ptr + offs_n[None, :] * stride_wn + (k + offs_k)[:, None])
            acc = tl.dot(xv, wv, acc)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n).to(tl.float32)[None, :]
        parity = ((ticket >> 32) & 1).to(tl.int32)
        seen = tl.load(count_ptr + parity, volatile=True)
        while seen < P:
            seen = tl.load(count_ptr + parity, volatile=True)
        tl.atomic_add(count_ptr + parity, 0, sem="acquire")
        first = tile * BN
        s = (first >= n0).to(tl.int32) + (first >= n1).to(tl.int32)
        cols = offs_n - _pick(s, 0, n0, n1)
        b_ptr = _pick(s, b0, b1, b2)
        b_slot = _pick(s, b_slot0, b_slot1, b_slot2)
        shrunk = tl.load(
            sums_ptr + parity * COPY + s * ROWS * R + offs_m[:, None] * R + offs_r[None, :],
            cache_modifier=".cg",
        )
        e = first_adapter
        a = tl.load(active_ptr + e, mask=e < entries, other=-1)
        while a >= 0:
            sv = tl.where((slot == a)[:, None], shrunk, 0.0).to(y_ptr.dtype.element_ty)
            bv = tl.load(b_ptr + a * b_slot + cols[None, :] * R + offs_r[:, None])
            acc = tl.dot(sv, bv, acc)
            e += 1
            a = tl.load(active_ptr + e, mask=e < entries, other=-1)
        tl.store(
            y_ptr + offs_m[:, None] * N + offs_n[None, :],
            acc.to(y_ptr.dtype.element_ty),
            mask=row_ok[:, None],
        )
    if (ticket & 0xFFFFFFFF) == G - 1:  # the launch's last ticket: the next starts at 0, one up
        tl.atomic_add(ticket_ptr, tl.full([], (1 << 32) - G, tl.int64), sem="relaxed")


class _Workspace:
    """A device's shrink sums (two copies), their counts and the ticket counter."""

    def __init__(self, rank: int, device: torch.device) -> None:
        self.copy = MAX_SLICES * _WORKSPACE_ROWS * rank
        self.sums = torch.zeros(2 * self.copy, dtype=torch.float32, device=device)
        self.count = torch.zeros(2, dtype=torch.int32, device=device)
        self.ticket = torch.zeros(1, dtype=torch.int64, device=device)


_workspaces: dict[tuple[torch.device, int], _Workspace] = {}


def _workspace(rank: int, device: torch.device) -> _Workspace | None:
    """The device's workspace for this rank; None where it would have to be
    made inside a CUDA graph's capture (it is made at the first eager call,
    vLLM's warm-up, and kept)."""
    key = (device, rank)
    if key not in _workspaces:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        _workspaces[key] = _Workspace(rank, device)
    return _workspaces[key]


def supports(
    rows: torch.Tensor,
    weight: torch.Tensor,
    lora_a: tuple[torch.Tensor, ...] | list[torch.Tensor],
    lora_b: tuple[torch.Tensor, ...] | list[torch.Tensor],
    widths: tuple[int, ...],
) -> bool:
    """Whether :func:`fused_lora_linear` takes this layer and step."""
    if not (1 <= rows.size(0) <= MAX_TOKENS and 1 <= len(widths) <= MAX_SLICES):
        return False
    if len(lora_a) != len(widths) or len(lora_b) != len(widths):
        return False
    if rows.dtype not in (torch.float16, torch.bfloat16) or weight.dtype != rows.dtype:
        return False
    n, k = weight.shape
    if sum(widths) != n or rows.size(1) != k or weight.stride(1) != 1 or rows.stride(1) != 1:
        return False
    if tiles_for(widths, k) is None or k % CHUNK_K:
        return False
    try:
        a_views = [_as_slot_rows_cols(a) for a in lora_a]
        b_views = [_as_slot_rows_cols(b) for b in lora_b]
    except ValueError:
        return False
    rank = a_views[0].size(1)
    if rank not in RANKS:
        return False
    return (
        all(
            a.dtype == rows.dtype and a.shape[1:] == (rank, k) and a.stride()[1:] == (k, 1)
            for a in a_views
        )
        and all(
            b.dtype == rows.dtype and b.shape[1:] == (w, rank) and b.stride()[1:] == (rank, 1)
            for b, w in zip(b_views, widths)
        )
        and a_views[0].stride(0) == a_views[-1].stride(0)
    )


def fused_lora_linear(
    rows: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    lora_a: tuple[torch.Tensor, ...] | list[torch.Tensor],
    lora_b: tuple[torch.Tensor, ...] | list[torch.Tensor],
    widths: tuple[int, ...],
    slot_of_row: torch.Tensor,
    active_slots: torch.Tensor,
    scale: float = 1.0,
    out: torch.Tensor | None = None,
    lanes: int | None = None,
    ticket_roles: bool = False,
    tiles: Tiles | None = None,
) -> torch.Tensor | None:
    """``rows W^T + bias`` plus, for each row with an adapter slot (``slot_of_row``,
    -1: none), ``scale (row A_slot^T) B_slot^T`` on each slice, in one launch.

    ``lora_a``/``lora_b``: vLLM's stacked weights per slice ((slots, 1, rank,
    K) and (slots, 1, width, rank)); ``active_slots``: the slots the step
    holds (-1 entries are skipped, as vLLM pads its list); both index
    tensors stay on the device, so a CUDA graph replays with new ones.
    None where :func:`supports` says no (or the workspace would have to be
    made inside a graph's capture): the caller runs its other path.
    ``out``: a contiguous (rows, N) tensor to write into instead of a new one.
    ``lanes``: how many pieces share each (slice, columns) of the shrink, each
    taking every ``lanes``-th adapter of the step (None: :func:`lanes_for`
    the device's wave; one off CUDA). ``tiles``: others than :func:`tiles_for`'s
    (what a benchmark tries); they must divide every slice and K.
    """
    if not supports(rows, weight, lora_a, lora_b, widths):
        return None
    m, k = rows.shape
    n = weight.size(0)
    a_views = [_as_slot_rows_cols(a) for a in lora_a]
    b_views = [_as_slot_rows_cols(b) for b in lora_b]
    rank = a_views[0].size(1)
    space = _workspace(rank, rows.device)
    if tiles is None:
        tiles = tiles_for(widths, k)
    elif any(w % tiles.block_n for w in widths) or k % tiles.block_k:
        raise ValueError(f"{tiles} do not divide slices {widths} and K {k}")
    if space is None or tiles is None:
        return None
    piece = next(p for p in PIECE_KS if k % p == 0)
    pieces_per_slice = k // piece
    if lanes is None:
        slots = _device_slots(rows.device, tiles)
        per_lane = len(widths) * pieces_per_slice
        lanes = 1 if slots is None else lanes_for(n // tiles.block_n, per_lane, slots)
    pieces = lanes * len(widths) * pieces_per_slice
    programs = pieces + n // tiles.block_n
    zero_share = triton.cdiv(space.copy, pieces)  # the pieces zero the next launch's copy
    bounds = [sum(widths[: i + 1]) for i in range(len(widths) - 1)]
    n0, n1 = [*bounds, n, n][:2]
    if out is None:
        out = torch.empty(m, n, dtype=rows.dtype, device=rows.device)
    elif out.shape != (m, n) or out.dtype != rows.dtype or not out.is_contiguous():
        raise ValueError(f"out of shape {tuple(out.shape)} and {out.dtype} for ({m}, {n})")
    a_ptrs = _three(a_views, a_views[0])
    b_ptrs = _three(b_views, b_views[0])
    b_slot_strides = _three([int(b.stride(0)) for b in b_views], int(b_views[0].stride(0)))
    _fused_lora_linear[(programs,)](
        rows, rows.stride(0), weight, weight.stride(0), bias if bias is not None else out, out,
        *a_ptrs, a_views[0].stride(0), *b_ptrs, *b_slot_strides,
        slot_of_row, active_slots, active_slots.numel(),
        space.sums, space.count, space.ticket,
        m, n, k, n0, n1, zero_share, scale,
        HAS_BIAS=bias is not None, R=rank, BM=max(16, triton.next_power_of_2(m)),
        BN=tiles.block_n, BK=tiles.block_k, PIECE=piece, CHUNK=min(CHUNK_K, piece),
        KP=pieces_per_slice, LANES=lanes, P=pieces, G=programs,
        ZB=triton.next_power_of_2(zero_share), ROWS=_WORKSPACE_ROWS, COPY=space.copy,
        TICKET_ROLES=ticket_roles,
        **launch_options(tiles),
    )  # fmt: skip
    return out


def launch_options(tiles: Tiles) -> dict[str, int]:
    """Triton's compile options for a launch of these tiles: its pipeline, its
    warps and, where it buys a resident program an SM, a register bound."""
    options = {"num_stages": tiles.stages, "num_warps": NUM_WARPS}
    registers = tiles.max_registers()
    if registers is not None:
        options["maxnreg"] = registers
    return options
