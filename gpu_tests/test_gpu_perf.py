"""Throughput and pause latency on CUDA vLLM with a random 0.8B Llama.

Reuses the CPU benchmarks' code: per-tenant tokens/s with and without a
concurrent swap (per-adapter and global pause) and pause latency with 64
requests in flight. Prints a table and writes ``$OUT/gpu_perf.json``.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

from benchmarks import isolation, pause_latency, swap_time
from gpu_tests.conftest import GPU_FLAGS, start_server, stop_server
from gpu_tests.perf_model import build_perf_model, write_random_adapter


def test_gpu_throughput_and_pause_latency(tmp_path_factory) -> None:
    import torch
    import vllm

    root = Path(os.environ.get("SKYRL_GPU_PERF_DIR") or tmp_path_factory.mktemp("perf"))
    model = build_perf_model(root)
    modules = [f"{n}={p}" for n, p in model.adapters.items()]
    argv = [
        "--model",
        str(model.model_dir),
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
    ]
    proc, url = start_server(argv, "gpu_perf_server")
    try:
        prompt = list(range(10, 74))  # 64 prompt tokens
        phases, _ = asyncio.run(isolation.run(url, model, prompt, seconds=6.0, streams=16))
        latency = asyncio.run(pause_latency.run(url, model, prompt, rounds=50, in_flight=64))
        by_rank = {
            r: [
                write_random_adapter(model.model_dir, root / f"r{r}-{i}", r, seed=10 + i)
                for i in (1, 2)
            ]
            for r in (8, 16, 64)
        }
        swaps = asyncio.run(swap_time.run(url, model, repeats=4, adapters=by_rank))
    finally:
        stop_server(proc)
    base = phases[0]
    result = {
        "gpu": torch.cuda.get_device_name(0),
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "tenant_tok_s": {p.name: p.others_rate / 2 for p in phases},
        "others_ratio": {p.name: p.others_rate / base.others_rate for p in phases},
        "pause_latency_ms": latency.summary,
        "swap_ms": swaps,
    }
    out = Path(os.environ.get("OUT") or root)
    (out / "gpu_perf.json").write_text(json.dumps(result, indent=2))
    print("\n" + json.dumps(result, indent=2))
    assert latency.summary["p99_ms"] > 0 and base.others_rate > 0
