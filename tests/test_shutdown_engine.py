"""``skyrl-lora serve`` stops cleanly, and leaves nothing behind however it is stopped.

For SIGTERM and SIGINT (an operator, Ctrl-C) the process must exit with
status 0 within 30 s after answering its in-flight request, and every
process it started must be gone. For SIGKILL (the OOM killer) nothing runs
in the server any more: the reaper must stop what it started within 15 s.
Both with the server in a Ray actor (the default) and in-process
(``--no-ray``). The process tree is walked before the signal and checked
after it, by pid and start time.

Each case stops a server (a start is 40-55 s on the 2-core CPU machine),
so the cases are a pairwise cover of signal and mode, not
all six: every signal and every mode, and SIGKILL (the reaper's path) in
both modes. SIGTERM and SIGINT take one path in ``serve`` (``cli.py``): in
both modes ``on_signals`` installs the same handler for the two signals
(after ``ray.init``'s own SIGTERM handler in Ray mode; in ``--no-ray`` mode
uvicorn's handlers are off, ``_SignalFreeServer``, and vLLM's
``setup_server`` and ``build_async_engine_client``, unlike its
``run_server``, install none in this process), and that handler treats
them alike. So SIGTERM is checked in Ray mode and SIGINT in ``--no-ray``
mode, and each check asserts that the handler logged the signal it got:
a signal that reached another handler fails the case.

The servers are ones other tests have used (``conftest.serves``; these
cases run last, each right after its server's last user): the Ray-mode
SIGTERM case stops the flag-less ``serve`` that took a push over its
stream, the ``--no-ray`` cases the step watch's two servers (their flags
log steps and pace resumes; none touches stopping). A server that has
served, pushed, paused and reloaded must stop as cleanly as a fresh one,
and each start saved is 40-95 s of the suite.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import requests

from skyrl_lora.server.compat import submitted_request_ids
from skyrl_lora.server.reaper import alive
from tests.conftest import (
    SERVE_FLAGLESS,
    SERVE_STEP_WATCH,
    SERVE_STEP_WATCH_CONTROL,
    Serves,
)

pytestmark = pytest.mark.engine

#: The issue's bounds: a clean stop within 30 s, the reaper within 15 s of a kill.
CLEAN_STOP_S = 30.0
REAPED_WITHIN_S = 15.0
SAMPLES = 64


def _long_sample(url: str, answer: dict[str, Any]) -> None:
    """64 samples of 900 tokens in one request, so that the engine is still
    generating when the signal comes: on the 2-core CPU machine 32 took it
    8 s and 96 took 21 s. With one sample (2.5-3.5 s of generation) the
    sample had finished before the signal in 2 of 3 runs at e681bb0: the
    engine takes both cores, and the test's own ``/metrics`` poll, and the
    API process that answers it, were starved for up to 5 s. With 8
    samples it had finished in 3 of 13 runs."""
    body = {
        "prompt_token_ids": [1, 2, 3],
        "num_samples": SAMPLES,
        "sampling_params": {
            "max_tokens": 900,
            "temperature": 1.0,
            "seed": 0,
            "ignore_eos": True,
        },
    }
    try:
        reply = requests.post(f"{url}/skyrl/v1/sample", json=body, timeout=60)
        answer["status"] = reply.status_code
        answer["body"] = reply.json()
    except Exception as exc:  # the assertion below says what went wrong
        answer["error"] = repr(exc)


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
    except OSError:
        return "?"


def _generated(url: str) -> float:
    """The tokens the engine has made so far (the server may have served before)."""
    metrics = requests.get(f"{url}/metrics", timeout=10).text
    for line in metrics.splitlines():
        if line.startswith("vllm:generation_tokens_total"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _engine_generating(url: str, before: float) -> bool:
    """Whether the engine has made two tokens per sample since ``before``: a
    stop right after the first step (one token each) answered 64 samples
    with none at all at e950fe3, which is not what this test checks."""
    return _generated(url) - before >= 2 * SAMPLES


#: (signal, mode) pairs: each signal and each mode, SIGKILL in both (see above),
#: with the shared server each stops. SIGINT's case checks every sample's
#: tokens, so it takes the control's server (the other runs 48 sequences at
#: most: 16 of the 64 would wait with none).
CASES = [
    (signal.SIGTERM, "ray", SERVE_FLAGLESS),
    (signal.SIGINT, "no-ray", SERVE_STEP_WATCH_CONTROL),
    (signal.SIGKILL, "ray", SERVE_FLAGLESS),
    (signal.SIGKILL, "no-ray", SERVE_STEP_WATCH),
]


@pytest.mark.parametrize(
    ("sig", "mode", "argv"),
    [
        pytest.param(
            *case, id=f"{case[0].name}-{case[1]}", marks=pytest.mark.serve(case[2], take=True)
        )
        for case in CASES
    ],
)
def test_serve_leaves_no_process_behind(
    mode: str, sig: signal.Signals, argv: tuple[str, ...], serves: Serves
) -> None:
    assert ("--no-ray" in argv) == (mode == "no-ray")
    server = serves.take(argv)
    try:
        answer: dict[str, Any] = {}
        before = _generated(server.url)
        sampler = threading.Thread(target=_long_sample, args=(server.url, answer))
        sampler.start()
        deadline = time.monotonic() + 30
        while not _engine_generating(server.url, before) and time.monotonic() < deadline:
            time.sleep(0.05)
        started = server.tree()
        assert started, "the server started no process: nothing to check"
        server.proc.send_signal(sig)
        signalled = time.monotonic()
        status = server.proc.wait(timeout=CLEAN_STOP_S)
        stopped_s = time.monotonic() - signalled
        sampler.join(timeout=CLEAN_STOP_S)

        # Processes may take a moment to exit after the server (multiprocessing's
        # resource tracker reads the server's end of its pipe closing).
        deadline = signalled + (REAPED_WITHIN_S if sig == signal.SIGKILL else CLEAN_STOP_S)
        while alive(started) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = {pid: _command(pid) for pid, _ in alive(started)}
        assert left == {}, f"left behind after {sig.name}; see {server.log_path}"
        if sig == signal.SIGKILL:
            assert status == -signal.SIGKILL
            return
        assert status == 0, f"exit status {status} after {sig.name}; see {server.log_path}"
        assert stopped_s < CLEAN_STOP_S
        # ...through ``on_signals``'s handler, which SIGTERM and SIGINT share.
        assert f"{sig.name}: stopping the server" in server.log_path.read_text()
        # The request in flight was aborted and answered with what it had, not
        # left to run until the grace ran out and cut off.
        assert answer.get("status") == 200, answer
        sequences = answer["body"]["sequences"]
        assert len(sequences) == SAMPLES
        for sequence in sequences:
            assert sequence["stop_reason"] == "abort", json.dumps(sequence)[:200]
            assert 0 < len(sequence["tokens"]) < 900
    finally:
        server.kill_all()


def test_a_stopping_server_aborts_by_the_ids_requests_were_submitted_with() -> None:
    """vLLM 0.32 keys its states by internal ids and maps the submitted ones;
    builds without that map key the states by the submitted ids."""

    class Internal:
        request_states = {"sample-1-a1b2c3d4": object()}
        external_req_ids = {"sample-1": ["sample-1-a1b2c3d4"]}

    class Submitted:
        request_states = {"sample-1": object()}

    assert submitted_request_ids(Internal()) == ["sample-1"]
    assert submitted_request_ids(Submitted()) == ["sample-1"]
    assert submitted_request_ids(None) == []
