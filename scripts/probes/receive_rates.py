"""The host's own rates for the pieces of a streamed push's receive (336 MB).

``python scripts/probes/receive_rates.py`` times, with no project code:

- writing 336 MB in 8 MiB chunks into one file from 1, 4 or 8 threads
  (``pwrite`` at offsets), into one file per thread, and copying into a
  pre-faulted shared map of one file (``mmap_populate``), in ``$HOME``,
  ``/dev/shm`` and ``/tmp`` (setup ms, copy ms per try);
- loopback TCP over 1, 2, 4 and 8 connections, read with ``recv_into``;
- sha256 of the 42 chunks on 1, 4 and 8 threads.

Each is an upper bound on what its part of the receive can do on the host
(the push stream also hashes, writes and runs beside the engine). Pure
standard library: it runs on a GPU machine with nothing installed.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import socket
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

TOTAL = 336 << 20
CHUNK = 8 << 20
CHUNKS = TOTAL // CHUNK
SOURCE = bytearray(os.urandom(CHUNK))


def write(mode: str, threads: int, root: str) -> tuple[int, int]:
    folder = tempfile.mkdtemp(dir=root)
    paths = [os.path.join(folder, f"w{i}") for i in range(threads if mode == "files" else 1)]
    fds = [os.open(p, os.O_RDWR | os.O_CREAT, 0o600) for p in paths]
    started = time.perf_counter()
    mapped = None
    if mode == "mmap_populate":
        os.ftruncate(fds[0], TOTAL)
        mapped = mmap.mmap(fds[0], TOTAL, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    ready = time.perf_counter()

    def work(lane: int) -> None:
        for index in range(lane, CHUNKS, threads):
            if mode == "pwrite":
                os.pwrite(fds[0], SOURCE, index * CHUNK)
            elif mode == "files":
                os.write(fds[lane], SOURCE)
            else:
                assert mapped is not None
                mapped[index * CHUNK : (index + 1) * CHUNK] = SOURCE

    workers = [threading.Thread(target=work, args=(lane,)) for lane in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    done = time.perf_counter()
    if mapped is not None:
        mapped.close()
    for fd in fds:
        os.close(fd)
    for path in paths:
        os.unlink(path)
    os.rmdir(folder)
    return round((ready - started) * 1000), round((done - ready) * 1000)


def tcp(streams: int, data: bytearray) -> int:
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    per = TOTAL // streams

    def receive(conn: socket.socket) -> None:
        view = memoryview(bytearray(CHUNK))
        got = 0
        while got < per:
            n = conn.recv_into(view[: min(CHUNK, per - got)])
            if not n:
                break
            got += n
        conn.close()

    def accept() -> None:
        readers = []
        for _ in range(streams):
            conn, _ = server.accept()
            readers.append(threading.Thread(target=receive, args=(conn,)))
            readers[-1].start()
        for reader in readers:
            reader.join()

    acceptor = threading.Thread(target=accept)
    acceptor.start()
    started = time.perf_counter()

    def send(lane: int) -> None:
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(memoryview(data)[lane * per : (lane + 1) * per])

    senders = [threading.Thread(target=send, args=(lane,)) for lane in range(streams)]
    for sender in senders:
        sender.start()
    for sender in senders:
        sender.join()
    acceptor.join()
    server.close()
    return round((time.perf_counter() - started) * 1000)


def main() -> None:
    for root in (os.path.expanduser("~"), "/dev/shm", "/tmp"):
        for mode in ("pwrite", "files", "mmap_populate"):
            for threads in (1, 4, 8):
                tries = [write(mode, threads, root) for _ in range(4)]
                print(root, mode, threads, "setup/copy ms:", tries, flush=True)
    data = bytearray(os.urandom(1 << 20)) * (TOTAL >> 20)
    for streams in (1, 2, 4, 8):
        tries = [tcp(streams, data) for _ in range(4)]
        print("tcp loopback 336 MB, streams", streams, "ms:", tries, flush=True)
    blob = bytes(data)
    for threads in (1, 4, 8):
        with ThreadPoolExecutor(threads) as pool:
            started = time.perf_counter()
            chunks = (memoryview(blob)[i * CHUNK : (i + 1) * CHUNK] for i in range(CHUNKS))
            list(pool.map(lambda chunk: hashlib.sha256(chunk).digest(), chunks))
            ms = round((time.perf_counter() - started) * 1000)
        print("sha256 336 MB, threads", threads, "ms:", ms, flush=True)


if __name__ == "__main__":
    main()
