"""What the push route's own work costs over the HTTP stack it runs on.

``python -m benchmarks.push_receive`` serves two routes on uvicorn, in a
process of their own, as the API server runs them: ``/push`` receives the
multipart body with :func:`skyrl_lora.server.http.push.receive_push` (parse,
write, sha256, check) into a fresh folder; ``/sink`` reads the same body
and drops it. The client sends each the same streamed form
(:class:`skyrl_lora.client.push.StreamedForm`, a safetensors file of
``--mb`` MB), in interleaved rounds. The ratio push / sink is what the
route adds to moving the bytes through uvicorn; the sink's time is what any
HTTP push on this stack pays. The third, ``stream``, is the push stream
(:mod:`skyrl_lora.server.http.push_stream`): ``/stream/open`` answers a
ticket and the weights go over the listener's socket, received, written,
hashed and checked as a push is (the client's
:func:`~skyrl_lora.client.push_stream.stream_weights`), over one connection;
``lanes`` is the same over ``--lanes`` connections at once, received into
a receive area (:mod:`skyrl_lora.server.http.receive_area`),
``lanes_file`` the same written into the push's folder instead (a listener
without areas), the baseline of the areas, and ``lanes_process`` the
``lanes`` received by a listener in a process of its own, as ``serve`` runs
it (:mod:`skyrl_lora.server.http.push_stream_process`). No engine and no
staging: the swap's cost (``benchmarks.scale``) comes on top.

The server's event loop is watched as the API server's is
(:mod:`skyrl_lora.server.telemetry.loop_monitor`, its stacks sampled while late):
that loop also streams every other tenant's tokens, so how long a route
holds it up while a push arrives is a cost to them (``loop_stalls``: per
route, the stalls summed over each send, their longest, and where the
loop was).

Each send's CPU time is counted at both ends (``cpu_ms``): the sender's is
this process's (the client's threads included), the receiver's is the
server's and its children's (``/proc``; the listener's process included).
Where the lanes' byte moving and hashing land on the cores that the
engine's step loop shares, their sum is what a push takes from it; a
neighbour process that stands in for that loop (:mod:`benchmarks.cpu_neighbour`,
``--neighbour-step-ms``) says how much longer its steps ran during each
route's sends than in quiet windows before and after them.

Writes ``benchmarks/out/push_receive.json`` and prints the table.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import logging
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import current_commit, free_port, skyrl_event
from benchmarks.cpu_neighbour import Neighbour, Window, stretched
from benchmarks.report import spread_row, table
from benchmarks.stats import Spread, Tail, median
from examples.rl.gpu_busy import cpu_seconds
from skyrl_lora.client.config import ClientConfig
from skyrl_lora.client.push import adapter_payload
from skyrl_lora.client.push_stream import stream_weights
from skyrl_lora.client.transport import Transport
from skyrl_lora.server.reaper import descendants, process_table
from skyrl_lora.types import PushStreamTicket

ROOT = Path(__file__).resolve().parent.parent

ROUTES = ("sink", "push", "stream", "lanes", "lanes_file", "lanes_process")
#: (top, bottom, what the ratio says), each as ``ratio_{top}_over_{bottom}``.
RATIOS = (
    ("push", "sink", "what parsing, writing and hashing add over uvicorn"),
    ("stream", "sink", "the push stream against bytes dropped by uvicorn"),
    ("stream", "push", "the push stream against the HTTP push"),
    ("lanes", "stream", "the push stream's lanes against one lane"),
    ("lanes", "push", "the push stream's lanes against the HTTP push"),
    ("lanes", "lanes_file", "lanes into a receive area against lanes into the folder's file"),
    ("lanes_process", "lanes", "lanes received in a process of their own against in the server's"),
)


def serve(port: int, events: Path | None) -> None:
    """The server process: ``/push`` and ``/sink`` on uvicorn; the push
    stream's receive events go to ``events``, a line each."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from skyrl_lora.server.http.push import check_safetensors, checked_push, receive_push
    from skyrl_lora.server.http.push_assembly import OpenedPush, Receipt
    from skyrl_lora.server.http.push_stream import PushStreamConfig, PushStreamListener
    from skyrl_lora.server.http.push_stream_process import PushStream, PushStreamProcess
    from skyrl_lora.server.telemetry.loop_monitor import LoopMonitorConfig, monitoring
    from skyrl_lora.types import AdapterInfo

    listeners: dict[str, PushStream] = {}  # by where the lanes receive

    async def checked(push: OpenedPush, receipt: Receipt) -> AdapterInfo:
        try:
            digest = await receipt.digest()
            pushed = await asyncio.to_thread(
                checked_push, push.fields, push.folder, digest, weights_written=False
            )
            await asyncio.to_thread(check_safetensors, receipt.weights)
        finally:
            shutil.rmtree(push.folder, ignore_errors=True)
        return AdapterInfo(
            lora_name=pushed.lora_name,
            lora_path=digest,
            version=1,
            paused=False,
            in_flight=0,
            held=0,
            engine_requests=0,
        )

    async def open_stream(request: Request) -> JSONResponse:
        opened = await request.json()
        into = str(opened.get("into", "area"))
        if into not in listeners:
            config = PushStreamConfig(idle_areas=0 if into == "file" else 2)
            if into == "process":
                listeners[into] = await PushStreamProcess.start("127.0.0.1", 0, checked, config)
            else:
                loop = asyncio.get_running_loop()
                listeners[into] = PushStreamListener("127.0.0.1", 0, checked, loop, config)
        folder = Path(tempfile.mkdtemp(prefix="skyrl-push-bench-"))
        (folder / "adapter_config.json").write_text("{}")
        size, lanes = int(opened["weights_bytes"]), int(opened["lanes"])
        fields = {"lora_name": "bench"}
        ticket = await listeners[into].open(OpenedPush("bench", folder, size, fields, lanes))
        return JSONResponse(ticket.model_dump())

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

    routes = [
        Route("/push", push, methods=["POST"]),
        Route("/sink", sink, methods=["POST"]),
        Route("/stream/open", open_stream, methods=["POST"]),
    ]

    @contextlib.asynccontextmanager
    async def watched(_: Starlette) -> AsyncIterator[None]:
        # A wake-up every 2 ms; stalls over 5 ms logged, with the loop's stacks.
        watch = LoopMonitorConfig(interval_s=0.002, report_over_s=0.005, stall_stacks=True)
        async with monitoring(watch):
            yield

    if events is not None:
        from skyrl_lora.server.telemetry.observability import event_logger

        event_logger.setLevel(logging.INFO)
        handler = logging.FileHandler(events)
        handler.setFormatter(logging.Formatter("%(created).6f %(message)s"))
        event_logger.addHandler(handler)
    app = Starlette(routes=routes, lifespan=watched)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


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


