"""The swap-isolation figures shared by the CPU benchmark and the GPU perf test.

:func:`collect` runs, against one server, the interleaved isolation run (3
tenants, and optionally 8 tenants with one swapping), the others' token-gap
tails, pause latency, the idle control round trip and the swap time by rank.
:meth:`PerfRun.figures` turns that into the flat json of issue 10
(``others_ratio.per_adapter``, ``stall_ms.during_swap_p99``, ...), and
:meth:`PerfRun.rows` into table rows. The CPU benchmark and
``gpu_tests/test_gpu_perf.py`` both call exactly this, with different shapes,
so the GPU run cannot hit a code path the CPU run never took.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import control_roundtrip, isolation, pause_latency, swap_time
from benchmarks.common import collector_paused
from benchmarks.isolation import IsolationConfig, IsolationResult
from benchmarks.pause_latency import PauseLatency
from benchmarks.report import Row, spread_row
from benchmarks.stats import Spread, Tail, tails_spread

#: Keys (dotted = nested) that issue 10 asks ``gpu_perf.json`` to carry; the
#: isolation ones also under ``eight_tenants``.
ISOLATION_KEYS = (
    "others_ratio.per_adapter",
    "others_ratio.global",
    "stall_ms.outside_p99",
    "stall_ms.during_swap_p99",
    "stall_ms.during_swap_max",
)
REQUIRED_KEYS = (
    *ISOLATION_KEYS,
    "swap_ms.16",
    "control_roundtrip_ms.idle_pause_resume",
    "pause_latency_ms.p99_ms",
    "pause_latency_ms.server_p99_ms",
)


def missing_keys(figures: dict[str, Any]) -> list[str]:
    """Required keys that are absent from :meth:`PerfRun.figures` or not numbers."""
    wanted = list(REQUIRED_KEYS)
    if "eight_tenants" in figures:
        wanted += [f"eight_tenants.{k}" for k in ISOLATION_KEYS]
    missing = []
    for key in wanted:
        node: Any = figures
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, (int, float)):
            missing.append(key)
    return missing


@dataclass(frozen=True)
class PerfShape:
    """How much of everything to run; ``eight_tenants=None`` skips that variant."""

    isolation: IsolationConfig = field(default_factory=IsolationConfig)
    eight_tenants: IsolationConfig | None = field(
        default_factory=lambda: IsolationConfig(tenants=8, streams=4)
    )
    pause_rounds: int = 3
    pauses: int = 50
    in_flight: int = 64
    control_rounds: int = 3
    control_repeats: int = 50
    swap_repeats: int = 6
    ranks: tuple[int, ...] = (8, 16, 64)


@dataclass
class PerfRun:
    shape: PerfShape
    isolation: IsolationResult
    eight_tenants: IsolationResult | None
    pause: PauseLatency
    control: list[Tail]
    swaps: swap_time.SwapTimes

    def check(self) -> None:
        """Every sanity check of the run (raises ``UntrustworthyRunError``)."""
        self.isolation.check()
        if self.eight_tenants is not None:
            self.eight_tenants.check()

    @property
    def control_spread(self) -> dict[str, Spread]:
        return tails_spread(self.control)

    def figures(self) -> dict[str, Any]:
        """Medians over rounds under issue 10's keys; spreads under ``spread``."""
        ctl = self.control_spread
        out: dict[str, Any] = {
            **_isolation_figures(self.isolation),
            "swap_ms": {str(r): s.median for r, s in self.swaps.three_calls.items()},
            "reload_ms": {str(r): s.median for r, s in self.swaps.reload_only.items()},
            "control_roundtrip_ms": {
                "idle_pause_resume": ctl["p50"].median,
                "idle_pause_resume_p99": ctl["p99"].median,
                "idle_pause_resume_max": ctl["max"].median,
            },
            "pause_latency_ms": self.pause.summary,
        }
        out["spread"]["swap_ms"] = {str(r): s.to_json() for r, s in self.swaps.three_calls.items()}
        out["spread"]["reload_ms"] = {
            str(r): s.to_json() for r, s in self.swaps.reload_only.items()
        }
        out["spread"]["control_roundtrip_ms"] = {q: s.to_json() for q, s in ctl.items()}
        if self.eight_tenants is not None:
            out["eight_tenants"] = _isolation_figures(self.eight_tenants)
        return out

    def rows(self) -> list[Row]:
        rows = _isolation_rows(self.isolation, "")
        if self.eight_tenants is not None:
            rows += _isolation_rows(self.eight_tenants, "8 tenants, ")
        p = self.pause
        cs, ss, st = p.client_spread, p.server_spread, p.probe_spread
        rows.append(
            spread_row(
                f"pause latency p99, {p.in_flight} in flight, {p.pauses} pauses x {p.rounds}",
                cs["p99"],
                ".1f",
                " ms",
                "<= 50 ms",
                f"p50 {cs['p50'].median:.1f}, max {cs['max'].median:.1f} ms; server-side drain"
                f" p50 / p99 / max {ss['p50'].median:.1f} / {ss['p99'].median:.1f} /"
                f" {ss['max'].median:.1f} ms (p99 {ss['p99'].min:.1f}-{ss['p99'].max:.1f});"
                " another tenant's token gap across a pause p50 / p99 / max"
                f" {st['p50'].median:.1f} /"
                f" {st['p99'].median:.1f} / {st['max'].median:.1f} ms",
            )
        )
        rows.append(
            spread_row(
                "another tenant's longest token gap across a pause, less its longest outside",
                p.probe_excess,
                ".1f",
                " ms",
                "<= 50 ms",
                f"{st['max'].median:.1f} ms across ({st['max'].min:.1f}-{st['max'].max:.1f})"
                f" against {p.probe_outside.median:.1f} ms outside"
                f" ({p.probe_outside.min:.1f}-{p.probe_outside.max:.1f}); the probe in a"
                " process of its own",
            )
        )
        ctl = self.control_spread
        rows.append(
            spread_row(
                "idle control round trip: pause + resume, nothing in flight, p50",
                ctl["p50"],
                ".1f",
                " ms",
                "<= 10 ms",
                f"p99 {ctl['p99'].median:.1f} ms, max {ctl['max'].median:.1f} ms;"
                f" {self.shape.control_repeats} x {self.shape.control_rounds}",
            )
        )
        rows.append(
            _by_rank_row(
                "swap: pause + reload in place + resume", self.swaps.three_calls, self.shape
            )
        )
        rows.append(
            _by_rank_row(
                "reload in place alone (staged while serving; paused only to install)",
                self.swaps.reload_only,
                self.shape,
            )
        )
        return rows


