"""``skyrl-lora serve --help`` prints help and exits 0 without starting Ray or an engine."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

#: Runs the CLI's ``main`` once for each argv of its JSON argument in one fresh
#: interpreter (importing vLLM for the help takes seconds: one import, not one
#: per flag), and after each says its return code and whether Ray was started.
PROBE = """
import json, sys
from skyrl_lora.server.cli import main
for argv in json.loads(sys.argv[1]):
    print("PROBE_BEGIN", flush=True)
    rc = main(argv)
    ray = sys.modules.get("ray")
    started = bool(ray is not None and getattr(ray, "is_initialized", lambda: False)())
    print(f"PROBE_END rc={rc} RAY_STARTED={started}", flush=True)
"""

#: Each help flag, alone and after the flags of a real start.
HELPS = {"--help": ["serve", "--help"], "-h": ["serve", "--embedded", "--port", "0", "-h"]}


@pytest.fixture(scope="module")
def helps() -> dict[str, list[str]]:
    """What each of :data:`HELPS` printed, up to its return code and Ray's state."""
    done = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(list(HELPS.values()))],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    outs = [out.split("PROBE_END", 1) for out in done.stdout.split("PROBE_BEGIN\n")[1:]]
    assert len(outs) == len(HELPS), done.stdout[-2000:]
    return {flag: out for flag, out in zip(HELPS, outs)}


@pytest.mark.parametrize("flag", list(HELPS))
def test_serve_help_prints_ours_and_vllms_flags_and_exits_0(
    flag: str, helps: dict[str, list[str]]
) -> None:
    out, end = helps[flag]
    for ours in ("--embedded", "--no-ray", "--api-keys", "--adapter-root"):
        assert ours in out, ours
    for vllms in ("--lora-modules", "--max-lora-rank", "--tensor-parallel-size"):
        assert vllms in out, vllms
    assert end.split() == ["rc=0", "RAY_STARTED=False"], end


@pytest.mark.parametrize(("flags", "paced"), [([], True), (["--no-resume-pacing"], False)])
def test_resume_pacing_is_on_unless_turned_off(flags: list[str], paced: bool) -> None:
    from skyrl_lora.server.engine.gate import DEFAULT_RESUME_PACING
    from skyrl_lora.server.http.app import parse_server_args, resume_pacing

    pacing = resume_pacing(parse_server_args(["--model", "unused", *flags]))
    assert pacing == (DEFAULT_RESUME_PACING if paced else None)


@pytest.mark.parametrize(("flags", "paced"), [([], True), (["--no-answer-pacing"], False)])
def test_answer_pacing_is_on_unless_turned_off(flags: list[str], paced: bool) -> None:
    from skyrl_lora.server.engine.gate import DEFAULT_ANSWER_PACING
    from skyrl_lora.server.http.app import answer_pacing, parse_server_args

    pacing = answer_pacing(parse_server_args(["--model", "unused", *flags]))
    assert pacing == (DEFAULT_ANSWER_PACING if paced else None)


@pytest.mark.parametrize(
    ("flags", "port"),
    [([], 0), (["--push-stream-port", "7001"], 7001), (["--no-push-stream"], None)],
)
def test_the_push_stream_is_on_a_free_port_unless_turned_off(
    flags: list[str], port: int | None
) -> None:
    from skyrl_lora.server.http.app import parse_server_args, push_stream_port

    assert push_stream_port(parse_server_args(["--model", "unused", *flags])) == port


@pytest.mark.parametrize(("flags", "frozen"), [([], True), (["--no-gc-freeze"], False)])
def test_the_gc_freeze_is_on_unless_turned_off(flags: list[str], frozen: bool) -> None:
    from skyrl_lora.server.http.app import parse_server_args

    assert parse_server_args(["--model", "unused", *flags]).gc_freeze is frozen


@pytest.mark.parametrize(("flags", "naps"), [([], True), (["--no-staging-yield"], False)])
def test_staging_naps_are_on_unless_turned_off(flags: list[str], naps: bool) -> None:
    from skyrl_lora.server.http.app import parse_server_args, staging_yield
    from skyrl_lora.server.loading.staging_yield import DEFAULT_STAGING_YIELD

    config = staging_yield(parse_server_args(["--model", "unused", *flags]))
    assert config == (DEFAULT_STAGING_YIELD if naps else None)


@pytest.mark.parametrize(("flags", "prefill"), [([], True), (["--no-slot-prefill"], False)])
def test_slot_prefill_is_on_unless_turned_off(flags: list[str], prefill: bool) -> None:
    from skyrl_lora.server.http.app import parse_server_args

    assert parse_server_args(["--model", "unused", *flags]).slot_prefill is prefill


@pytest.mark.parametrize(("flags", "reader"), [([], False), (["--adapter-reader"], True)])
def test_the_reader_process_is_off_unless_turned_on(flags: list[str], reader: bool) -> None:
    from skyrl_lora.server.http.app import parse_server_args

    assert parse_server_args(["--model", "unused", *flags]).adapter_reader is reader


@pytest.mark.parametrize(
    ("flags", "cpu_loras"),
    [
        (["--enable-lora", "--max-loras", "8"], 16),
        (["--enable-lora", "--max-loras", "8", "--max-cpu-loras", "9"], 9),
        ([], None),
    ],
)
def test_the_cpu_adapter_cache_has_room_for_new_versions(
    flags: list[str], cpu_loras: int | None
) -> None:
    from skyrl_lora.server.http.app import parse_server_args

    assert parse_server_args(["--model", "unused", *flags]).max_cpu_loras == cpu_loras
