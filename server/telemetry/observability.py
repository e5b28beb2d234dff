"""Metrics on ``/metrics`` (beside vLLM's own) and structured event log lines.

The gate's counters are read at scrape time by a collector, so the hot path
only bumps plain integers; the pause-to-aborted latency goes to a histogram.
Event lines are one JSON object each, so log pipelines can parse them.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import REGISTRY, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:  # the gate is read at scrape time; importing it here would invert the layers
    from ..engine.gate import AdapterGate

event_logger = logging.getLogger("skyrl_lora.events")

PAUSE_TO_ABORTED = Histogram(
    "skyrl_pause_to_aborted_seconds",
    "Time from a per-adapter pause (or abort) to every aborted request having returned.",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
)

#: ``slot="none"`` counts the installs that vLLM copies into a slot in its
#: step loop, stalling every tenant for that long (see ``server/loading/slots.py``).
STAGINGS = Counter(
    "skyrl_adapter_stagings",
    "Adapter versions staged off the step loop, by whether the staging also "
    "wrote them into an engine LoRA slot.",
    labelnames=["slot"],
)

#: How each staged version's files were read: ``read="reader"`` in the
#: adapter reader process (``server/transfer/adapter_reader.py``), ``"one_buffer"`` on
#: the engine process's staging thread in one call (``server/adapters/adapter_file.py``),
#: ``"safetensors"`` there tensor by tensor; both of the latter share the
#: engine process's GIL with the step loop. The rest (``staging_status.py``)
#: are built from a template: a file read in one call (``"file_template"``),
#: a hand-over (``"handover"``, ``"handover_template"``), and a streamed
#: push's receive area copied to the GPU as it landed (``"area_upload"``,
#: ``server/transfer/area_upload.py``).
READS = Counter(
    "skyrl_adapter_reads",
    "Adapter versions staged, by how their files were read.",
    labelnames=["read"],
)
ARRIVING_READS = Counter(
    "skyrl_adapter_arriving_reads",
    "Adapter versions staged while their weights file still arrived (a streamed "
    "push read as its bytes landed), by how the file was read.",
    labelnames=["read"],
)

#: How each path load's weights file reached its snapshot: ``weights="held"``
#: handed to the engine's workers open, who read it and write the snapshot's
#: copy (``server/adapters/registry.py``), ``"copied"`` copied by the API
#: server first (no stage channel to carry the file).
SNAPSHOTS = Counter(
    "skyrl_adapter_snapshots",
    "Path loads snapshotted, by how their weights file reached the snapshot.",
    labelnames=["weights"],
)

#: Pushed adapter weights that reached this server, in bytes, by how:
#: ``via="stream"`` over its push stream, ``"http"`` in an HTTP body, and
#: ``"host_share"`` from another server's receive area on this host
#: (``server/http/push_shared.py``): bytes that crossed no wire to reach it.
PUSHED_BYTES = Counter(
    "skyrl_pushed_bytes",
    "Bytes of pushed adapter weights received, by how they reached this server.",
    labelnames=["via"],
)

#: Naps a staging took to give the GIL back to a busy step loop
#: (``server/loading/staging_yield.py``): none while the engine is idle.
STAGING_NAPS = Counter(
    "skyrl_adapter_staging_naps",
    "Naps adapter stagings took to let the engine's step loop run alone.",
)


#: Samples drawn from non-finite logits (``server/http/sample.py``), by
#: adapter (``""``: the base model) and by what became of them: ``retried``
#: ran once more, ``refused`` was answered 422. A tenant whose adapter
#: diverged shows ``refused``; ``retried`` alone on a healthy adapter means
#: something else reached its requests.
NONFINITE_SAMPLES = Counter(
    "skyrl_nonfinite_samples",
    "Samples drawn from NaN or infinite logits, by adapter and outcome (retried, refused).",
    labelnames=["lora_name", "outcome"],
)


#: Events of vLLM's engine process, where only vLLM's own logger tree has a
#: handler. Its lines carry vLLM's time stamp (to the second), so each event
#: carries its own wall-clock ``at``.
engine_event_logger = logging.getLogger("vllm.skyrl_lora.events")


def _log(to: logging.Logger, event: str, fields: dict[str, Any]) -> None:
    to.info("skyrl_event %s", json.dumps({"event": event, **fields}, default=str))


def log_event(event: str, **fields: Any) -> None:
    """One structured line: ``skyrl_event {"event": ..., ...}``."""
    _log(event_logger, event, fields)


def log_engine_event(event: str, **fields: Any) -> None:
    """:func:`log_event` for vLLM's engine process, with ``at`` (``time.time()``)
    right after the name, where :mod:`benchmarks.timeline` looks for it."""
    _log(engine_event_logger, event, {"at": round(time.time(), 4), **fields})


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


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def log_to_stderr() -> None:
    """Our own handler on the ``skyrl_lora`` logger, not only the root's.

    vLLM reconfigures logging while it builds the engine, after which records
    that propagate to the root logger stopped reaching stderr: the pause,
    load and staging event lines went missing. A handler of our own does not
    depend on what happens to the root logger.
    """
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    formatter = logging.Formatter(LOG_FORMAT)
    ours = logging.getLogger("skyrl_lora")
    if not ours.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(formatter)
        ours.addHandler(handler)
    ours.setLevel(logging.INFO)
    ours.propagate = False
