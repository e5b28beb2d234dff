"""The push stream's listener in a process of its own (``serve --push-stream-port``).

Why: the API server's event loop streams every tenant's tokens. With the
listener's threads in that process, a push's lanes and hashers took the
GIL between their reads and that loop waited for it. With 32 tenants on
the 8B model (H100, main 93f1e70, 2026-11-27) it stalled 151-258 ms in each
4-s window in which one tenant pushed rank-64 weights (0-30 ms in windows
where it loaded them by path). On the 2-core CPU machine the loop, while
late, was in none of this package's code (main a1d3517): it waited for the
GIL or for a core.

What it changed, on one H100 machine (main e2ba6a6, 2026-11-27; servers
in their own process, in the API server's, in their own again;
``benchmarks.scale``, 8B, rank 64, one tenant pushing once a second): the
API loop's stalls per push window fell from 147 ms (123-200) to 72
(0-112) at 32 tenants, and from 45 (23-59) to 16 (0-32) at 8. The other
tenants' longest gap between two tokens while a tenant pushes did not
fall (32 tenants: 63.5 and 61.2 ms against 65.7; 8: 49.8 and 49.7 against
39.8), nor did the push's swap (under load 94 and 99 ms against 101). So
that gap is not the API loop's: it coincides with an engine step two to
three times as long as the others, while the bytes move (see
docs/gpu.md, "The push stream in a process of its own").

How: a child process (``python -m skyrl_lora.server.http.push_stream_process``)
runs the same :class:`~.push_stream.PushStreamListener` (the port, the
tickets, the receive areas, the lanes and the hashes) and nothing else.
What needs the engine stays here: a push's load runs on this event loop as
it would in one process, with a :class:`~.push_assembly.Receipt` that the
child's messages settle. The two talk over one Unix socket pair in pickled
frames (both ends are this package, so nothing else can write to it):

- here to there: ``open`` (an :class:`~.push_assembly.OpenedPush`; the
  answer is ``opened``, a ticket or an error), and ``done`` (a load's
  answer, which the child gives every lane);
- there to here: ``ready`` (the port), ``start`` (a push's first lane came:
  its weights file, which this side opens to hand the engine), ``head``,
  ``digest`` and ``failed`` (its receipt), and ``log`` (the child's log
  records, logged here by the same loggers, so that its
  ``push_stream_received`` events are in the server's log as before).

A child that exits fails every push in flight, with a message that says so,
and a push opened after it is refused as by a server without a push stream
(422 ``push_stream_unavailable``), so the client sends its weights in the
HTTP body instead; the server's other routes go on.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
import os
import pickle
import socket
import struct
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from skyrl_lora.errors import (
    InternalServerError,
    PushStreamUnavailableError,
    ServerError,
    error_class_for,
)
from skyrl_lora.types import AdapterInfo, PushStreamTicket

from .push_assembly import Finish, OpenedPush, Receipt, error_reply
from .push_stream import PushStreamConfig, PushStreamListener

logger = logging.getLogger(__name__)

_LENGTH = struct.Struct("!I")
#: How long the child may take to import and bind its port.
START_TIMEOUT_S = 60.0
#: How long the child may take to close once its socket pair is closed.
STOP_TIMEOUT_S = 5.0
#: How much lower the child's CPU priority is than the server's (``nice``;
#: ``serve --push-stream-nice``). Above 0, where a push's byte movers (its
#: lanes, its hashers, the trainer's senders) outnumber the host's free
#: cores, the engine's and the API server's threads run first and the bytes
#: arrive later. 0 by default: an A/B of 0 against 10 on the H100 (8B model,
#: 8 tenants, main 6c8ba2b, 2026-11-27) ran on a machine whose gaps without
#: any swap were twice those of the others that day, and told nothing.
NICE = 0


def _frame(message: tuple[Any, ...]) -> bytes:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(body)) + body


async def _read_frame(reader: asyncio.StreamReader) -> tuple[Any, ...] | None:
    """The next message, or None once the other side closed."""
    try:
        (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
        message: tuple[Any, ...] = pickle.loads(await reader.readexactly(length))
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    return message


def error_from_reply(reply: dict[str, Any]) -> ServerError:
    """The typed error of an :func:`~.push_assembly.error_reply`."""
    error = reply["error"]
    status = int(reply["status"])
    return error_class_for(status, error["type"])(str(error["message"]), status=status)


class PushStreamProcess:
    """The API server's side: opens pushes in the child and loads them here.

    Same surface as :class:`~.push_stream.PushStreamListener` (``port``,
    ``open``, ``close``); start it with :meth:`start`.
    """

    def __init__(
        self,
        process: subprocess.Popen[bytes],
        sock: socket.socket,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        port: int,
        finish: Finish,
    ) -> None:
        self.port = port
        self._process = process
        self._sock = sock
        self._reader = reader
        self._writer = writer
        self._finish = finish
        self._calls = itertools.count()
        self._opening: dict[int, asyncio.Future[PushStreamTicket]] = {}
        self._receipts: dict[int, Receipt] = {}
        self._loads: set[asyncio.Task[None]] = set()
        self._gone: str | None = None  # why no push can be opened any more
        self._pump = asyncio.create_task(self._receive())

    @classmethod
    async def start(
        cls,
        host: str | None,
        port: int,
        finish: Finish,
        config: PushStreamConfig | None = None,
        nice: int = NICE,
    ) -> PushStreamProcess:
        """Start the child, ``nice`` steps below this process's CPU priority,
        and return once it listens on its port."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        command = [
            sys.executable,
            "-m",
            __name__,
            "--fd",
            str(theirs.fileno()),
            "--host",
            host or "",
            "--port",
            str(port),
            "--config",
            json.dumps(dataclasses.asdict(config or PushStreamConfig())),
            "--nice",
            str(nice),
        ]
        try:
            process = await asyncio.to_thread(
                subprocess.Popen, command, pass_fds=(theirs.fileno(),)
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        reader, writer = await asyncio.open_unix_connection(sock=ours)
        try:
            ready = await asyncio.wait_for(_read_frame(reader), START_TIMEOUT_S)
        except BaseException:
            writer.close()
            _stop(process)
            raise
        if ready is None or ready[0] != "ready":
            writer.close()
            _stop(process)
            raise RuntimeError(
                f"the push stream process did not start (exit code {process.returncode}; "
                "its error is on the server's standard error)"
            )
        return cls(process, ours, reader, writer, int(ready[1]), finish)

    async def open(self, push: OpenedPush) -> PushStreamTicket:
        """A ticket for ``push``, whose folder the child owns from now on."""
        if self._gone is not None:
            raise PushStreamUnavailableError(f"{self._gone}: push in the HTTP body")
        call = next(self._calls)
        answer: asyncio.Future[PushStreamTicket] = asyncio.get_running_loop().create_future()
        self._opening[call] = answer
        try:
            self._send(("open", call, push))
            return await answer
        finally:
            self._opening.pop(call, None)

    def close(self) -> None:
        """Close the socket pair (the child then closes its listener and exits)."""
        self._gone = self._gone or "the server is shutting down"
        self._pump.cancel()
        with contextlib.suppress(OSError):  # now: the transport would close it on a later turn
            self._sock.shutdown(socket.SHUT_RDWR)
        self._writer.close()
        _stop(self._process)

    # -- the child's messages ---------------------------------------------
    def _send(self, message: tuple[Any, ...]) -> None:
        self._writer.write(_frame(message))

    async def _receive(self) -> None:
        try:
            while (message := await _read_frame(self._reader)) is not None:
                try:
                    self._handle(message)
                except Exception:  # one bad message must not end the others
                    logger.exception("push stream process: message %r failed", message[:2])
        finally:
            self._child_gone()

    def _handle(self, message: tuple[Any, ...]) -> None:
        kind, key, *rest = message
        if kind == "log":
            name, level, line = key, *rest
            logging.getLogger(name).log(level, "%s", line)
        elif kind == "opened":
            answer = self._opening.get(key)
            if answer is not None and not answer.done():
                (ticket,) = rest
                if isinstance(ticket, PushStreamTicket):
                    answer.set_result(ticket)
                else:
                    answer.set_exception(error_from_reply(ticket))
        elif kind == "start":
            push, weights, in_area = rest
            self._start_load(key, push, Path(weights), in_area)
        elif kind in ("head", "digest", "failed"):
            receipt = self._receipts.get(key)
            if receipt is None:  # its load answered first (it failed early): sent meanwhile
                return
            if kind == "head":
                receipt.head_written(rest[0])
            elif kind == "digest":
                receipt.received(rest[0])
            else:
                receipt.failed(error_from_reply(rest[0]))
        else:
            logger.error("push stream process: unknown message %r", kind)

    def _start_load(self, key: int, push: OpenedPush, weights: Path, in_area: bool) -> None:
        """The push's first lane came: load it as an in-process push is
        loaded. A push received into an area is handed to the engine by a
        descriptor this side opens (the area's own is the child's)."""
        try:
            fd = os.open(weights, os.O_RDWR) if in_area else None
        except OSError as exc:  # answered, or the child's lanes would wait for it
            logger.error("push stream: cannot open its receive area %s: %s", weights, exc)
            self._send(("done", key, error_reply(InternalServerError(f"the push's area: {exc}"))))
            return
        receipt = Receipt(weights, fd)
        self._receipts[key] = receipt

        async def load() -> None:
            try:
                info = await self._finish(push, receipt)
                reply: dict[str, Any] = {"status": 200, "adapter": info.model_dump()}
            except ServerError as exc:
                reply = error_reply(exc)
            except Exception as exc:  # answered, not lost: the trainer sees why
                logger.exception("push stream's load failed")
                reply = error_reply(InternalServerError(f"the push stream's load failed: {exc!r}"))
            finally:
                del self._receipts[key]
                if fd is not None:
                    os.close(fd)
            if self._gone is None:
                self._send(("done", key, reply))

        task = asyncio.get_running_loop().create_task(load())
        self._loads.add(task)
        task.add_done_callback(self._loads.discard)

    def _child_gone(self) -> None:
        """Fail what the child can no longer finish; refuse what comes next."""
        if self._gone is None:
            self._gone = f"the push stream process exited (code {self._process.poll()})"
            logger.error("%s: pushes by stream are refused from now on", self._gone)
        for receipt in self._receipts.values():
            receipt.failed(InternalServerError(self._gone))
        for answer in self._opening.values():
            if not answer.done():
                answer.set_exception(PushStreamUnavailableError(self._gone))


#: What a server takes streamed pushes with: the listener in a process of
#: its own (the default), or in the API server's (``--push-stream-in-process``).
PushStream = PushStreamProcess | PushStreamListener


def _stop(process: subprocess.Popen[bytes]) -> None:
    try:
        process.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


# -- the child --------------------------------------------------------------
class _Parent:
    """The child's side of the socket pair: frames out from any thread
    (lanes log from theirs), frames in on the child's event loop."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._lock = threading.Lock()
        self._keys = itertools.count()
        self._done: dict[int, asyncio.Future[dict[str, Any]]] = {}

    def send(self, message: tuple[Any, ...]) -> None:
        frame = _frame(message)
        with self._lock, contextlib.suppress(OSError):  # the parent is gone: it exits
            self._sock.sendall(frame)

    async def finish(self, push: OpenedPush, receipt: Receipt) -> AdapterInfo:
        """The listener's load: the parent's, told of the receipt as it settles."""
        key = next(self._keys)
        done: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._done[key] = done
        in_area = receipt.weights_fd is not None
        self.send(("start", key, push, str(receipt.weights), in_area))
        forwarding = asyncio.ensure_future(self._forward(key, receipt))
        try:
            reply = await done  # the load may answer before every byte came
        finally:
            forwarding.cancel()
            del self._done[key]
        if reply["status"] != 200:
            raise error_from_reply(reply)
        return AdapterInfo.model_validate(reply["adapter"])

    async def _forward(self, key: int, receipt: Receipt) -> None:
        try:
            self.send(("head", key, await receipt.head()))
            self.send(("digest", key, await receipt.digest()))
        except ServerError as exc:
            self.send(("failed", key, error_reply(exc)))

    def settle(self, key: int, reply: dict[str, Any]) -> None:
        done = self._done.get(key)
        if done is not None and not done.done():
            done.set_result(reply)


class _ToParent(logging.Handler):
    """Sends the child's log records to the API server, whose loggers log them."""

    def __init__(self, parent: _Parent) -> None:
        super().__init__()
        self._parent = parent
        self.setFormatter(logging.Formatter("%(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._parent.send(("log", record.name, record.levelno, self.format(record)))
        except Exception:
            self.handleError(record)


async def _serve_child(sock: socket.socket, host: str | None, port: int, config: Any) -> None:
    parent = _Parent(sock)
    root = logging.getLogger()
    root.handlers[:] = [_ToParent(parent)]
    root.setLevel(logging.INFO)
    loop = asyncio.get_running_loop()
    listener = PushStreamListener(host, port, parent.finish, loop, config)
    parent.send(("ready", listener.port))
    frames = sock.makefile("rb")  # read on a thread: sends stay blocking ones
    try:
        while (message := await asyncio.to_thread(_read_frame_blocking, frames)) is not None:
            kind, key, *rest = message
            if kind == "open":
                try:
                    ticket: PushStreamTicket | dict[str, Any] = await listener.open(rest[0])
                except ServerError as exc:
                    ticket = error_reply(exc)
                parent.send(("opened", key, ticket))
            elif kind == "done":
                parent.settle(key, rest[0])
    finally:
        listener.close()


def _read_frame_blocking(frames: Any) -> tuple[Any, ...] | None:
    """The parent's next message, or None once it closed its end."""
    head = frames.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        return None
    (length,) = _LENGTH.unpack(head)
    body = frames.read(length)
    if len(body) < length:
        return None
    message: tuple[Any, ...] = pickle.loads(body)
    return message


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fd", type=int, required=True, help="the socket pair's end")
    parser.add_argument("--host", default="")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--config", default="{}", help="PushStreamConfig's fields, as JSON")
    parser.add_argument("--nice", type=int, default=NICE, help="steps below the server's priority")
    args = parser.parse_args(argv)
    if args.nice:
        os.nice(args.nice)
    sock = socket.socket(fileno=args.fd)
    sock.setblocking(True)
    config = PushStreamConfig(**json.loads(args.config))
    asyncio.run(_serve_child(sock, args.host or None, args.port, config))


if __name__ == "__main__":
    main()
