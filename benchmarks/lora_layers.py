"""A decode step's linear layers with their LoRA, as the engine schedules them.

``python -m benchmarks.lora_layers`` (GPU) times, in one CUDA graph per
schedule, every linear layer of a decoder shape (``--size``: the 8B shape's
32 layers of q/k/v, o, gate/up and down) with its base GEMM (``x @ W.T`` on
bf16 weights into the layer's output: the cuBLAS call vLLM's unquantized
layers make) and its LoRA:

* ``base``: the GEMMs alone (what a step without adapters runs);
* ``overlap``: ``serve --lora-overlap on`` (the default): the shrink on a
  second stream beside the GEMM, the expand after both
  (``compat._overlapped_lora_apply``'s order);
* ``fused``: ``serve --lora-overlap fused``: the GEMM and its LoRA in one
  launch (:mod:`skyrl_lora.server.kernels.fused_lora`, its shrink's pieces
  in as many lanes as the wave has room for; ``fused@L``: in ``L`` lanes,
  ``--fused-lanes``; ``fused@Lt``: roles by ticket, not by program id;
  ``fused~CLASS=BNxBKxSTAGES``: one layer class in other tiles,
  ``--fused-tiles``), ``overlap`` where that does not take the step (more
  than 64 tokens);
* ``sequential``: GEMM, shrink, expand on one stream (``--lora-overlap off``);
* ``beside``: shrink *and* expand on the second stream (the expand writing
  the LoRA term into a zeroed buffer), added to the GEMM's output once both
  are done: vLLM's own second-stream order, with the grouped kernels.

Every LoRA schedule fills the step's row-chunk plan once, as ``serve`` does.
The figure that matters is each schedule's step over ``base``: the share of
the base model's rate its linear layers keep (attention and the rest of the
step not included, so the engine's ratio is closer to 1). Kernel-only
timings, without the GEMMs, are :mod:`benchmarks.lora_kernels`.
Schedules are interleaved, rounds are medians with their spread; outputs
are checked against ``sequential``'s before timing. ``--diagnose`` adds
parts of ``overlap`` (:data:`DIAGNOSTICS`) to see where its time goes;
``--by-class`` times each layer class's layers alone too (``fused/down_proj``:
the 32 down projections under ``fused``), each against ``base`` of that class.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.lora_kernels import (
    Slots,
    add_graph_flags,
    graph_of,
    int_list,
    llama_layers,
    make_slots,
    metadata,
    run_facts,
    run_to_json,
    time_graph,
)

SCHEDULES = ("base", "overlap", "sequential", "beside")
#: ``--diagnose``: parts of ``overlap``, to see where its time goes (their
#: outputs are not the layer's): the fork and join alone (events, nothing on
#: the second stream), the shrink beside the GEMM without the expand, and the
#: expand after the GEMM without any shrink.
DIAGNOSTICS = ("fork_join", "shrink_beside", "expand_after")


def schedule_fn(
    schedule: str,
    layers: list[Slots],
    weights: list[torch.Tensor],
    x: dict[int, torch.Tensor],
    meta: dict[str, torch.Tensor],
    groups: int,
    outs: dict[str, torch.Tensor],
) -> Callable[[], None]:
    """One step's linear layers under ``schedule`` (each decoder layer its own weights)."""
    from skyrl_lora.server.kernels.fused_lora import fused_lora_linear
    from skyrl_lora.server.kernels.grouped_lora import (
        DEFAULT_CONFIG,
        fill_plan,
        grouped_expand,
        grouped_shrink,
        new_plan,
    )

    tokens = next(iter(x.values())).size(0)
    device = meta["ids"].device
    fused = schedule.startswith("fused")
    lanes = int(schedule.partition("@")[2].rstrip("t")) if "@" in schedule else None
    tiles = tiles_of(schedule.partition("~")[2]) if "~" in schedule else {}
    by_ticket = schedule.endswith("t")
    plan = new_plan(tokens, groups, device)
    side = torch.cuda.Stream()
    before, shrunk = torch.cuda.Event(), torch.cuda.Event()
    ids = (meta["sorted"], meta["per"], meta["start"], meta["ids"], groups)

    def shrink(slots: Slots, xin: torch.Tensor, buf: torch.Tensor) -> None:
        grouped_shrink(xin, slots.a, buf, *ids, 1.0, DEFAULT_CONFIG, plan)

    def expand(slots: Slots, buf: torch.Tensor, y: torch.Tensor, add: bool = True) -> None:
        grouped_expand(buf, slots.b, y, *ids, 0, add, DEFAULT_CONFIG, plan)

    def term_of(slots: Slots, y: torch.Tensor) -> torch.Tensor:
        return outs[f"term{len(slots.widths)}{y.size(1)}"]

    def term_beside(slots: Slots, xin: torch.Tensor, buf: torch.Tensor, y: torch.Tensor) -> None:
        shrink(slots, xin, buf)
        term = term_of(slots, y)
        term.zero_()
        expand(slots, buf, term, add=False)

    def shrink_only(slots: Slots, xin: torch.Tensor, buf: torch.Tensor, y: torch.Tensor) -> None:
        shrink(slots, xin, buf)

    def nothing(slots: Slots, xin: torch.Tensor, buf: torch.Tensor, y: torch.Tensor) -> None:
        pass

    def expand_into(slots: Slots, xin: torch.Tensor, buf: torch.Tensor, y: torch.Tensor) -> None:
        expand(slots, buf, y)

    def both(slots: Slots, xin: torch.Tensor, buf: torch.Tensor, y: torch.Tensor) -> None:
        shrink(slots, xin, buf)
        expand(slots, buf, y)

    def add_term(slots: Slots, xin: torch.Tensor, buf: torch.Tensor, y: torch.Tensor) -> None:
        y.add_(term_of(slots, y))

    # What each schedule runs on the second stream beside the GEMM (absent:
    # no second stream), and what it runs after both, on the GEMM's stream.
    Step = Callable[[Slots, torch.Tensor, torch.Tensor, torch.Tensor], None]
    beside: dict[str, Step] = {
        "overlap": shrink_only,
        "shrink_beside": shrink_only,
        "fork_join": nothing,
        "beside": term_beside,
    }
    after: dict[str, Step] = {
        "overlap": expand_into,
        "expand_after": expand_into,
        "sequential": both,
        "beside": add_term,
    }

    def lora(slots: Slots, xin: torch.Tensor, y: torch.Tensor, gemm: Callable[[], None]) -> None:
        """The layer's GEMM with its LoRA under ``schedule`` (``base``: the GEMM alone)."""
        buf = outs[f"buf{len(slots.widths)}"]
        key = "overlap" if fused else schedule  # where the fused one declines
        work = beside.get(key)
        if work is not None:
            before.record()
            with torch.cuda.stream(side):
                before.wait()
                work(slots, xin, buf, y)
                shrunk.record()
        gemm()
        if work is not None:
            shrunk.wait()
        if key in after:
            after[key](slots, xin, buf, y)

    def run() -> None:
        if schedule != "base":
            fill_plan(plan, *ids)
        for slots, weight in zip(layers, weights):
            xin = x[weight.size(1)]
            y = outs[f"y:{slots.name}"]
            if fused and fused_lora_linear(
                xin, weight, None, slots.a, slots.b, tuple(slots.widths), meta["mapping"],
                meta["ids"], 1.0, out=y, lanes=lanes, ticket_roles=by_ticket,
                tiles=tiles.get(slots.name),
            ) is not None:  # fmt: skip
                continue

            def gemm(xin: torch.Tensor = xin, weight: torch.Tensor = weight, y: torch.Tensor = y):
                torch.matmul(xin, weight.t(), out=y)

            lora(slots, xin, y, gemm)

    return run


