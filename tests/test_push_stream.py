"""The push stream alone: the chunked digest, the listener's tickets and
receive, and the client's sender against it (no engine: the load is a fake)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import socket
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import xxhash

from skyrl_lora.chunk_digest import (
    CHUNK_BYTES,
    ChunkedDigest,
    chunk_count,
    chunk_span,
    combine,
    digest_of,
    lane_bytes,
    lane_chunks,
)
from skyrl_lora.client.push_stream import stream_weights
from skyrl_lora.errors import (
    AuthenticationError,
    BadRequestError,
    ConflictError,
    ServerUnavailableError,
)
from skyrl_lora.server.http.push_assembly import OpenedPush, Receipt
from skyrl_lora.server.http.push_stream import PushStreamConfig, PushStreamListener
from skyrl_lora.server.http.push_stream_process import PushStream, PushStreamProcess
from skyrl_lora.types import PUSH_STREAM_HELLO as HELLO
from skyrl_lora.types import AdapterInfo, PushStreamTicket
from tests.conftest import until

URL = "http://127.0.0.1:1"  # only its host is used by the stream


def test_chunked_digest_is_sha256_over_the_chunks_xxh3_128s() -> None:
    data = os.urandom(2 * CHUNK_BYTES + 12345)
    pieces = [data[:CHUNK_BYTES], data[CHUNK_BYTES : 2 * CHUNK_BYTES], data[2 * CHUNK_BYTES :]]
    # xxhash's canonical (big-endian) bytes, as its hexdigest reads.
    inner = b"".join(bytes.fromhex(xxhash.xxh3_128(p).hexdigest()) for p in pieces)
    expected = hashlib.sha256(inner).hexdigest()
    assert digest_of(data) == expected
    with ChunkedDigest(threads=3) as digest:
        for piece in pieces:
            digest.add(memoryview(piece))
        assert digest.hexdigest() == expected
    assert digest_of(b"") == combine([]) == hashlib.sha256(b"").hexdigest()
    assert digest_of(data[:-1]) != expected


def test_chunked_digest_takes_chunks_by_index_from_lanes() -> None:
    data = os.urandom(5 * CHUNK_BYTES + 99)
    assert chunk_count(len(data)) == 6 and chunk_count(CHUNK_BYTES) == 1
    assert [list(lane_chunks(lane, 4, len(data))) for lane in range(4)] == [
        [0, 4], [1, 5], [2], [3]
    ]  # fmt: skip
    assert lane_bytes(1, 4, len(data)) == CHUNK_BYTES + 99
    assert sum(lane_bytes(lane, 4, len(data)) for lane in range(4)) == len(data)
    with ChunkedDigest(threads=2, total_bytes=len(data)) as digest:
        for index in (5, 2, 0, 4, 1):
            start, length = chunk_span(index, len(data))
            digest.add(data[start : start + length], index)
        with pytest.raises(ValueError, match=r"chunks \[3\] of 6 were never added"):
            digest.hexdigest()
        with pytest.raises(ValueError, match="chunk 3 holds 8388608 bytes, not 5"):
            digest.add(b"short", 3)
        digest.add(data[3 * CHUNK_BYTES : 4 * CHUNK_BYTES], 3)
        with pytest.raises(ValueError, match="chunk 3 was added already"):
            digest.add(data[3 * CHUNK_BYTES : 4 * CHUNK_BYTES], 3)
        assert digest.hexdigest() == digest_of(data)
    with ChunkedDigest(threads=1) as digest, pytest.raises(ValueError, match="total_bytes"):
        digest.add(b"x", 0)


def test_chunked_digest_hashes_chunks_its_threads_read() -> None:
    """A sender that never holds its bytes (``sendfile``) hands the read of
    each chunk to the hashing threads; a short read fails the digest."""
    data = os.urandom(2 * CHUNK_BYTES + 7)

    def reader(index: int, cut: int = 0) -> Callable[[], bytes]:
        start, length = chunk_span(index, len(data))
        return lambda: data[start : start + length - cut]

    with ChunkedDigest(threads=2, total_bytes=len(data)) as digest:
        for index in (2, 0, 1):
            digest.add_read(index, reader(index))
        with pytest.raises(ValueError, match="chunk 1 was added already"):
            digest.add_read(1, reader(1))
        assert digest.hexdigest() == digest_of(data)
    with ChunkedDigest(threads=2, total_bytes=len(data)) as digest:
        for index in range(3):
            digest.add_read(index, reader(index, cut=1 if index == 1 else 0))
        with pytest.raises(ValueError, match="chunk 1 holds 8388608 bytes, not 8388607"):
            digest.hexdigest()
    with ChunkedDigest(threads=1) as digest, pytest.raises(ValueError, match="total_bytes"):
        digest.add_read(0, lambda: b"x")


def test_chunked_digest_refuses_chunks_off_the_boundaries() -> None:
    with ChunkedDigest(threads=1) as digest:
        with pytest.raises(ValueError, match="1 to"):
            digest.add(b"x" * (CHUNK_BYTES + 1))
        with pytest.raises(ValueError, match="1 to"):
            digest.add(b"")
        digest.add(b"short")
        with pytest.raises(ValueError, match="must be the last"):
            digest.add(b"x" * CHUNK_BYTES)


class FakeServer:
    """A listener whose load records what it got and answers an AdapterInfo."""

    def __init__(
        self, tmp: Path, config: PushStreamConfig | None = None, *, listen: bool = True
    ) -> None:
        """``listen``: start a listener here (:meth:`in_own_process` starts
        one in a process of its own instead)."""
        self.tmp = tmp
        self.loaded: list[tuple[str, bytes, bytes, str]] = []
        self.heads: list[bytes | None] = []
        self.areas: list[Path | None] = []  # where each load found its weights, if in an area
        #: What the tests push to: the listener, or a process running another.
        self.stream: PushStream
        if listen:
            self.listener = PushStreamListener(
                "127.0.0.1", 0, self._finish, asyncio.get_running_loop(), config
            )
            self.stream = self.listener

    @classmethod
    async def in_own_process(cls, tmp: Path, config: PushStreamConfig) -> FakeServer:
        """The same, with its listener in a process of its own, as a server runs it."""
        fake = cls(tmp, config, listen=False)
        fake.stream = await PushStreamProcess.start("127.0.0.1", 0, fake._finish, config)
        return fake

    async def _finish(self, push: OpenedPush, receipt: Receipt) -> AdapterInfo:
        if push.lora_name == "refused-early":
            raise ConflictError("the load refused it before its bytes came")
        self.heads.append(await receipt.head())
        digest = await receipt.digest()
        in_area = receipt.weights_fd is not None
        self.areas.append(receipt.weights.parent if in_area else None)
        in_folder = [] if in_area else ["adapter_model.safetensors"]
        assert sorted(p.name for p in push.folder.iterdir()) == ["adapter_config.json", *in_folder]
        weights = receipt.weights.read_bytes()
        if receipt.weights_fd is not None:  # the descriptor the engine is handed reads the same
            assert os.pread(receipt.weights_fd, len(weights) + 1, 0) == weights
        config = (push.folder / "adapter_config.json").read_bytes()
        self.loaded.append((push.lora_name, weights, config, digest))
        if push.lora_name == "refused":
            raise BadRequestError("the load refused it")
        return AdapterInfo(
            lora_name=push.lora_name,
            version=int(push.fields.get("version", "1")),
            lora_path=f"stream:{digest}",
            paused=False,
            in_flight=0,
            held=0,
            engine_requests=0,
        )

    async def open(self, name: str, size: int, lanes: int = 1) -> tuple[PushStreamTicket, Path]:
        folder = self._new_folder()
        opened = OpenedPush(name, folder, size, {"version": "3"}, lanes)
        return await self.stream.open(opened), folder

    def _new_folder(self) -> Path:
        folder = Path(self.tmp / f"push-{len(os.listdir(self.tmp))}")
        folder.mkdir()
        (folder / "adapter_config.json").write_text('{"r": 8}')
        return folder


@pytest.fixture(params=["into_area", "into_folder", "own_process"])
async def server(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[FakeServer]:
    """A listener receiving into shared-memory areas, one writing each
    push's weights file in its folder (a host without ``/dev/shm``), and
    one receiving into areas in a process of its own, as a server runs it."""
    config = PushStreamConfig(idle_areas=0 if request.param == "into_folder" else 2)
    if request.param == "own_process":
        fake = await FakeServer.in_own_process(tmp_path, config)
    else:
        fake = FakeServer(tmp_path, config)
    yield fake
    fake.stream.close()


async def send(ticket: PushStreamTicket, weights: bytes | Path) -> AdapterInfo:
    raw = await stream_weights(URL, ticket, weights, timeout=30, connect_timeout=5)
    return AdapterInfo.model_validate_json(raw)


async def test_weights_arrive_whole_and_are_loaded_with_their_digest(
    server: FakeServer, tmp_path: Path
) -> None:
    data = os.urandom(3 * CHUNK_BYTES + 777)
    ticket, _ = await server.open("tenant-a", len(data))
    info = await send(ticket, data)
    ((name, weights, config, digest),) = server.loaded
    assert (name, weights, config) == ("tenant-a", data, b'{"r": 8}')
    assert digest == digest_of(data) and info.lora_path == f"stream:{digest}"
    assert info.version == 3
    # A file is sent from disk the same way.
    path = tmp_path / "weights.safetensors"
    path.write_bytes(data[: CHUNK_BYTES - 1])
    ticket, _ = await server.open("tenant-a", CHUNK_BYTES - 1)
    await send(ticket, path)
    assert server.loaded[-1][1] == data[: CHUNK_BYTES - 1]


async def test_lanes_carry_the_chunks_at_once_and_each_answers(
    server: FakeServer, tmp_path: Path
) -> None:
    data = os.urandom(5 * CHUNK_BYTES + 4321)
    ticket, _ = await server.open("tenant-a", len(data), lanes=4)
    assert ticket.lanes == 4
    info = await send(ticket, data)
    ((_, weights, _, digest),) = server.loaded
    assert weights == data and digest == digest_of(data) == info.lora_path.split(":")[1]
    path = tmp_path / "weights.safetensors"
    path.write_bytes(data)
    ticket, _ = await server.open("tenant-a", len(data), lanes=3)
    await send(ticket, path)
    assert server.loaded[-1][1] == data
    # Granted: no more lanes than chunks, nor than the listener's max_lanes.
    assert (await server.open("tenant-a", CHUNK_BYTES + 1, lanes=8))[0].lanes == 2
    assert (await server.open("tenant-a", 100 * CHUNK_BYTES, lanes=60))[0].lanes == 8


async def test_the_header_is_handed_to_the_load_once_its_chunk_is_in(server: FakeServer) -> None:
    """A safetensors header in the first chunk comes before the rest; one
    longer than that chunk is left to the whole file (None)."""
    short = (16).to_bytes(8, "little") + b'{"__metadata__":{}}'[:16]
    data = short + os.urandom(3 * CHUNK_BYTES)
    await send((await server.open("tenant-a", len(data), lanes=2))[0], data)
    assert server.heads[-1] == short
    long = (CHUNK_BYTES + 1).to_bytes(8, "little") + os.urandom(2 * CHUNK_BYTES)
    await send((await server.open("tenant-a", len(long), lanes=2))[0], long)
    assert server.heads[-1] is None


def lane_hello(ticket: PushStreamTicket, lane: int) -> bytes:
    return HELLO + ticket.ticket.encode() + f"{lane:02x}\n".encode()


def lane_answers(port: int, lanes: list[list[bytes]]) -> list[dict[str, object]]:
    """Send each lane's parts on a connection of its own, all at once; the answers."""
    with ThreadPoolExecutor(len(lanes)) as pool:
        return list(pool.map(lambda parts: raw_stream(port, *parts), lanes))