async def send_once(transport: Transport, url: str, route: str, folder: Path, lanes: int) -> None:
    """One push of the adapter as a trainer's client sends it to ``route``."""
    payload = await asyncio.to_thread(adapter_payload, str(folder))
    if not route.startswith(("stream", "lanes")):
        form = payload.form("bench", "abort_resume")
        await transport.call("POST", f"{url}/{route}", form, timeout=300)
        return
    opened = {
        "weights_bytes": payload.weights_bytes,
        "lanes": 1 if route == "stream" else lanes,
        "into": {"lanes_file": "file", "lanes_process": "process"}.get(route, "area"),
    }
    raw = await transport.call("POST", f"{url}/stream/open", opened, timeout=300)
    ticket = PushStreamTicket.model_validate_json(raw)
    await stream_weights(url, ticket, payload.weights, timeout=300, connect_timeout=10)


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user and system) that process ``pid`` and every process
    below it have used so far, from ``/proc``: the reaper's process table
    and tree walk, the RL example's per-process CPU time."""
    return sum(cpu_seconds(p) for p in descendants([pid], process_table()))


@dataclass
class Measured:
    """Per route, per round, each send's milliseconds of wall clock and of
    CPU time at the sending and at the receiving end."""

    ms: dict[str, list[list[float]]]
    sender_cpu_ms: dict[str, list[list[float]]]
    receiver_cpu_ms: dict[str, list[list[float]]]


async def measure(
    url: str,
    folder: Path,
    rounds: int,
    sends: int,
    lanes: int,
    server_pid: int,
    spans: list[Span] | None = None,
) -> Measured:
    """Every route's sends (routes alternate within a round); each measured
    send's wall-clock span goes to ``spans``."""
    transport = Transport(ClientConfig(), {})

    def per_route() -> dict[str, list[Any]]:
        return {route: [] for route in ROUTES}

    measured = Measured(per_route(), per_route(), per_route())
    try:
        for round_index in range(rounds + 1):  # the first round warms both routes up
            this_round = [per_route(), per_route(), per_route()]
            for send in range(sends):
                shift = (round_index + send) % len(ROUTES)
                order = ROUTES[shift:] + ROUTES[:shift]
                for route in order:
                    # The /proc walk first: its own CPU is not the sender's.
                    receiver_before = tree_cpu_s(server_pid)
                    sender_before = time.process_time()
                    started, wall = time.perf_counter(), time.time()
                    await send_once(transport, url, route, folder, lanes)
                    this_round[0][route].append((time.perf_counter() - started) * 1000)
                    this_round[1][route].append((time.process_time() - sender_before) * 1000)
                    this_round[2][route].append((tree_cpu_s(server_pid) - receiver_before) * 1000)
                    if round_index and spans is not None:
                        spans.append(Span(route, wall, time.time()))
            if round_index:
                for kept, got in zip(
                    (measured.ms, measured.sender_cpu_ms, measured.receiver_cpu_ms),
                    this_round,
                    strict=True,
                ):
                    for route in ROUTES:
                        kept[route].append(got[route])
    finally:
        await transport.aclose()
    return measured


