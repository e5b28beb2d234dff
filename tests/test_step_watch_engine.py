"""The engine's steps on the real engine, as the step watch and the resume pacing see them.

One ``--no-ray`` server on the embedded model with ``--long-step-ms 1``
(``conftest.SERVE_STEP_WATCH``, shared through ``serves``; the shutdown
tests stop it and the control's server after these tests): on
two CPU cores nearly every step takes longer than that, so the server's log
holds an ``engine_long_step`` event for each step with the step's shape read
from vLLM's own scheduler output.

- One sample of 64 tokens must leave such events (one request, one token a
  step once decoding), and the server must say it watches.
- With ``--resume-tokens-per-step 1`` a resumed adapter's held requests must
  enter the engine spread over steps: the gate counts vLLM's steps by their
  outputs (``compat.call_after_engine_steps``) and lets one request through
  per step. The gate's pace is not quite the engine's: a request let
  through for one step can reach the engine a step late, beside the next
  one (seen once in a few runs on two loaded cores: 1, 0, 0, 2, 1), so the
  test asks for at least three steps with entries and none with more than
  two. With the same 1-token room following the running batch
  (``--resume-graph-tokens 2``), where each 40-token request fits in no
  step beside it, the same four requests enter in at most two steps: the
  gate must have read how many requests run from vLLM's scheduler stats,
  or it would pace them one a step.
- A reload's answer leaves a ``weights_answered`` event: its time in the
  route holds the staging's (``adapter_staged``), so a sync's timeline can
  split the API's own work from the engine's.
- A staging's event holds its thread's CPU time beside its wall time, whole
  and for the slot write, so a slow staging under load says whether it
  waited off the CPU (for the GIL) or on it.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import requests

from skyrl_lora.server.cluster.process import ServeProcess
from tests.conftest import SERVE_STEP_WATCH, SERVE_STEP_WATCH_CONTROL, Serves

pytestmark = [pytest.mark.engine, pytest.mark.serve(SERVE_STEP_WATCH)]

_EVENT = re.compile(
    r'skyrl_event (\{"event": "(?:engine_long_step|resume|adapter_stag(?:ed|ing)|weights_answered)"'
    r".*\})"
)


@pytest.fixture(scope="module")
def server(serves: Serves) -> ServeProcess:
    return serves.use(SERVE_STEP_WATCH)


def _events(server: ServeProcess) -> list[dict[str, Any]]:
    return [json.loads(m.group(1)) for m in _EVENT.finditer(server.log_path.read_text())]


def _events_once(
    server: ServeProcess, logged: Callable[[list[dict[str, Any]]], object], timeout_s: float = 30
) -> list[dict[str, Any]]:
    """The log's events once ``logged(events)`` holds. The engine process's
    lines reach the log through vLLM's worker output relay, which may write
    them after the HTTP reply that followed them (a fresh-clone CI at
    5583917 read a staging's event before its line was written)."""
    deadline = time.monotonic() + timeout_s
    while not logged(events := _events(server)):
        assert time.monotonic() < deadline, f"not logged in {timeout_s} s; see {server.log_path}"
        time.sleep(0.1)
    return events


def _sample(url: str, prompt: list[int], max_tokens: int, lora: str | None = None) -> Any:
    body: dict[str, Any] = {
        "prompt_token_ids": prompt,
        "sampling_params": {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True},
    }
    if lora is not None:
        body["lora_name"] = lora
    reply = requests.post(f"{url}/skyrl/v1/sample", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_a_real_engines_long_steps_are_logged_with_their_shape(server: ServeProcess) -> None:
    info = requests.get(f"{server.url}/skyrl/v1/server_info", timeout=30).json()
    assert info["engine_long_step_ms"] == 1
    # the step budget as vLLM resolved it; a CPU engine keeps vLLM's (no CUDA graphs)
    assert info["engine_step_sequences"] == 48 and info["engine_step_tokens"] >= 48
    assert info["graph_step_budget"] is False
    began = time.monotonic()
    _sample(server.url, [1, 2, 3], 64)

    def long_steps(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [e for e in events if e["event"] == "engine_long_step"]

    steps = long_steps(_events_once(server, lambda events: len(long_steps(events)) > 10))
    decoding = [s for s in steps if s["prefill_tokens"] == 0]
    assert decoding, steps[:5]
    for step in decoding:
        assert step["requests"] == 1 and step["tokens"] == 1 and step["new_requests"] == 0
        assert step["ms"] > 1 and step["busy"] == []
    _long_steps_read_by_the_rl_report(server, began, time.monotonic())


def _long_steps_read_by_the_rl_report(server: ServeProcess, began: float, ended: float) -> None:
    """The RL report reads these events back from the log on its own clock
    (``engine_steps``): every long step of the sample's window, written or
    counted as left unwritten, and the time they took."""
    from examples.rl.engine_rate import COUNTERS, EngineTokenCounter
    from examples.rl.report import ModeRun, engine_steps
    from skyrl_lora.server.telemetry.event_log import read_events

    events = read_events(server.log_path.read_text().splitlines(), time.time() - time.monotonic())
    inside = [e.fields for e in events if e.name == "engine_long_step" and began <= e.at <= ended]
    counter = EngineTokenCounter(server.url)
    counter.times = [began, ended]
    for name in COUNTERS:  # no metrics read: the steps' figures are 0, the long ones are not
        counter.readings[name] = [0.0, 0.0]
    figures = engine_steps(ModeRun("probe", {}, counter, began, ended, engine_events=events))
    seconds = ended - began
    counted = sum(1 + e["suppressed"] for e in inside)
    assert counted >= 10 and figures["long_steps_per_s"] == pytest.approx(counted / seconds)
    assert figures["long_step_share"] == pytest.approx(
        sum(e["ms"] for e in inside) / 1000 / seconds
    )
    assert figures["long_steps_over_graph_share"] == 0  # one 3-token prompt, then 1-token steps


def _held(url: str, lora: str) -> int:
    listing = requests.get(f"{url}/skyrl/v1/adapters", timeout=30).json()["adapters"]
    return int(next(a["held"] for a in listing if a["lora_name"] == lora))


def _resumed_backlog_entries(server: ServeProcess, lora: str) -> list[int]:
    """Hold four requests of ``lora`` behind a pause, resume, and return how
    many new requests each logged step after the resume took in.

    Nothing else runs, so the engine's steps are those four requests' (a
    dozen or so: under the step watch's 20 events a second).
    """
    url = server.url
    time.sleep(1.1)  # a new second of events: an earlier sample's may have spent this one's
    with ThreadPoolExecutor(4) as pool:
        reply = requests.post(f"{url}/skyrl/v1/pause", json={"lora_name": lora}, timeout=30)
        assert reply.status_code == 200, reply.text
        held = [pool.submit(_sample, url, [4 + i] * 40, 8, lora) for i in range(4)]
        deadline = time.monotonic() + 60
        while _held(url, lora) < 4:
            assert time.monotonic() < deadline, "the requests were never held"
            time.sleep(0.02)
        reply = requests.post(f"{url}/skyrl/v1/resume", json={"lora_name": lora}, timeout=30)
        assert reply.status_code == 200, reply.text
        for done in held:
            assert len(done.result()["sequences"][0]["tokens"]) == 8

    def entries(events: list[dict[str, Any]]) -> list[int]:
        resumed_at = max(i for i, e in enumerate(events) if e["event"] == "resume")
        return [e["new_requests"] for e in events[resumed_at:] if e["event"] == "engine_long_step"]

    # every held request enters once: wait until all four entries are logged
    return entries(_events_once(server, lambda events: sum(entries(events)) >= 4))


def test_a_resumed_backlog_enters_spread_over_steps(server: ServeProcess) -> None:
    info = requests.get(f"{server.url}/skyrl/v1/server_info", timeout=30).json()
    assert info["resume_tokens_per_step"] == 1 and info["resume_pacing_sees_steps"]
    entries = _resumed_backlog_entries(server, "meow")
    assert sum(map(bool, entries)) >= 3, f"the backlog entered together: {entries}"
    assert max(entries) <= 2, f"a step took in more than two resumed requests: {entries}"


@pytest.mark.serve(SERVE_STEP_WATCH_CONTROL)
def test_the_same_backlog_enters_together_with_no_room_beside_the_batch(serves: Serves) -> None:
    """The other side of the test above: where a resumed request fits in no
    step beside the running batch, the same requests enter in at most two
    steps, so the test above can fail. The room is the same 1 token a step,
    but following the running batch: a step of at most 2 tokens less the
    requests vLLM's stats say run, which no 40-token prompt fits, so all of
    them go in at once.

    This one control stands for pacing turned off too (vLLM's own admission,
    which lets the backlog in at once; ``--no-resume-pacing`` reaching the
    server is ``test_cli.py``'s and ``test_gate.py``'s): a second server for
    it cost about a minute of the CPU suite."""
    server = serves.use(SERVE_STEP_WATCH_CONTROL)
    info = requests.get(f"{server.url}/skyrl/v1/server_info", timeout=30).json()
    assert info["resume_graph_tokens"] == 2 and info["resume_pacing_sees_steps"]
    _sample(server.url, [1, 2, 3], 2)  # a step that says how many requests run
    entries = _resumed_backlog_entries(server, "meow")
    assert sum(map(bool, entries)) <= 2 and max(entries) >= 2, entries


def test_a_reload_leaves_its_time_in_the_route(server: ServeProcess, embedded_model: Any) -> None:
    body = {"lora_name": "woof", "lora_path": str(embedded_model.adapters["moo"])}
    reply = requests.post(f"{server.url}/skyrl/v1/adapters/load", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    version = reply.json()["version"]
    events = _events(server)
    (answered,) = [
        e for e in events if e["event"] == "weights_answered" and e["version"] == version
    ]
    (staged,) = [
        e for e in events if e["event"] == "adapter_staged" and e["lora_name"] == f"woof@v{version}"
    ]
    assert answered["route"] == "load" and answered["lora_name"] == "woof"
    assert staged["stage_ms"] <= answered["ms"] < 60_000


def test_a_staging_reports_its_thread_cpu_time(server: ServeProcess, embedded_model: Any) -> None:
    body = {"lora_name": "quack", "lora_path": str(embedded_model.adapters["quack"])}
    reply = requests.post(f"{server.url}/skyrl/v1/adapters/load", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    name = f"quack@v{reply.json()['version']}"

    def stagings(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [e for e in events if e["event"] == "adapter_staging" and e["lora_name"] == name]

    (staging,) = stagings(_events_once(server, stagings))
    # measured around the same span as ``ms``, a few microseconds apart
    assert 0 < staging["cpu_ms"] <= staging["ms"] + 0.5, staging
    for phase in ("slot", "handover_copy"):  # each beside its wall time, and within the whole
        cpu = staging[f"{phase}_cpu_ms"]
        assert (cpu is None) == (staging[f"{phase}_ms"] is None), staging
        assert cpu is None or cpu <= staging["cpu_ms"], staging