async def test_a_lane_that_fails_fails_the_push_on_every_lane(server: FakeServer) -> None:
    data = os.urandom(2 * CHUNK_BYTES + 10)
    port = server.stream.port
    ticket, folder = await server.open("tenant-a", len(data), lanes=3)
    whole = digest_of(data).encode()
    chunks = [data[:CHUNK_BYTES], data[CHUNK_BYTES : 2 * CHUNK_BYTES], data[2 * CHUNK_BYTES :]]
    cut = [[lane_hello(ticket, lane), chunks[lane], whole] for lane in range(3)]
    cut[1] = [lane_hello(ticket, 1), chunks[1][:1000]]
    answers = await asyncio.to_thread(lane_answers, port, cut)
    assert [a["status"] for a in answers] == [400, 400, 400]
    assert len({json.dumps(a) for a in answers}) == 1  # every lane says the same
    assert "broke off" in str(answers[0]["error"]) and "after 1000 of" in str(answers[0]["error"])
    assert not folder.exists() and not server.loaded
    # A lane whose digest differs from the bytes': damaged, on every lane.
    ticket, folder = await server.open("tenant-a", len(data), lanes=3)
    lies = [[lane_hello(ticket, lane), chunks[lane], whole] for lane in range(3)]
    lies[2][2] = digest_of(data[1:]).encode()
    answers = await asyncio.to_thread(lane_answers, port, lies)
    assert {a["status"] for a in answers} == {400}
    assert all("damaged" in str(a["error"]) for a in answers)
    assert not folder.exists() and not server.loaded