def summarise(measured: Measured, mb: int) -> dict[str, Any]:
    times = measured.ms

    def round_medians(per_round: list[list[float]]) -> dict[str, float]:
        return Spread.of(sorted(r)[len(r) // 2] for r in per_round).__dict__

    def ratios(top: str, bottom: str) -> dict[str, float]:
        per_round = [
            sorted(t)[len(t) // 2] / sorted(b)[len(b) // 2]
            for t, b in zip(times[top], times[bottom], strict=True)
        ]
        return Spread.of(per_round).__dict__

    out: dict[str, Any] = {
        f"ratio_{top}_over_{bottom}": ratios(top, bottom) for top, bottom, _ in RATIOS
    }
    for route in ROUTES:
        medians = [sorted(r)[len(r) // 2] for r in times[route]]
        pooled = [ms for r in times[route] for ms in r]
        out[route] = {
            "ms": Spread.of(medians).__dict__,
            "pooled": Tail.of(pooled).to_json(),
            "mb_per_s": Spread.of(mb * 1000 / ms for ms in medians).__dict__,
            "cpu_ms": {
                "sender": round_medians(measured.sender_cpu_ms[route]),
                "receiver": round_medians(measured.receiver_cpu_ms[route]),
            },
        }
    return out


def report(result: dict[str, Any]) -> str:
    rows = []
    for route in ROUTES:
        spread = Spread(**result[route]["ms"])
        pooled, cpu = result[route]["pooled"], result[route]["cpu_ms"]
        rows.append(
            spread_row(
                f"{route}, {result['mb']} MB",
                spread,
                ".0f",
                " ms",
                "",
                f"p99 {pooled['p99']:.0f} / max {pooled['max']:.0f} ms; "
                f"{Spread(**result[route]['mb_per_s']).median:.0f} MB/s; CPU sender "
                f"{cpu['sender']['median']:.0f} + receiver {cpu['receiver']['median']:.0f} ms",
            )
        )
    for top, bottom, says in RATIOS:
        ratio = Spread(**result[f"ratio_{top}_over_{bottom}"])
        rows.append(spread_row(f"{top} / {bottom}", ratio, ".2f", "x", "", says))
    return table(rows)


def receive_parts(events: Path) -> dict[str, dict[str, float]]:
    """Where the push stream's receives spent their time, by lane count
    (medians over pushes, warm-up included): the receive's ms, the slowest
    lane's time reading its socket and waiting for its writes and hashes,
    the writes' summed time, and the wait for the digest after the last lane."""
    by_lanes: dict[str, list[dict[str, Any]]] = {}
    for line in events.read_text().splitlines() if events.exists() else []:
        event = skyrl_event(line) or {}
        if event.get("event") == "push_stream_received":
            where = f"{event['lanes']} lane(s) into {event.get('into', 'file')}"
            by_lanes.setdefault(where, []).append(event)

    def middle(values: list[float]) -> float:
        return round(median(values), 1)

    return {
        lanes: {
            "pushes": len(pushes),
            "ms": middle([e["ms"] for e in pushes]),
            "slowest_lane_recv_ms": middle([max(e["recv_ms"]) for e in pushes]),
            "slowest_lane_wait_ms": middle([max(e["wait_ms"]) for e in pushes]),
            "write_ms_summed": middle([e["write_ms"] for e in pushes]),
            "digest_wait_ms": middle([e["digest_wait_ms"] for e in pushes]),
        }
        for lanes, pushes in sorted(by_lanes.items())
    }


@dataclass(frozen=True)
class Span:
    """One measured send: its route and its wall-clock start and end."""

    route: str
    start: float
    end: float


def loop_stalls(events: Path, spans: list[Span]) -> dict[str, dict[str, Any]]:
    """The server loop's stalls by route: each stall (an ``event_loop_stall``
    line, stamped with its end) counts for the send it overlaps; per route,
    the median and largest sum of stalls over one send, the longest stall,
    and the stacks seen most often while the loop was late."""
    stalls: list[tuple[float, float, dict[str, Any]]] = []
    for line in events.read_text().splitlines() if events.exists() else []:
        stamp, _, rest = line.partition(" ")
        event = skyrl_event(rest)
        if event is not None and event.get("event") == "event_loop_stall":
            end = float(stamp)
            stalls.append((end - event["ms"] / 1000, end, event))
    out: dict[str, dict[str, Any]] = {}
    for route in ROUTES:
        mine = [span for span in spans if span.route == route]
        if not mine:
            continue
        summed, longest = [], 0.0
        seen: collections.Counter[tuple[str, ...]] = collections.Counter()
        for span in mine:
            during = [e for b, a, e in stalls if b < span.end and a > span.start]
            summed.append(sum(e["ms"] for e in during))
            longest = max([longest, *(e["ms"] for e in during)])
            for event in during:
                for stack in event.get("stacks", []):
                    seen[tuple(stack["stack"][-3:])] += stack["seen"]
        out[route] = {
            "sends": len(mine),
            "stalled_ms_per_send": Spread.of(summed).__dict__,
            "longest_stall_ms": longest,
            "stacks": [{"seen": n, "innermost": list(k)} for k, n in seen.most_common(3)],
        }
    return out


def windows(spans: list[Span], route: str) -> list[Window]:
    """The measured sends of ``route``, as the neighbour's steps are read by."""
    return [Window(span.start, span.end) for span in spans if span.route == route]


def quiet_window(seconds: float = 2.0) -> Window:
    """Wait ``seconds`` with nothing sent: the neighbour's steps then are its baseline."""
    start = time.time()
    time.sleep(seconds)
    return Window(start, time.time())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--events", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--mb", type=int, default=336, help="weights file size (rank 64, 8B: 336)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sends", type=int, default=3, help="sends per route and round")
    parser.add_argument("--lanes", type=int, default=4, help="connections of the lanes route")
    parser.add_argument(
        "--neighbour-step-ms",
        type=float,
        default=5.0,
        help="the CPU-bound neighbour's step (0: no neighbour)",
    )
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks/out/push_receive.json")
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.events)
        return 0
    port = free_port()
    with tempfile.TemporaryDirectory() as work:
        events = Path(work) / "events.log"
        argv = [sys.executable, "-m", "benchmarks.push_receive", "--serve", str(port)]
        server = subprocess.Popen([*argv, "--events", str(events)])
        neighbour = Neighbour(args.neighbour_step_ms, Path(work) / "neighbour.json")
        try:
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
            spans: list[Span] = []
            quiet: list[Window] = []
            if args.neighbour_step_ms:
                neighbour.start()
                quiet.append(quiet_window())
            measured = asyncio.run(
                measure(url, folder, args.rounds, args.sends, args.lanes, server.pid, spans)
            )
            if args.neighbour_step_ms:
                quiet.append(quiet_window())
                steps = neighbour.stop()
        finally:
            neighbour.kill()
            server.terminate()
            server.wait(30)
        receives = receive_parts(events)
        stalls = loop_stalls(events, spans)
        neighbour_steps = (
            {route: stretched(steps, windows(spans, route), quiet) for route in ROUTES}
            if args.neighbour_step_ms
            else {}
        )
    result = {
        "commit": current_commit(),
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{os.cpu_count()} CPU cores ({sys.platform})",
        "mb": args.mb,
        "rounds": args.rounds,
        "sends_per_round": args.sends,
        "lane_count": args.lanes,  # "lanes" is a route's summary
        **summarise(measured, args.mb),
        "receive_parts": receives,
        "loop_stalls": stalls,
        "neighbour_step_ms": args.neighbour_step_ms,
        "neighbour_steps": neighbour_steps,
        "raw_ms": measured.ms,
        "raw_cpu_ms": {"sender": measured.sender_cpu_ms, "receiver": measured.receiver_cpu_ms},
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1))
    print(report(result))
    for where, parts in receives.items():
        print(f"receive over {where}, medians over pushes: {parts}")
    for route, stalled in stalls.items():
        per_send = Spread(**stalled["stalled_ms_per_send"])
        print(
            f"server loop during {route}: stalled {per_send.median:.1f} ms a send "
            f"({per_send.min:.1f}-{per_send.max:.1f}), longest {stalled['longest_stall_ms']:.1f} ms"
        )
    for route, seen in neighbour_steps.items():
        over = seen["longest_step_over_quiet_ms"]
        print(
            f"neighbour's {args.neighbour_step_ms:g} ms steps during {route}: the longest "
            f"{over['median']:.1f} ms over its quiet {seen['quiet_step_ms']:.1f} ms a send "
            f"({over['min']:.1f}-{over['max']:.1f})"
        )
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
