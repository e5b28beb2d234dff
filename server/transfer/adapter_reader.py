"""Read adapters in a process of their own, off the engine process's GIL.

Staging (:mod:`skyrl_lora.server.loading.staging`) moved vLLM's adapter load out of
the step loop onto a thread, but a thread of the engine process: while it
reads safetensors, parses 224 tensor names, converts dtypes and pins 224
host tensors one by one, it holds the GIL in thousands of short turns, and
every turn it takes is one the step loop waits for. On an H100 under load a
rank-16 read took 35-77 ms instead of 20, and stretched the other tenants'
steps as long.

:class:`AdapterReader` runs vLLM's own ``LoRAModel.from_local_checkpoint``
in a child process, with the very arguments the worker's loader passed (so
validation and layout stay exactly vLLM's), folds each layer's scaling into
B there, and hands the model back through :mod:`skyrl_lora.server.transfer.tensor_pickle`:
the object graph over a socket, the tensors in one file in shared memory,
read by the engine process in one call into one (pinned) buffer. What is
left in the engine process is that read, a few hundred tensor views, and
vLLM's packing, which now has nothing to compute.

It is opt-in (``serve --adapter-reader``). The hand-over costs two copies of
the adapter (into shared memory, then into the engine's buffer) that the
in-process read does not make. On an H100 under the perf test's load the
pack fell from 22 to 3 ms and the engine process's read became a wait on the
socket plus one buffer read (17 ms at the median, all of it together), but the
idle swap grew from 53 to 93 ms (rank 64: 91 to 200 ms), while the other
tenants' token gaps moved by less than the difference between two machines.

The child is a plain ``subprocess`` (vLLM's workers may be daemonic
processes, which ``multiprocessing`` forbids to have children). It exits
when its socket closes, so it never outlives the engine. Should it die or
refuse a request it cannot take, the load runs in the engine process as
before: a reader is an optimisation, never a new way to fail.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import os
import pickle
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from .. import compat
from ..adapters import arrival
from ..adapters.scale_fold import multiply_in_place
from . import tensor_pickle

logger = logging.getLogger("vllm.skyrl_lora.reader")


#: The child's tensor work is a few hundred small ops (dtype casts, the
#: scaling fold). With torch's default of a thread per core, each op waits
#: for a thread team to assemble on cores the engine and its clients keep
#: busy: on a loaded 16-core H100 host a rank-16 read took 66-350 ms that
#: way, and 25-52 ms of the child's time on one thread.
_ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@dataclass(frozen=True)
class ReadTimes:
    """One read through the reader, in ms: all of it, and the child's part."""

    total_ms: float
    child_ms: float


class ReaderUnavailable(Exception):
    """The reader cannot take this load (gone, or its arguments do not travel)."""


def _buffer_dir() -> str | None:
    """Shared memory where there is some: the file is written and read once, never synced."""
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None