async def test_lanes_are_checked_and_a_missing_lane_fails_the_push(tmp_path: Path) -> None:
    fake = FakeServer(tmp_path, PushStreamConfig(idle_timeout_s=0.3))
    port = fake.listener.port
    data = os.urandom(CHUNK_BYTES + 5)
    try:
        ticket, folder = await fake.open("tenant-a", len(data), lanes=2)
        # A lane the ticket has not is refused, and the ticket stays good.
        beyond = await asyncio.to_thread(raw_stream, port, lane_hello(ticket, 2))
        assert beyond["status"] == 400 and "lanes 0 to 1, not 2" in str(beyond["error"])
        answers = await asyncio.to_thread(
            lane_answers,
            port,
            [[lane_hello(ticket, 0), data[:CHUNK_BYTES], digest_of(data).encode()]],
        )
        assert answers[0]["status"] == 400
        assert "1 of the push's 2 lanes never connected" in str(answers[0]["error"])
        assert not folder.exists() and not fake.loaded
    finally:
        fake.listener.close()


async def test_a_ticket_is_good_for_one_stream(server: FakeServer) -> None:
    ticket, _ = await server.open("tenant-a", 10)
    await send(ticket, b"0123456789")
    with pytest.raises(AuthenticationError, match="unknown push stream ticket"):
        await send(ticket, b"0123456789")
    forged = PushStreamTicket(ticket="0" * 32, port=ticket.port, expires_in_s=60)
    with pytest.raises(AuthenticationError):
        await send(forged, b"0123456789")
    assert len(server.loaded) == 1


