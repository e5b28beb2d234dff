"""Sending a push's weights over a server's push stream (``serve --push-stream-port``).

The HTTP route opens the push and answers a ticket
(:class:`~skyrl_lora.types.PushStreamTicket`); this module connects to the
ticket's port on the server's host and sends the ticket line, the weights
and their chunked digest (:mod:`skyrl_lora.chunk_digest`), hashing each chunk
on other threads while it is sent, then reads the one-line answer. It runs
on a thread with a blocking socket: the bytes go out in 8 MiB ``sendall``
calls, with no event-loop turn between them. See
``skyrl_lora.server.http.push_stream`` for the server's side and why.
"""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path
from urllib.parse import urlsplit

from skyrl_lora.chunk_digest import CHUNK_BYTES, ChunkedDigest
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
        with socket.create_connection((host, ticket.port), timeout=connect_timeout) as sock:
            sock.settimeout(timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                sock.sendall(PUSH_STREAM_HELLO + ticket.ticket.encode("ascii") + b"\n")
                digest = _send_weights(sock, weights)
                sock.sendall(digest.encode("ascii"))
            except OSError:  # refused part-way: the server's answer says why
                line = _read_line(sock)
                if not line:
                    raise
            else:
                line = _read_line(sock)
    except TimeoutError as exc:
        raise RequestTimeoutError(f"{where} timed out after {timeout} s") from exc
    except OSError as exc:
        raise ServerUnavailableError(f"{where} failed: {exc!r}") from exc
    try:
        answer = json.loads(line)
        status = int(answer["status"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ResponseFormatError(f"{where} answered {line[:200]!r}, not a push's answer") from exc
    if status >= 400:
        raise error_from_body(status, line.decode(errors="replace"), url)
    return json.dumps(answer.get("adapter")).encode()


def _send_weights(sock: socket.socket, weights: bytes | Path) -> str:
    """Send the weights chunk by chunk while other threads hash the chunks sent."""
    with ChunkedDigest() as digest:
        if isinstance(weights, Path):
            size = weights.stat().st_size
            with weights.open("rb", buffering=0) as file:
                for start in range(0, size, CHUNK_BYTES):
                    chunk = file.read(CHUNK_BYTES)
                    if len(chunk) != min(CHUNK_BYTES, size - start):
                        raise ValueError(f"{weights} shrank while it was being sent")
                    digest.add(chunk)
                    sock.sendall(chunk)
        else:
            view = memoryview(weights)
            for start in range(0, len(view), CHUNK_BYTES):
                chunk = view[start : start + CHUNK_BYTES]
                digest.add(chunk)
                sock.sendall(chunk)
        return digest.hexdigest()


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
