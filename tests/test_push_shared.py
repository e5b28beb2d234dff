"""Push shares between the servers of one host, without an engine: a listener
lends a push's receive area under the share's name, a peer takes it and
follows its bytes to the matched digest, and the area goes to another push
only once every peer took it and let go, under a private name again."""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import threading
from pathlib import Path

import pytest

from skyrl_lora.chunk_digest import CHUNK_BYTES, digest_of
from skyrl_lora.errors import ConflictError, PushStreamUnavailableError
from skyrl_lora.server.adapters.arrival import MARKER, Arrival, ArrivalFailed, ArrivalWriter
from skyrl_lora.server.http import push_shared
from skyrl_lora.server.http.push_assembly import OpenedPush, Receipt
from skyrl_lora.server.http.push_shared import TakenShare, follow, take_share
from skyrl_lora.server.http.push_stream import PushStreamConfig
from skyrl_lora.server.http.receive_area import SHM_ROOT, host_token
from skyrl_lora.types import PushStreamTicket
from tests.conftest import until
from tests.test_push_stream import FakeServer, lane_hello, send

pytestmark = pytest.mark.skipif(not SHM_ROOT.is_dir(), reason="areas live in /dev/shm")


async def open_shared(fake: FakeServer, size: int, share: str, lanes: int = 1) -> PushStreamTicket:
    """A push of ``size`` bytes lent under ``share`` to one peer."""
    opened = OpenedPush("tenant-a", fake._new_folder(), size, {"version": "3"}, lanes, share, 1)
    return await fake.stream.open(opened)


async def followed(taken: TakenShare) -> tuple[Receipt, asyncio.Future[None]]:
    receipt = Receipt(taken.weights, taken.weights_fd)
    following = asyncio.ensure_future(asyncio.to_thread(follow, taken, receipt, threading.Event()))
    return receipt, following


@pytest.mark.parametrize("where", ["in_process", "own_process"])
async def test_a_peer_loads_the_lent_area_and_it_is_reused_once_let_go(
    tmp_path: Path, where: str
) -> None:
    config = PushStreamConfig(idle_areas=1)
    if where == "own_process":  # as a server runs it
        fake = await FakeServer.in_own_process(tmp_path, config)
    else:
        fake = FakeServer(tmp_path, config)
    try:
        head = (16).to_bytes(8, "little") + b'{"__metadata__"}'
        data = head + os.urandom(2 * CHUNK_BYTES)
        share = secrets.token_hex(16)
        ticket = await open_shared(fake, len(data), share, lanes=2)
        sending = asyncio.create_task(send(ticket, data))
        taken = await asyncio.to_thread(take_share, share, len(data), 10)
        receipt, following = await followed(taken)
        assert await receipt.head() == head
        assert await receipt.digest() == digest_of(data)
        await following
        info = await sending
        assert info.lora_path == f"stream:{digest_of(data)}"
        assert os.pread(taken.weights_fd, len(data) + 1, 0) == data
        (lent,) = fake.areas
        assert lent is not None and lent.name == f"skyrl-share-{share}"

        # While the peer holds it, the next push of that size gets an area of its own.
        await send((await fake.open("tenant-a", len(data)))[0], data[::-1])
        assert fake.areas[-1] not in (None, lent) and lent.exists()
        assert os.pread(taken.weights_fd, len(data) + 1, 0) == data  # untouched
        taken.close()
        # Let go: the lent area serves the next push, under a private name.
        await send((await fake.open("tenant-a", len(data)))[0], data[::-1])
        again = fake.areas[-1]
        assert again is not None and again.name.startswith("skyrl-push-")
        assert not lent.exists() and fake.loaded[-1][1] == data[::-1]
        with pytest.raises(PushStreamUnavailableError, match="within"):
            take_share(share, len(data), 0.05)  # an earlier push's peer finds nothing
    finally:
        fake.stream.close()


async def test_an_area_no_peer_took_waits_for_it(tmp_path: Path) -> None:
    fake = FakeServer(tmp_path, PushStreamConfig(idle_areas=2))
    try:
        data = os.urandom(1000)
        await send(await open_shared(fake, len(data), secrets.token_hex(16)), data)
        await send((await fake.open("tenant-a", len(data)))[0], data)
        first, second = fake.areas
        assert first != second  # its peer never came: not reused before LEND_S
    finally:
        fake.listener.close()


async def test_a_peer_fails_with_the_push_it_follows(tmp_path: Path) -> None:
    """The receiver's stream is cut off by a wrong digest after the peer took
    the area: the peer's receipt fails, with a message that says so."""
    fake = FakeServer(tmp_path, PushStreamConfig(idle_areas=1))
    try:
        data = os.urandom(CHUNK_BYTES + 99)
        share = secrets.token_hex(16)
        ticket = await open_shared(fake, len(data), share)
        with socket.create_connection(("127.0.0.1", ticket.port)) as lane:
            lane.sendall(lane_hello(ticket, 0) + data[:CHUNK_BYTES])
            taken = await asyncio.to_thread(take_share, share, len(data), 10)
            receipt, following = await followed(taken)
            await receipt.head()  # the first chunk is in
            lane.sendall(data[CHUNK_BYTES:] + digest_of(b"other").encode())
            answer = await asyncio.to_thread(lane.recv, 4096)
        assert b'"status": 400' in answer
        with pytest.raises(ConflictError, match="failed"):
            await receipt.digest()
        await following
        taken.close()
        # Its area is removed (off the listener's threads), never reused.
        await until(lambda: not (SHM_ROOT / f"skyrl-share-{share}").exists())
        with pytest.raises(PushStreamUnavailableError):
            take_share(share, len(data), 0.05)
    finally:
        fake.listener.close()


def test_every_server_of_a_host_reads_one_host_token(tmp_path: Path) -> None:
    token = host_token(tmp_path)
    assert token is not None and len(token) == 32
    assert host_token(tmp_path) == token
    assert host_token(tmp_path / "absent") is None
    assert [p.name for p in tmp_path.iterdir()] == [f"skyrl-host-{os.getuid()}"]


async def test_a_peer_takes_a_receiver_that_went_quiet_for_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No byte for ``STALL_S`` (a receiver killed mid-push writes no failure):
    the peer fails, and marks the arrival failed for its engine's read too."""
    monkeypatch.setattr(push_shared, "STALL_S", 0.1)
    (tmp_path / "adapter_model.safetensors").write_bytes(bytes(100))
    writer = ArrivalWriter(tmp_path, 100)
    writer.ready(10)
    dir_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    weights_fd = os.open(tmp_path / "adapter_model.safetensors", os.O_RDONLY)
    taken = TakenShare("quiet", dir_fd, weights_fd, tmp_path / "adapter_model.safetensors")
    receipt, following = await followed(taken)
    with pytest.raises(ConflictError, match="no byte came"):
        await receipt.head()
    await following
    with Arrival(tmp_path / MARKER, timeout_s=5) as engine_read:
        with pytest.raises(ArrivalFailed, match="push writing"):
            engine_read.wait_for(5)  # bytes that came: only a failure refuses them
    taken.close()
    writer.close()
