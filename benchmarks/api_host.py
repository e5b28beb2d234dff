"""The API process's host work at a GPU's token rate: two commits, A/B.

At a GPU's pace the API process (our routes and vLLM's front end on one
event loop) is host-bound: its loop stalls and its collector's full
collections set the other tenants' token gaps. The CPU engine never steps
fast enough to show that, so both servers here step with the stand-in core
of :mod:`benchmarks.fast_engine` (``--step-ms`` apart, one token per
running request): one runs the code of ``--base`` (a git revision, checked
out to a temporary folder), the other this working tree. Each round is one
:func:`benchmarks.pause_latency.run` round on one server (tenant A's
``--in-flight`` ``sample_with_retry`` loops paused ``--pauses`` times, a
probe tenant streaming from its own process), alternating A B B A ...

Per round and server: the probe's longest token gap outside pauses and
across them, the API process's ``event_loop_stall`` events (count, p99,
max) and its collections: the share of the round spent collecting, the full
collections and their mean, and the longest ``gc_pause``. The figures are
medians over each server's rounds with their spread.

``python -m benchmarks.api_host [--base REV] [--in-flight 256] [--rounds 3]
[--pauses 15] [--step-ms 25] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.common import current_commit, greeting_prompt, skyrl_event
from benchmarks.gc_freeze import gc_figures, gc_totals
from benchmarks.pause_latency import run as pause_round
from benchmarks.stats import Spread, Tail

ROOT = Path(__file__).resolve().parent.parent
#: The packages' folders in the tree and where ``import`` finds them
#: (``pyproject.toml``'s package-dir mapping).
PACKAGE_DIRS = {
    "skyrl_lora": "skyrl_lora",
    "client": "skyrl_lora/client",
    "server": "skyrl_lora/server",
}


def checkout(rev: str, into: Path) -> Path:
    """The packages of ``rev`` laid out as ``import`` finds them, under ``into``;
    ``benchmarks`` is this tree's (the stand-in core and the load are the same
    for both sides). A server started there imports ``rev``'s code."""
    tree = into / "tree"
    tree.mkdir()
    archive = subprocess.run(
        ["git", "archive", rev, *PACKAGE_DIRS], cwd=ROOT, check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    shim = into / "shim"
    shim.mkdir()
    for src, dst in PACKAGE_DIRS.items():
        shutil.move(str(tree / src), str(shim / dst))
    (shim / "benchmarks").symlink_to(ROOT / "benchmarks")
    return shim


def _events(log: Path, start: int) -> dict[str, list[float]]:
    """The ``ms`` of each skyrl_event line after byte ``start``, by event."""
    found: dict[str, list[float]] = {}
    with open(log, "rb") as f:
        f.seek(start)
        data = f.read()
    for line in data.decode(errors="replace").splitlines():
        event = skyrl_event(line)
        if event is not None:
            found.setdefault(event["event"], []).append(float(event.get("ms", 0.0)))
    return found


async def _metrics(url: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as session:
        return await gc_totals(session, url)


def _round(url: str, log: Path, model: Any, args: argparse.Namespace) -> dict[str, float]:
    before = asyncio.run(_metrics(url))
    start = log.stat().st_size
    began = time.perf_counter()
    figures = asyncio.run(
        pause_round(url, model, greeting_prompt(model), 1, args.pauses, args.in_flight)
    )
    wall = time.perf_counter() - began
    after = asyncio.run(_metrics(url))
    events = _events(log, start)
    stalls = events.get("event_loop_stall") or [0.0]
    return {
        "probe_outside_max_ms": figures.probe_outside_max[0],
        "probe_across_max_ms": figures.probe[0].max,
        "probe_excess_ms": figures.probe[0].max - figures.probe_outside_max[0],
        "stalls": float(len(events.get("event_loop_stall", []))),
        "stall_p99_ms": Tail.of(stalls).p99,
        "stall_max_ms": max(stalls),
        **gc_figures(before, after, wall),
        "gc_pause_max_ms": max(events.get("gc_pause") or [0.0]),
    }


@contextmanager
def _servers(base: str, step_ms: float, root: Path) -> Iterator[tuple[dict[str, Any], Any]]:
    from skyrl_lora.server.cluster.process import start_serve
    from skyrl_lora.server.embedded import ensure_embedded_model
    from skyrl_lora.server.presets import CPU_ENV, embedded_server_argv

    model = ensure_embedded_model()
    argv = ["--no-ray", *embedded_server_argv(model)]
    launcher = ("-m", "benchmarks.fast_engine", "--step-ms", str(step_ms), "--")
    homes = {f"base {base}": checkout(base, root), "this tree": ROOT}
    with ExitStack() as stack:
        servers = {}
        for name, home in homes.items():
            log = root / f"{name.split()[0]}.log"
            server = start_serve(argv, log, env=CPU_ENV, launcher=launcher, cwd=home)
            stack.callback(server.kill_all)
            stack.callback(server.stop)
            servers[name] = (server.url, log)
        yield servers, model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base", default="HEAD", help="git revision of the A side")
    parser.add_argument("--in-flight", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3, help="rounds per server")
    parser.add_argument("--pauses", type=int, default=15, help="pauses per round")
    parser.add_argument("--step-ms", type=float, default=25.0)
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args()

    with (
        tempfile.TemporaryDirectory() as tmp,
        _servers(args.base, args.step_ms, Path(tmp)) as (
            servers,
            model,
        ),
    ):
        names = list(servers)
        rounds: dict[str, list[dict[str, float]]] = {name: [] for name in names}
        for i in range(args.rounds * 2):
            name = names[(i + i // 2) % 2]  # A B B A A B ...
            url, log = servers[name]
            got = _round(url, log, model, args)
            rounds[name].append(got)
            print(f"round {i + 1:2} {name:12} " + " ".join(f"{k} {v:.3g}" for k, v in got.items()))
    figures = {
        name: {key: Spread.of(r[key] for r in per).to_json() for key in per[0]}
        for name, per in rounds.items()
    }
    result = {
        "commit": current_commit(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
        f"load average {os.getloadavg()[0]:.1f} at the end",
        "load": {k: getattr(args, k) for k in ("in_flight", "rounds", "pauses", "step_ms")},
        "figures": figures,
    }
    for name, f in figures.items():
        print(
            f"{name:12}: probe gap outside {f['probe_outside_max_ms']['median']:.0f} ms, "
            f"across {f['probe_across_max_ms']['median']:.0f} ms; stalls "
            f"{f['stalls']['median']:.0f} (p99 {f['stall_p99_ms']['median']:.0f} ms, "
            f"max {f['stall_max_ms']['median']:.0f}); GC {f['gc_share']['median']:.1%}, "
            f"{f['full_collections']['median']:.0f} full of "
            f"{f['full_collection_mean_ms']['median']:.1f} ms, "
            f"longest {f['gc_pause_max_ms']['median']:.0f} ms"
        )
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=1)


if __name__ == "__main__":
    main()
