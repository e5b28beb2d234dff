"""How fast this host reads 336 MB out of a push's receive area, against a file.

``python3 scripts/probes/area_read.py [--mb 336] [--tries 3]`` (standard
library only) writes the bytes once into ``/dev/shm`` (where a push's lanes
receive, ``server/http/receive_area.py``) and once into a file in ``$HOME``
(page cache, as a path load reads it), then times, for each: ``pread`` in
8 MiB slices on one thread (how a staging follows a push's bytes), the same
slices split over four threads, and a copy out of a read-only map (first
touch, then again). It prints the kernel's shared-memory huge-page setting
and the core count first.
"""

from __future__ import annotations

import argparse
import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor

SLICE = 8 << 20
THREADS = 4


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=336)
    parser.add_argument("--tries", type=int, default=3)
    args = parser.parse_args()
    size = args.mb << 20
    data = os.urandom(1 << 20) * args.mb
    paths = ["/dev/shm/skyrl-area-read-probe", os.path.expanduser("~/skyrl-area-read-probe")]
    for path in paths:
        with open(path, "wb") as out:
            out.write(data)
    buffer = memoryview(bytearray(size))
    pool = ThreadPoolExecutor(THREADS)

    def split(fd: int, begin: int, end: int) -> None:
        step = -(-(end - begin) // THREADS)
        starts = range(begin, end, step)
        list(pool.map(lambda s: os.preadv(fd, [buffer[s : min(s + step, end)]], s), starts))

    with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as setting:
        print(f"shmem huge pages: {setting.read().strip()}; cores: {os.cpu_count()}")
    try:
        for _ in range(args.tries):
            for path in paths:
                fd = os.open(path, os.O_RDONLY)
                began = time.perf_counter()
                for start in range(0, size, SLICE):
                    os.preadv(fd, [buffer[start : start + SLICE]], start)
                one = time.perf_counter()
                for start in range(0, size, SLICE):
                    split(fd, start, min(start + SLICE, size))
                four = time.perf_counter()
                with mmap.mmap(fd, size, prot=mmap.PROT_READ) as mapped:
                    view = memoryview(mapped)
                    for start in range(0, size, SLICE):
                        buffer[start : start + SLICE] = view[start : start + SLICE]
                    first = time.perf_counter()
                    for start in range(0, size, SLICE):
                        buffer[start : start + SLICE] = view[start : start + SLICE]
                    again = time.perf_counter()
                    view.release()
                os.close(fd)
                print(
                    f"{path}: pread 1 thread {1e3 * (one - began):.0f} ms, "
                    f"{THREADS} threads {1e3 * (four - one):.0f} ms, "
                    f"mapped copy {1e3 * (first - four):.0f} ms (again {1e3 * (again - first):.0f})"
                )
    finally:
        for path in paths:
            os.unlink(path)


if __name__ == "__main__":
    main()
