"""The host-side LoRA plan's cost per step, both ways, by step size.

``python -m benchmarks.host_plan`` (CPU): the engine's step loop maps each
token's adapter id to its slot and plans the LoRA kernels' metadata
(:func:`skyrl_lora.server.lora_metadata.slots_of` and ``plan``) twice a
step, for the tokens and for the sampled rows. Small steps take the Python
lists, larger ones torch's ``unique`` and ``sort`` (``LIST_PLAN_MAX``);
this times both ways at each size, interleaved, ``--rounds`` rounds,
median with min and max, so the switch can be placed where they cross.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import current_commit
from benchmarks.lora_kernels import int_list, run_to_json
from skyrl_lora.server import lora_metadata

#: vLLM's captured active-adapter counts at ``--max-loras 32``.
CAPTURED = [1, 2, 4, 8, 16, 32, 33]


@contextmanager
def _way(name: str) -> Iterator[None]:
    """Every size planned on lists (``lists``) or with torch (``torch``)."""
    kept = lora_metadata.LIST_PLAN_MAX
    lora_metadata.LIST_PLAN_MAX = 1 << 30 if name == "lists" else -1
    try:
        yield
    finally:
        lora_metadata.LIST_PLAN_MAX = kept


def _us_per_plan(ids: list[int], table: dict[int, int], reps: int) -> float:
    start = time.perf_counter()
    for _ in range(reps):
        lora_metadata.plan(lora_metadata.slots_of(ids, table), CAPTURED)
    return (time.perf_counter() - start) / reps * 1e6


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)  # the step loop's own thread
    table = lora_metadata.slot_table([None, *range(1, 33)])
    result: dict[str, Any] = {
        "commit": args.commit, "date": time.strftime("%Y-%m-%d"), "machine": args.machine,
        "adapters": args.adapters, "list_plan_max": lora_metadata.LIST_PLAN_MAX, "points": [],
    }  # fmt: skip
    for tokens in args.tokens:
        rng = random.Random(tokens)
        ids = [rng.choice([0, *range(1, args.adapters + 1)]) for _ in range(tokens)]
        times: dict[str, list[float]] = {"lists": [], "torch": []}
        for r in range(args.rounds):
            for way in ("lists", "torch") if r % 2 == 0 else ("torch", "lists"):
                with _way(way):
                    times[way].append(_us_per_plan(ids, table, args.reps))
        point: dict[str, Any] = {"tokens": tokens}
        for way, values in times.items():
            point[way] = {"us": statistics.median(values), "min": min(values), "max": max(values)}
        result["points"].append(point)
        shown = ", ".join(
            f"{way} {p['us']:.0f} us ({p['min']:.0f}-{p['max']:.0f})"
            for way, p in point.items()
            if isinstance(p, dict)
        )
        print(f"{tokens} tokens: {shown}", flush=True)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int_list, default=[16, 64, 128, 256, 512, 2048])
    parser.add_argument("--adapters", type=int, default=8, help="distinct adapters in a step")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--reps", type=int, default=400, help="plans timed a round")
    parser.add_argument("--machine", default="")
    parser.add_argument("--commit", default=current_commit())
    parser.add_argument("--json", type=Path)
    return run_to_json(parser, run)


if __name__ == "__main__":
    raise SystemExit(main())
