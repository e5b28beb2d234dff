"""The engine's tokens/s against the number of distinct adapters in its batch.

``python -m benchmarks.engine_rate`` (GPU) serves the random 8B-shaped model
(``--size``) with ``--max-loras`` rank-``--rank`` adapters loaded before it measures,
from several servers side by side on one GPU, each with its share of the
memory (``--gpu-mem``; by default they split :data:`GPU_MEM_TOTAL` evenly):

* ``ours``: ``skyrl-lora serve`` with its defaults (the grouped LoRA
  kernels, each layer's shrink on a second stream beside its base GEMM);
* ``ours_fused``: the same with ``--lora-overlap fused`` (each layer's base
  GEMM and LoRA in one launch of ours where it takes the step);
* ``ours_no_overlap``: the same with ``--lora-overlap off``;
* ``ours_vllm_kernels``: the same with vLLM's kernels and no overlap, as
  plain vLLM runs its LoRA layers (what the wrapper itself costs);
* ``vllm``: plain ``vllm serve`` (vLLM's OpenAI server) with the same vLLM flags.

Plain vLLM loads the adapters at start (``--lora-modules``, about 15 s
apiece at the 8B shape); ours load them through their own route
(``POST /skyrl/v1/adapters/load``, the path loads of a sync) once up, and
the JSON keeps each server's ``adapter_load_s``.

For each point (``--streams`` concurrent streamed completions, spread
round-robin over ``A`` of the adapters, ``A`` from ``--adapters``; 0 is
the base model through the same LoRA-enabled server) every server in turn
runs the load for ``--warmup-s`` and is measured for ``--window-s``; the
order alternates between rounds, and only the measured server has load
(the others idle). Beside each point: the decode step's time (streams over
tokens/s: each step gives every running stream one token), the GPU's busy
share over the window (NVML), and the HBM time of the bytes that step must
read (base weights, each distinct adapter once, the streams' KV cache),
so each point reads as a fraction of its own roofline. ``--json`` takes
the points with ``commit``, ``date`` and ``machine``; ``--plot`` draws them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.common import current_commit, free_port, int_list
from benchmarks.greedy_reference import (
    bench_prompt,
    distance,
    served_first_token,
)
from benchmarks.rounding_orders import first_token_references
from benchmarks.streams import StreamLog, keep_streaming
from examples.rl.gpu_busy import GpuBusy
from skyrl_lora.client import RemoteInferenceClient
from skyrl_lora.errors import SkyRLLoraError

#: H200 HBM3e, the datasheet's bandwidth.
HBM_BYTES_PER_S = 4.8e12
#: vLLM's CUDA graph sizes for every server here: fewer than its default 67 (a
#: server start of minutes fewer on a lent GPU), up to the 512-token step budget.
CAPTURE_SIZES = [1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 128, 160, 192, 256, 320, 384, 448, 512]
#: Our servers' flags beyond the shared vLLM flags.
OURS = {
    "ours": [],
    "ours_fused": ["--lora-overlap", "fused"],
    "ours_no_overlap": ["--lora-overlap", "off"],
    "ours_vllm_kernels": ["--lora-kernels", "vllm", "--lora-overlap", "off"],
}
SERVERS = (*OURS, "vllm")
#: The most of a GPU's memory the servers' ``--gpu-mem`` shares may add up to
#: (each process's CUDA context takes some beside its share).
GPU_MEM_TOTAL = 0.95
#: How the plot names them.
LABELS = {
    "ours": "skyrl-lora serve (grouped kernels, overlapped shrink)",
    "ours_fused": "skyrl-lora serve --lora-overlap fused",
    "ours_no_overlap": "skyrl-lora serve --lora-overlap off",
    "ours_vllm_kernels": "skyrl-lora serve --lora-kernels vllm --lora-overlap off",
    "vllm": "plain vllm serve",
}


@dataclass(frozen=True)
class Measured:
    """One point's window: tokens/s, the GPU's busy share (None without NVML),
    and the share of one core this load generator used: near 1 it, not the
    server, may be what limits the rate."""

    tokens_per_s: float
    gpu_busy: float | None
    client_cpu: float


@dataclass(frozen=True)
class Model:
    """What a step must read, from the model's files."""

    name: str
    weight_bytes: int
    kv_bytes_per_token: int
    adapter_bytes: int


