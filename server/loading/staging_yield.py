"""Let an adapter staging give the GIL back to a busy step loop.

The staging thread (:mod:`skyrl_lora.server.loading.staging`) runs vLLM's adapter
read and packing in the engine process: Python, a few hundred short turns
per tensor name. The step loop lets the GIL go at every tensor call and
every wait for the device, and each time the staging thread has Python to
run it takes the GIL, so the step loop waits to get it back, a little at
each of its hundreds of hand-overs per step. On an H100 under the perf
test's load a rank-16 staging read for 17-30 ms (9 ms idle), and 6 of the
12 longest token gaps the other tenants saw during swaps (23-30 ms, against
a p99 of 15 ms) overlapped it.

So, while the engine is stepping, the staging thread runs its Python in
slices of at most :attr:`StagingYield.slice_s` and sleeps
:attr:`StagingYield.nap_s` after each: the step loop has the GIL to itself
during every nap. The slices end at yield points that vLLM's read and
packing pass once per tensor name or layer (:func:`install_yield_points`). The cost
falls on the swapping tenant alone: its staging, during which its own
requests are paused, takes longer under load. With the engine idle (no step
began within :attr:`StagingYield.busy_within_s`) the staging never sleeps,
so an idle swap costs what it did.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from .. import compat


@dataclass(frozen=True)
class StagingYield:
    """How a staging shares the GIL with a busy step loop.

    The defaults come from the H100 A/Bs (``docs/gpu/gap_legs_yield_*.txt``):
    with 0.5 ms slices and 1 ms naps the others' longest step during a
    staging still reached 31 ms; with 0.25 ms and 1.5 ms it was 20.7 ms in
    two runs (15-16 ms in windows without a swap, 64-65 ms without naps),
    while the staging under load took about three times as long.
    """

    #: The longest the staging thread runs between two naps while the engine steps.
    slice_s: float = 0.00025
    #: How long each nap lets the step loop run alone.
    nap_s: float = 0.0015
    #: The engine counts as stepping this long after a step began.
    busy_within_s: float = 0.05


#: What ``serve`` stages with unless ``--no-staging-yield``.
DEFAULT_STAGING_YIELD = StagingYield()


@dataclass
class Naps:
    """What one staging's yield points did: how many naps, and their time."""

    count: int = 0
    slept_s: float = 0.0

    @property
    def slept_ms(self) -> float:
        return round(self.slept_s * 1000, 2)


class YieldPoints:
    """The yield points of one worker's staging thread.

    Called (``points()``) from vLLM's read and packing on whatever thread
    runs them; only a thread inside :meth:`yielding` ever sleeps, so a load
    the step loop runs itself is never slowed. ``config`` None turns the
    points into no-ops.
    """

    def __init__(self, config: StagingYield | None) -> None:
        self.config = config
        self._local = threading.local()
        #: When the step loop last began a step (written by it, read by the staging thread).
        self._last_step = float("-inf")

    def note_step(self) -> None:
        """The step loop began a step."""
        self._last_step = time.perf_counter()

    @contextmanager
    def yielding(self) -> Iterator[Naps]:
        """Let this thread's passes through the yield points nap while the engine steps."""
        naps = Naps()
        self._local.naps = naps
        self._local.slice_start = time.perf_counter()
        try:
            yield naps
        finally:
            self._local.naps = None

    def __call__(self) -> None:
        naps: Naps | None = getattr(self._local, "naps", None)
        config = self.config
        if naps is None or config is None:
            return
        now = time.perf_counter()
        if now - self._local.slice_start < config.slice_s:
            return
        if now - self._last_step < config.busy_within_s:
            time.sleep(config.nap_s)
            slept = time.perf_counter() - now
            naps.count += 1
            naps.slept_s += slept
            now += slept
        self._local.slice_start = now


def install_yield_points(
    points: YieldPoints, model_manager: Any | None, model_runner: Any | None
) -> bool:
    """Put ``points`` into vLLM's adapter read and packing, and time the engine's steps.

    Returns whether the engine's steps could be timed: without that the
    points never see the engine busy, and a staging never naps.
    """
    compat.call_before_lora_name_parses(points)
    if model_manager is not None:
        compat.call_before_lora_layer_lookups(model_manager, points)
    return model_runner is not None and compat.call_before_model_steps(
        model_runner, points.note_step
    )