def _by_rank_row(label: str, by_rank: dict[int, Spread], shape: PerfShape) -> Row:
    ranks = list(by_rank)
    return (
        f"{label}, rank " + " / ".join(str(r) for r in ranks),
        " / ".join(f"{by_rank[r].median:.0f}" for r in ranks) + " ms",
        " / ".join(f"{by_rank[r].min:.0f}-{by_rank[r].max:.0f}" for r in ranks),
        "",
        f"{shape.swap_repeats} per rank",
    )


def _isolation_figures(res: IsolationResult) -> dict[str, Any]:
    per = res.stall["per_adapter_during_swap"]
    out = res.stall["per_adapter_outside_swap"]
    glob = res.stall["global_during_swap"]
    calm = res.stall["no_swap"]
    return {
        "others_ratio": {m: s.median for m, s in res.ratios.items()},
        "others_ratio_pooled": {m: res.pooled(m) for m in isolation.SWAP_MODES},
        "others_tok_s_no_swap": res.baseline.median,
        "stall_ms": {
            "outside_p50": out["p50"].median,
            "outside_p99": out["p99"].median,
            "outside_max": out["max"].median,
            "during_swap_p50": per["p50"].median,
            "during_swap_p99": per["p99"].median,
            "during_swap_max": per["max"].median,
            "no_swap_p99": calm["p99"].median,
            "global_during_swap_p99": glob["p99"].median,
            "global_during_swap_max": glob["max"].median,
        },
        "spread": res.to_json(),
    }


def _isolation_rows(res: IsolationResult, label: str) -> list[Row]:
    cfg = res.config
    others = cfg.tenants - 1
    kept = len(res.round_baselines.kept)
    rounds = f"{cfg.rounds} rounds" if kept == cfg.rounds else f"{kept} of {cfg.rounds} rounds"
    shape = f"{others} others x {cfg.streams} streams, {rounds}"
    swaps = {m: sum(len(w.swaps) for w in res.of(m)) for m in isolation.SWAP_MODES}
    rows = [
        spread_row(
            f"isolation, {label}others' tok/s during swaps / no swap: per-adapter pause",
            res.ratios["per_adapter"],
            ".2f",
            "x",
            ">= 0.95x",
            f"pooled {res.pooled('per_adapter'):.2f}x; {shape};"
            f" no swap {res.baseline.median:.0f} tok/s"
            f" ({res.baseline.min:.0f}-{res.baseline.max:.0f}); {swaps['per_adapter']} swaps",
        ),
        spread_row(
            f"isolation, {label}same, vLLM global keep-mode pause",
            res.ratios["global"],
            ".2f",
            "x",
            "(baseline design) < 1",
            f"pooled {res.pooled('global'):.2f}x; {swaps['global']} swaps",
        ),
    ]
    for kind, what in (
        ("per_adapter_during_swap", "during per-adapter swaps"),
        ("per_adapter_outside_swap", "outside swaps"),
        ("global_during_swap", "during global pauses"),
    ):
        tail = res.stall[kind]
        rows.append(
            spread_row(
                f"others' inter-token gap {what}, {label}p99",
                tail["p99"],
                ".1f",
                " ms",
                "",
                f"p50 {tail['p50'].median:.1f} ms, max {tail['max'].median:.1f} ms"
                f" ({tail['max'].min:.1f}-{tail['max'].max:.1f})",
            )
        )
    return rows


async def collect(
    url: str,
    model: Any,
    prompt: list[int],
    shape: PerfShape,
    adapters_by_rank: dict[int, list[Path]] | None = None,
) -> PerfRun:
    """Run every figure of :class:`PerfShape` against the server at ``url``."""
    iso = await isolation.run(url, model, prompt, shape.isolation)
    eight = (
        await isolation.run(url, model, prompt, shape.eight_tenants)
        if shape.eight_tenants is not None
        else None
    )
    with collector_paused():  # isolation.run pauses it for its windows itself
        pause = await pause_latency.run(
            url,
            model,
            prompt,
            rounds=shape.pause_rounds,
            pauses=shape.pauses,
            in_flight=shape.in_flight,
        )
        control = await control_roundtrip.run(
            url, model, rounds=shape.control_rounds, repeats=shape.control_repeats
        )
        swaps = await swap_time.run(
            url, model, ranks=shape.ranks, repeats=shape.swap_repeats, adapters=adapters_by_rank
        )
    return PerfRun(shape, iso, eight, pause, control, swaps)
