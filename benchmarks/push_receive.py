"""What the push route's own work costs over the HTTP stack it runs on.

``python -m benchmarks.push_receive`` serves two routes on uvicorn, in a
process of their own, as the API server runs them: ``/push`` receives the
multipart body with :func:`skyrl_lora.server.http.push.receive_push` (parse,
write, sha256, check) into a fresh folder; ``/sink`` reads the same body
and drops it. The client sends each the same streamed form
(:class:`skyrl_lora.client.push.StreamedForm`, a safetensors file of
``--mb`` MB), in interleaved rounds. The ratio push / sink is what the
route adds to moving the bytes through uvicorn; the sink's time is what any
HTTP push on this stack pays. No engine and no staging: the swap's cost
(``benchmarks.scale``) comes on top.

Writes ``benchmarks/out/push_receive.json`` and prints the table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import current_commit
from benchmarks.report import spread_row, table
from benchmarks.stats import Spread, Tail
from skyrl_lora.client.config import ClientConfig
from skyrl_lora.client.push import adapter_payload
from skyrl_lora.client.transport import Transport

ROOT = Path(__file__).resolve().parent.parent
ROUTES = ("sink", "push")


def serve(port: int) -> None:
    """The server process: ``/push`` and ``/sink`` on uvicorn."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from skyrl_lora.server.http.push import receive_push

    async def push(request: Request) -> JSONResponse:
        folder = Path(tempfile.mkdtemp(prefix="skyrl-push-bench-"))
        try:
            pushed = await receive_push(request.headers, request.stream(), folder, 1 << 34)
            return JSONResponse({"sha256": pushed.sha256})
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    async def sink(request: Request) -> JSONResponse:
        received = 0
        async for chunk in request.stream():
            received += len(chunk)
        return JSONResponse({"bytes": received})

    routes = [Route("/push", push, methods=["POST"]), Route("/sink", sink, methods=["POST"])]
    uvicorn.run(Starlette(routes=routes), host="127.0.0.1", port=port, log_level="warning")


def adapter(folder: Path, mb: int) -> Path:
    """An adapter folder whose weights file is a valid safetensors file of ``mb`` MB."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text("{}")
    nbytes = mb << 20
    header = json.dumps({"w": {"dtype": "U8", "shape": [nbytes], "data_offsets": [0, nbytes]}})
    head = header.encode() + b" " * (-len(header) % 8)
    with (folder / "adapter_model.safetensors").open("wb") as weights:
        weights.write(struct.pack("<Q", len(head)) + head)
        block = os.urandom(1 << 20)
        for _ in range(mb):
            weights.write(block)
    return folder


async def measure(url: str, folder: Path, rounds: int, sends: int) -> dict[str, list[list[float]]]:
    """Per route, per round, each send's milliseconds (routes alternate within a round)."""
    transport = Transport(ClientConfig(), {})
    times: dict[str, list[list[float]]] = {route: [] for route in ROUTES}
    try:
        for round_index in range(rounds + 1):  # the first round warms both routes up
            this_round: dict[str, list[float]] = {route: [] for route in ROUTES}
            for send in range(sends):
                order = ROUTES if (round_index + send) % 2 == 0 else ROUTES[::-1]
                for route in order:
                    started = time.perf_counter()
                    payload = await asyncio.to_thread(adapter_payload, str(folder))
                    form = payload.form("bench", "abort_resume")
                    await transport.call("POST", f"{url}/{route}", form, timeout=300)
                    this_round[route].append((time.perf_counter() - started) * 1000)
            if round_index:
                for route in ROUTES:
                    times[route].append(this_round[route])
    finally:
        await transport.aclose()
    return times


def summarise(times: dict[str, list[list[float]]], mb: int) -> dict[str, Any]:
    ratios = [
        sorted(p)[len(p) // 2] / sorted(s)[len(s) // 2]
        for p, s in zip(times["push"], times["sink"], strict=True)
    ]
    out: dict[str, Any] = {
        "ratio_push_over_sink": Spread.of(ratios).__dict__,
    }
    for route in ROUTES:
        medians = [sorted(r)[len(r) // 2] for r in times[route]]
        pooled = [ms for r in times[route] for ms in r]
        out[route] = {
            "ms": Spread.of(medians).__dict__,
            "pooled": Tail.of(pooled).to_json(),
            "mb_per_s": Spread.of(mb * 1000 / ms for ms in medians).__dict__,
        }
    return out


def report(result: dict[str, Any]) -> str:
    rows = []
    for route in ROUTES:
        spread = Spread(**result[route]["ms"])
        pooled = result[route]["pooled"]
        rows.append(
            spread_row(
                f"{route}, {result['mb']} MB",
                spread,
                ".0f",
                " ms",
                "",
                f"p99 {pooled['p99']:.0f} / max {pooled['max']:.0f} ms; "
                f"{Spread(**result[route]['mb_per_s']).median:.0f} MB/s",
            )
        )
    rows.append(
        spread_row(
            "push / sink",
            Spread(**result["ratio_push_over_sink"]),
            ".2f",
            "x",
            "",
            "what parsing, writing and hashing add over uvicorn",
        )
    )
    return table(rows)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--mb", type=int, default=336, help="weights file size (rank 64, 8B: 336)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sends", type=int, default=3, help="sends per route and round")
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks/out/push_receive.json")
    args = parser.parse_args()
    if args.serve:
        serve(args.serve)
        return 0
    port = free_port()
    argv = [sys.executable, "-m", "benchmarks.push_receive", "--serve", str(port)]
    server = subprocess.Popen(argv)
    try:
        with tempfile.TemporaryDirectory() as work:
            folder = adapter(Path(work) / "adapter", args.mb)
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    if time.monotonic() > deadline or server.poll() is not None:
                        raise RuntimeError("the push_receive server did not start") from None
                    time.sleep(0.2)
            times = asyncio.run(measure(url, folder, args.rounds, args.sends))
    finally:
        server.terminate()
        server.wait(30)
    result = {
        "commit": current_commit(),
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{os.cpu_count()} CPU cores ({sys.platform})",
        "mb": args.mb,
        "rounds": args.rounds,
        "sends_per_round": args.sends,
        **summarise(times, args.mb),
        "raw_ms": times,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1))
    print(report(result))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
