"""``skyrl-lora serve`` as a child process, for scripts and tests without Ray.

The GPU machines have no Ray, and a test of how ``serve`` stops needs the
real process. The process gets a session (and process group) of its own, so that however a
test ends, failed or timed out included, :meth:`ServeProcess.kill_all` can
take down the server and everything it started: the process group at once,
and the processes recorded below the server (vLLM's engine processes, Ray's)
by pid and start time.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from ..reaper import ProcessKey, alive, process_tree, stop_processes


@dataclass
class ServeProcess:
    proc: subprocess.Popen[str]
    url: str
    log_path: Path
    #: Every process seen below the server so far (refreshed by :meth:`tree`).
    seen: set[ProcessKey] = field(default_factory=set)

    def tree(self) -> set[ProcessKey]:
        """The processes below the server now (also remembered for :meth:`kill_all`)."""
        now = process_tree(self.proc.pid)
        self.seen |= now
        return now

    def stop(self, timeout_s: float = 60) -> int:
        """SIGTERM, as an operator would; SIGKILL to the whole group if it hangs."""
        self.tree()
        self.proc.terminate()
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill_all()
            return self.proc.wait()

    def kill_all(self) -> None:
        """SIGKILL the process group and whatever is left of the recorded tree."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        stop_processes(alive(self.seen), grace_s=0.0)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)


def start_serve(
    argv: Sequence[str],
    log_path: Path,
    *,
    timeout_s: float = 540,
    env: dict[str, str] | None = None,
    launcher: Sequence[str] = ("-m", "skyrl_lora.server", "serve"),
    cwd: Path | None = None,
) -> ServeProcess:
    """Start ``skyrl-lora serve ARGV`` and wait for its ready line.

    ``launcher``: the Python arguments before ``ARGV`` (a benchmark's
    wrapper around ``serve``), run in ``cwd``.
    """
    # Line-buffered, so a test can read the log while the server runs.
    log = open(log_path, "w", buffering=1)  # noqa: SIM115 (lives with the process)
    proc = subprocess.Popen(
        [sys.executable, *launcher, *argv],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        start_new_session=True,
        env=None if env is None else {**os.environ, **env},
        cwd=cwd,
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}; see {log_path}")
            continue
        # vLLM logs to stdout: its start-up, and why a start failed, belong in the log too
        log.write(line)
        if "server ready at" in line:
            # Keep draining stdout (vLLM logs there) into the log: a full pipe
            # would block the server's next write and hang every request.
            threading.Thread(target=_drain, args=(proc.stdout, log), daemon=True).start()
            server = ServeProcess(proc, line.rsplit(" ", 1)[-1].strip(), log_path)
            server.tree()
            return server
    ServeProcess(proc, "", log_path).kill_all()
    raise TimeoutError(f"server not ready after {timeout_s} s; see {log_path}")


@contextlib.contextmanager
def serving(argv: Sequence[str], log_path: Path, **kwargs: object) -> Iterator[ServeProcess]:
    """A server for the block; stopped with SIGTERM after it, and nothing left either way."""
    server = start_serve(argv, log_path, **kwargs)  # type: ignore[arg-type]
    try:
        yield server
    finally:
        if server.proc.poll() is None:
            server.stop()
        server.kill_all()


def _drain(stream: IO[str], log: IO[str]) -> None:
    for line in stream:
        log.write(line)
    log.flush()
