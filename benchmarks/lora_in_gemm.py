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
  Every combination of ``--piece-k`` (a piece's columns: how many
  programs count), ``--chunk-k`` (what it reads at once: the shared memory
  it holds), ``--backoff-ns`` (waiting threads sleep between polls) and
  ``--skip`` (diagnostics: leave out the wait, the workspace's clearing or
  the pieces' atomics) is a variant, named ``KIND:PIECE/CHUNK[@NS][~LEFT]``.

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
from dataclasses import dataclass
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
#: What ``SKIP`` leaves out, by bit (diagnostic variants: their sums are wrong).
SKIPS = {1: "wait", 2: "clear", 4: "atomics"}


@dataclass(frozen=True)
class Variant:
    """One way to run a layer: ``kind`` (``cublas``, ``triton``, ``epilogue``,
    ``in_gemm``, ``in_gemm_apart``) and, for the last two, how the shrink's
    pieces are cut (``piece`` columns of K a program, read ``chunk`` at a
    time), how its waits poll and what a diagnostic run leaves out."""

    kind: str
    piece: int = PIECE_K
    chunk: int = PIECE_K
    backoff_ns: int = 0
    skip: int = 0

    @property
    def name(self) -> str:
        if not self.kind.startswith("in_gemm"):
            return self.kind
        left_out = "".join(f"~{what}" for bit, what in SKIPS.items() if self.skip & bit)
        backoff = f"@{self.backoff_ns}" if self.backoff_ns else ""
        return f"{self.kind}:{self.piece}/{self.chunk}{backoff}{left_out}"


@triton.jit
def _gemm(
    x_ptr, w_ptr, y_ptr, a_ptr, b_ptr, sums_ptr, count_ptr, N, K, n0, n1,
    LORA: tl.constexpr, SHRINK: tl.constexpr, APART: tl.constexpr, KP: tl.constexpr,
    P: tl.constexpr, R: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    PIECE: tl.constexpr, BKS: tl.constexpr, BACKOFF_NS: tl.constexpr, SKIP: tl.constexpr,
):  # fmt: skip
    """y[:, tile] = x @ W[tile].T (+ s @ B[tile].T, s the tile's slice's shrink).

    With ``SHRINK``, programs ``pid < P`` first add one piece of the shrink
    (``PIECE`` columns of K, read ``BKS`` at a time: the piece's width sets
    how many programs count, the chunk's the shared memory they hold);
    ``APART``: those programs do nothing else, and the tiles are the
    programs after them (launched first, so the tiles' wait cannot hold
    the SMs they need). ``SKIP`` (diagnostics, wrong sums) leaves out
    the wait (1), the workspace's clearing (2) or the pieces' atomics (4)."""
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
        at = sums_ptr + (pid // KP) * BM * R + offs_m[:, None] * R + offs_r[None, :]
        if SKIP & 4:
            tl.store(at, part)
        else:
            before = tl.atomic_add(at, part, sem="relaxed")
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
                if not SKIP & 1:
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
    if SHRINK and not SKIP & 2:  # the last program out clears the workspace and counters
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

    def launch(self, i: int, v: Variant, config: tuple[int, int, int]) -> None:
        """Layer ``i`` of the class as ``v`` (``epilogue`` reads the given
        shrink from ``sums``, left there by :meth:`error`)."""
        bn, bk, stages = config
        if v.kind == "cublas":
            torch.matmul(self.x, self.weights[i].t(), out=self.y)
            return
        apart = v.kind == "in_gemm_apart"
        pieces = self.fan_in // v.piece
        shrink_programs = len(self.widths) * pieces
        if v.kind == "in_gemm" and shrink_programs > self.n // bn:
            raise ValueError(f"{shrink_programs} pieces for {self.n // bn} tiles: some never run")
        _gemm[(self.n // bn + (shrink_programs if apart else 0),)](
            self.x, self.weights[i], self.y, self.a[i], self.b[i], self.sums, self.count,
            self.n, self.fan_in, self.n0, self.n1,
            LORA=v.kind != "triton", SHRINK=v.kind.startswith("in_gemm"), APART=apart,
            KP=pieces, P=shrink_programs, R=RANK, BM=TOKENS, BN=bn, BK=bk, PIECE=v.piece,
            BKS=v.chunk, BACKOFF_NS=v.backoff_ns, SKIP=v.skip, num_stages=stages, num_warps=4,
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

    def error(self, i: int, v: Variant, config: tuple[int, int, int], launches: int) -> float:
        """The largest relative error of ``launches`` launches against :meth:`reference`."""
        want = self.reference(i, lora=v.kind != "triton")
        worst = 0.0
        for _ in range(launches):
            if v.kind == "epilogue":  # the shrink's output, given
                x = self.x.float()
                for s, a in enumerate(self.slots[i].a):
                    self.sums[s].copy_(x @ a[0, 0].float().T)
            self.launch(i, v, config)
            torch.cuda.synchronize()
            worst = max(worst, float((self.y.float() - want).abs().max() / want.abs().max()))
        if v.kind == "epilogue":
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
    variants = [Variant("cublas"), Variant("triton"), Variant("epilogue")] + [
        Variant(kind, piece, chunk, ns, skip)
        for kind in args.kinds
        for piece in args.piece_k
        for chunk in args.chunk_k or [piece]
        for ns in args.backoff_ns
        for skip in args.skip
        if chunk <= piece
    ]
    step: dict[str, float | None] = {v.name: 0.0 for v in variants}
    for c in classes:
        errors: dict[str, float | None] = {}
        for v in variants[1:]:
            errors[v.name] = None  # diagnostic, or no configuration has as many tiles as pieces
            for config in args.configs if not v.skip else []:
                try:
                    errors[v.name] = c.error(0, v, config, 20)
                    break
                except ValueError:
                    continue

        def layers(v: Variant, config: tuple[int, int, int], c: LayerClass = c) -> None:
            for i in range(depth):
                c.launch(i, v, config)

        graphs = {}
        for v in variants:
            for config in args.configs[:1] if v.kind == "cublas" else args.configs:
                try:
                    graphs[f"{v.name} {config}"] = graph_of(partial(layers, v, config))
                except (triton.runtime.errors.OutOfResources, ValueError):
                    continue
        timed = _interleaved(graphs, args.rounds, args.reps)
        del graphs
        best = {  # None: no configuration of this class can run the variant
            v.name: min(
                (t["ms"] for k, t in timed.items() if k.startswith(v.name + " ")), default=None
            )
            for v in variants
        }
        for name, ms in best.items():
            total = step[name]
            step[name] = None if total is None or ms is None else total + ms
        result["classes"][c.name] = {"max_rel_err": errors, "timed": timed}
        print(c.name, {k: ms and round(ms, 3) for k, ms in best.items()}, errors, flush=True)
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
    parser.add_argument(
        "--kinds", type=lambda t: t.split(","), default=["in_gemm", "in_gemm_apart"]
    )
    parser.add_argument("--piece-k", type=int_list, default=[PIECE_K], help="K columns a piece")
    parser.add_argument(
        "--chunk-k", type=int_list, default=[], help="K columns a piece reads at once (its width)"
    )
    parser.add_argument(
        "--skip", type=int_list, default=[0], help=f"diagnostic variants leaving out {SKIPS}"
    )
    add_graph_flags(parser)
    return run_to_json(parser, run)


if __name__ == "__main__":
    raise SystemExit(main())
