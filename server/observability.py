"""Metrics on ``/metrics`` (beside vLLM's own) and structured event log lines.

The gate's counters are read at scrape time by a collector, so the hot path
only bumps plain integers; the pause-to-aborted latency goes to a histogram.
Event lines are one JSON object each, so log pipelines can parse them.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

from prometheus_client import REGISTRY, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from skyrl_lora.server.gate import AdapterGate

event_logger = logging.getLogger("skyrl_lora.events")

PAUSE_TO_ABORTED = Histogram(
    "skyrl_pause_to_aborted_seconds",
    "Time from a per-adapter pause (or abort) to every aborted request having returned.",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
)

#: ``slot="none"`` counts the installs that vLLM copies into a slot in its
#: step loop, stalling every tenant for that long (see ``server/slots.py``).
STAGINGS = Counter(
    "skyrl_adapter_stagings",
    "Adapter versions staged off the step loop, by whether the staging also "
    "wrote them into an engine LoRA slot.",
    labelnames=["slot"],
)

#: ``process="engine"`` counts the stagings whose files were read on the
#: engine process's own staging thread, sharing its GIL with the step loop
#: (see ``server/adapter_reader.py``).
READS = Counter(
    "skyrl_adapter_reads",
    "Adapter versions staged, by the process that read their files.",
    labelnames=["process"],
)


def log_event(event: str, **fields: Any) -> None:
    """One structured line: ``skyrl_event {"event": ..., ...}``."""
    event_logger.info("skyrl_event %s", json.dumps({"event": event, **fields}, default=str))


class GateCollector:
    """Exports an :class:`AdapterGate`'s counters at scrape time."""

    def __init__(self, gate: AdapterGate) -> None:
        self.gate = gate

    def collect(self) -> Iterator[Metric]:
        c = self.gate.counters
        yield CounterMetricFamily("skyrl_pauses", "Per-adapter pauses.", value=c.pauses)
        yield CounterMetricFamily(
            "skyrl_aborted_requests",
            "Requests aborted by a pause or abort.",
            value=c.aborted_requests,
        )
        yield CounterMetricFamily(
            "skyrl_held_requests",
            "Requests that waited at a paused adapter's gate.",
            value=c.held_requests,
        )
        yield CounterMetricFamily(
            "skyrl_resumed_segments",
            "Sample requests that resume an aborted sample (retries).",
            value=c.resumed_segments,
        )
        yield CounterMetricFamily(
            "skyrl_paced_requests",
            "Requests spaced out after their adapter resumed (see ResumePacing).",
            value=c.paced_requests,
        )
        held_now = GaugeMetricFamily(
            "skyrl_requests_held_now", "Requests waiting at a gate now.", labels=["lora_name"]
        )
        for name, count in self.gate.held_by_adapter().items():
            held_now.add_metric([name], count)
        yield held_now


def register(gate: AdapterGate) -> None:
    REGISTRY.register(GateCollector(gate))  # type: ignore[arg-type]
