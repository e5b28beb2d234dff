"""Ready-made server flags: the embedded tiny model (CPU), the random perf models (GPU)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from .embedded import EmbeddedModel

#: Environment for CPU vLLM on small machines: a 1 GiB KV cache is plenty for
#: the tiny model and leaves room for several replicas on one host. vLLM binds
#: each engine's OpenMP threads to the host's first cores by default (and keeps
#: one core for its scheduler), so every replica on a host computed on core 0:
#: two replicas on the 2-core CPU machine made 25-26 tokens/s each, one alone
#: 52-55. Unbound and single-threaded (the tiny model gains nothing from more),
#: the OS spreads them: 33-42 each (main 1875299, 2026-11-28).
CPU_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
}

EMBEDDED_MODEL_NAME = "tiny-llama"


def embedded_server_argv(
    model: EmbeddedModel,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    extra: Sequence[str] = (),
) -> list[str]:
    """``vllm serve`` flags that serve the embedded model with its adapters loaded."""
    modules = [f"{name}={path}" for name, path in sorted(model.adapters.items())]
    return [
        "--model",
        str(model.model_dir),
        "--served-model-name",
        EMBEDDED_MODEL_NAME,
        "--dtype",
        "float32",
        "--max-model-len",
        "1024",
        "--enable-lora",
        "--max-lora-rank",
        "64",
        "--max-loras",
        str(max(4, len(modules))),
        "--lora-modules",
        *modules,
        "--host",
        host,
        "--port",
        str(port),
        "--disable-uvicorn-access-log",
        *extra,
    ]


#: The random perf models' served name (:mod:`.embedded.random_model`).
RANDOM_MODEL_NAME = "perf-llama"


def random_model_server_argv(
    model_dir: Path,
    *,
    max_lora_rank: int,
    max_loras: int,
    gpu_memory_utilization: float,
    extra: Sequence[str] = (),
) -> list[str]:
    """``vllm serve`` flags for a random perf model on CUDA, on a free local port.

    ``gpu_memory_utilization`` is the server's share of the GPU: lower it
    where trainers or a second server share the card.
    """
    return [
        "--model", str(model_dir),
        "--served-model-name", RANDOM_MODEL_NAME,
        "--dtype", "bfloat16",
        "--max-model-len", "2048",
        "--enable-lora",
        "--max-lora-rank", str(max_lora_rank),
        "--max-loras", str(max_loras),
        "--host", "127.0.0.1",
        "--port", "0",
        "--disable-uvicorn-access-log",
        "--gpu-memory-utilization", str(gpu_memory_utilization),
        *extra,
    ]  # fmt: skip
