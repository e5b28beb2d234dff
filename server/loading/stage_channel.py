"""Stage requests to the workers beside the engine's step loop, not through it.

vLLM reaches its workers with ``collective_rpc``, a utility call that the
engine core serves between two steps. Under load a call therefore waits for
the step in progress: on an H100 a stage request waited 25-40 ms in the
0.8B RL run, and a step of the 8B model with 56 streams takes about 27 ms,
so one step boundary alone was most of a swap's budget.

A worker that shares the API server's host listens on a Unix socket in the
folder where it publishes stagings' statuses (:mod:`.staging`), on a thread
of its own that sleeps in ``accept``/``recv`` (the GIL released). The API
server writes one JSON line per stage request; the worker thread hands it
to the staging thread at once. Nothing is answered on the socket: the
statuses come back as files, as before. A worker without the socket (on
another host), or a socket that fails, is reached by ``collective_rpc``.

A request may carry open file descriptors (``SCM_RIGHTS``): a path load
sends the adapter's weights file, opened and checked by the API server, so
the worker reads the file itself and writes the version's snapshot from
what it read, after the swap (:mod:`.registry`, :mod:`.staged_buffer`). The
line says how many it carries (``"fds"``); the kernel delivers them with
the line's first bytes, so the reader queues them and hands each line its own.

The folder is the API server's private ``mkdtemp`` folder (mode 0700), so
only the server's own user can connect.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

logger = logging.getLogger("vllm.skyrl_lora.stage_channel")

#: The longest request line a listener takes (a request is a few hundred bytes).
MAX_LINE_BYTES = 1 << 16
#: The most descriptors one read takes with it (a request sends one or none).
MAX_FDS_PER_READ = 16


def socket_path(folder: Path, worker: str) -> Path:
    """Where ``worker`` listens in ``folder``."""
    return folder / f"{worker}.sock"


class StageListener:
    """A worker's end: one thread that passes each request line to ``handle``,
    with the descriptors that came with it (``handle`` owns them, even when it raises)."""

    def __init__(self, path: Path, handle: Callable[[dict[str, Any], list[int]], None]) -> None:
        self.path = path
        self._handle = handle
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(str(path))
        os.chmod(path, 0o600)
        self._server.listen(8)
        self._connections: set[socket.socket] = set()
        self._thread = threading.Thread(
            target=self._serve, name="skyrl-lora-stage-listener", daemon=True
        )
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                connection, _ = self._server.accept()
            except OSError:  # closed
                return
            self._connections.add(connection)
            threading.Thread(
                target=self._read, args=(connection,), name="skyrl-lora-stage-reader", daemon=True
            ).start()

    def _read(self, connection: socket.socket) -> None:
        pending = b""
        fds: list[int] = []  # arrived, not yet claimed by a line
        try:
            with connection:
                while True:
                    data, received, _, _ = socket.recv_fds(
                        connection, MAX_LINE_BYTES, MAX_FDS_PER_READ
                    )
                    if not data:
                        return
                    fds.extend(received)
                    pending += data
                    *lines, pending = pending.split(b"\n")
                    if len(pending) > MAX_LINE_BYTES:
                        logger.error("skyrl-lora stage channel: a request line is too long")
                        return
                    for line in lines:
                        self._take(line, fds)
        except OSError:  # closed under it
            pass
        finally:
            for fd in fds:  # sent with a line that never came whole
                os.close(fd)
            self._connections.discard(connection)

    def _take(self, line: bytes, fds: list[int]) -> None:
        """Hand one request to ``handle`` with the descriptors it says it carries."""
        try:
            message = json.loads(line)
            count = max(0, int(message.get("fds", 0)))
        except Exception:  # one bad request must not end the channel
            logger.exception("skyrl-lora could not read a stage request")
            for fd in fds:  # whose they are is no longer known
                os.close(fd)
            fds.clear()
            return
        mine = fds[:count]
        del fds[:count]
        try:
            self._handle(message, mine)
        except Exception:  # the handler closed what it was given
            logger.exception("skyrl-lora could not take a stage request")

    def close(self) -> None:
        """Stop listening and end every connection (their writers then fail)."""
        for sock in (self._server, *list(self._connections)):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


class StageChannel:
    """The API server's end: one connection per worker, written to in order."""

    def __init__(self, paths: list[Path]) -> None:
        self._connections = []
        try:
            for path in paths:
                connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self._connections.append(connection)
                connection.connect(str(path))
        except OSError:
            self.close()
            raise

    @property
    def open(self) -> bool:
        return bool(self._connections)

    def send(self, request: dict[str, Any], fds: tuple[int, ...] = ()) -> bool:
        """Write ``request`` to every worker, with a copy of each of ``fds``
        (the caller keeps its own); False (and the channel closed) if any
        write failed: the caller then asks by RPC.

        A line of a few hundred bytes into a local socket's buffer does not
        block; a worker may then get the same request twice (once here, once
        by RPC), which stages the same version again, harmlessly.
        """
        line = json.dumps({**request, "fds": len(fds)} if fds else request).encode() + b"\n"
        try:
            for connection in self._connections:
                if fds:
                    sent = socket.send_fds(connection, [line], list(fds))
                    if sent < len(line):
                        connection.sendall(line[sent:])
                else:
                    connection.sendall(line)
        except OSError as exc:
            logger.warning("skyrl-lora stage channel failed, staging by RPC: %s", exc)
            self.close()
            return False
        return bool(self._connections)

    def close(self) -> None:
        for connection in self._connections:
            connection.close()
        self._connections = []