def model_facts(model_dir: Path, adapter_dir: Path) -> Model:
    config = json.loads((model_dir / "config.json").read_text())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    kv = config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head_dim * 2
    weights = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    adapter = sum(p.stat().st_size for p in adapter_dir.glob("*.safetensors"))
    return Model(model_dir.name, weights, kv, adapter)


@dataclass
class Running:
    name: str
    url: str
    proc: subprocess.Popen[bytes]


@contextlib.contextmanager
def plain_vllm(
    argv: list[str],
    log: Path,
    env: dict[str, str],
    timeout_s: float = 900,
    launcher: Sequence[str] = ("-m", "vllm.entrypoints.openai.api_server"),
) -> Iterator[Running]:
    """vLLM's own OpenAI server with ``argv`` (its ``--port 0`` replaced by a free port).

    ``launcher``: the Python arguments before ``argv`` (a benchmark's wrapper)."""
    port = free_port()
    args = list(argv)
    args[args.index("--port") + 1] = str(port)
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, *launcher, *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **env},
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {proc.returncode}; see {log}")
            with contextlib.suppress(OSError):
                import urllib.request

                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            time.sleep(2)
        else:
            raise RuntimeError(f"vllm serve not healthy in {timeout_s} s; see {log}")
        yield Running("vllm", url, proc)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 15)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)


async def measure_point(
    url: str, models: list[str], streams: int, prompt: list[int], args: argparse.Namespace
) -> Measured:
    """``streams`` streams spread over ``models``, measured over the window."""
    logs = [StreamLog(m) for m in models]
    stop = asyncio.Event()
    per = [
        streams // len(models) + (1 if i < streams % len(models) else 0) for i in range(len(models))
    ]
    tasks = [
        asyncio.create_task(
            keep_streaming(url, m, prompt, log, stop, n, args.max_tokens, length_spread=0.5)
        )
        for m, log, n in zip(models, logs, per)
        if n > 0
    ]
    busy = GpuBusy.open(args.nvml_device, interval=0.2)  # None without NVML
    polled = asyncio.Event()
    polling = asyncio.create_task(busy.run(polled)) if busy is not None else None
    try:
        await asyncio.sleep(args.warmup_s)
        start, cpu_start = time.monotonic(), time.process_time()
        await asyncio.sleep(args.window_s)
        end, cpu_end = time.monotonic(), time.process_time()
        for task in tasks:
            if task.done() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
    finally:
        polled.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, *([polling] if polling else []), return_exceptions=True)
    tokens = sum(log.tokens_in(start, end) for log in logs)
    share = busy.between(start, end)["device_busy_pct"] / 100 if busy is not None else None
    return Measured(tokens / (end - start), share, (cpu_end - cpu_start) / (end - start))


async def same_outputs(
    urls: dict[str, str], models: list[str], prompt: list[int]
) -> dict[str, Any]:
    """Greedy 16 tokens of each model from every server (``greedy``: the
    tokens, the first token's logprob and that position's top 5 tokens),
    against the first server's: the same tokens, and how far apart the first
    token's logprob is."""
    got: dict[str, dict[str, Any]] = {}
    async with aiohttp.ClientSession() as session:
        for server, url in urls.items():
            got[server] = {}
            for model in models:
                got[server][model] = await served_first_token(session, url, model, prompt)
    if not got:
        return {}
    first = next(iter(got))
    # The tokens themselves too: servers run one per GPU, in processes of
    # their own, are compared across their JSON files afterwards.
    report: dict[str, Any] = {"greedy": got}
    for server in list(got)[1:]:
        same, lp = 0, 0.0
        for model in models:
            a, b = got[first][model], got[server][model]
            same += int(a[0] == b[0])
            lp = max(lp, abs(a[1] - b[1]))
        report[f"{server}_vs_{first}"] = {
            "same_tokens": f"{same}/{len(models)}",
            "first_logprob_max_diff": round(lp, 4),
        }
    return report


