"""Log the engine's long steps, with what they computed and what ran beside them.

Every tenant's next token waits for the engine's next step, so a step that
runs long is a gap in every stream at once. The other tenants' longest gaps
during swaps have had several causes (a staging holding the GIL, a driver
call that pins host memory, the swapping tenant's resumed requests
re-prefilling in one step, garbage collections), and token timestamps at the
client cannot tell them apart. The engine can: its step loop calls the
worker's ``execute_model`` once per step, and the time from one call to the
next is the step as every running request sees it (scheduling, forward
pass, sampling, output).

:class:`StepWatch` looks at each step as it begins. When the time since the
previous step began exceeds ``long_step_s`` and some request ran in both
(so the engine was not idle in between), it logs an ``engine_long_step``
event with what that previous step scheduled (requests, tokens, and the
tokens of requests given more than one: prompts, resumed requests
re-prefilling after a swap) and what of ours was busy meanwhile
(``busy``: a staging, a snapshot write). The check is a few attribute
reads per step, and at most ``max_per_s`` events are written a second
(each says how many long steps went unwritten before it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .observability import log_engine_event

logger = logging.getLogger(__name__)

#: A step longer than this is logged (``serve --long-step-ms``).
DEFAULT_LONG_STEP_S = 0.05

#: What a ``busy`` callable answers when nothing of ours runs beside the steps.
NOTHING_BUSY: frozenset[str] = frozenset()


@dataclass(frozen=True)
class StepShape:
    """What one step scheduled."""

    requests: int = 0
    tokens: int = 0
    #: Tokens of requests given more than one this step (prefill chunks).
    prefill_tokens: int = 0
    #: Requests scheduled for the first time (new, or resumed after a pause).
    new_requests: int = 0
    request_ids: frozenset[str] = field(default_factory=frozenset)

    @classmethod
    def of(cls, scheduler_output: Any) -> StepShape:
        """The shape of vLLM's ``SchedulerOutput`` (0.26 and 0.32)."""
        scheduled: dict[str, int] = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
        return cls(
            requests=len(scheduled),
            tokens=int(getattr(scheduler_output, "total_num_scheduled_tokens", 0) or 0),
            prefill_tokens=sum(n for n in scheduled.values() if n > 1),
            new_requests=len(getattr(scheduler_output, "scheduled_new_reqs", None) or ()),
            request_ids=frozenset(scheduled),
        )


class StepWatch:
    """Called with each step's scheduler output as the step begins (see the module)."""

    def __init__(
        self,
        long_step_s: float = DEFAULT_LONG_STEP_S,
        busy: Callable[[], frozenset[str]] = lambda: NOTHING_BUSY,
        log: Callable[..., None] = log_engine_event,
        clock: Callable[[], float] = time.perf_counter,
        max_per_s: int = 20,
    ) -> None:
        self.long_step_s = long_step_s
        self._busy = busy
        self._log = log
        self._clock = clock
        self._began: float | None = None
        self._shape = StepShape()
        #: What was busy while the step in flight ran, sampled as it began
        #: and again as the next one begins.
        self._busy_at_start = NOTHING_BUSY
        self.long_steps = 0
        self.failed = False
        #: At most this many events a second; the rest are counted.
        self.max_per_s = max_per_s
        self._second_began = float("-inf")
        self._logged_this_second = 0
        self._suppressed = 0

    def __call__(self, scheduler_output: Any) -> None:
        """Runs in the step loop: a fault here turns the watch off, never fails the step."""
        if self.failed:
            return
        try:
            self._look(scheduler_output)
        except Exception:
            self.failed = True
            logger.exception("skyrl-lora stops watching engine steps")

    def _look(self, scheduler_output: Any) -> None:
        now = self._clock()
        shape = StepShape.of(scheduler_output)
        long = self._began is not None and now - self._began > self.long_step_s
        # A request in both steps waited the whole time: the engine was not idle.
        if long and self._shape.request_ids & shape.request_ids:
            assert self._began is not None
            self.long_steps += 1
            if self._over_rate(now):
                self._suppressed += 1
            else:
                self._log_step(now - self._began)
        self._began, self._shape = now, shape
        self._busy_at_start = self._busy()

    def _over_rate(self, now: float) -> bool:
        """Whether this second's events are spent (a slow engine, say a large
        model on CPUs, would otherwise log every step)."""
        if now - self._second_began >= 1.0:
            self._second_began, self._logged_this_second = now, 0
        self._logged_this_second += 1
        return self._logged_this_second > self.max_per_s

    def _log_step(self, step_s: float) -> None:
        busy_now = self._busy()
        suppressed, self._suppressed = self._suppressed, 0
        self._log(
            "engine_long_step",
            ms=round(step_s * 1000, 1),
            requests=self._shape.requests,
            tokens=self._shape.tokens,
            prefill_tokens=self._shape.prefill_tokens,
            new_requests=self._shape.new_requests,
            busy=sorted(self._busy_at_start | busy_now),
            suppressed=suppressed,  # long steps left unwritten since the last event
        )
