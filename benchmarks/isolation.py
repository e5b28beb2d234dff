"""Isolation: the other tenants' tokens/s and token gaps while one tenant swaps weights.

One load runs for the whole measurement: tenant A (the swapper) keeps
``sample_with_retry`` calls in flight, every other tenant keeps requests in
flight (from a process of its own where the machine has cores to spare): a
few streamed completions, whose chunk arrival times give the inter-token
gaps, and token-in samples for the rest (see
:mod:`benchmarks.stream_process` for why both, and why not from this
process); their tokens together give the rate. Over that load the run
alternates short windows, ``no_swap / per_adapter / global`` per round for
several rounds, then one closing ``no_swap``, each window after its own
settle time. In a swap window A is paused, held for ``hold_s`` (standing in
for the trainer's weight transfer), reloaded and resumed once per
``period_s``, with the per-adapter pause or vLLM's global keep-mode pause.

Phases run one after the other would compare different machine states
(warm-up, caches, neighbours); interleaving makes each round's ratio come
from windows seconds apart, and the baseline of a round is the mean of the
no-swap windows on either side of its swap windows. The spread over rounds and
the checks in :mod:`benchmarks.stats` say whether the run can be trusted at
all.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from benchmarks.common import TokenMeter, collector_paused, keep_sampling
from benchmarks.stats import (
    Gap,
    IsolationChecks,
    RoundBaselines,
    Spread,
    Tail,
    check_count,
    check_isolation,
    overlaps,
    split_gaps,
    tails_spread,
)
from benchmarks.stream_process import (
    InProcessTenant,
    StreamProcess,
    StreamSpec,
    TenantLoad,
    TenantRecord,
)
from skyrl_lora.client import ClientConfig, RemoteInferenceClient

MODES = ("no_swap", "per_adapter", "global")
SWAP_MODES = ("per_adapter", "global")
#: How the swapper's new weights come in (:attr:`IsolationConfig.swap_transport`).
SWAP_TRANSPORTS = ("path", "push_stream")


@dataclass(frozen=True)
class IsolationConfig:
    """Shape of the run. ``tenants`` includes the swapper (tenant 0)."""

    tenants: int = 3
    #: Request loops per tenant; of the others' loops, ``streamed`` stream
    #: (the gaps), the rest sample without streaming.
    streams: int = 8
    streamed: int = 4
    #: Each other tenant's load from a process of its own (the swapper's
    #: retry bursts then never delay the loop that timestamps their tokens);
    #: off on a machine whose few cores the server being measured needs.
    own_processes: bool = False
    max_tokens: int = 32
    #: Completion lengths vary by this fraction around ``max_tokens`` (see
    #: :func:`benchmarks.common.completion_lengths`): streams in lockstep
    #: carry one window's phase into the next and drift the baseline.
    length_spread: float = 0.5
    rounds: int = 3
    period_s: float = 1.0
    swaps_per_window: int = 3
    settle_s: float = 1.0
    #: After every tenant produced its first tokens, and one warm-up swap,
    #: before the first window: the first completions' prefill and adapter
    #: activation, and a server's first swap (the staging thread starting,
    #: first pinned allocations), are not the steady state the windows compare.
    warmup_s: float = 2.0
    hold_s: float = 0.3
    #: How the swapper's new weights come in: ``"path"`` (a reload from the
    #: shared disk) or ``"push_stream"`` (the bytes over the server's push
    #: stream, as a trainer on another host sends them).
    swap_transport: str = "path"
    #: Connections of the swapper's pushes (``ClientConfig.push_stream_lanes``);
    #: None: the client's default.
    push_lanes: int | None = None
    #: A swap's cost to the others outlasts its resume: the swapper's aborted
    #: requests all come back at once and re-prefill prompt and partial
    #: completion under the new weights (the old KV cache belongs to the old
    #: version), one long engine step for everyone. On the H100 that step took
    #: 55-62 ms, 10-40 ms after the resume was answered. Gaps that overlap
    #: this long after the resume count as the swap's, not as outside it.
    aftermath_s: float = 0.2
    checks: IsolationChecks = field(default_factory=IsolationChecks)

    def __post_init__(self) -> None:
        if self.swap_transport not in SWAP_TRANSPORTS:
            # a misspelt one would be measured as a path load, and labelled otherwise
            raise ValueError(f"swap_transport is one of {SWAP_TRANSPORTS}: {self.swap_transport!r}")

    @property
    def window_s(self) -> float:
        return self.period_s * self.swaps_per_window

    @property
    def names(self) -> list[str]:
        return [f"iso-{chr(ord('a') + i)}" if i < 26 else f"iso-{i}" for i in range(self.tenants)]


@dataclass
class Window:
    round: int
    mode: str
    start: float
    end: float
    others_rate: float
    swaps: list[tuple[float, float]]  # (pause call, resume answered) of each swap


@dataclass
class IsolationResult:
    config: IsolationConfig
    windows: list[Window]
    others: list[TenantRecord]
    swapper: TokenMeter
    #: From the windows: ratio per swap mode over rounds, the others' tok/s in
    #: the no-swap windows, and gap tails by window kind.
    ratios: dict[str, Spread]
    baseline: Spread
    stall: dict[str, dict[str, Spread]]
    #: The longest stalls during per-adapter swaps (:func:`longest_during_swaps`).
    longest_stalls: list[dict[str, float]] = field(default_factory=list)

    def of(self, mode: str) -> list[Window]:
        return [w for w in self.windows if w.mode == mode]

    def check(self) -> None:
        """Raise :class:`~benchmarks.stats.UntrustworthyRunError` if a sanity check fails.

        Separate from the measurement, so a failed run still leaves its raw
        figures in ``results.json`` for whoever has to find out why.
        """
        check_isolation(
            [w.others_rate for w in self.of("no_swap")],
            self.per_round("global"),
            {m: [len(w.swaps) for w in self.of(m)] for m in SWAP_MODES},
            self.config.swaps_per_window,
            self.config.checks,
        )

    def per_round(self, mode: str) -> list[float]:
        return _per_round(self.windows, mode, self.config.checks.baseline_tolerance)

    def pooled(self, mode: str) -> float:
        """All ``mode`` windows' tokens over what their rounds' baselines would have made.

        The median of four rounds ignores one bad round entirely (a 0.81x
        round beside three at 0.99-1.01x reads 1.00x); pooled, it weighs in
        with its share of the time. NaN when no round has a baseline.
        """
        pairs = _with_baselines(self.windows, mode, self.config.checks.baseline_tolerance)
        if not pairs:
            return math.nan
        made = sum(w.others_rate * (w.end - w.start) for w, _ in pairs)
        expected = sum(base * (w.end - w.start) for w, base in pairs)
        return made / expected

    @property
    def round_baselines(self) -> RoundBaselines:
        return _round_baselines(self.windows, self.config.checks.baseline_tolerance)

    def to_json(self) -> dict[str, Any]:
        rounds = self.round_baselines
        return {
            "config": {
                "tenants": self.config.tenants,
                "streams": self.config.streams,
                "streamed": self.config.streamed,
                "own_processes": self.config.own_processes,
                "rounds": self.config.rounds,
                "window_s": self.config.window_s,
                "settle_s": self.config.settle_s,
                "hold_s": self.config.hold_s,
                "swap_transport": self.config.swap_transport,
                "push_lanes": self.config.push_lanes,
                "aftermath_s": self.config.aftermath_s,
                "baseline_tolerance": self.config.checks.baseline_tolerance,
                "length_spread": self.config.length_spread,
            },
            "others_ratio": {m: s.to_json() for m, s in self.ratios.items()},
            "others_ratio_pooled": {m: self.pooled(m) for m in SWAP_MODES},
            "others_tok_s_no_swap": self.baseline.to_json(),
            # None: the round's no-swap windows disagreed, it has no ratio
            "round_baselines": list(rounds.per_round),
            "lone_no_swap_windows": list(rounds.lone),
            "swaps": {m: [len(w.swaps) for w in self.of(m)] for m in SWAP_MODES},
            "stall_ms": {k: {q: s.to_json() for q, s in v.items()} for k, v in self.stall.items()},
            "longest_gaps_during_swaps": self.longest_stalls,
            "windows": [
                {
                    "round": w.round,
                    "mode": w.mode,
                    "others_tok_s": w.others_rate,
                    # time.monotonic(), to line windows up with the server's log
                    "start": w.start,
                    "end": w.end,
                    "swaps": w.swaps,
                }
                for w in self.windows
            ],
        }


async def _swap_window(
    client: RemoteInferenceClient,
    swapper: str,
    paths: Sequence[str],
    mode: str,
    cfg: IsolationConfig,
) -> list[tuple[float, float]]:
    """``swaps_per_window`` swaps, one at the start of each period."""
    lora = swapper if mode == "per_adapter" else None
    start = time.monotonic()
    swaps: list[tuple[float, float]] = []
    for i in range(cfg.swaps_per_window):
        await asyncio.sleep(max(0.0, start + i * cfg.period_s - time.monotonic()))
        paused_at = time.monotonic()
        await client.pause_generation(lora_name=lora)
        try:
            await asyncio.sleep(cfg.hold_s)
            if cfg.swap_transport == "push_stream":
                await client.push_lora_adapter(swapper, paths[i % 2], push_stream=True)
            else:
                await client.reload_lora_adapter(swapper, paths[i % 2])
        finally:
            await client.resume_generation(lora_name=lora)
        swaps.append((paused_at, time.monotonic()))
    await asyncio.sleep(max(0.0, start + cfg.window_s - time.monotonic()))
    return swaps


async def _first_tokens(
    others: Sequence[TenantLoad], meter: TokenMeter, swapper: asyncio.Task[None]
) -> None:
    """Wait until every tenant has produced tokens (raising a load's failure)."""
    while not (meter.spans and all(p.streaming for p in others)):
        if swapper.done():
            await swapper  # raises its error
            raise RuntimeError("the swapper's load ended before the windows began")
        await asyncio.sleep(0.05)


async def _windows(
    client: RemoteInferenceClient,
    swapper: str,
    paths: Sequence[str],
    cfg: IsolationConfig,
) -> list[Window]:
    """Run the planned windows; their ``others_rate`` is filled in from the logs later."""
    plan = [(r, m) for r in range(cfg.rounds) for m in MODES] + [(cfg.rounds, "no_swap")]
    windows: list[Window] = []
    for rnd, mode in plan:
        await asyncio.sleep(cfg.settle_s)
        start = time.monotonic()
        if mode == "no_swap":
            await asyncio.sleep(cfg.window_s)
            swaps: list[tuple[float, float]] = []
        else:
            swaps = await _swap_window(client, swapper, paths, mode, cfg)
        end = time.monotonic()
        windows.append(Window(rnd, mode, start, end, math.nan, swaps))
    return windows


def _round_baselines(windows: list[Window], tolerance: float) -> RoundBaselines:
    return RoundBaselines.of([w.others_rate for w in windows if w.mode == "no_swap"], tolerance)


def _with_baselines(
    windows: list[Window], mode: str, tolerance: float
) -> list[tuple[Window, float]]:
    """Each ``mode`` window of a round that has a baseline, with that baseline.

    Only rounds with a baseline count (see :class:`RoundBaselines`): the
    mean of the no-swap windows just before and just after the round, so a
    slow drift cancels to first order.
    """
    baselines = _round_baselines(windows, tolerance).per_round
    return [
        (w, base) for w in windows if w.mode == mode and (base := baselines[w.round]) is not None
    ]


def _per_round(windows: list[Window], mode: str, tolerance: float) -> list[float]:
    """The others' rate in each ``mode`` window over its round's baseline."""
    return [w.others_rate / base for w, base in _with_baselines(windows, mode, tolerance)]


def _stall(
    windows: list[Window], others: list[TenantRecord], aftermath_s: float
) -> dict[str, dict[str, Spread]]:
    """Gap tails of every window kind: no-swap, and during / outside the swaps of
    each mode, a swap lasting from its pause call to ``aftermath_s`` after its resume."""
    tails: dict[str, list[Tail]] = {}
    for w in windows:
        gaps = [g for tenant in others for g in tenant.streams.gaps(w.start, w.end)]
        during, outside = split_gaps(gaps, [(s, e + aftermath_s) for s, e in w.swaps])
        kinds = (
            {"no_swap": outside}
            if w.mode == "no_swap"
            else {f"{w.mode}_during_swap": during, f"{w.mode}_outside_swap": outside}
        )
        for kind, values in kinds.items():
            check_count("stall gaps", len(values), 1, f"token gaps in a {kind} window")
            tails.setdefault(kind, []).append(Tail.of(values))
    return {k: tails_spread(v) for k, v in tails.items()}


#: Gaps ending this close together are one stall of many streams.
SAME_STALL_S = 0.003


def longest_during_swaps(
    windows: list[Window], others: list[TenantRecord], aftermath_s: float, top: int = 12
) -> list[dict[str, float]]:
    """The ``top`` longest stalls of the others' streams during per-adapter
    swaps, each placed in its swap: when the late tokens came, in ms after the
    swap's pause call and after its resume's answer (negative: before the
    resume), and ``at`` on the benchmark's clock (for
    :func:`benchmarks.timeline.longest_stalls`). Gaps that end within
    :data:`SAME_STALL_S` of a longer one are
    one stall, counted in ``streams``: a stall of the whole engine or API
    process holds every stream at once. The tails say *how* long the others
    waited; this says in which part of a swap (the hold, the staging and
    install, the resumed requests' return) and how widely.
    """
    placed: list[tuple[Gap, float, float, int]] = []
    for w in windows:
        if w.mode != "per_adapter":
            continue
        for gap in (g for tenant in others for g in tenant.streams.gaps(w.start, w.end)):
            swap = next((s for s in w.swaps if overlaps(gap, [(s[0], s[1] + aftermath_s)])), None)
            if swap is not None:
                placed.append((gap, *swap, w.round))
    # Longest first: each gap either joins a longer stall that ended within
    # SAME_STALL_S of it, or starts a stall of its own; once ``top`` stalls are
    # started, a gap that joins none of them is shorter than all and is left out.
    stalls: list[tuple[float, dict[str, float]]] = []
    for gap, paused, resumed, round_ in sorted(placed, key=lambda p: -p[0].ms):
        same = next((s for end, s in stalls if abs(end - gap.end) <= SAME_STALL_S), None)
        if same is not None:
            same["streams"] += 1
        elif len(stalls) < top:
            stall = {
                "ms": round(gap.ms, 2),
                "round": round_,
                "after_pause_ms": round((gap.end - paused) * 1000, 1),
                "after_resume_ms": round((gap.end - resumed) * 1000, 1),
                "streams": 1,
                "at": round(gap.end, 4),  # the benchmark's monotonic clock, for the timeline
            }
            stalls.append((gap.end, stall))
    return [stall for _, stall in stalls]


def _ratio_spread(windows: list[Window], mode: str, cfg: IsolationConfig) -> Spread:
    """The ratios of the rounds with a baseline; NaN when none has one (``check`` says why)."""
    ratios = _per_round(windows, mode, cfg.checks.baseline_tolerance)
    return Spread.of(ratios) if ratios else Spread(math.nan, math.nan, math.nan, 0)


async def run(
    url: str, model: Any, prompt: list[int], cfg: IsolationConfig | None = None
) -> IsolationResult:
    """Load the tenants, run the interleaved windows and summarise them (see ``check``)."""
    cfg = cfg or IsolationConfig()
    names = cfg.names
    weights = sorted(model.adapters)
    swapper, other_names = names[0], names[1:]
    paths = [str(model.adapters[w]) for w in weights[:2]]
    meter = TokenMeter()
    stop = asyncio.Event()
    load_of: type[StreamProcess] | type[InProcessTenant] = (
        StreamProcess if cfg.own_processes else InProcessTenant
    )
    streamers: list[TenantLoad] = [
        load_of(
            StreamSpec(
                url,
                t,
                prompt,
                streams=min(cfg.streamed, cfg.streams),
                max_tokens=cfg.max_tokens,
                length_spread=cfg.length_spread,
                bulk=max(0, cfg.streams - cfg.streamed),
            )
        )
        for t in other_names
    ]
    lanes = {} if cfg.push_lanes is None else {"push_stream_lanes": cfg.push_lanes}
    async with RemoteInferenceClient(url, config=ClientConfig(**lanes)) as client:
        for i, tenant in enumerate(names):
            await client.load_lora_adapter(tenant, str(model.adapters[weights[i % len(weights)]]))
        for streamer in streamers:
            streamer.start()
        sampling = asyncio.create_task(
            keep_sampling(
                client,
                swapper,
                prompt,
                meter,
                stop,
                cfg.streams,
                cfg.max_tokens,
                length_spread=cfg.length_spread,
            )
        )
        try:
            await _first_tokens(streamers, meter, sampling)
            warmup_swap = replace(cfg, swaps_per_window=1)
            await _swap_window(client, swapper, paths, "per_adapter", warmup_swap)
            await asyncio.sleep(cfg.warmup_s)
            with collector_paused():
                windows = await _windows(client, swapper, paths, cfg)
            if cfg.swap_transport == "push_stream" and not client.metrics().pushes_streamed:
                raise RuntimeError("the swapper's pushes went over HTTP, not the push stream")
        except BaseException:
            for streamer in streamers:
                streamer.kill()
            raise
        finally:
            stop.set()
            with contextlib.suppress(Exception):
                await client.resume_all()
            await sampling
        others = [await streamer.stop() for streamer in streamers]
    for w in windows:
        w.others_rate = sum(tenant.rate(w.start, w.end) for tenant in others)
    return IsolationResult(
        cfg,
        windows,
        others,
        meter,
        ratios={m: _ratio_spread(windows, m, cfg) for m in SWAP_MODES},
        baseline=Spread.of(w.others_rate for w in windows if w.mode == "no_swap"),
        stall=_stall(windows, others, cfg.aftermath_s),
        longest_stalls=longest_during_swaps(windows, others, cfg.aftermath_s),
    )
