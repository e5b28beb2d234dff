"""Sending a push's weights over a server's push stream (on unless ``serve --no-push-stream``).

The HTTP route opens the push and answers a ticket
(:class:`~skyrl_lora.types.PushStreamTicket`); this module connects to the
ticket's port on the server's host, once per lane the ticket grants, and
sends on each the ticket line, the lane's chunks and the whole file's
chunked digest (:mod:`skyrl_lora.chunk_digest`), hashing each chunk on other
threads while it is sent, then reads the one-line answer. Each lane runs
on a thread with a blocking socket: the bytes go out in 8 MiB ``sendall``
calls, with no event-loop turn between them. See
``skyrl_lora.server.http.push_stream`` for the server's side and why.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import socket
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from skyrl_lora.chunk_digest import ChunkedDigest, chunk_span, lane_chunks
from skyrl_lora.client.push import weights_size
from skyrl_lora.client.transport import error_from_body
from skyrl_lora.errors import RequestTimeoutError, ResponseFormatError, ServerUnavailableError
from skyrl_lora.types import PUSH_STREAM_HELLO, PushStreamTicket

#: The answer is one JSON line; anything longer is not one.
MAX_ANSWER_BYTES = 1 << 20


async def stream_weights(
    url: str,
    ticket: PushStreamTicket,
    weights: bytes | Path,
    *,
    timeout: float,
    connect_timeout: float,
) -> bytes:
    """Send the weights of an opened push to the server at ``url``; returns the
    answer's adapter (an ``AdapterInfo`` as JSON bytes) or raises its typed error."""
    host = urlsplit(url).hostname or "127.0.0.1"
    return await asyncio.to_thread(_stream, url, host, ticket, weights, timeout, connect_timeout)


def _stream(
    url: str,
    host: str,
    ticket: PushStreamTicket,
    weights: bytes | Path,
    timeout: float,
    connect_timeout: float,
) -> bytes:
    where = f"push stream {host}:{ticket.port} of {url}"
    try:
        with contextlib.ExitStack() as stack:
            lanes = [
                stack.enter_context(
                    socket.create_connection((host, ticket.port), timeout=connect_timeout)
                )
                for _ in range(ticket.lanes)
            ]
            lines = _send_lanes(lanes, ticket, weights, timeout)
    except TimeoutError as exc:
        raise RequestTimeoutError(f"{where} timed out after {timeout} s") from exc
    except OSError as exc:
        raise ServerUnavailableError(f"{where} failed: {exc!r}") from exc
    answers = [_parsed_answer(line, where) for line in lines if line]
    for status, _, line in answers:
        if status >= 400:
            raise error_from_body(status, line.decode(errors="replace"), url)
    if len(answers) < len(lines):
        raise ServerUnavailableError(f"{where}: a lane was cut off with no answer")
    return json.dumps(answers[0][1].get("adapter")).encode()


def _send_lanes(
    lanes: list[socket.socket], ticket: PushStreamTicket, weights: bytes | Path, timeout: float
) -> list[bytes]:
    """Send every lane's chunks at once, a thread each; each lane's answer line
    (empty where a lane was cut off before the server said why)."""
    total = weights_size(weights)
    all_sent = threading.Barrier(len(lanes))
    with (
        ChunkedDigest(total_bytes=total) as digest,
        ThreadPoolExecutor(len(lanes), thread_name_prefix="skyrl-push-lane") as pool,
    ):

        def send(lane: int) -> bytes:
            sock = lanes[lane]
            sock.settimeout(timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                sock.sendall(PUSH_STREAM_HELLO + f"{ticket.ticket}{lane:02x}\n".encode("ascii"))
                _send_chunks(sock, weights, lane, len(lanes), total, digest)
                all_sent.wait()  # every chunk is added: the digest can be waited for
                sock.sendall(digest.hexdigest().encode("ascii"))
            except (OSError, threading.BrokenBarrierError):  # the server's answer says why
                all_sent.abort()
                try:
                    return _read_line(sock)
                except OSError:
                    return b""
            except BaseException:  # ours (the file shrank): stop every lane now
                all_sent.abort()
                for other in lanes:
                    with contextlib.suppress(OSError):
                        other.shutdown(socket.SHUT_RDWR)
                raise
            return _read_line(sock)

        return list(pool.map(send, range(len(lanes))))


def _send_chunks(
    sock: socket.socket,
    weights: bytes | Path,
    lane: int,
    lanes: int,
    total: int,
    digest: ChunkedDigest,
) -> None:
    """Send one lane's chunks while other threads hash them.

    A file's chunks go with ``sendfile``: the kernel moves them from the
    page cache to the socket, and this process never copies them (a read
    into memory and a send were each a copy of the whole file on the lanes'
    threads). The hashing threads read their own copy of each chunk beside
    the send (:meth:`ChunkedDigest.add_read`). The file must stay as it is
    until the push is answered, as before: a chunk changed between its
    hash's read and its send fails the server's digest check."""
    if not isinstance(weights, Path):
        view = memoryview(weights)
        for index in lane_chunks(lane, lanes, total):
            start, length = chunk_span(index, total)
            chunk = view[start : start + length]
            digest.add(chunk, index)
            sock.sendall(chunk)
        return
    with weights.open("rb", buffering=0) as file:
        fd = file.fileno()
        reads: list[Future[bytes]] = []
        try:
            for index in lane_chunks(lane, lanes, total):
                start, length = chunk_span(index, total)
                read = functools.partial(_read_whole, weights, fd, start, length)
                reads.append(digest.add_read(index, read))
                if sock.sendfile(file, start, length) != length:
                    raise ValueError(f"{weights} shrank while it was being sent")
        finally:
            wait(reads)  # they read through this file: it stays open for them


def _read_whole(path: Path, fd: int, start: int, length: int) -> bytes:
    """A chunk of the file for its hash. Any failure is the file's, not the
    stream's: a ValueError, so that the lanes stop at once instead of
    waiting for the server's answer (:func:`_send_lanes`)."""
    try:
        chunk = os.pread(fd, length, start)
    except OSError as exc:
        raise ValueError(f"{path} could not be read while it was being sent: {exc}") from exc
    if len(chunk) != length:
        raise ValueError(f"{path} shrank while it was being sent")
    return chunk


def _parsed_answer(line: bytes, where: str) -> tuple[int, dict[str, Any], bytes]:
    try:
        answer = json.loads(line)
        return int(answer["status"]), answer, line
    except (ValueError, KeyError, TypeError) as exc:
        raise ResponseFormatError(f"{where} answered {line[:200]!r}, not a push's answer") from exc


def _read_line(sock: socket.socket) -> bytes:
    received = bytearray()
    while not received.endswith(b"\n"):
        piece = sock.recv(65536)
        if not piece:
            break
        received += piece
        if len(received) > MAX_ANSWER_BYTES:
            break
    return bytes(received).strip()
