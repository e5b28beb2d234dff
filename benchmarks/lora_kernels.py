"""The LoRA work of one decode step, kernel by kernel: vLLM's Punica ops against ours.

``python -m benchmarks.lora_kernels`` (GPU) builds the stacked adapter
slots of every LoRA layer of a decoder shape (``--size``: the 8B shape's 32
layers of q/k/v, o, gate/up and down), maps a step's tokens round-robin
onto ``A`` distinct adapters, and times, in one CUDA graph per variant (as
vLLM replays them), the shrink and expand of every layer:

* ``vllm``: vLLM's ``lora_shrink``/``lora_expand`` as ``serve`` runs them,
  over every slot (``--max-loras`` + 1 groups);
* ``vllm_specialized``: the same over the captured count of active
  adapters (what ``--specialize-active-lora`` buys);
* ``grouped``: :mod:`skyrl_lora.server.kernels.grouped_lora` as ``serve``
  runs them: the step's row-chunk plan filled once (one launch, timed with
  the step) from metadata over every slot, then every layer's shrink and
  expand reading it;
* ``grouped_NAME`` (with ``--base-kernels NAME=FILE``, repeatable): another
  ``grouped_lora.py`` (an earlier revision's, ``git show
  REV:server/kernels/grouped_lora.py``, or a candidate), given every slot
  as ``grouped`` is (and a step plan where that file makes one), so old,
  new and candidates are timed in one run.

Each variant's outputs are checked against ``vllm``'s (bf16 tolerance)
before it is timed. Beside each figure: the HBM time of the adapter bytes
the step must read (each distinct adapter once), so a point reads as a
fraction of its own roofline. Variants are interleaved, rounds are medians
with their spread. ``--profile`` adds a torch profiler table of one step
of ``vllm`` and ``grouped`` at 8 and 32 adapters.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from benchmarks.common import current_commit
from skyrl_lora.server import compat

#: (name, slices' output widths, input width) of each LoRA layer of a Llama decoder layer.
Layer = tuple[str, tuple[int, ...], int]

#: H200 HBM3e, the datasheet's figure; the run also measures a copy.
HBM_BYTES_PER_S = 4.8e12


def llama_layers(size: str) -> tuple[list[Layer], int]:
    """The LoRA layers of one decoder layer of a random-model size, and the layer count."""
    from skyrl_lora.server.embedded.random_model import SIZES

    s = SIZES[size]
    h, i = s["hidden_size"], s["intermediate_size"]
    kv = h // s["num_attention_heads"] * s["num_key_value_heads"]
    layers: list[Layer] = [
        ("qkv_proj", (h, kv, kv), h),
        ("o_proj", (h,), h),
        ("gate_up_proj", (i, i), h),
        ("down_proj", (h,), i),
    ]
    return layers, s["num_hidden_layers"]


@dataclass
class Slots:
    """One decoder layer's stacked LoRA weights, as vLLM's LoRA layers hold them."""

    name: str
    a: list[torch.Tensor]  # per slice: (slots, 1, rank, in)
    b: list[torch.Tensor]  # per slice: (slots, 1, width, rank)
    widths: tuple[int, ...]

    @property
    def bytes_per_adapter(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in (*self.a, *self.b))


def make_slots(layer: Layer, slots: int, rank: int, gen: torch.Generator) -> Slots:
    name, widths, fan_in = layer

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device="cuda") * 0.02).to(torch.bfloat16)

    return Slots(
        name,
        [rand(slots, 1, rank, fan_in) for _ in widths],
        [rand(slots, 1, w, rank) for w in widths],
        widths,
    )


def kernel_metadata(mapping: torch.Tensor, slots: int) -> dict[str, torch.Tensor]:
    """What vLLM's ``LoRAKernelMeta.prepare_tensors`` makes of a token-to-slot
    mapping (-1: the base model), on the mapping's device; ``active`` (the
    groups present) stays on the host."""
    from skyrl_lora.server.lora_metadata import plan

    step = plan(mapping.cpu())
    active = step.active_slots
    ids = torch.full((slots + 1,), -1, dtype=torch.int32)
    ids[: len(active)] = active
    per = torch.zeros(slots + 1, dtype=torch.int32)
    per[: len(active)] = step.tokens_per_slot
    start = torch.zeros(slots + 2, dtype=torch.int32)
    start[1 : 1 + len(active)] = step.start_loc
    meta = {"mapping": step.slots, "sorted": step.sorted_by_slot, "per": per, "start": start}
    return {k: v.to(mapping.device) for k, v in (meta | {"ids": ids}).items()} | {"active": active}


def metadata(tokens: int, adapters: int, slots: int) -> dict[str, torch.Tensor]:
    """vLLM's kernel metadata for ``tokens`` mapped round-robin onto ``adapters`` slots."""
    mapping = torch.arange(tokens, dtype=torch.int32, device="cuda") % max(adapters, 1)
    return kernel_metadata(mapping, slots)


