"""A server stopped with SIGTERM gives the GPU's memory back and leaves no process behind.

vLLM's engine runs in child processes that hold the GPU memory; if any
outlives the server (the case ``skyrl_lora.server.reaper`` exists for),
the next server on the card cannot start. The baseline is read before the
server starts, with ``nvidia-smi`` (no CUDA context in the test process),
and must come back within ``TOLERANCE_BYTES`` in ``DEADLINE_S``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from gpu_tests.conftest import GPU_FLAGS, start_server
from skyrl_lora.server.reaper import alive, process_tree

DEADLINE_S = 30.0
TOLERANCE_BYTES = 1 << 30
GIB = 1 << 30


def gpu_used_bytes() -> int:
    """Memory in use on GPU 0, all processes together."""
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(out.stdout.strip().splitlines()[0]) << 20  # MiB


def test_sigterm_gives_back_gpu_memory_and_processes(embedded_model: Any) -> None:
    from skyrl_lora.server.presets import embedded_server_argv

    baseline = gpu_used_bytes()
    argv = embedded_server_argv(
        embedded_model, extra=[*GPU_FLAGS, "--dtype", "bfloat16", "--enforce-eager"]
    )
    started = time.monotonic()
    proc, _url = start_server(argv, "gpu_memory_server")
    ready_s = time.monotonic() - started
    serving = gpu_used_bytes()
    tree = process_tree(proc.pid)
    stopped = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    after, left = serving, alive(tree)
    while time.monotonic() - stopped < DEADLINE_S:
        after, left = gpu_used_bytes(), alive(tree)
        if proc.poll() is not None and not left and after <= baseline + TOLERANCE_BYTES:
            break
        time.sleep(0.25)
    back_s = time.monotonic() - stopped
    if proc.poll() is None:
        proc.kill()
    line = (
        f"GPU memory: baseline {baseline / GIB:.2f} GiB, serving {serving / GIB:.2f} GiB "
        f"(ready in {ready_s:.0f} s), {after / GIB:.2f} GiB {back_s:.1f} s after SIGTERM; "
        f"server exit code {proc.returncode}; {len(tree)} processes it started, "
        f"{len(left)} alive"
    )
    print("\n" + line)
    out = os.environ.get("OUT")
    if out:
        Path(out, "gpu_memory.txt").write_text(line + "\n")
    assert serving > baseline + TOLERANCE_BYTES, "the server never took GPU memory"
    assert tree, "the server started no process (vLLM's engine runs in one)"
    assert proc.returncode is not None, "the server did not exit on SIGTERM"
    assert not left, f"processes left running: {sorted(left)}"
    assert after <= baseline + TOLERANCE_BYTES, line
