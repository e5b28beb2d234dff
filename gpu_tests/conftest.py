"""GPU fixtures: the same scenarios as ``tests/``, served by CUDA vLLM.

Everything skips, with the reason, where there is no CUDA device or no vLLM.
The server runs in a subprocess (``skyrl-lora serve --no-ray``): the GPU
machines have no Ray, and one server needs none.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

# The CUDA engine runs the tiny model so fast that short samples finish before
# a pause can land: the shared scenarios read these when they are imported.
os.environ.setdefault("SKYRL_TEST_LONG", "900")
os.environ.setdefault("SKYRL_TEST_SETTLE_S", "0.05")

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


def start_server(
    argv: Sequence[str], log_name: str, timeout: float = 540
) -> tuple[subprocess.Popen[str], str]:
    """Start ``skyrl-lora serve --no-ray`` and wait for its ready line."""
    log_dir = os.environ.get("OUT") or "/tmp"
    log = open(os.path.join(log_dir, f"{log_name}.log"), "w")  # noqa: SIM115 (lives with the process)
    proc = subprocess.Popen(
        [sys.executable, "-m", "skyrl_lora.server", "serve", "--no-ray", *argv],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}; see {log.name}")
            continue
        if "server ready at" in line:
            # Keep draining stdout (vLLM logs there) into the log: a full pipe
            # would block the server's next write and hang every request.
            threading.Thread(target=_drain, args=(proc.stdout, log), daemon=True).start()
            return proc, line.rsplit(" ", 1)[-1].strip()
    proc.kill()
    raise TimeoutError(f"server not ready after {timeout} s; see {log.name}")


def _drain(stream: Any, log: Any) -> None:
    for line in stream:
        log.write(line)
    log.flush()


def stop_server(proc: subprocess.Popen[str]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="session")
def engine_server(
    embedded_model: Any,  # noqa: F811
    tokenizer: Any,  # noqa: F811
    tmp_path_factory: Any,
) -> Iterator[EngineServer]:
    from skyrl_lora.server.presets import embedded_server_argv

    dtype = os.environ.get("SKYRL_GPU_DTYPE", "bfloat16")  # CUDA LoRA kernels: fp16/bf16 only
    snapshots = tmp_path_factory.mktemp("snapshots")
    extra = [*GPU_FLAGS, "--dtype", dtype, "--adapter-snapshot-dir", str(snapshots)]
    extra += ["--adapter-reader"]  # opt-in, as on the CPU's session server: covered here too
    extra += ["--max-adapter-bytes", str(MAX_ADAPTER_BYTES)]
    argv = embedded_server_argv(embedded_model, extra=extra)
    started = time.monotonic()
    proc, url = start_server(argv, "gpu_scenario_server")
    print(f"\nCUDA scenario server ready in {time.monotonic() - started:.0f} s at {url}")
    try:
        yield EngineServer(url, embedded_model, tokenizer, snapshot_dir=snapshots)
    finally:
        stop_server(proc)