def captured_count(adapters: int, slots: int) -> int:
    """vLLM's captured active-adapter count for ``adapters`` (powers of two, then slots + 1)."""
    from vllm.lora.utils import get_captured_lora_counts

    return next(n for n in get_captured_lora_counts(slots, True) if n >= adapters)


def kernels_of(variant: str) -> ModuleType:
    """The grouped kernels' module a variant runs: this tree's, or a ``--base-kernels`` file's."""
    if variant in _OTHER_KERNELS:
        return _OTHER_KERNELS[variant]
    from skyrl_lora.server.kernels import grouped_lora

    return grouped_lora


#: ``grouped_NAME`` -> the module of ``--base-kernels NAME=FILE``.
_OTHER_KERNELS: dict[str, ModuleType] = {}


def load_other_kernels(spec_text: str) -> None:
    """Import another ``grouped_lora.py`` (``NAME=FILE``) under a name of its own (it
    imports only torch and Triton; Triton reads its kernels' source from the file)."""
    name, _, path = spec_text.partition("=")
    if not path:
        raise SystemExit(f"--base-kernels {spec_text!r}: expected NAME=FILE")
    spec = importlib.util.spec_from_file_location(f"grouped_lora_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    _OTHER_KERNELS[f"grouped_{name}"] = module


def step_fn(
    variant: str,
    layers: list[Slots],
    x: dict[int, torch.Tensor],
    meta: dict[str, torch.Tensor],
    groups: int,
    outs: dict[str, torch.Tensor],
    config: Any = None,
) -> Callable[[], None]:
    """One decode step's LoRA work of every layer (each decoder layer its own weights)."""
    from vllm.lora.ops.triton_ops import lora_expand, lora_shrink

    kernels = None if variant.startswith("vllm") else kernels_of(variant)
    plan: Any = None
    if kernels is not None:
        grouped_shrink, grouped_expand = kernels.grouped_shrink, kernels.grouped_expand
        config = config or kernels.DEFAULT_CONFIG
        if hasattr(kernels, "fill_plan"):  # revisions before 2026-11-29 plan in every launch
            tokens = next(iter(x.values())).size(0)
            height = config.for_tokens(tokens).block_m
            plan = kernels.new_plan(tokens, groups, meta["ids"].device, (height,))
    planned = {"plan": plan} if plan is not None else {}

    no_lora = torch.tensor([False])
    count = torch.tensor([groups], dtype=torch.int32)
    scale = 1.0

    def run() -> None:
        if plan is not None:
            kernels.fill_plan(plan, meta["sorted"], meta["per"], meta["start"], meta["ids"], groups)
        for i, slots in enumerate(layers):
            xin = x[slots.a[0].size(-1)]
            buf = outs[f"buf{len(slots.widths)}"]
            y = outs[f"y{i % 4}"]
            if variant.startswith("vllm"):
                lora_shrink(
                    xin, slots.a, buf, meta["mapping"], meta["sorted"], meta["per"],
                    meta["start"], meta["ids"], no_lora, count, scale,
                )  # fmt: skip
                lora_expand(
                    buf, slots.b, y, meta["mapping"], meta["sorted"], meta["per"],
                    meta["start"], meta["ids"], no_lora, count, offset_start=0, add_inputs=True,
                )  # fmt: skip
            else:
                grouped_shrink(
                    xin, slots.a, buf, meta["sorted"], meta["per"], meta["start"], meta["ids"],
                    groups, scale, config, **planned,
                )  # fmt: skip
                grouped_expand(
                    buf, slots.b, y, meta["sorted"], meta["per"], meta["start"], meta["ids"],
                    groups, 0, True, config, **planned,
                )  # fmt: skip

    return run


def graph_of(fn: Callable[[], None]) -> torch.cuda.CUDAGraph:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up: compiles, and fills vLLM's pointer caches outside the capture
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def time_graph(graph: torch.cuda.CUDAGraph, reps: int) -> float:
    """Milliseconds per replay, over ``reps`` replays."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def copy_bandwidth() -> float:
    """Bytes/s of a 4 GiB device-to-device copy (read plus write), the measured roof."""
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    torch.cuda.synchronize()
    per = (time.perf_counter() - t) / 5
    del src, dst
    return 2 * (2 << 30) / per


VARIANTS = ("vllm", "vllm_specialized", "grouped")


def variants() -> tuple[str, ...]:
    """The variants this run times (one more per ``--base-kernels``)."""
    return (*VARIANTS, *_OTHER_KERNELS)


def groups_of(variant: str, adapters: int, slots: int) -> int:
    if variant == "vllm_specialized":
        return captured_count(adapters, slots)
    return slots + 1


def check(
    layers: list[Slots], x: dict[int, torch.Tensor], meta: dict[str, torch.Tensor],
    outs: dict[str, torch.Tensor], adapters: int, slots: int,
) -> dict[str, float]:  # fmt: skip
    """Each variant's outputs over the first decoder layer against ``vllm``'s (a
    ``--base-kernels`` candidate that fails is dropped from the run, saying why)."""
    first = layers[:4]
    results = {}
    for variant in variants():
        for y in ("y0", "y1", "y2", "y3"):
            outs[y].zero_()
        groups = groups_of(variant, adapters, slots)
        try:
            step_fn(variant, first, x, meta, groups, outs)()
        except Exception as exc:  # a candidate that does not compile leaves the run
            if variant not in _OTHER_KERNELS:
                raise
            print(f"{variant} dropped: {str(exc)[:300]}", flush=True)
            del _OTHER_KERNELS[variant]
            continue
        results[variant] = [outs[y].float().clone() for y in ("y0", "y1", "y2", "y3")]
    ref = results["vllm"]
    return {
        v: max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-6)) for a, b in zip(got, ref))
        for v, got in results.items()
    }


def profile_table(fn: Callable[[], None], rows: int = 12) -> str:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    table: str = prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows)
    return table


#: Tile and grid choices the sweep tries (block_m, block_k, block_n, num_warps, blocks_per_sm).
SWEEP = [
    (16, 256, 128, 4, 4),
    (16, 256, 128, 4, 8),
    (16, 128, 128, 4, 8),
    (16, 512, 128, 4, 4),
    (16, 256, 64, 4, 4),
    (16, 256, 256, 8, 4),
    (32, 256, 128, 4, 4),
    (64, 128, 128, 4, 4),
]


def sweep(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The grouped kernels' step time per tile/grid choice (rank 64, each of ``--tokens``)."""
    from skyrl_lora.server.kernels.grouped_lora import GroupedConfig

    layer_shapes, depth = llama_layers(args.size)
    gen = torch.Generator(device="cuda").manual_seed(1)
    layers = [make_slots(s, args.slots, 64, gen) for _ in range(depth) for s in layer_shapes]
    rows: list[dict[str, Any]] = []
    for tokens in args.tokens:
        x = {
            f: torch.randn(tokens, f, device="cuda").to(torch.bfloat16)
            for f in {s[2] for s in layer_shapes}
        }
        outs = {f"buf{n}": torch.empty(n, tokens, 64, device="cuda") for n in (1, 2, 3)}
        for j, (_, widths, _) in enumerate(layer_shapes):
            outs[f"y{j}"] = torch.zeros(tokens, sum(widths), device="cuda").to(torch.bfloat16)
        for adapters in (1, 8, 32):
            meta = metadata(tokens, adapters, args.slots)
            for fields in SWEEP:
                point = {"tokens": tokens, "adapters": adapters, "config": fields}
                try:
                    config = GroupedConfig(*fields)
                    fn = step_fn("grouped", layers, x, meta, args.slots + 1, outs, config)
                    graph = graph_of(fn)
                    ms = statistics.median(time_graph(graph, args.reps) for _ in range(3))
                except Exception as exc:  # a choice that does not compile
                    rows.append(point | {"error": str(exc)[:200]})
                    continue
                rows.append(point | {"ms": ms})
                print(f"sweep M={tokens} A={adapters} {fields}: {ms:.3f} ms", flush=True)
    return rows


def run_facts(args: argparse.Namespace) -> dict[str, Any]:
    """What every GPU benchmark's JSON opens with: the commit, date, machine and shape."""
    return {
        "commit": args.commit,
        "date": time.strftime("%Y-%m-%d"),
        "machine": args.machine or torch.cuda.get_device_name(0),
        "size": args.size,
        "slots": args.slots,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    layer_shapes, depth = llama_layers(args.size)
    gen = torch.Generator(device="cuda").manual_seed(0)
    result: dict[str, Any] = {
        **run_facts(args),
        "hbm_bytes_per_s_datasheet": HBM_BYTES_PER_S,
        "copy_bytes_per_s": copy_bandwidth(),
        "points": [],
        "checks": [],
        "profiles": {},
    }
    print(f"copy bandwidth {result['copy_bytes_per_s'] / 1e12:.2f} TB/s", flush=True)
    for rank in args.ranks:
        compat.forget_lora_pointer_caches()  # the last rank's weights may have had these addresses
        layers = [
            make_slots(shape, args.slots, rank, gen) for _ in range(depth) for shape in layer_shapes
        ]
        adapter_bytes = sum(s.bytes_per_adapter for s in layers)
        for tokens in args.tokens:
            x = {
                fan_in: torch.randn(tokens, fan_in, device="cuda").to(torch.bfloat16)
                for fan_in in {shape[2] for shape in layer_shapes}
            }
            outs = {f"buf{n}": torch.empty(n, tokens, rank, device="cuda") for n in (1, 2, 3)}
            for j, (_, widths, _) in enumerate(layer_shapes):
                outs[f"y{j}"] = torch.zeros(tokens, sum(widths), device="cuda").to(torch.bfloat16)
            for adapters in args.adapters:
                if adapters > args.slots:
                    continue
                meta = metadata(tokens, adapters, args.slots)
                errors = check(layers, x, meta, outs, adapters, args.slots)
                result["checks"].append(
                    {"rank": rank, "tokens": tokens, "adapters": adapters, "max_rel_err": errors}
                )
                timed = variants()
                steps = {
                    v: step_fn(v, layers, x, meta, groups_of(v, adapters, args.slots), outs)
                    for v in timed
                }
                graphs = {v: graph_of(fn) for v, fn in steps.items()}
                times: dict[str, list[float]] = {v: [] for v in timed}
                for r in range(args.rounds):
                    order = timed if r % 2 == 0 else tuple(reversed(timed))
                    for v in order:
                        times[v].append(time_graph(graphs[v], args.reps))
                roof_ms = adapters * adapter_bytes / HBM_BYTES_PER_S * 1e3
                point = {
                    "rank": rank,
                    "tokens": tokens,
                    "adapters": adapters,
                    "adapter_bytes": adapter_bytes,
                    "roofline_ms": roof_ms,
                }
                for v, ts in times.items():
                    med = statistics.median(ts)
                    point[v] = {"ms": med, "min": min(ts), "max": max(ts)}
                result["points"].append(point)
                print(
                    f"r{rank} M={tokens} A={adapters}: "
                    + ", ".join(f"{v} {point[v]['ms']:.3f}" for v in timed)
                    + f" ms; roof {roof_ms:.3f} ms; err "
                    + ", ".join(f"{v} {e:.1e}" for v, e in errors.items()),
                    flush=True,
                )
                profiled = rank == max(args.ranks) and tokens == min(args.tokens)
                if args.profile and profiled and adapters in (8, 32):
                    for v in ("vllm", "grouped"):
                        result["profiles"][f"{v}_A{adapters}"] = profile_table(steps[v])
                del graphs, steps
                torch.cuda.synchronize()
        del layers
        torch.cuda.empty_cache()
    return result


def int_list(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def add_graph_flags(parser: argparse.ArgumentParser) -> None:
    """The flags every CUDA-graph timing here shares: rounds, replays a
    round, and the labels and file of its JSON."""
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--machine", default="")
    parser.add_argument("--commit", default=current_commit())
    parser.add_argument("--json", type=Path)


def run_to_json(
    parser: argparse.ArgumentParser, run: Callable[[argparse.Namespace], dict[str, Any]]
) -> int:
    """Parse the flags, run, and write the result where ``--json`` says."""
    args = parser.parse_args()
    result = run(args)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="8b")
    parser.add_argument("--slots", type=int, default=32, help="--max-loras")
    parser.add_argument("--ranks", type=lambda s: [int(v) for v in s.split(",")], default=[16, 64])
    parser.add_argument(
        "--tokens", type=lambda s: [int(v) for v in s.split(",")], default=[64, 256]
    )
    parser.add_argument(
        "--adapters", type=lambda s: [int(v) for v in s.split(",")], default=[1, 2, 4, 8, 16, 32]
    )
    add_graph_flags(parser)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--sweep", action="store_true", help="also time tile/grid choices")
    parser.add_argument(
        "--base-kernels",
        action="append",
        default=[],
        help="NAME=FILE: another grouped_lora.py, timed as grouped_NAME (repeatable)",
    )
    args = parser.parse_args()
    for spec_text in args.base_kernels:
        load_other_kernels(spec_text)
    result = run(args)
    if args.sweep:
        result["sweep"] = sweep(args)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    for name, table in result["profiles"].items():
        print(f"== profile {name}\n{table}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
