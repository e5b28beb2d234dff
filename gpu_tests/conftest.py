"""GPU fixtures: the same scenarios as ``tests/``, served by CUDA vLLM.

Everything skips, with the reason, where there is no CUDA device or no vLLM.
The server runs in a subprocess (``skyrl-lora serve --no-ray``): the GPU
machines have no Ray, and one server needs none.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

# The CUDA engine runs the tiny model so fast that short samples finish before
# a pause can land: the shared scenarios read these when they are imported.
os.environ.setdefault("SKYRL_TEST_LONG", "900")
os.environ.setdefault("SKYRL_TEST_SETTLE_S", "0.05")

from skyrl_lora.server.cluster.process import ServeProcess, start_serve
from tests.conftest import (  # noqa: F401
    MAX_ADAPTER_BYTES,
    EngineServer,
    embedded_model,
    http,
    tokenizer,
)


def _missing() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device"
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed (scripts/gpu_device_run.sh installs it on a lent GPU)"
    return None


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    reason = _missing()
    if reason is not None:
        for item in items:
            if "gpu_tests" in str(item.fspath):
                item.add_marker(pytest.mark.skip(reason=f"GPU tests need CUDA vLLM: {reason}"))


#: Flags every GPU server gets: leave room for a second server on the card.
GPU_FLAGS = ["--gpu-memory-utilization", os.environ.get("SKYRL_GPU_MEM", "0.35")]


#: The servers started here, by pid, so that stop_server can take down their trees.
_STARTED: dict[int, ServeProcess] = {}


def start_server(
    argv: Sequence[str], log_name: str, timeout: float = 540
) -> tuple[subprocess.Popen[str], str]:
    """Start ``skyrl-lora serve --no-ray`` in a session of its own and wait for its ready line."""
    log_dir = Path(os.environ.get("OUT") or "/tmp")
    server = start_serve(["--no-ray", *argv], log_dir / f"{log_name}.log", timeout_s=timeout)
    _STARTED[server.proc.pid] = server
    return server.proc, server.url


def stop_server(proc: subprocess.Popen[str]) -> None:
    """SIGTERM, then SIGKILL to the process group and every process it started."""
    server = _STARTED.pop(proc.pid)
    try:
        server.stop(timeout_s=60)
    finally:
        server.kill_all()


@pytest.fixture(scope="session")
def engine_server(
    embedded_model: Any,  # noqa: F811
    tokenizer: Any,  # noqa: F811
    tmp_path_factory: Any,
) -> Iterator[EngineServer]:
    from skyrl_lora.server.presets import embedded_server_argv

    dtype = os.environ.get("SKYRL_GPU_DTYPE", "bfloat16")  # CUDA LoRA kernels: fp16/bf16 only
    snapshots = tmp_path_factory.mktemp("snapshots")
    # Adapter paths confined as on the CPU's session server: the embedded
    # model's folder and one scratch folder the scenarios write to.
    scratch = tmp_path_factory.mktemp("adapter-root")
    extra = [*GPU_FLAGS, "--dtype", dtype, "--adapter-snapshot-dir", str(snapshots)]
    extra += ["--adapter-root", str(embedded_model.root), "--adapter-root", str(scratch)]
    extra += ["--adapter-reader"]  # opt-in, as on the CPU's session server: covered here too
    extra += ["--max-adapter-bytes", str(MAX_ADAPTER_BYTES)]
    argv = embedded_server_argv(embedded_model, extra=extra)
    started = time.monotonic()
    proc, url = start_server(argv, "gpu_scenario_server")
    print(f"\nCUDA scenario server ready in {time.monotonic() - started:.0f} s at {url}")
    try:
        yield EngineServer(
            url, embedded_model, tokenizer, adapter_root=scratch, snapshot_dir=snapshots
        )
    finally:
        stop_server(proc)