def tiles_of(spec: str) -> dict[str, Any]:
    """``CLASS=BNxBKxSTAGES`` (``--fused-tiles``): that layer class's fused tiles, by class."""
    from skyrl_lora.server.kernels.fused_lora import Tiles

    name, _, sizes = spec.partition("=")
    return {name: Tiles(*(int(v) for v in sizes.split("x")))}


def _outputs(outs: dict[str, torch.Tensor], names: list[str]) -> list[torch.Tensor]:
    return [outs[f"y:{name}"].float().clone() for name in names]


def run(args: argparse.Namespace) -> dict[str, Any]:
    shapes, depth = llama_layers(args.size)
    names = [name for name, _, _ in shapes]
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = [make_slots(s, args.slots, args.rank, gen) for _ in range(depth) for s in shapes]
    weights = [
        torch.empty(sum(w), fan_in, device="cuda", dtype=torch.bfloat16).normal_(0, 0.02)
        for _ in range(depth)
        for _, w, fan_in in shapes
    ]
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    adapter_bytes = sum(s.bytes_per_adapter for s in layers)
    result: dict[str, Any] = {
        **run_facts(args),
        "rank": args.rank,
        "weight_bytes": weight_bytes,
        "adapter_bytes": adapter_bytes,
        "points": [],
    }
    for tokens in args.tokens:
        x = {
            f: torch.randn(tokens, f, device="cuda").to(torch.bfloat16)
            for f in {s[2] for s in shapes}
        }
        outs = {f"buf{n}": torch.empty(n, tokens, args.rank, device="cuda") for n in (1, 2, 3)}
        for name, widths, _ in shapes:
            outs[f"y:{name}"] = torch.zeros(
                tokens, sum(widths), device="cuda", dtype=torch.bfloat16
            )
            outs[f"term{len(widths)}{sum(widths)}"] = torch.zeros_like(outs[f"y:{name}"])
        for adapters in args.adapters:
            meta = metadata(tokens, adapters, args.slots)
            schedules = (
                *SCHEDULES,
                "fused",
                *(f"fused@{lanes}" for lanes in args.fused_lanes),
                *(f"fused@{lanes}t" for lanes in args.fused_lanes if args.fused_ticket_roles),
                *(f"fused~{spec}" for spec in args.fused_tiles),
            )
            whole = (*schedules, *DIAGNOSTICS) if args.diagnose else schedules
            steps = {
                s: schedule_fn(s, layers, weights, x, meta, args.slots + 1, outs) for s in whole
            }
            for s in whole if args.by_class else ():
                for name in names:  # that class's layers alone: "schedule/class"
                    mine = [i for i, slots in enumerate(layers) if slots.name == name]
                    steps[f"{s}/{name}"] = schedule_fn(
                        s, [layers[i] for i in mine], [weights[i] for i in mine], x, meta,
                        args.slots + 1, outs,
                    )  # fmt: skip
            timed = tuple(steps)
            got = {}
            for s in schedules:  # the first decoder layer's outputs, eagerly
                schedule_fn(s, layers[:4], weights[:4], x, meta, args.slots + 1, outs)()
                torch.cuda.synchronize()
                got[s] = _outputs(outs, names)
            ref = got["sequential"]
            errors = {
                s: max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(got[s], ref))
                for s in schedules
                if s != "base"
            }
            graphs = {s: graph_of(fn) for s, fn in steps.items()}
            times: dict[str, list[float]] = {s: [] for s in timed}
            for r in range(args.rounds):
                for s in timed if r % 2 == 0 else timed[::-1]:
                    times[s].append(time_graph(graphs[s], args.reps))
            base_ms = {k: statistics.median(ts) for k, ts in times.items() if k.startswith("base")}
            point: dict[str, Any] = {
                "tokens": tokens,
                "adapters": adapters,
                "max_rel_err": errors,
                "base_roofline_ms": weight_bytes / args.hbm_bytes_per_s * 1e3,
                "adapters_roofline_ms": adapters * adapter_bytes / args.hbm_bytes_per_s * 1e3,
            }
            for s, ts in times.items():
                med = statistics.median(ts)
                base = base_ms["base" + s[s.index("/") :] if "/" in s else "base"]
                point[s] = {
                    "ms": med, "min": min(ts), "max": max(ts), "lora_ms": med - base,
                    "over_base": base / med,
                }  # fmt: skip
            result["points"].append(point)
            print(
                f"M={tokens} A={adapters}: "
                + ", ".join(
                    f"{s} {point[s]['ms']:.3f} ms ({point[s]['over_base']:.3f}x)" for s in timed
                )
                + " err "
                + ", ".join(f"{s} {e:.1e}" for s, e in errors.items()),
                flush=True,
            )
            del graphs, steps
            torch.cuda.synchronize()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="8b")
    parser.add_argument("--slots", type=int, default=32, help="--max-loras")
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--tokens", type=int_list, default=[64, 256])
    parser.add_argument("--adapters", type=int_list, default=[1, 2, 8, 32])
    add_graph_flags(parser)
    parser.add_argument("--hbm-bytes-per-s", type=float, default=4.8e12)
    parser.add_argument("--diagnose", action="store_true", help="also time overlap's parts")
    parser.add_argument("--fused-lanes", type=int_list, default=[], help="fused@L schedules")
    parser.add_argument(
        "--by-class", action="store_true", help="also each layer class alone: schedule/class"
    )
    parser.add_argument(
        "--fused-ticket-roles", action="store_true", help="also fused@Lt: roles by ticket"
    )
    parser.add_argument(
        "--fused-tiles",
        type=lambda s: s.split(","),
        default=[],
        help="also fused~CLASS=BNxBKxSTAGES: that class in other tiles (qkv_proj=64x64x6)",
    )
    return run_to_json(parser, run)


if __name__ == "__main__":
    raise SystemExit(main())