async def test_an_unused_ticket_expires_and_its_folder_goes(tmp_path: Path) -> None:
    fake = FakeServer(tmp_path, PushStreamConfig(ticket_ttl_s=0.05))
    try:
        ticket, folder = await fake.open("tenant-a", 10)
        await asyncio.sleep(0.1)
        with pytest.raises(AuthenticationError):
            await send(ticket, b"0123456789")
        assert not folder.exists() and not fake.loaded
    finally:
        fake.listener.close()


async def test_too_many_open_pushes_are_refused(tmp_path: Path) -> None:
    fake = FakeServer(tmp_path, PushStreamConfig(max_open=1))
    try:
        await fake.open("tenant-a", 10)
        with pytest.raises(ConflictError, match="1 pushes are open"):
            await fake.open("tenant-b", 10)
    finally:
        fake.listener.close()


async def test_the_loads_error_reaches_the_sender(server: FakeServer) -> None:
    ticket, folder = await server.open("refused", 3)
    with pytest.raises(BadRequestError, match="the load refused it"):
        await send(ticket, b"abc")
    assert not folder.exists()


async def test_a_load_that_fails_before_the_bytes_came_stops_the_lanes(
    server: FakeServer,
) -> None:
    data = os.urandom(6 * CHUNK_BYTES)
    ticket, folder = await server.open("refused-early", len(data), lanes=2)
    with pytest.raises(ConflictError, match="before its bytes came"):
        await send(ticket, data)
    assert not folder.exists() and not server.loaded


