"""Ready-made server flags for the embedded tiny model."""

from __future__ import annotations

from collections.abc import Sequence

from .embedded import EmbeddedModel

#: Environment for CPU vLLM on small machines: a 1 GiB KV cache is plenty for
#: the tiny model and leaves room for several replicas on one host.
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}

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
