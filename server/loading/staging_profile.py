"""An opt-in torch-profiler capture of a worker's first stagings.

The staging events (:mod:`.staging`) time a staging's phases with the
clock: read, copy, pack, slot write. What a phase spends its time on (a
GPU allocation, a stream synchronize, one kernel per tensor) only a
profile of the real path says. Set ``SKYRL_STAGING_PROFILE=DIR`` (or
``DIR,N``; N defaults to 8) in the server's environment, which vLLM's
workers inherit: each worker runs its first N stagings under
``torch.profiler`` and writes each one's op table (CPU and CUDA times, by
CPU total) to ``DIR/staging-<pid>-<k>-<adapter>.txt``, and its trace (the
staging thread's calls and the kernels and copies they queued) to
``.json`` beside it, on a thread of its own after the staging: the table
says what a phase calls, the trace when the GPU ran what it queued
(``scripts/probes/staging_trace.py``). The engine's own kernels, run as
CUDA graphs, were not in the traces on an H100 (3b61c2a), so a trace does
not show what the staging's work queued behind.
A profiled staging runs slower than one that is not: its figures in the
events and in a benchmark are not the ones to report.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ENV = "SKYRL_STAGING_PROFILE"
DEFAULT_COUNT = 8
ROWS = 40


class StagingProfiler:
    """Profiles the first ``count`` stagings into ``folder`` (off when ``folder`` is None)."""

    def __init__(self, folder: Path | None, count: int = DEFAULT_COUNT) -> None:
        self.folder = folder
        self.count = count
        self._taken = 0
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> StagingProfiler:
        spec = (os.environ if environ is None else environ).get(ENV, "")
        if not spec:
            return cls(None)
        folder, _, count = spec.partition(",")
        return cls(Path(folder), int(count) if count else DEFAULT_COUNT)

    def _next(self) -> int | None:
        with self._lock:
            if self.folder is None or self._taken >= self.count:
                return None
            self._taken += 1
            return self._taken

    @contextlib.contextmanager
    def capture(self, name: str) -> Iterator[None]:
        """Profile what runs inside, if this is one of the first ``count``."""
        number = self._next()
        if number is None:
            yield
            return
        import torch

        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as profile:
            yield
        assert self.folder is not None
        safe = re.sub(r"[^A-Za-z0-9_.@-]", "_", name)[:80]
        path = self.folder / f"staging-{os.getpid()}-{number}-{safe}.txt"
        threading.Thread(target=_write_profile, args=(profile, path), daemon=True).start()


def _write_profile(profile: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    averages = profile.key_averages()
    path.write_text(averages.table(sort_by="cpu_time_total", row_limit=ROWS))
    part = path.with_suffix(".json.part")  # a reader never sees half a trace
    profile.export_chrome_trace(str(part))
    part.rename(path.with_suffix(".json"))