def raw_stream(port: int, *parts: bytes) -> dict[str, object]:
    """Send bytes as they are (a damaged or cut stream) and read the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        for part in parts:
            sock.sendall(part)
        sock.shutdown(socket.SHUT_WR)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return json.loads(answer)


async def test_a_damaged_or_cut_stream_loads_nothing_and_says_why(server: FakeServer) -> None:
    data = os.urandom(1000)
    port = server.stream.port
    ticket, folder = await server.open("tenant-a", len(data))
    hello = HELLO + ticket.ticket.encode() + b"00\n"
    damaged = await asyncio.to_thread(raw_stream, port, hello, data, digest_of(data[1:]).encode())
    assert damaged["status"] == 400 and "damaged" in str(damaged["error"])
    assert not folder.exists()
    ticket, folder = await server.open("tenant-a", len(data))
    hello = HELLO + ticket.ticket.encode() + b"00\n"
    cut = await asyncio.to_thread(raw_stream, port, hello, data[:500])
    assert cut["status"] == 400 and "after 500 of 1000 bytes" in str(cut["error"])
    assert not folder.exists()
    big = os.urandom(CHUNK_BYTES + 1000)  # cut in its second chunk: the count is the stream's
    ticket, folder = await server.open("tenant-a", len(big))
    hello = HELLO + ticket.ticket.encode() + b"00\n"
    cut = await asyncio.to_thread(raw_stream, port, hello, big[: CHUNK_BYTES + 10])
    assert f"after {CHUNK_BYTES + 10} of {CHUNK_BYTES + 1000} bytes" in str(cut["error"])
    assert not folder.exists()
    wrong = await asyncio.to_thread(raw_stream, port, b"GET / HTTP/1.1\r\n" + b"x" * 60)
    assert wrong["status"] == 400 and "starts with" in str(wrong["error"])
    ticket, folder = await server.open("tenant-a", len(data))
    sha256_client = b"SKYRL-PUSH-STREAM/2 " + ticket.ticket.encode() + b"00\n"
    older = await asyncio.to_thread(raw_stream, port, sha256_client, data)
    assert older["status"] == 400 and "the client SKYRL-PUSH-STREAM/2" in str(older["error"])
    assert not server.loaded


async def test_a_closed_listener_takes_nothing(tmp_path: Path) -> None:
    fake = FakeServer(tmp_path)
    ticket, folder = await fake.open("tenant-a", 10)
    fake.listener.close()
    assert not folder.exists()
    with pytest.raises(ServerUnavailableError):
        await send(ticket, b"0123456789")


@pytest.mark.parametrize("where", ["read_for_its_hash", "truncated_on_disk"])
async def test_a_file_that_shrinks_while_sent_stops_every_lane(
    server: FakeServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """The client's own failure on one lane ends the others at once, not
    after a timeout, and the server loads nothing: whether the hashing
    threads' read of a chunk comes back short, or the file is cut short on
    disk before its last chunk is sent (``sendfile`` then sends less)."""
    data = os.urandom(4 * CHUNK_BYTES)
    path = tmp_path / "weights.safetensors"
    path.write_bytes(data)
    ticket, folder = await server.open("tenant-a", len(data), lanes=4)
    if where == "read_for_its_hash":
        real_pread = os.pread

        def shrinking(fd: int, length: int, offset: int) -> bytes:
            if offset == 3 * CHUNK_BYTES:
                return real_pread(fd, length - 1, offset)
            return real_pread(fd, length, offset)

        monkeypatch.setattr(os, "pread", shrinking)
    else:
        real_sendfile = socket.socket.sendfile

        def truncating(sock: socket.socket, file: Any, offset: int = 0, count: Any = None) -> int:
            if offset == 3 * CHUNK_BYTES:
                os.truncate(path, offset + 10)
            return real_sendfile(sock, file, offset, count)

        monkeypatch.setattr(socket.socket, "sendfile", truncating)
    started = asyncio.get_running_loop().time()
    with pytest.raises(ValueError, match="shrank"):
        await send(ticket, path)
    assert asyncio.get_running_loop().time() - started < 10
    for _ in range(100):  # the server's lanes see the connections end, and fail the push
        if not folder.exists():
            break
        await asyncio.sleep(0.05)
    assert not folder.exists() and not server.loaded


async def test_an_area_serves_the_next_push_of_its_size_and_a_failed_one_goes(
    tmp_path: Path,
) -> None:
    fake = FakeServer(tmp_path, PushStreamConfig(idle_areas=1))
    try:
        data = os.urandom(2 * CHUNK_BYTES + 5)
        await send((await fake.open("tenant-a", len(data), lanes=2))[0], data)
        await send((await fake.open("tenant-a", len(data), lanes=2))[0], data[::-1])
        first, second = fake.areas
        assert first is not None and first == second and first.is_dir()
        assert fake.loaded[-1][1] == data[::-1]  # the area's bytes are the new push's
        other = os.urandom(1000)  # another size: a new area; only one is kept idle
        await send((await fake.open("tenant-a", len(other)))[0], other)
        assert fake.areas[-1] not in (None, first)
        await until(lambda: not first.exists())  # closed off the event loop's thread
        kept = fake.areas[-1]
        assert kept is not None and sorted(p.name for p in kept.iterdir()) == [
            "adapter_model.safetensors"  # the arrival marker went with the digest's match
        ]
        ticket, _ = await fake.open("tenant-a", len(other))
        hello = HELLO + ticket.ticket.encode() + b"00\n"
        damaged = await asyncio.to_thread(
            raw_stream, fake.listener.port, hello, other, digest_of(other[1:]).encode()
        )
        assert damaged["status"] == 400
        await until(lambda: not kept.exists())  # its readers may still be at it: never reused
    finally:
        fake.listener.close()
    assert not [area for area in fake.areas if area is not None and area.exists()]


async def test_a_push_maps_one_area_however_many_lanes_connect_at_once(tmp_path: Path) -> None:
    """Its first lane takes the area, outside the listener's lock; the other
    lanes wait for it instead of mapping areas of their own."""
    fake = FakeServer(tmp_path, PushStreamConfig(idle_areas=4))
    try:
        data = os.urandom(4 * CHUNK_BYTES)
        for _ in range(2):
            await send((await fake.open("tenant-a", len(data), lanes=4))[0], data)
            assert fake.listener.idle_areas() == 1
        assert fake.areas[0] is not None and fake.areas[0] == fake.areas[1]
    finally:
        fake.listener.close()