class AdapterReader:
    """The engine process's end of one reader child process."""

    def __init__(self, pin_memory: bool) -> None:
        self._allocate = tensor_pickle.host_buffers(pin_memory)
        self._lock = threading.Lock()
        self._dir = tempfile.mkdtemp(prefix="skyrl-lora-reader-", dir=_buffer_dir())
        self._names = itertools.count()
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        env["CUDA_VISIBLE_DEVICES"] = ""  # the child must never take a CUDA context
        env.update(_ONE_THREAD)
        self._process = subprocess.Popen(
            [sys.executable, "-m", __name__, str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            env=env,
            stdin=subprocess.DEVNULL,
        )
        theirs.close()
        self._connection: Connection | None = Connection(ours.detach())
        #: The child has imported vLLM's loader (it says so once, seconds after its start).
        self._ready = False
        #: Set once the child is gone: every later load runs in the engine process.
        self.failure: str | None = None
        atexit.register(self.close)  # the child goes on its own; its folder does not

    @property
    def alive(self) -> bool:
        return self.failure is None

    def read(self, loader: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, float]:
        """``loader.from_local_checkpoint(*args, **kwargs)``, run in the child.

        Returns the model and the milliseconds the child spent on it.
        Raises :class:`ReaderUnavailable` when the caller should load in
        process instead; any error of the load itself is raised as it was.
        """
        path = os.path.join(self._dir, f"{next(self._names)}.bin")
        try:
            request = pickle.dumps((loader, args, kwargs, path), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # an argument that does not pickle
            raise ReaderUnavailable(f"the load's arguments do not pickle: {exc}") from exc
        try:
            with self._lock:
                if self._connection is None:
                    raise ReaderUnavailable(self.failure or "closed")
                try:
                    if not self._ready:
                        if not self._connection.poll(0):
                            raise ReaderUnavailable("the reader process is still starting")
                        self._ready = pickle.loads(self._connection.recv_bytes()) == ("ready",)
                    self._connection.send_bytes(request)
                    reply = pickle.loads(self._connection.recv_bytes())
                except (OSError, EOFError, pickle.UnpicklingError) as exc:
                    self._fail(f"the reader process is gone: {exc!r}")
                    raise ReaderUnavailable(self.failure) from exc
            if reply[0] == "error":
                raise reply[1]
            _, skeleton, nbytes, child_ms = reply
            buffer = tensor_pickle.read_buffer(path, nbytes, self._allocate)
            return tensor_pickle.load(skeleton, buffer), child_ms
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def _fail(self, why: str) -> None:
        logger.warning("skyrl-lora adapter reader off, loads run in the engine process: %s", why)
        self.failure = why
        self.close()

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None
        with contextlib.suppress(Exception):
            self._process.wait(timeout=5)
        if self._process.poll() is None:
            self._process.kill()
        shutil.rmtree(self._dir, ignore_errors=True)


class ReaderRoutedLoader:
    """Stands in for vLLM's ``LoRAModel`` class in the worker's LoRA manager.

    ``from_local_checkpoint`` goes to the reader when ``route`` says so (on
    the staging thread) and to vLLM's class otherwise (a load in the step
    loop must not queue behind a staging's read). Everything else is the
    class's own.
    """

    def __init__(self, model_cls: Any, reader: AdapterReader, route: Callable[[], bool]) -> None:
        self._model_cls = model_cls
        self._reader = reader
        self._route = route
        #: The last routed read's times; None where it ran in this process.
        self.last_read: ReadTimes | None = None

    def from_local_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        routed = self._route()
        if routed:
            self.last_read = None
        lora_dir = kwargs.get("lora_dir", args[0] if args else None)
        if routed and lora_dir is not None and arrival.arriving(lora_dir):
            routed = False  # read here, following the bytes; the child would wait for all
        if routed and self._reader.alive:
            started = time.perf_counter()
            try:
                model, child_ms = self._reader.read(self._model_cls, args, kwargs)
            except ReaderUnavailable as exc:
                logger.info("skyrl-lora reads this adapter in the engine process: %s", exc)
            else:
                self.last_read = ReadTimes((time.perf_counter() - started) * 1000, child_ms)
                return model
        return self._model_cls.from_local_checkpoint(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model_cls, name)


def _serve(connection: Connection) -> None:
    """The child's loop: one load per request, until the engine closes the socket."""
    import torch

    torch.set_num_threads(1)
    compat.disable_lora_pinning()
    connection.send_bytes(pickle.dumps(("ready",)))
    while True:
        try:
            request = connection.recv_bytes()
        except (EOFError, OSError):
            return
        started = time.perf_counter()
        try:
            loader, args, kwargs, path = pickle.loads(request)
            model = loader.from_local_checkpoint(*args, **kwargs)
            compat.fold_lora_scalings(model, multiply_in_place)  # on the host: no GPU here
            with open(path, "wb") as data:
                skeleton, nbytes = tensor_pickle.dump(model, data)
            reply: tuple[Any, ...] = ("ok", skeleton, nbytes, _ms_since(started))
        except Exception as exc:
            reply = ("error", _travelling(exc))
        connection.send_bytes(pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))


def _ms_since(started: float) -> float:
    return round((time.perf_counter() - started) * 1000, 2)


def _travelling(exc: Exception) -> Exception:
    """``exc`` if it survives pickling, else a RuntimeError with its words."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


if __name__ == "__main__":
    _serve(Connection(int(sys.argv[1])))
