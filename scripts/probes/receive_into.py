"""Where a streamed push's lanes can put their bytes, timed on the host alone.

``python scripts/probes/receive_into.py [--lanes 4] [--tries 4]`` sends 336 MB
over ``--lanes`` loopback TCP connections, each carrying every
``lanes``-th 8 MiB chunk as the push stream's lanes do, and times the
receive into each destination (interleaved tries, ms):

- ``pwrite``: a reused buffer per chunk, written at its offset into one
  file by a writer thread per lane (the push stream at main 072c8e3,
  without the hashing);
- ``parts``: the same, a file per lane;
- ``mmap``: ``recv_into`` a shared map of the file (made full size with
  ``ftruncate``), so the kernel copies each byte once, into the page cache;
- ``mmap_falloc``: the same after ``fallocate``;
- ``shm_reused``: ``recv_into`` a map of one ``/dev/shm`` file kept and
  touched before the first try (a reused, resident receive area);
- ``memory``: ``recv_into`` anonymous memory touched before (the floor).

File modes run in ``$HOME`` and in ``/dev/shm``. Pure standard library:
it runs on a GPU machine with nothing installed.
"""

from __future__ import annotations

import argparse
import mmap
import os
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

TOTAL = 336 << 20
CHUNK = 8 << 20
CHUNKS = TOTAL // CHUNK
DATA = bytes(os.urandom(1 << 20)) * (TOTAL >> 20)

#: A lane's sink: (lane, chunk index, the connection) -> None, once the chunk is in.
Sink = Callable[[int, int, socket.socket], None]


def recv_exactly(conn: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if not n:
            raise ConnectionError("short stream")
        got += n


def run_lanes(lanes: int, sink: Sink) -> float:
    """Seconds to move every chunk over ``lanes`` connections into ``sink``."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def send(lane: int) -> None:
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(lane.to_bytes(1, "little"))
            for index in range(lane, CHUNKS, lanes):
                sock.sendall(memoryview(DATA)[index * CHUNK : (index + 1) * CHUNK])

    def receive(conn: socket.socket) -> None:
        with conn:
            lane = conn.recv(1)[0]
            for index in range(lane, CHUNKS, lanes):
                sink(lane, index, conn)

    started = time.perf_counter()
    senders = [threading.Thread(target=send, args=(lane,)) for lane in range(lanes)]
    for sender in senders:
        sender.start()
    readers = []
    for _ in range(lanes):
        conn, _ = server.accept()
        readers.append(threading.Thread(target=receive, args=(conn,)))
        readers[-1].start()
    for thread in senders + readers:
        thread.join()
    server.close()
    return time.perf_counter() - started


def buffered(lanes: int, fds: list[int]) -> float:
    """Reused buffers, a writer thread per lane, ``fds[lane % len(fds)]``."""
    writers = [ThreadPoolExecutor(1) for _ in range(lanes)]
    pending: list[list[tuple[bytearray, Future[None]]]] = [[] for _ in range(lanes)]

    def write(fd: int, view: memoryview, offset: int) -> None:
        while view:
            n = os.pwrite(fd, view, offset)
            view, offset = view[n:], offset + n

    def sink(lane: int, index: int, conn: socket.socket) -> None:
        mine = pending[lane]
        buffer = mine.pop(0)[0] if len(mine) >= 2 else bytearray(CHUNK)
        if len(mine) >= 2:
            mine[0][1].result()
        recv_exactly(conn, memoryview(buffer))
        fd = fds[lane % len(fds)]
        offset = index * CHUNK if len(fds) == 1 else (index // lanes) * CHUNK
        mine.append((buffer, writers[lane].submit(write, fd, memoryview(buffer), offset)))

    try:
        took = run_lanes(lanes, sink)
        started = time.perf_counter()
        for mine in pending:
            for _, done in mine:
                done.result()
        return took + (time.perf_counter() - started)
    finally:
        for writer in writers:
            writer.shutdown()


def mapped(lanes: int, area: mmap.mmap) -> float:
    view = memoryview(area)

    def sink(lane: int, index: int, conn: socket.socket) -> None:
        recv_exactly(conn, view[index * CHUNK : (index + 1) * CHUNK])

    try:
        return run_lanes(lanes, sink)
    finally:
        view.release()


def file_mode(mode: str, lanes: int, root: str) -> float:
    folder = tempfile.mkdtemp(dir=root)
    names = [f"part{i}" for i in range(lanes)] if mode == "parts" else ["weights"]
    fds = [os.open(os.path.join(folder, n), os.O_RDWR | os.O_CREAT, 0o600) for n in names]
    try:
        started = time.perf_counter()  # the map's setup counts too
        if mode in ("pwrite", "parts"):
            buffered(lanes, fds)
        else:
            if mode == "mmap_falloc":
                os.posix_fallocate(fds[0], 0, TOTAL)
            os.ftruncate(fds[0], TOTAL)
            with mmap.mmap(fds[0], TOTAL, flags=mmap.MAP_SHARED) as area:
                mapped(lanes, area)
        return time.perf_counter() - started
    finally:
        for fd in fds:
            os.close(fd)
        for name in names:
            os.unlink(os.path.join(folder, name))
        os.rmdir(folder)


def touched(area: mmap.mmap) -> mmap.mmap:
    for offset in range(0, len(area), CHUNK):
        area[offset : offset + CHUNK] = DATA[offset : offset + CHUNK]
    return area


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lanes", type=int, default=4)
    parser.add_argument("--tries", type=int, default=4)
    args = parser.parse_args()
    shm_fd, shm_path = tempfile.mkstemp(dir="/dev/shm")
    os.ftruncate(shm_fd, TOTAL)
    shm = touched(mmap.mmap(shm_fd, TOTAL, flags=mmap.MAP_SHARED))
    memory = touched(mmap.mmap(-1, TOTAL))
    runs: dict[str, Callable[[], float]] = {"memory": lambda: mapped(args.lanes, memory)}
    runs["shm_reused"] = lambda: mapped(args.lanes, shm)
    for root in (os.path.expanduser("~"), "/dev/shm"):
        for mode in ("pwrite", "parts", "mmap", "mmap_falloc"):
            runs[f"{mode} {root}"] = lambda m=mode, r=root: file_mode(m, args.lanes, r)
    times: dict[str, list[int]] = {name: [] for name in runs}
    for _ in range(args.tries):
        for name, run in runs.items():
            times[name].append(round(run() * 1000))
    print(f"336 MB over {args.lanes} loopback lanes, ms per try ({os.cpu_count()} cores):")
    for name, tries in times.items():
        print(f"{name:28s} median {sorted(tries)[len(tries) // 2]:4d}  {tries}")
    shm.close()
    os.close(shm_fd)
    os.unlink(shm_path)


if __name__ == "__main__":
    main()
