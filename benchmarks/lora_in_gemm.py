"""One adapter's LoRA inside the base GEMM, measured: what a GEMM of our own would buy.

``python -m benchmarks.lora_in_gemm`` (GPU) times a decode step's linear
layers (the 8B shape: 32 layers of q/k/v, o, gate/up, down, each its own
weights, 64 tokens, all on one rank-64 adapter) in CUDA graphs, each layer
class over its 32 layers:

* ``cublas``: ``x @ W.T`` (the GEMM vLLM's unquantized layers run);
* ``triton``: the same GEMM as a plain Triton kernel (:func:`_gemm`), for
  each tile configuration of ``--configs``;
* ``epilogue``: that kernel with the LoRA expand in its epilogue, the
  shrink's output given (what the expand costs once it is inside the GEMM);
* ``in_gemm``: the whole LoRA inside the one kernel: the first programs add
  split-K pieces of the shrink into an fp32 workspace and count themselves
  done, every program waits for that count after its main loop, then
  applies the expand in its epilogue (one launch a layer, no second stream);
* ``in_gemm_apart``: the same with the pieces in programs of their own,
  launched before the tiles. The pieces' buffers double the kernel's shared
  memory at ``--piece-k`` 256 (64 KiB a program against 32 at BN 64, BK
  128, 6 stages: half the programs resident, which may be what the wait
  costs); at 64 it stays 32 KiB (Triton's compile for sm_90). ``in_gemm``
  skips configurations with more pieces than tiles.
  ``--backoff-ns`` adds variants whose waiting threads sleep between polls,
  ``--piece-k`` sets the pieces' width (how many programs count) and
  ``--chunk-k`` adds variants whose pieces read it in narrower chunks
  (``in_gemm/64``: what the pieces hold in shared memory).

The step is each class's best configuration summed over the 128 layers,
beside ``serve``'s schedule (:mod:`benchmarks.lora_layers`'s ``overlap``)
and cuBLAS alone, measured in the same run. ``in_gemm`` is a probe, not a
kernel ``serve`` runs: its waiting programs assume the counting ones were
scheduled first (true of the hardware's block order in practice, not
promised), and it serves one adapter's rows only. Outputs are checked
against torch before timing.
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial
from typing import Any

import torch
import triton
import triton.language as tl

from benchmarks.lora_kernels import (
    add_graph_flags,
    graph_of,
    int_list,
    llama_layers,
    make_slots,
    metadata,
    run_to_json,
    time_graph,
)

TOKENS, RANK = 64, 64
#: (BLOCK_N, BLOCK_K, stages): tile configurations tried for every layer class.
CONFIGS = [(bn, bk, st) for bn in (32, 64) for bk in (64, 128) for st in (3, 4, 6)]
#: The shrink's split-K piece (columns of K per counting program).
PIECE_K = 256


@triton.jit
def _gemm(
    x_ptr, w_ptr, y_ptr, a_ptr, b_ptr, sums_ptr, count_ptr, N, K, n0, n1,
    LORA: tl.constexpr, SHRINK: tl.constexpr, APART: tl.constexpr, KP: tl.constexpr,
    P: tl.constexpr, R: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    PIECE: tl.constexpr, BKS: tl.constexpr, BACKOFF_NS: tl.constexpr,
):  # fmt: skip
    """y[:, tile] = x @ W[tile].T (+ s @ B[tile].T, s the tile's slice's shrink).

    With ``SHRINK``, programs ``pid < P`` first add one piece of the shrink
    (``PIECE`` columns of K, read ``BKS`` at a time: the piece's width sets
    how many programs count, the chunk's the shared memory they hold);
    ``APART``: those programs do nothing else, and the tiles are the
    programs after them (launched first, so the tiles' wait cannot hold
    the SMs they need)."""
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BM)
    offs_r = tl.arange(0, R)
    landed = pid * 0
    if SHRINK and pid < P:  # piece (slice, K columns) of the shrink
        part = tl.zeros((BM, R), tl.float32)
        for kk in range(0, PIECE, BKS):
            offs_ks = (pid % KP) * PIECE + kk + tl.arange(0, BKS)
            xs = tl.load(x_ptr + offs_m[:, None] * K + offs_ks[None, :])
            av = tl.load(a_ptr + ((pid // KP) * R + offs_r)[None, :] * K + offs_ks[:, None])
            part = tl.dot(xs, av, part)
        before = tl.atomic_add(
            sums_ptr + (pid // KP) * BM * R + offs_m[:, None] * R + offs_r[None, :],
            part,
            sem="relaxed",
        )
        # The count moves only once these atomics have returned (it depends on their values).
        landed += tl.sum(tl.sum(tl.where(before == before, 0, 1), axis=1), axis=0)
    if SHRINK and APART and pid < P:
        tl.atomic_add(count_ptr, 1 + tl.minimum(landed, 0), sem="acq_rel")
    else:
        tile = pid - P if SHRINK and APART else pid
        offs_n = tile * BN + tl.arange(0, BN)
        offs_k = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), tl.float32)
        for k in range(0, K, BK):
            xv = tl.load(x_ptr + offs_m[:, None] * K + (k + offs_k)[None, :])
            wv = tl.load(w_ptr + offs_n[None, :] * K + (k + offs_k)[:, None])
            acc = tl.dot(xv, wv, acc)
        if LORA:
            if SHRINK:
                if not APART and pid < P:
                    tl.atomic_add(count_ptr, 1 + tl.minimum(landed, 0), sem="acq_rel")
                seen = tl.load(count_ptr, volatile=True)
                while seen < P:
                    if BACKOFF_NS > 0:  # every waiting thread polls L2: fewer polls
                        _sleep(seen, BACKOFF_NS)
                    seen = tl.load(count_ptr, volatile=True)
                seen = tl.atomic_add(count_ptr, 0, sem="acquire")
            first = tile * BN
            s = (first >= n0).to(tl.int32) + (first >= n1).to(tl.int32)
            sv = tl.load(
                sums_ptr + s * BM * R + offs_m[:, None] * R + offs_r[None, :], cache_modifier=".cg"
            )
            bv = tl.load(b_ptr + offs_n[None, :] * R + offs_r[:, None])
            acc = tl.dot(sv.to(tl.bfloat16), bv, acc)
        tl.store(y_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(tl.bfloat16))
    if SHRINK:  # the last program out clears the workspace and counters
        done = tl.atomic_add(count_ptr + 32, 1, sem="acq_rel")
        if done == tl.num_programs(0) - 1:
            for sl in range(0, 3):
                at = sums_ptr + sl * BM * R + offs_m[:, None] * R + offs_r[None, :]
                tl.store(at, tl.zeros((BM, R), tl.float32))
            tl.atomic_xchg(count_ptr, 0)
            tl.atomic_xchg(count_ptr + 32, 0)


@triton.jit
def _sleep(like, NS: tl.constexpr):
    """``nanosleep`` in the threads holding ``like`` (a poll's back-off)."""
    tl.inline_asm_elementwise(
        "nanosleep.u32 $2;\nmov.b32 $0, $1;", "=r,r,r", [like, like * 0 + NS], dtype=tl.int32,
        is_pure=False, pack=1,
    )  # fmt: skip


class LayerClass:
    """One layer class's 32 layers: weights, slot 0's A (slices stacked) and B, output."""

    def __init__(self, shape: tuple[str, tuple[int, ...], int], depth: int, gen: torch.Generator):
        self.name, self.widths, self.fan_in = shape
        self.n = sum(self.widths)
        self.slots = [make_slots(shape, 1, RANK, gen) for _ in range(depth)]
        self.weights = [
            (torch.randn(self.n, self.fan_in, device="cuda", generator=gen) * 0.02).to(
                torch.bfloat16
            )
            for _ in range(depth)
        ]
        self.a = [torch.cat([a[0, 0] for a in s.a]).contiguous() for s in self.slots]
        self.b = [torch.cat([b[0, 0] for b in s.b]).contiguous() for s in self.slots]
        self.x = torch.randn(TOKENS, self.fan_in, device="cuda", generator=gen).to(torch.bfloat16)
        self.y = torch.empty(TOKENS, self.n, device="cuda", dtype=torch.bfloat16)
        self.sums = torch.zeros(3, TOKENS, RANK, device="cuda")
        self.count = torch.zeros(64, device="cuda", dtype=torch.int32)
        bounds = [sum(self.widths[: i + 1]) for i in range(len(self.widths) - 1)]
        self.n0, self.n1 = [*bounds, self.n, self.n][:2]

    def launch(
        self, i: int, variant: str, config: tuple[int, int, int], piece_k: int = PIECE_K
    ) -> None:
        """Layer ``i`` of the class as ``variant`` (``epilogue`` reads the given
        shrink from ``sums``, left there by :meth:`reference`; ``KIND/C``: the
        pieces read ``C`` columns at a time (default: the whole piece);
        ``KIND@NS``: the waits back off ``NS`` ns between polls)."""
        bn, bk, stages = config
        spec, _, backoff = variant.partition("@")
        kind, _, chunk = spec.partition("/")
        apart = kind == "in_gemm_apart"
        pieces = self.fan_in // piece_k
        shrink_programs = len(self.widths) * pieces
        if kind == "in_gemm" and shrink_programs > self.n // bn:
            raise ValueError(f"{shrink_programs} pieces for {self.n // bn} tiles: some never run")
        _gemm[(self.n // bn + (shrink_programs if apart else 0),)](
            self.x, self.weights[i], self.y, self.a[i], self.b[i], self.sums, self.count,
            self.n, self.fan_in, self.n0, self.n1,
            LORA=kind != "triton", SHRINK=kind.startswith("in_gemm"), APART=apart, KP=pieces,
            P=shrink_programs, R=RANK, BM=TOKENS, BN=bn, BK=bk, PIECE=piece_k,
            BKS=int(chunk or piece_k),
            BACKOFF_NS=int(backoff or 0), num_stages=stages, num_warps=4,
        )  # fmt: skip

    def reference(self, i: int, lora: bool) -> torch.Tensor:
        """Layer ``i`` in torch (the shrink rounded to bf16, as the kernel's epilogue reads it)."""
        x = self.x.float()
        want = x @ self.weights[i].float().T
        col = 0
        for a, b, width in zip(self.slots[i].a, self.slots[i].b, self.widths):
            if lora:
                shrunk = (x @ a[0, 0].float().T).bfloat16().float()
                want[:, col : col + width] += shrunk @ b[0, 0].float().T
            col += width
        return want

    def error(
        self, i: int, variant: str, config: tuple[int, int, int], launches: int, piece_k: int
    ) -> float:
        """The largest relative error of ``launches`` launches against :meth:`reference`."""
        want = self.reference(i, lora=variant != "triton")
        worst = 0.0
        for _ in range(launches):
            if variant == "epilogue":  # the shrink's output, given
                x = self.x.float()
                for s, a in enumerate(self.slots[i].a):
                    self.sums[s].copy_(x @ a[0, 0].float().T)
            self.launch(i, variant, config, piece_k)
            torch.cuda.synchronize()
            worst = max(worst, float((self.y.float() - want).abs().max() / want.abs().max()))
        if variant == "epilogue":
            self.sums.zero_()
        return worst


def _interleaved(graphs: dict[str, torch.cuda.CUDAGraph], rounds: int, reps: int) -> dict[str, Any]:
    """Each graph's median ms over ``rounds`` (every round times all, in alternating order)."""
    times: dict[str, list[float]] = {k: [] for k in graphs}
    for r in range(rounds):
        for k in list(graphs) if r % 2 == 0 else list(graphs)[::-1]:
            times[k].append(time_graph(graphs[k], reps))
    return {k: {"ms": statistics.median(v), "min": min(v), "max": max(v)} for k, v in times.items()}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.lora_layers import schedule_fn

    shapes, depth = llama_layers("8b")
    gen = torch.Generator(device="cuda").manual_seed(0)
    classes = [LayerClass(shape, depth, gen) for shape in shapes]
    result: dict[str, Any] = {
        "commit": args.commit, "date": time.strftime("%Y-%m-%d"),
        "machine": args.machine or torch.cuda.get_device_name(0),
        "tokens": TOKENS, "rank": RANK, "classes": {},
    }  # fmt: skip
    lora_in_gemm = [
        f"{kind}{f'/{chunk}' if chunk != args.piece_k else ''}{f'@{ns}' if ns else ''}"
        for kind in ("in_gemm", "in_gemm_apart")
        for chunk in args.chunk_k or [args.piece_k]
        for ns in args.backoff_ns
    ]
    step: dict[str, float | None] = dict.fromkeys(
        ("cublas", "triton", "epilogue", *lora_in_gemm), 0.0
    )
    for c in classes:
        errors: dict[str, float | None] = {}
        for v in step:
            if v == "cublas":
                continue
            errors[v] = None  # no configuration has as many tiles as pieces
            for config in args.configs:
                try:
                    errors[v] = c.error(0, v, config, 20, args.piece_k)
                    break
                except ValueError:
                    continue

        def layers(variant: str, config: tuple[int, int, int], c: LayerClass = c) -> None:
            for i in range(depth):
                if variant == "cublas":
                    torch.matmul(c.x, c.weights[i].t(), out=c.y)
                else:
                    c.launch(i, variant, config, args.piece_k)

        graphs = {}
        for variant in step:
            for config in [args.configs[0]] if variant == "cublas" else args.configs:
                try:
                    graphs[f"{variant} {config}"] = graph_of(partial(layers, variant, config))
                except (triton.runtime.errors.OutOfResources, ValueError):
                    continue
        timed = _interleaved(graphs, args.rounds, args.reps)
        del graphs
        best = {  # None: no configuration of this class can run the variant
            v: min((t["ms"] for k, t in timed.items() if k.startswith(v + " ")), default=None)
            for v in step
        }
        for v, ms in best.items():
            total = step[v]
            step[v] = None if total is None or ms is None else total + ms
        result["classes"][c.name] = {"max_rel_err": errors, "timed": timed}
        print(c.name, {v: ms and round(ms, 3) for v, ms in best.items()}, errors, flush=True)
    meta = metadata(TOKENS, 1, 1)
    outs: dict[str, torch.Tensor] = {
        f"buf{n}": torch.empty(n, TOKENS, RANK, device="cuda") for n in (1, 2, 3)
    }
    for j, (_, widths, _) in enumerate(shapes):
        outs[f"y{j}"] = torch.zeros(TOKENS, sum(widths), device="cuda", dtype=torch.bfloat16)
    layers_all = [c.slots[i] for i in range(depth) for c in classes]
    weights_all = [c.weights[i] for i in range(depth) for c in classes]
    xs = {c.fan_in: c.x for c in classes}
    graphs = {
        s: graph_of(schedule_fn(s, layers_all, weights_all, xs, meta, 2, outs))
        for s in ("base", "overlap")
    }
    whole = {k: t["ms"] for k, t in _interleaved(graphs, args.rounds, args.reps).items()}
    result["step_ms"] = {**step, **{f"serve_{k}": v for k, v in whole.items()}}
    print("step ms:", {k: v and round(v, 3) for k, v in result["step_ms"].items()}, flush=True)
    return result


def _configs(text: str) -> list[tuple[int, int, int]]:
    return [tuple(int(v) for v in part.split("x")) for part in text.split(",")]  # type: ignore[misc]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", type=_configs, default=CONFIGS, help="BNxBKxSTAGES,...")
    parser.add_argument(
        "--backoff-ns", type=int_list, default=[0], help="in_gemm's poll back-offs to add (0: none)"
    )
    parser.add_argument("--piece-k", type=int, default=PIECE_K, help="K columns a shrink piece")
    parser.add_argument(
        "--chunk-k",
        type=int_list,
        default=[],
        help="in_gemm variants whose pieces read K this wide",
    )
    add_graph_flags(parser)
    return run_to_json(parser, run)


if __name__ == "__main__":
    raise SystemExit(main())