def against_reference(outputs: dict[str, Any], references: dict[str, Any]) -> dict[str, Any]:
    """Each server's first tokens, per model, beside every reference's
    (:func:`benchmarks.rounding_orders.first_token_references`; every adapter
    name is one adapter's files, so each takes a reference's ``adapter``
    entry), and the reference each lies nearest (the smallest largest gap)."""
    from skyrl_lora.server.presets import RANDOM_MODEL_NAME

    report: dict[str, Any] = {"reference": references, "distance": {}, "nearest": {}}
    for server, models in outputs.get("greedy", {}).items():
        distances = report["distance"][server] = {}
        nearest = report["nearest"][server] = {}
        for model, got in models.items():
            which = "base" if model == RANDOM_MODEL_NAME else "adapter"
            gaps = {name: distance(tops[which], got[2]) for name, tops in references.items()}
            distances[model] = gaps
            nearest[model] = min(gaps, key=lambda name: gaps[name]["max_abs_gap"])
    return report


async def load_adapters(url: str, names: list[str], path: Path) -> float:
    """Load ``names`` (each ``path``'s files) through our server's load route,
    one after another as a trainer's syncs come; the seconds it took."""
    started = time.monotonic()
    async with RemoteInferenceClient(url) as client:
        for name in names:
            await client.load_lora_adapter(name, str(path))
    return time.monotonic() - started


def roofline_ms(model: Model, adapters: int, streams: int, args: argparse.Namespace) -> float:
    """HBM time of one decode step's reads: weights, each distinct adapter, the KV cache."""
    context = args.prompt_tokens + args.max_tokens / 2
    read = model.weight_bytes + adapters * model.adapter_bytes
    read += streams * context * model.kv_bytes_per_token
    return read / HBM_BYTES_PER_S * 1e3


