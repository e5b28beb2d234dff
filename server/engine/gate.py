"""Per-adapter admission gate: the heart of the per-adapter pause.

Every generate call for an adapter passes :meth:`AdapterGate.admit` before it
reaches the engine and holds an :class:`Admission` until its output stream
ends. That gives two guarantees without any grace sleep:

* While an adapter is paused, new requests wait inside ``admit`` (held, not
  rejected, not run) until :meth:`AdapterGate.resume`.
* :meth:`AdapterGate.pause` closes the gate first and then aborts and waits
  for every admission of that adapter to end. ``admit`` registers the
  admission with no ``await`` between the paused check and the registration,
  so a request is either held or visible to the abort: none can slip through
  and run on half-swapped weights.

The answers of the requests a pause ends are let go at a pace
(:class:`AnswerPacing`), so building them does not hold the API server's
event loop all at once. After a resume the gate also paces the adapter's backlog back in
(:class:`ResumePacing`): the requests a pause aborted all come back at once
and must re-prefill under the new weights, and let in together they make one
long engine step in which no other tenant gets a token. The pace is counted
in prefill tokens per engine step: whoever wires the gate calls
:meth:`AdapterGate.engine_stepped` as each step's outputs arrive.

The gate knows nothing about vLLM: aborting is a callback and a step is a
call, so it is tested on its own.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

AbortFn = Callable[[Sequence[str]], Awaitable[None]]

#: How often pause re-sends the abort while requests are still draining. A
#: request admitted a moment before the pause may not have reached the engine
#: when the first abort goes out (the abort is then a no-op there); re-sending
#: catches it as soon as it is registered.
ABORT_RETRY_INTERVAL_S = 0.005


@dataclass(frozen=True)
class ResumePacing:
    """How a resumed adapter's backlog re-enters the engine.

    When an adapter resumes, every request its pause aborted comes back
    within milliseconds (clients retry them) and re-prefills prompt and
    partial completion under the new weights, since the old version's KV
    cache is not theirs. Admitted together they make one engine step that
    stalls every other tenant: 52 ms at the median on an H100 with 16 such
    requests of the 0.8B model, against 6-8 ms steps otherwise; 59-75 ms on
    an H200 with 465-530 tokens of the 8B model, against 16-22 ms.

    For ``window_s`` after a resume the gate lets the adapter's requests in
    while the engine's current step has room: at most ``tokens_per_step``
    prefill tokens (prompt and resumed prefix, times samples) per step across
    every paced adapter, and always one request per step, however long its
    prompt. Counting steps, not milliseconds, keeps the pace right for a
    small model's 6 ms steps and a large one's 25 ms ones alike. 256 keeps a
    step with 64 decodes in it under vLLM's largest CUDA graph (512 tokens
    by default); a step beyond it runs eagerly: 75-101 ms against at most
    38 ms for the 8B model on an H100 (d33a58d against 53132fa, 2026-11-26).

    A step is signalled by :meth:`AdapterGate.engine_stepped`. When none
    comes for ``step_wait_s`` (an idle engine has no steps; a server that
    cannot see them), the waiters take it as one, so pacing never holds a
    request for long.

    The fixed 256 fits a small batch only. Beside ~210 decoding requests
    (8 RL tenants on an H100, 1f92e2f, 2026-11-27), a resumed request of a
    group of samples brings several hundred prefill tokens: every step it
    enters runs eagerly, and letting such requests in one a step turns one
    eager step into many (775-966 steps over 50 ms per run, against 465
    without pacing). With ``graph_tokens`` (the largest step the engine
    runs in a CUDA graph) and the running batch known
    (:meth:`AdapterGate.engine_stepped` ``running``), a step's room is
    ``graph_tokens`` less the requests running (one token each), and a
    request that fits in no such room goes in at once, beside the others
    that do not: one eager step rather than one per request. Opt-in
    (``serve --resume-graph-tokens``): on an H100 (0b36222) both pause
    modes' engines ran 1.17x faster than with the fixed room, but the steps
    left over the graphs were larger and the per-adapter engine's own pace
    fell to 0.89-0.90; vLLM's chunked prefill cut to the graphs
    (``--max-num-batched-tokens 512``, now ``serve``'s default on a GPU:
    :mod:`.step_budget`) did more (docs/gpu.md).

    The aborted requests come back only once their clients have handled
    the abort and retried, which ``window_s`` does not cover everywhere: on
    the 2-core CPU machine with 64 in flight they reached the engine 0.1-0.6 s
    after the resume, 25-64 in one step, which made steps of up to 1,451
    prefill tokens and 1.6 s for every other tenant. So the adapter also stays
    paced until as many requests as the pause aborted (and held) have been
    let in, for at most ``backlog_s`` after the resume (0: ``window_s``
    alone).

    A waiter that sees no step for ``step_wait_s`` counts one. Where the
    engine's own steps are longer (CPU steps beside a re-prefill: 0.1-0.5 s),
    that let several steps' room into one real step, so the wait follows
    the engine: twice its last step, within ``step_wait_s`` and
    ``max_step_wait_s`` (at most ``step_wait_s``: a fixed wait).
    """

    tokens_per_step: int = 256
    step_wait_s: float = 0.05
    window_s: float = 0.25
    graph_tokens: int | None = None
    backlog_s: float = 2.0
    max_step_wait_s: float = 1.0

    def __post_init__(self) -> None:
        if self.tokens_per_step < 1:
            raise ValueError(f"tokens_per_step must be at least 1, not {self.tokens_per_step}")
        if self.graph_tokens is not None and self.graph_tokens < 1:
            raise ValueError(f"graph_tokens must be at least 1, not {self.graph_tokens}")
        if self.backlog_s < 0:
            raise ValueError(f"backlog_s must be 0 (none) or more, not {self.backlog_s}")


DEFAULT_RESUME_PACING = ResumePacing()


@dataclass(frozen=True)
class AnswerPacing:
    """How the requests one pause (or abort) ended are answered.

    The abort ends them all in one engine output, so every one of their
    handlers becomes ready in the same turn of the API server's event loop,
    and building and sending their answers (partial samples, or an
    aborted stream's last chunk) holds the loop that streams every other
    tenant's tokens: an event-loop stall of 11-32 ms right after each pause
    on an H100 with 16 requests aborted. Each one's answer is instead let
    go ``spacing_s`` after the previous one (its place in the abort times
    ``spacing_s``, at most ``window_s``), after its admission has ended, so
    the drain, and with it the pause, is not lengthened: only the aborted
    requests' partial answers come up to ``window_s`` later, and they are
    retried after the resume anyway.
    """

    spacing_s: float = 0.001
    window_s: float = 0.02

    def delay_s(self, place: int) -> float:
        return min(place * self.spacing_s, self.window_s)


DEFAULT_ANSWER_PACING = AnswerPacing()


@dataclass
class Admission:
    """One request's pass through the gate, held until its stream ends."""

    lora_name: str
    request_id: str
    version: int
    admitted_at: float = field(default_factory=time.monotonic)
    ended: bool = False
    #: Set when a pause or abort ended it: how long after its end to answer
    #: (:class:`AnswerPacing`).
    answer_after_s: float = 0.0


@dataclass
class _AdapterState:
    paused: bool = False
    resumed: asyncio.Event = field(default_factory=asyncio.Event)
    #: Pulsed on every release, so a drain wakes up as requests end.
    released: asyncio.Event = field(default_factory=asyncio.Event)
    in_flight: dict[str, Admission] = field(default_factory=dict)
    held: int = 0
    #: Admissions wait for room in the engine's step until ``paced_until``
    #: (``time.monotonic``), after the last resume.
    paced_until: float = 0.0
    #: Requests aborted by the pause in force, which their clients will send again.
    returning: int = 0
    #: Since the last resume: admissions still paced as the pause's backlog
    #: (:attr:`ResumePacing.backlog_s`), until ``backlog_until``.
    backlog: int = 0
    backlog_until: float = 0.0

    def __post_init__(self) -> None:
        self.resumed.set()


@dataclass(frozen=True)
class DrainResult:
    aborted: int
    seconds: float


@dataclass
class GateCounters:
    """Monotonic counters, exported as metrics."""

    pauses: int = 0
    aborted_requests: int = 0
    held_requests: int = 0
    resumed_segments: int = 0
    paced_requests: int = 0


class StepBudget:
    """The prefill tokens paced requests may still bring into the engine's current step.

    Shared by every adapter, so two tenants resuming together share one
    step's room. The first request of a step always fits. With
    ``graph_tokens``, the room follows the running batch (:class:`ResumePacing`).
    """

    def __init__(
        self, tokens_per_step: int, graph_tokens: int | None = None, max_wait_s: float = 0.0
    ) -> None:
        self.tokens_per_step = tokens_per_step
        self.graph_tokens = graph_tokens
        #: The longest a waiter waits for a step before counting one.
        self.max_wait_s = max_wait_s
        #: The time between the engine's last two steps (None until two came;
        #: a longer one is an idle engine, not a step, and is not kept).
        self.step_s: float | None = None
        self._last_step_at: float | None = None
        #: Requests the engine ran in its last step; None until a step says.
        self.running: int | None = None
        self.left = tokens_per_step
        self.taken = 0
        self.steps = 0
        #: Requests queued for a later step; newcomers queue behind them.
        self.waiting = 0
        self._stepped = asyncio.Event()

    def _beside_batch(self) -> int | None:
        """The graph's room beside the running batch; None unless both are known."""
        if self.graph_tokens is None or self.running is None:
            return None
        return max(self.graph_tokens - self.running, 0)

    def room(self) -> int:
        """A whole step's room: within the CUDA graphs beside the running
        batch where both are known, else ``tokens_per_step``."""
        beside = self._beside_batch()
        return self.tokens_per_step if beside is None else beside

    def fits_no_step(self, tokens: int) -> bool:
        """Whether a request would pass the graphs in any step beside this batch."""
        beside = self._beside_batch()
        return beside is not None and tokens > beside

    def take(self, tokens: int) -> bool:
        if self.taken and tokens > self.left:
            return False
        self.left -= tokens
        self.taken += 1
        return True

    def engine_stepped(self, running: int | None = None) -> None:
        """The engine's own step: as :meth:`stepped`, and its length is kept."""
        now = time.monotonic()
        if self._last_step_at is not None and now - self._last_step_at <= self.max_wait_s:
            self.step_s = now - self._last_step_at
        self._last_step_at = now
        self.stepped(running)

    def step_wait_s(self, least_s: float) -> float:
        """How long a waiter waits for a step: twice the engine's last one,
        within ``least_s`` and ``max_wait_s``."""
        if self.step_s is None:
            return least_s
        return min(max(least_s, 2 * self.step_s), max(least_s, self.max_wait_s))

    def stepped(self, running: int | None = None) -> None:
        """A new step: its room is whole again, and every waiter looks."""
        self.steps += 1
        if running is not None:
            self.running = running
        self.left = self.room()
        self.taken = 0
        if self.waiting:
            self._stepped.set()
            self._stepped = asyncio.Event()

    async def next_step(self, timeout_s: float) -> None:
        """Wait for the next step; after ``timeout_s`` without one, count one."""
        seen, stepped = self.steps, self._stepped
        try:
            await asyncio.wait_for(stepped.wait(), timeout_s)
        except asyncio.TimeoutError:
            if self.steps == seen:
                self.stepped()


class AdapterGate:
    """Pause state and in-flight requests of every adapter on one server.

    All methods must run on the server's event loop (they are not
    thread-safe, and do not need to be: the HTTP routes and the engine
    client share that loop).
    """

    def __init__(
        self,
        version_of: Callable[[str], int],
        pacing: ResumePacing | None = DEFAULT_RESUME_PACING,
        answer_pacing: AnswerPacing | None = DEFAULT_ANSWER_PACING,
    ) -> None:
        self._version_of = version_of
        self._pacing = pacing
        self._answer_pacing = answer_pacing
        self._budget = (
            StepBudget(pacing.tokens_per_step, pacing.graph_tokens, pacing.max_step_wait_s)
            if pacing is not None
            else StepBudget(1)
        )
        self._states: dict[str, _AdapterState] = {}
        self.counters = GateCounters()

    @property
    def pacing(self) -> ResumePacing | None:
        return self._pacing

    def _state(self, lora_name: str) -> _AdapterState:
        state = self._states.get(lora_name)
        if state is None:
            state = self._states[lora_name] = _AdapterState()
        return state

    def is_paused(self, lora_name: str) -> bool:
        state = self._states.get(lora_name)  # asking creates no state for unknown names
        return state is not None and state.paused

    def in_flight(self, lora_name: str) -> int:
        return len(self._state(lora_name).in_flight)

    def in_flight_of_version(self, lora_name: str, version: int) -> int:
        """Requests of one adapter version still running (a draining version
        is retired when this reaches 0)."""
        return sum(a.version == version for a in self._state(lora_name).in_flight.values())

    def busy_versions(self) -> int:
        """Distinct adapter versions with requests running: the engine LoRA
        slots the running batch needs."""
        return len(
            {(a.lora_name, a.version) for s in self._states.values() for a in s.in_flight.values()}
        )

    def held(self, lora_name: str) -> int:
        return self._state(lora_name).held

    def held_by_adapter(self) -> dict[str, int]:
        return {name: s.held for name, s in self._states.items() if s.held}

    async def admit(
        self,
        lora_name: str,
        request_id: str,
        version: int | None = None,
        prefill_tokens: int | None = None,
    ) -> Admission:
        """Wait while the adapter is paused (and for room in the engine's step
        while it is paced after a resume), then register the request.

        ``prefill_tokens``: what the request brings to the engine's next step
        (prompt, resumed prefix, times samples); unknown counts as a whole
        step's room. The version is read at admission: the pause guarantees
        it cannot change until this admission is released. A request pinned
        to a ``version`` is registered on that one (the caller checks it is
        still held once admitted).
        """
        state = self._state(lora_name)
        while True:
            if state.paused:
                await self._hold(state)
                continue
            if not self._paced(state) or await self._room_in_step(state, prefill_tokens):
                break
        if state.backlog:
            state.backlog -= 1
        # No await between the paused check above and the registration below.
        pinned = self._version_of(lora_name) if version is None else version
        admission = Admission(lora_name, request_id, pinned)
        state.in_flight[request_id] = admission
        return admission

    async def _hold(self, state: _AdapterState) -> None:
        state.held += 1
        self.counters.held_requests += 1
        try:
            while state.paused:
                await state.resumed.wait()
        finally:
            state.held -= 1

    def _paced(self, state: _AdapterState) -> bool:
        if self._pacing is None:
            return False
        now = time.monotonic()
        return now < state.paced_until or (state.backlog > 0 and now < state.backlog_until)

    async def _room_in_step(self, state: _AdapterState, prefill_tokens: int | None) -> bool:
        """Take room in the engine's step, waiting for later steps while there
        is none; False when a pause came meanwhile (no room is taken then)."""
        assert self._pacing is not None
        budget = self._budget
        tokens = self._pacing.tokens_per_step if prefill_tokens is None else prefill_tokens

        def eager_anyway() -> bool:
            # It passes the graphs in whatever step it enters: better with
            # the others that do, in one step, than one a step.
            return prefill_tokens is not None and budget.fits_no_step(tokens)

        if eager_anyway() or (not budget.waiting and budget.take(tokens)):
            return True
        self.counters.paced_requests += 1
        state.held += 1  # waiting at the gate too: ``forget`` must keep the state
        budget.waiting += 1
        try:
            while True:
                await budget.next_step(budget.step_wait_s(self._pacing.step_wait_s))
                if state.paused:
                    return False
                if eager_anyway() or budget.take(tokens):
                    return True
        finally:
            budget.waiting -= 1
            state.held -= 1

    def engine_stepped(self, running: int | None = None) -> None:
        """The engine finished a step (its outputs arrived): paced requests
        may fill the next one. ``running``: the requests it ran, where the
        engine says (its scheduler's stats)."""
        self._budget.engine_stepped(running)

    def release(self, admission: Admission) -> None:
        state = self._state(admission.lora_name)
        admission.ended = True
        if state.in_flight.get(admission.request_id) is admission:
            del state.in_flight[admission.request_id]
        state.released.set()

    async def pause(self, lora_name: str, abort: AbortFn) -> tuple[bool, DrainResult]:
        """Close the gate, abort the adapter's requests, wait until none is left.

        Returns whether the adapter was already paused (pausing twice is
        harmless) and what the drain took.
        """
        state = self._state(lora_name)
        was_paused = state.paused
        state.paused = True
        state.resumed.clear()
        if not was_paused:
            self.counters.pauses += 1
        drain = await self._abort_and_drain(state, abort)
        state.returning += drain.aborted
        return was_paused, drain

    async def abort(self, lora_name: str, abort: AbortFn) -> DrainResult:
        """Abort the adapter's in-flight requests without closing the gate."""
        return await self._abort_and_drain(self._state(lora_name), abort)

    def resume(self, lora_name: str) -> bool:
        """Open the gate; returns whether it was closed."""
        state = self._state(lora_name)
        was_paused = state.paused
        state.paused = False
        state.resumed.set()
        if was_paused and self._pacing is not None:
            now = time.monotonic()
            state.paced_until = now + self._pacing.window_s
            # What the pause ended comes back as its clients retry, and what
            # it held comes in now: both are its backlog.
            state.backlog = state.returning + state.held
            state.backlog_until = now + self._pacing.backlog_s
        state.returning = 0
        return was_paused

    def forget(self, lora_name: str) -> None:
        """Drop the state of an unloaded adapter that nobody waits on."""
        state = self._states.get(lora_name)
        if state is not None and not state.paused and not state.in_flight and not state.held:
            del self._states[lora_name]

    async def _abort_and_drain(self, state: _AdapterState, abort: AbortFn) -> DrainResult:
        """Abort what is in flight now and wait until all of it has ended.

        Only the requests in flight at the call are waited for: a plain abort
        leaves the gate open, and requests admitted after it are not its
        business (under a pause nothing new is admitted anyway). The abort is
        re-sent only when ``ABORT_RETRY_INTERVAL_S`` passes without the drain
        finishing, not on every release: while 64 requests come back one by
        one, re-aborting the rest each time would flood the engine.
        """
        # time.monotonic, not loop.time(): uvloop's loop clock (vLLM runs on
        # uvloop) has 1 ms steps, so a drain read 0 or 1 ms, too coarse for
        # the few-ms targets and the 5 ms re-abort timer.
        started = time.monotonic()
        targets = list(state.in_flight.values())
        if self._answer_pacing is not None:
            for place, admission in enumerate(targets):
                admission.answer_after_s = self._answer_pacing.delay_s(place)
        remaining = targets
        resend_at = started
        while remaining:
            now = time.monotonic()
            if now >= resend_at:
                await abort([a.request_id for a in remaining])
                resend_at = time.monotonic() + ABORT_RETRY_INTERVAL_S
                remaining = [a for a in remaining if not a.ended]
                continue
            state.released.clear()
            try:
                await asyncio.wait_for(state.released.wait(), resend_at - now)
            except asyncio.TimeoutError:
                pass
            remaining = [a for a in remaining if not a.ended]
        self.counters.aborted_requests += len(targets)
        return DrainResult(aborted=len(targets), seconds=time.monotonic() - started)
