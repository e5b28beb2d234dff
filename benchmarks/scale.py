"""Swap cost at realistic scale: adapter size, transport, tenant count.

``python -m benchmarks.scale`` serves the random 8B-shaped model (``--size``;
:mod:`skyrl_lora.server.embedded.random_model`) on one GPU and measures two
curves on that one server:

* **swap cost against adapter bytes**: for each rank (``--ranks``; adapters
  on every linear layer), a trainer's sync (pause, weights in, resume) by
  each transport (``path``, HTTP ``push``, ``push_stream``, GPU ``handover``, and the
  hand-over as one call, ``handover_swap``), idle and while
  7 other tenants sample, in interleaved rounds
  (:func:`benchmarks.transport_swap.measure`);
* **the other tenants' cost against tenant count**: for each count
  (``--tenants``), one tenant reloads once a period (by each of
  ``--swap-transports``: a path load, or its bytes over the push stream)
  while the others stream, per-adapter pause against vLLM's global keep-mode pause, in
  interleaved windows (:func:`benchmarks.isolation.run`): the others'
  tokens/s over no-swap windows and their inter-token gaps during and
  outside swaps.

The server is started once with ``--max-lora-rank`` the largest rank and
``--max-loras`` the largest tenant count (a restart per count would cost
minutes of a lent GPU each). Raw figures go to ``--json`` (one entry per
curve point, with ``commit``, ``date``, ``machine`` and ``model``);
``--plot JSON`` draws the curves from such a file into PNGs beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import shlex
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks import isolation, transport_swap
from benchmarks.common import current_commit, int_list
from benchmarks.stats import IsolationChecks, UntrustworthyRunError
from skyrl_lora.client import RemoteInferenceClient
from skyrl_lora.errors import AdapterNotFoundError

ROOT = Path(__file__).resolve().parent.parent

#: The others' load while a rank's syncs are timed: 7 tenants of 8 streams.
SWAP_LOAD = transport_swap.TransportConfig(rounds=3, swaps=3, others=7, streams=8)
#: One tenant reloads (by path, no hold) once a second while the others stream.
TENANT_LOAD = isolation.IsolationConfig(
    rounds=3,
    max_tokens=128,
    swaps_per_window=4,
    hold_s=0.0,
    own_processes=True,
    warmup_s=3.0,
    checks=IsolationChecks(baseline_tolerance=0.15),
)
#: Streams per other tenant by tenant count: about 60 streams in all.
TOTAL_STREAMS = 60


def streams_per_tenant(tenants: int) -> int:
    return max(2, TOTAL_STREAMS // (tenants - 1))


async def unload(url: str, names: list[str]) -> None:
    async with RemoteInferenceClient(url) as client:
        for name in names:
            with contextlib.suppress(AdapterNotFoundError):  # a run that failed early
                await client.unload_lora_adapter(name)


def swap_cost_points(
    url: str,
    folders: dict[int, list[Path]],
    load: transport_swap.TransportConfig,
    commit: str,
    points: list[dict[str, Any]],
    saved: Callable[[], None] = lambda: None,
) -> None:
    """One point per rank, load and transport (the sync's spread over rounds
    and its tail), appended to ``points``, ``saved()`` after each rank."""
    for rank, pair in folders.items():
        cfg = replace(load, swapper=f"swap-r{rank}")
        started = time.monotonic()
        result = asyncio.run(transport_swap.measure(url, pair, cfg, strict=False))
        asyncio.run(unload(url, [cfg.swapper]))  # an idle adapter would hold a slot
        print(f"rank {rank}: measured in {time.monotonic() - started:.0f} s", flush=True)
        print(transport_swap.table(result), flush=True)
        adapter_bytes = (pair[0] / "adapter_model.safetensors").stat().st_size
        for load_kind in cfg.loads:
            for transport, figures in result[load_kind].items():
                points.append(
                    {
                        "commit": commit,
                        "greedy_same_tokens": result["greedy_same_tokens"],
                        "resumed_segments": result["resumed_segments"],
                        "rank": rank,
                        "adapter_bytes": adapter_bytes,
                        "load": load_kind,
                        "transport": transport,
                        **figures,
                    }
                )
        saved()


def tenant_points(
    url: str,
    model: Any,
    counts: list[int],
    commit: str,
    transports: list[str],
    points: list[dict[str, Any]],
    saved: Callable[[], None] = lambda: None,
    push_lanes: int | None = None,
) -> None:
    """One point per tenant count and swapper's transport (the others' rate
    ratio and gap tails by mode), appended to ``points``, ``saved()`` after
    each: a run cut short keeps the points it measured."""
    prompt = list(range(10, 74))  # 64 prompt tokens
    for tenants, transport in itertools.product(counts, transports):
        streams = streams_per_tenant(tenants)
        cfg = replace(
            TENANT_LOAD,
            tenants=tenants,
            streams=streams,
            streamed=min(4, streams),
            swap_transport=transport,
            push_lanes=push_lanes,
        )
        started = time.monotonic()
        try:
            result = asyncio.run(isolation.run(url, model, prompt, cfg))
        except UntrustworthyRunError as why:  # the other points still count
            print(f"{tenants} tenants, {transport}: no figures, {why}", flush=True)
            points.append(
                {
                    "commit": commit,
                    "tenants": tenants,
                    "swap_transport": transport,
                    "untrustworthy": str(why),
                }
            )
            saved()
            continue
        finally:
            asyncio.run(unload(url, cfg.names))
        try:
            result.check()
            trusted: str | None = None
        except UntrustworthyRunError as why:
            trusted = str(why)
        figures = result.to_json()
        print(
            f"{tenants} tenants, {transport} ({time.monotonic() - started:.0f} s): "
            f"{json.dumps(figures['others_ratio'])} untrusted={trusted}",
            flush=True,
        )
        points.append(
            {
                "commit": commit,
                "tenants": tenants,
                "swap_transport": transport,
                "streams_per_other": streams,
                "others_ratio": figures["others_ratio"],
                "others_ratio_pooled": figures["others_ratio_pooled"],
                "others_tok_s_no_swap": figures["others_tok_s_no_swap"],
                "gap_ms": figures["stall_ms"],
                "longest_gaps_during_swaps": figures["longest_gaps_during_swaps"],
                "swaps": figures["swaps"],
                # Each window's span on this process's clock, for the log's probes
                # (scripts/probes/gap_causes.py: the engine's long steps by window).
                "windows": figures["windows"],
                "untrustworthy": trusted,
            }
        )
        saved()


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from skyrl_lora.server.cluster.process import serving
    from skyrl_lora.server.embedded.random_model import build_random_model, write_model_adapter
    from skyrl_lora.server.presets import random_model_server_argv

    out = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="skyrl-scale-out-"))
    work = Path(args.work or tempfile.mkdtemp(prefix="skyrl-scale-"))
    started = time.monotonic()
    model = build_random_model(work, rank=64, size=args.size)
    folders = {
        r: [write_model_adapter(model.model_dir, work / f"r{r}-{i}", r, 20 + i) for i in (1, 2)]
        for r in args.ranks
    }
    torch.cuda.empty_cache()
    built_s = time.monotonic() - started
    argv = random_model_server_argv(
        model.model_dir,
        max_lora_rank=max(args.ranks),
        max_loras=max(args.tenants),
        gpu_memory_utilization=args.gpu_memory_utilization,
        extra=[*transport_swap.SERVER_FLAGS, *shlex.split(args.serve_flags)],
    )
    load = swap_load(args)
    meta: dict[str, Any] = {
        "commit": args.commit,
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{torch.cuda.get_device_name(0)}, vLLM 0.26.0",
        "model": args.size,
        "server": {
            "max_lora_rank": max(args.ranks),
            "max_loras": max(args.tenants),
            "flags": args.serve_flags,
        },
        "swap_load": load.__dict__,
        "model_build_s": round(built_s, 1),
        # The gaps' times are this process's monotonic clock, the server log's wall time.
        "wall_minus_monotonic_s": time.time() - time.monotonic(),
    }
    result: dict[str, Any] = {**meta, "swap_cost": [], "tenants": []}

    def save() -> None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))

    started = time.monotonic()
    with serving(["--no-ray", *argv], out / "scale_server.log") as running:
        result["server_start_s"] = round(time.monotonic() - started, 1)
        print(f"server up in {result['server_start_s']} s", flush=True)
        result["server"]["info"] = asyncio.run(server_info(running.url))
        save()
        if "tenants" in args.parts:
            transports = args.swap_transports.split(",")
            tenant_points(
                running.url,
                model,
                args.tenants,
                args.commit,
                transports,
                result["tenants"],
                save,
                args.push_lanes,
            )
        if "swap_cost" in args.parts:
            swap_cost_points(running.url, folders, load, args.commit, result["swap_cost"], save)
    return result


async def server_info(url: str) -> dict[str, Any]:
    """What the server says it runs with (its staging parts, pinned reserve, step watch)."""
    async with RemoteInferenceClient(url) as client:
        return (await client.server_info()).model_dump()


def plot(path: Path) -> list[Path]:
    """The curves of a ``scale.json`` as PNGs beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(path.read_text())
    commit = data["commit"]
    if isinstance(commit, dict):  # curves measured at different commits
        commit = ", ".join(f"{part} {c}" for part, c in commit.items())
    label = f"{data['model']} model, {data['machine']}, {commit} ({data['date']})"
    made = []
    if data["swap_cost"]:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
        for ax, load in zip(axes, ("idle", "under_load")):
            for transport in transport_swap.TRANSPORTS:
                points = sorted(
                    (
                        p
                        for p in data["swap_cost"]
                        if p["load"] == load and p["transport"] == transport
                    ),
                    key=lambda p: p["adapter_bytes"],
                )
                mb = [p["adapter_bytes"] / 1e6 for p in points]
                ax.errorbar(
                    mb,
                    [p["sync_ms"]["median"] for p in points],
                    yerr=[
                        [p["sync_ms"]["median"] - p["sync_ms"]["min"] for p in points],
                        [p["sync_ms"]["max"] - p["sync_ms"]["median"] for p in points],
                    ],
                    marker="o",
                    capsize=3,
                    label=transport,
                )
                for p, x in zip(points, mb):
                    ax.annotate(f"r{p['rank']}", (x, p["sync_ms"]["median"]), fontsize=7)
            ax.set_title(f"sync, {load.replace('_', ' ')}")
            ax.set_xlabel("adapter MB (bf16, every linear layer)")
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("pause + weights in + resume, ms")
        axes[0].legend()
        fig.suptitle(label, fontsize=9)
        fig.tight_layout()
        made.append(path.with_name("scale_swap_cost.png"))
        fig.savefig(made[-1], dpi=110)
        plt.close(fig)
    if data["tenants"]:
        points = sorted(  # the path reloads' curve (push points are in the JSON)
            (
                p
                for p in data["tenants"]
                if "others_ratio" in p and p.get("swap_transport", "path") == "path"
            ),
            key=lambda p: p["tenants"],
        )
        counts = [p["tenants"] for p in points]
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
        for mode in isolation.SWAP_MODES:
            spreads = [p["others_ratio"][mode] for p in points]
            axes[0].errorbar(
                counts,
                [s["median"] for s in spreads],
                yerr=[
                    [s["median"] - s["min"] for s in spreads],
                    [s["max"] - s["median"] for s in spreads],
                ],
                marker="o",
                capsize=3,
                label=isolation_title(mode),
            )
        axes[0].axhline(0.97, color="grey", ls=":", label="target 0.97x")
        axes[0].set_xlabel("tenants (one swapping once a second)")
        axes[0].set_ylabel("others' tokens/s during swaps / no swap")
        axes[0].legend()
        for kind, color in (("per_adapter_during_swap", "C3"), ("per_adapter_outside_swap", "C0")):
            where = kind.replace("per_adapter_", "").replace("_", " ")
            for tail, style in (("max", "o-"), ("p99", "s:")):
                axes[1].plot(
                    counts,
                    [p["gap_ms"][kind][tail]["median"] for p in points],
                    style,
                    color=color,
                    label=f"{tail} gap, {where}",
                )
        axes[1].set_xlabel("tenants")
        axes[1].set_ylabel("others' inter-token gap, ms (median of rounds)")
        axes[1].legend(fontsize=8)
        for ax in axes:
            ax.set_xticks(counts)
            ax.grid(alpha=0.3)
        fig.suptitle(label, fontsize=9)
        fig.tight_layout()
        made.append(path.with_name("scale_tenants.png"))
        fig.savefig(made[-1], dpi=110)
        plt.close(fig)
    return made