def run(args: argparse.Namespace) -> dict[str, Any]:
    from skyrl_lora.server.cluster.process import start_serve
    from skyrl_lora.server.embedded.random_model import build_random_model, write_model_adapter
    from skyrl_lora.server.presets import RANDOM_MODEL_NAME, random_model_server_argv

    work = args.work
    args.out.mkdir(parents=True, exist_ok=True)
    built = time.monotonic()
    model = build_random_model(work, rank=16, size=args.size)
    adapter = write_model_adapter(model.model_dir, args.out / f"r{args.rank}", args.rank, seed=7)
    facts = model_facts(model.model_dir, adapter)
    # As many adapters as the largest point uses, in a server of --max-loras
    # slots either way.
    names = [f"a{i}" for i in range(min(args.max_loras, max([*args.adapters, 1])))]
    # One adapter's files under every name: a name is a slot of its own, and
    # the kernels read each slot's weights whatever they hold.
    modules = ["--lora-modules", *(f"{n}={adapter}" for n in names)]
    flags = random_model_server_argv(
        model.model_dir,
        max_lora_rank=args.rank,
        max_loras=args.max_loras,
        gpu_memory_utilization=args.gpu_mem,
        extra=[
            "--max-num-batched-tokens", "512",
            "--max-num-seqs", "512",
            "--compilation-config", json.dumps({"cudagraph_capture_sizes": CAPTURE_SIZES}),
        ],
    )  # fmt: skip
    vllm_flags = [*flags, *modules]
    result: dict[str, Any] = {
        "commit": args.commit,
        "date": time.strftime("%Y-%m-%d"),
        "machine": args.machine,
        "size": args.size,
        "rank": args.rank,
        "max_loras": args.max_loras,
        "adapters_loaded": len(names),
        "model": facts.__dict__,
        "hbm_bytes_per_s": HBM_BYTES_PER_S,
        # Plain vLLM's also --lora-modules a0..aN; ours load a0..aN once up.
        "vllm_flags": flags,
        "model_build_s": round(time.monotonic() - built, 1),
        "server_start_s": {},
        "adapter_load_s": {},
        "points": [],
    }
    prompt = bench_prompt(args.prompt_tokens)
    out = args.out
    # Before the servers, while the GPU's memory is free (28 GB at 8B): a run
    # cut short still holds its answer once the servers' first tokens are in.
    references = None
    if args.reference:
        references = first_token_references(model.model_dir, prompt, adapter)

    def save() -> None:
        if args.json:
            args.json.write_text(json.dumps(result, indent=1))

    with contextlib.ExitStack() as stack:
        urls: dict[str, str] = {}
        for name in args.servers:
            started = time.monotonic()
            try:
                # A compile cache of its own each: vLLM keys it by the model, not
                # by the LoRA kernels its graphs call.
                cache = {"VLLM_CACHE_ROOT": str(out / f"vllm-cache-{name}")}
                if name == "vllm":
                    running = stack.enter_context(
                        plain_vllm(vllm_flags, out / "vllm_server.log", cache)
                    )
                    urls[name] = running.url
                else:
                    server = start_serve(
                        ["--no-ray", *flags, *OURS[name]],
                        out / f"{name}_server.log",
                        timeout_s=900,
                        env=cache,
                    )
                    stack.callback(server.kill_all)
                    stack.callback(server.stop)
                    urls[name] = server.url
                    loaded = asyncio.run(load_adapters(server.url, names, adapter))
                    result["adapter_load_s"][name] = round(loaded, 1)
                    print(f"{name} loaded {len(names)} adapters in {loaded:.1f} s", flush=True)
            except (RuntimeError, SkyRLLoraError) as exc:  # not up, or its loads refused:
                # the others still measure; the JSON says why
                result.setdefault("server_errors", {})[name] = str(exc)
                print(f"{name} did not start: {exc}", flush=True)
                continue
            result["server_start_s"][name] = round(time.monotonic() - started, 1)
            print(f"{name} up in {result['server_start_s'][name]} s", flush=True)
        result["outputs"] = asyncio.run(same_outputs(urls, ["perf-llama", *names[:4]], prompt))
        print(f"outputs: {result['outputs']}", flush=True)
        if references is not None:
            result["outputs"] |= against_reference(result["outputs"], references)
            print(f"nearest reference: {result['outputs']['nearest']}", flush=True)
        save()
        servers = [s for s in args.servers if s in urls]
        for at, streams in enumerate(args.streams):
            # Rounds outermost, each walking the points forward then back: a
            # point's rounds spread over the run, so drift in the machine's
            # speed lands on the base model's point as on the others.
            for r in range(args.rounds if at == 0 else args.later_rounds):
                for adapters in args.adapters if r % 2 == 0 else args.adapters[::-1]:
                    models = names[:adapters] if adapters else [RANDOM_MODEL_NAME]
                    roof = roofline_ms(facts, adapters, streams, args)
                    order = servers if r % 2 == 0 else servers[::-1]
                    for name in order:
                        got = asyncio.run(measure_point(urls[name], models, streams, prompt, args))
                        tok_s, busy = got.tokens_per_s, got.gpu_busy
                        step_ms = 1e3 * streams / tok_s if tok_s else float("inf")
                        result["points"].append(
                            {
                                "server": name,
                                "streams": streams,
                                "adapters": adapters,
                                "round": r,
                                "tokens_per_s": round(tok_s, 1),
                                "step_ms": round(step_ms, 3),
                                "gpu_busy": None if busy is None else round(busy, 3),
                                "client_cpu": round(got.client_cpu, 3),
                                "roofline_ms": round(roof, 3),
                                "roofline_fraction": round(roof / step_ms, 3),
                            }
                        )
                        print(
                            f"S={streams} A={adapters} r{r} {name}: {tok_s:,.0f} tok/s, "
                            f"step {step_ms:.2f} ms (roof {roof:.2f}), busy {busy}, "
                            f"client cpu {got.client_cpu:.2f}",
                            flush=True,
                        )
                        save()
    result["summary"] = summary(result["points"])
    save()
    return result


