"""Swap isolation, token-gap stalls and control latency on CUDA vLLM (random 0.8B Llama).

Runs exactly the CPU benchmark's code (:func:`benchmarks.perf.collect`:
interleaved no-swap / per-adapter / global windows over rounds, the other
tenants' streamed inter-token gaps inside and outside swaps, pause latency,
idle control round trip, swap time by rank), in issue 10's shape: 3 tenants
x 16 streams, a swap every second holding 0.3 s, then 8 tenants with one
swapping. Prints the table and writes ``gpu_perf.json`` to ``$OUT`` and to
``docs/gpu/``; fails if a sanity check says the run is not trustworthy.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import time
from dataclasses import replace
from pathlib import Path

from benchmarks import perf
from benchmarks.isolation import IsolationConfig
from benchmarks.report import table
from benchmarks.stats import IsolationChecks
from gpu_tests.conftest import GPU_FLAGS, start_server, stop_server
from gpu_tests.perf_model import build_perf_model, write_random_adapter

ROOT = Path(__file__).resolve().parent.parent

#: A dedicated GPU drifts less than the shared CPU box: a tighter baseline check.
GPU_CHECKS = IsolationChecks(baseline_tolerance=0.15)
#: Longer than the CPU's warm-up: the first seconds on a fresh GPU server
#: still capture CUDA graphs for new batch sizes.
GPU_WARMUP_S = 5.0
#: Completions four times the CPU's: a 0.8B model on an H100 finishes a
#: 32-token completion in a few steps, so 48 loops of them spend much of
#: their time between requests (HTTP, admission, prefill). The engine then
#: ran 32-44 of the 48 and the others' rate followed request turnaround, not
#: the engine (no-swap windows 22-37% apart in three runs).
GPU_MAX_TOKENS = 128
#: Windows of 6 s (6 swaps each) instead of 3 s: with 3 s windows the no-swap
#: windows of one run were 17% apart in three runs of two sessions, one
#: window off by itself each time, and a 3 s window holds only ~2 of the
#: rare 30-60 ms engine steps that set the tails.
GPU_SWAPS_PER_WINDOW = 6
#: Four rounds, not the CPU's three: per-round ratios on the H100 spread
#: over 10-20 points (0.88-1.01x in one run) against a 0.97x target, so a
#: median of three moves with one round's luck; 45 s more per part.
GPU_ROUNDS = 4
GPU_ISOLATION = IsolationConfig(
    tenants=3,
    rounds=GPU_ROUNDS,
    streams=16,
    max_tokens=GPU_MAX_TOKENS,
    swaps_per_window=GPU_SWAPS_PER_WINDOW,
    own_processes=True,  # 16 cores: a process per tenant costs the server nothing
    checks=GPU_CHECKS,
    warmup_s=GPU_WARMUP_S,
)
GPU_SHAPE = perf.PerfShape(
    isolation=GPU_ISOLATION,
    eight_tenants=replace(GPU_ISOLATION, tenants=8),
    pause_rounds=3,
    pauses=50,
    in_flight=64,
    swap_repeats=6,
)


#: ``SKYRL_GPU_PERF_PART=three_tenants``: the 3-tenant isolation part with a
#: token pause-latency, control and rank-16 swap part, no 8 tenants: about
#: 2.5 minutes of measuring instead of 4.5, for a lease's last minutes.
THREE_TENANTS_SHAPE = replace(
    GPU_SHAPE,
    eight_tenants=None,
    pause_rounds=1,
    pauses=10,
    control_rounds=1,
    control_repeats=10,
    swap_repeats=2,
    ranks=(16,),
)


def _argv(model_dir: Path, modules: list[str]) -> list[str]:
    return [
        "--model",
        str(model_dir),
        "--served-model-name",
        "perf-llama",
        "--dtype",
        "bfloat16",
        "--max-model-len",
        "2048",
        "--enable-lora",
        "--max-lora-rank",
        "64",
        "--max-loras",
        "8",
        "--lora-modules",
        *modules,
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--disable-uvicorn-access-log",
        *GPU_FLAGS,
        # Engine flags to compare (e.g. a step token budget), recorded in the json.
        *shlex.split(os.environ.get("SKYRL_GPU_PERF_FLAGS", "")),
    ]


def test_gpu_swap_isolation_and_latency(tmp_path_factory) -> None:
    import torch
    import vllm

    shape = (
        THREE_TENANTS_SHAPE
        if os.environ.get("SKYRL_GPU_PERF_PART") == "three_tenants"
        else GPU_SHAPE
    )
    root = Path(os.environ.get("SKYRL_GPU_PERF_DIR") or tmp_path_factory.mktemp("perf"))
    model = build_perf_model(root)
    by_rank = {
        r: [write_random_adapter(model.model_dir, root / f"r{r}-{i}", r, 10 + i) for i in (1, 2)]
        for r in shape.ranks
    }
    started = time.monotonic()
    proc, url = start_server(
        _argv(model.model_dir, [f"{n}={p}" for n, p in model.adapters.items()]), "gpu_perf_server"
    )
    server_s = time.monotonic() - started
    try:
        prompt = list(range(10, 74))  # 64 prompt tokens
        run = asyncio.run(perf.collect(url, model, prompt, shape, adapters_by_rank=by_rank))
    finally:
        stop_server(proc)
    figures = {
        "gpu": torch.cuda.get_device_name(0),
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "server_flags": os.environ.get("SKYRL_GPU_PERF_FLAGS", ""),
        "part": os.environ.get("SKYRL_GPU_PERF_PART", "all"),
        "server_start_s": server_s,
        "measure_s": time.monotonic() - started - server_s,
        # Window times are time.monotonic(); the server log is wall-clock time.
        "wall_minus_monotonic_s": time.time() - time.monotonic(),
        **run.figures(),
    }
    text = json.dumps(figures, indent=2)
    for out in (Path(os.environ.get("OUT") or root), ROOT / "docs" / "gpu"):
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_perf.json").write_text(text)
    print("\n" + table(run.rows()))
    assert not perf.missing_keys(figures), perf.missing_keys(figures)
    run.check()  # after writing: an untrustworthy run still leaves its raw figures