def swap_load(args: argparse.Namespace) -> transport_swap.TransportConfig:
    """The swap-cost part's load, narrowed by ``--transports`` and
    ``--swapper-samples``, widened by ``--others-apart``."""
    return replace(
        SWAP_LOAD,
        transports=tuple(args.transports.split(",")),
        swapper_samples=args.swapper_samples,
        loads=transport_swap.LOADS if args.others_apart else SWAP_LOAD.loads,
    )


def isolation_title(mode: str) -> str:
    return {"per_adapter": "per-adapter pause", "global": "global keep pause"}[mode]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="8b")
    parser.add_argument("--ranks", type=int_list, default=[8, 32, 64, 128])
    parser.add_argument("--tenants", type=int_list, default=[8, 16, 32])
    parser.add_argument("--parts", default="tenants,swap_cost")
    parser.add_argument(
        "--transports",
        default=",".join(transport_swap.TRANSPORTS),
        help="the swap-cost part's transports (path always among them)",
    )
    parser.add_argument(
        "--swap-transports",
        default="path",
        help="the tenant part's swapper reloads by each of these in turn (path, push_stream)",
    )
    parser.add_argument(
        "--push-lanes",
        type=int,
        default=None,
        help="connections of the tenant part's swapper's pushes (default: the client's)",
    )
    parser.add_argument(
        "--swapper-samples",
        action="store_true",
        help="under load the swapper samples too, so its syncs abort and resume its own requests",
    )
    parser.add_argument(
        "--others-apart",
        action="store_true",
        help="also measure each round under the same load sent from a process of its own "
        "(the load 'under_load_apart'), not from the trainer's event loop",
    )
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.8)
    parser.add_argument("--work", help="where the model and adapters are built (reused)")
    parser.add_argument(
        "--serve-flags",
        default="",
        help="more `skyrl-lora serve` flags, e.g. --no-gpu-staging for an A/B",
    )
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks/out/scale.json")
    parser.add_argument("--commit", default=current_commit())
    parser.add_argument("--plot", type=Path, metavar="JSON", help="only draw the curves of JSON")
    args = parser.parse_args()
    unknown = set(args.swap_transports.split(",")) - set(isolation.SWAP_TRANSPORTS)
    if unknown:  # before a server starts: minutes of a lent GPU
        parser.error(f"--swap-transports: {sorted(unknown)} not among {isolation.SWAP_TRANSPORTS}")
    if args.plot:
        for made in plot(args.plot):
            print(f"wrote {made}")
        return 0
    run(args)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