def summary(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per server, streams and adapters: the median tokens/s over rounds, its
    spread, and the ratio to the same server's base-model rate."""
    keyed: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
    for p in points:
        keyed.setdefault((p["server"], p["streams"], p["adapters"]), []).append(p)
    rows = []
    for (server, streams, adapters), ps in sorted(keyed.items()):
        rates = [p["tokens_per_s"] for p in ps]
        base = keyed.get((server, streams, 0))
        base_rate = statistics.median(p["tokens_per_s"] for p in base) if base else None
        med = statistics.median(rates)
        rows.append(
            {
                "server": server,
                "streams": streams,
                "adapters": adapters,
                "tokens_per_s": med,
                "min": min(rates),
                "max": max(rates),
                "over_base": round(med / base_rate, 3) if base_rate else None,
                "step_ms": statistics.median(p["step_ms"] for p in ps),
                "roofline_fraction": statistics.median(p["roofline_fraction"] for p in ps),
                "gpu_busy": statistics.median(
                    p["gpu_busy"] for p in ps if p["gpu_busy"] is not None
                )
                if any(p["gpu_busy"] is not None for p in ps)
                else None,
            }
        )
    return rows


def merge(server_jsons: list[Path], kernels: Path | None, how: str) -> dict[str, Any]:
    """One JSON from runs made one server per GPU (``scripts/gpu_engine_rate.sh``):
    every server's points, start time, GPU and greedy tokens, the summary over
    all of them, and the kernel benchmark's run (profiles apart) if given."""
    runs = [json.loads(p.read_text()) for p in server_jsons]
    merged: dict[str, Any] = {k: v for k, v in runs[0].items() if k not in ("points", "summary")}
    merged["how"] = how
    merged["server_start_s"] = {}
    merged["gpu_of_server"] = {}
    merged["greedy"] = {}
    merged["points"] = []
    for gpu, run in enumerate(runs):
        merged["server_start_s"] |= run["server_start_s"]
        merged["gpu_of_server"] |= {name: gpu for name in run["server_start_s"]}
        merged["greedy"] |= run.get("outputs", {}).get("greedy", {})
        merged["points"] += run["points"]
    merged.pop("outputs", None)
    merged["summary"] = summary(merged["points"])
    if kernels is not None:
        merged["kernels"] = json.loads(kernels.read_text())
        merged["kernel_profiles"] = merged["kernels"].pop("profiles", {})
    return merged


def plot(path: Path) -> Path:
    """tokens/s against distinct adapters, one line per server and stream count,
    with the roofline's tokens/s beside them; where the JSON holds a
    ``kernels`` run (:mod:`benchmarks.lora_kernels`), a last panel of the
    step's LoRA work alone, vLLM's kernels against ours and the adapter
    bytes' HBM time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(path.read_text())
    rows = data["summary"]
    streams_list = sorted({r["streams"] for r in rows})
    kernels = data.get("kernels")
    panels = len(streams_list) + (1 if kernels else 0)
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.5), squeeze=False)
    for ax, streams in zip(axes[0], streams_list):
        for server in sorted({r["server"] for r in rows}):
            pts = [r for r in rows if r["server"] == server and r["streams"] == streams]
            xs = [max(r["adapters"], 0.5) for r in pts]
            label = LABELS.get(server, server)
            ax.plot(xs, [r["tokens_per_s"] for r in pts], marker="o", label=label)
        first = rows[0]["server"]
        roof = [p for p in data["points"] if p["streams"] == streams and p["server"] == first]
        roof_x = sorted({p["adapters"] for p in roof})
        roof_y = [
            1e3 * streams / next(p["roofline_ms"] for p in roof if p["adapters"] == a)
            for a in roof_x
        ]
        ax.plot([max(a, 0.5) for a in roof_x], roof_y, "k--", label="HBM roofline")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("distinct adapters in the batch (0 = base model, drawn at 0.5)")
        ax.set_ylabel("engine tokens/s")
        ax.set_title(f"{data['size']} shape, rank {data['rank']}, {streams} streams")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    if kernels:
        ax = axes[0][-1]
        pts = [
            p
            for p in kernels["points"]
            if p["rank"] == data["rank"] and p["tokens"] == min(streams_list)
        ]
        xs = [p["adapters"] for p in pts]
        for variant, label in (("vllm", "vLLM's kernels"), ("grouped", "grouped (ours)")):
            ax.plot(xs, [p[variant]["ms"] for p in pts], marker="o", label=label)
        ax.plot(xs, [p["roofline_ms"] for p in pts], "k--", label="adapter bytes' HBM time")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("distinct adapters in the batch")
        ax.set_ylabel("ms of LoRA kernels per decode step (CUDA graph)")
        ax.set_title(
            f"the step's LoRA work alone, {min(streams_list)} tokens\n"
            f"(main {kernels['commit']}, {kernels['date']})",
            fontsize=9,
        )
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    fig.suptitle(f"{data['machine']}, main {data['commit']}, {data['date']}", fontsize=9)
    fig.tight_layout()
    png = path.with_suffix(".png")
    fig.savefig(png, dpi=110)
    return png


def memory_share(servers: list[str], share: float | None) -> float:
    """Each server's share of the GPU's memory (None: an even split of
    :data:`GPU_MEM_TOTAL`). ValueError for a server not in :data:`SERVERS`,
    or shares that add up past it: vLLM refuses such a server only once the
    ones before it are up, minutes in."""
    unknown = sorted(set(servers) - set(SERVERS))
    if unknown:
        raise ValueError(f"--servers: no server {', '.join(unknown)} (known: {', '.join(SERVERS)})")
    if share is None:
        return int(GPU_MEM_TOTAL / len(servers) * 100) / 100
    if len(servers) * share > GPU_MEM_TOTAL:
        raise ValueError(
            f"--gpu-mem {share} for each of {len(servers)} servers side by side on one GPU "
            f"asks for more than {GPU_MEM_TOTAL} of its memory"
        )
    return share


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="8b")
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--max-loras", type=int, default=32)
    parser.add_argument("--adapters", type=int_list, default=[0, 1, 2, 4, 8, 16, 32])
    parser.add_argument("--streams", type=int_list, default=[64, 256])
    parser.add_argument("--servers", type=lambda s: s.split(","), default=list(SERVERS))
    parser.add_argument("--rounds", type=int, default=2, help="per point, first --streams")
    parser.add_argument("--later-rounds", type=int, default=1, help="per point, other --streams")
    parser.add_argument("--warmup-s", type=float, default=3.0)
    parser.add_argument("--window-s", type=float, default=5.0)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument(
        "--reference",
        action="store_true",
        help="the servers' first greedy tokens against float32 and bf16's rounding orders "
        "(benchmarks.rounding_orders; 28 GB at 8B, before the servers start)",
    )
    parser.add_argument(
        "--gpu-mem",
        type=float,
        help=f"each server's share of the GPU's memory (default: {GPU_MEM_TOTAL} split evenly)",
    )
    parser.add_argument("--nvml-device", type=int, default=0)
    parser.add_argument("--work", type=Path, default=Path("/tmp/engine-rate"))
    parser.add_argument("--out", type=Path, default=Path("/tmp/engine-rate/out"))
    parser.add_argument("--machine", default="")
    parser.add_argument("--commit", default=current_commit())
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path, help="draw an earlier run's JSON and exit")
    parser.add_argument(
        "--merge", type=Path, nargs="+", help="merge runs of one server each into --json, draw it"
    )
    parser.add_argument("--kernels", type=Path, help="with --merge: benchmarks.lora_kernels' JSON")
    parser.add_argument("--how", default="", help="with --merge: how the runs were made")
    args = parser.parse_args()
    if args.merge:
        if not args.json:
            parser.error("--merge needs --json")
        args.json.write_text(json.dumps(merge(args.merge, args.kernels, args.how), indent=1))
        print(plot(args.json))
        return 0
    if args.plot:
        print(plot(args.plot))
        return 0
    try:
        args.gpu_mem = memory_share(args.servers, args.gpu_mem)
    except ValueError as exc:
        parser.error(str(exc))
    result = run(args)
    for row in result["summary"]:
        print(row, flush=True)
    if args.json:
        print(plot(args.json))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
