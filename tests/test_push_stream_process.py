"""The push stream's listener in a process of its own: what the API server
sees of that process beyond the pushes themselves (the listener's own
behaviour, in either process, is in ``test_push_stream.py``)."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from pathlib import Path

import pytest

from skyrl_lora.chunk_digest import CHUNK_BYTES, digest_of
from skyrl_lora.errors import PushStreamUnavailableError
from skyrl_lora.server.http.push_assembly import OpenedPush
from skyrl_lora.server.http.push_stream import PushStreamConfig
from skyrl_lora.server.http.push_stream_process import PushStreamProcess
from tests.conftest import until
from tests.test_push_stream import FakeServer, lane_hello, send


async def test_the_childs_events_and_logs_are_logged_by_the_server(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fake = await FakeServer.in_own_process(tmp_path, PushStreamConfig())
    try:
        caplog.set_level(logging.INFO)
        data = os.urandom(CHUNK_BYTES + 3)
        await send((await fake.open("tenant-a", len(data), lanes=2))[0], data)
        events = [r for r in caplog.records if r.name == "skyrl_lora.events"]
        assert any('"event": "push_stream_received"' in r.getMessage() for r in events)
        assert any('"lanes": 2' in r.getMessage() for r in events)
    finally:
        fake.stream.close()


async def test_a_child_that_exits_fails_its_pushes_and_refuses_the_next(tmp_path: Path) -> None:
    """A push in flight fails, its load with it; a push opened later is
    refused as by a server without a push stream (the client then sends
    its weights in the HTTP body)."""
    fake = await FakeServer.in_own_process(tmp_path, PushStreamConfig())
    stream = fake.stream
    assert isinstance(stream, PushStreamProcess)
    data = os.urandom(2 * CHUNK_BYTES)
    ticket, _ = await fake.open("tenant-a", len(data), lanes=1)
    lane = await asyncio.to_thread(socket.create_connection, ("127.0.0.1", stream.port), 10)
    try:
        await asyncio.to_thread(lane.sendall, lane_hello(ticket, 0) + data[:CHUNK_BYTES])
        await until(lambda: bool(stream._receipts))  # its load started here
        stream._process.kill()
        await until(lambda: not stream._loads)  # and failed with the child
        assert not fake.loaded
        with pytest.raises(PushStreamUnavailableError, match="process exited"):
            await fake.open("tenant-b", 10)
    finally:
        lane.close()
        stream.close()


async def test_the_child_listens_where_it_is_told(tmp_path: Path) -> None:
    """A port taken already fails the start with the child's reason, not a hang."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]

        async def finish(*_: object) -> None:
            raise AssertionError("nothing is pushed")

        with pytest.raises(RuntimeError, match="did not start"):
            await PushStreamProcess.start("127.0.0.1", port, finish)  # type: ignore[arg-type]
    fake = await FakeServer.in_own_process(tmp_path, PushStreamConfig())
    try:
        data = b"0123456789"
        info = await send((await fake.open("tenant-a", len(data)))[0], data)
        assert info.lora_path == f"stream:{digest_of(data)}"
    finally:
        fake.stream.close()


async def test_the_child_runs_at_the_priority_it_is_given(tmp_path: Path) -> None:
    """``nice`` steps below the server's (``serve --push-stream-nice``): a
    push's byte movers then wait for a busy host's cores after the engine."""

    async def finish(*_: object) -> None:
        raise AssertionError("nothing is pushed")

    stream = await PushStreamProcess.start("127.0.0.1", 0, finish, nice=5)  # type: ignore[arg-type]
    try:
        ours = os.getpriority(os.PRIO_PROCESS, 0)
        assert os.getpriority(os.PRIO_PROCESS, stream._process.pid) == min(19, ours + 5)
    finally:
        stream.close()


async def test_a_push_whose_area_cannot_be_opened_is_answered(tmp_path: Path) -> None:
    """Its lanes wait for the load's answer: one that cannot start still answers."""
    fake = await FakeServer.in_own_process(tmp_path, PushStreamConfig())
    stream = fake.stream
    assert isinstance(stream, PushStreamProcess)
    sent: list[tuple[object, ...]] = []
    stream._send = sent.append  # type: ignore[method-assign]
    try:
        push = OpenedPush("tenant-a", tmp_path, 10, {}, 1)
        stream._handle(("start", 7, push, str(tmp_path / "gone" / "weights"), True))
        ((kind, key, reply),) = sent
        assert (kind, key) == ("done", 7) and isinstance(reply, dict)
        assert reply["status"] == 500 and "area" in reply["error"]["message"]
        assert not stream._receipts and not fake.loaded
        stream._handle(("digest", 7, "ab" * 32))  # a late message for it is dropped
    finally:
        stream.close()


async def test_serves_push_stream_flags_reach_the_child(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--push-stream-max-lanes`` caps a push's lanes in the child; a limit
    under 1, or a priority above the server's, is refused before it starts."""
    from skyrl_lora.server.http.app import parse_server_args, push_stream_config

    base = ["--model", "unused", "--enable-lora", "--push-stream-port", "0"]
    limits = ["--push-stream-max-lanes", "2", "--push-stream-hash-threads", "3"]
    config = push_stream_config(parse_server_args([*base, *limits]))
    assert (config.max_lanes, config.hash_threads) == (2, 3)
    assert push_stream_config(parse_server_args(base)) == PushStreamConfig()
    fake = await FakeServer.in_own_process(tmp_path, config)
    try:
        ticket, _ = await fake.open("tenant-a", 100 * CHUNK_BYTES, lanes=8)
        assert ticket.lanes == 2
    finally:
        fake.stream.close()
    for flag in ("--push-stream-max-lanes", "--push-stream-hash-threads"):
        with pytest.raises(SystemExit):
            parse_server_args([*base, flag, "0"])
        assert "must be at least 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # above the server's priority needs privileges
        parse_server_args([*base, "--push-stream-nice", "-5"])
    assert "--push-stream-nice must be 0" in capsys.readouterr().err
