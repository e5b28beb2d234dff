"""Pause latency: pause call to every in-flight request of the adapter returned.

``in_flight`` ``sample_with_retry`` calls keep tenant A busy (they resubmit
after each resume); each pause waits until vLLM runs all of them, then times
the pause call, which returns only once every aborted request has come back.
Repeated in ``rounds`` rounds of ``pauses`` pauses: each round gives p50,
p99 and max, seen by the client and as the server's own drain time. The
design this replaces slept a fixed 5 s before aborting.

One streamed probe on another adapter runs alongside, in a process of its
own as another tenant's client would be: in the load's process, its tokens
waited for that process to handle 64 aborted answers (its event loop held
for up to 0.44 s after a pause on the 2-core CPU machine). Its inter-token gaps
that overlap a pause (from the pause call to the resume's answer) show what
the pause costs a tenant that is not paused, against its longest gap
outside pauses: the excess is the pause's own cost. Each pause comes right
after the resubmitted requests were admitted, so their re-prefill (paced
by the gate, :class:`~skyrl_lora.server.engine.gate.ResumePacing`) shares
the steps on both sides.

``python -m benchmarks.pause_latency --ab`` serves the embedded model twice,
with the gate's pacing of a late backlog and without it (``--resume-backlog-s
0 --resume-step-wait-max-ms 50``: pacing for 0.25 s after a resume only), and
measures them in alternating rounds.

``--in-flight 64,256`` measures each count of tenant A's requests in rounds
of its own against the same server(s), one count after the other.

``python -m benchmarks.pause_latency --gpu`` (CUDA vLLM) serves the random
perf model (``--size``) from one ``skyrl-lora serve --no-ray`` with the two
tenants' adapters loaded at its start, and writes to ``--json`` the run's
``commit``, ``date`` and ``machine`` beside each count's figures under
``in_flight``. Its bar (issue 67): the probe's longest gap across a pause at
most :data:`GPU_EXCESS_TARGET_MS` over its longest outside pauses.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.common import current_commit, int_list, wait_engine_requests
from benchmarks.stats import Spread, Tail, check_count, split_gaps, tails_spread
from benchmarks.streams import StreamLog, keep_streaming
from skyrl_lora.client import RemoteInferenceClient

if TYPE_CHECKING:
    from skyrl_lora.server.embedded import EmbeddedModel

#: Tenant A, whose requests are paused, and the probe tenant, another tenant
#: streaming beside it: each with the model's adapter it serves.
PAUSED, PROBE = "lat-a", "lat-probe"
ADAPTER_OF = {PAUSED: "meow", PROBE: "woof"}


@dataclass
class PauseLatency:
    rounds: int
    pauses: int
    in_flight: int
    client: list[Tail]
    server: list[Tail]
    probe: list[Tail]  # the probe tenant's inter-token gaps that overlap a pause
    aborted: list[int]
    #: Per round, the probe's longest gap outside every pause.
    probe_outside_max: list[float] = field(default_factory=list)

    @property
    def probe_excess(self) -> Spread:
        """Per round, the longest gap across a pause less the longest outside."""
        return Spread.of(t.max - o for t, o in zip(self.probe, self.probe_outside_max))

    @property
    def probe_outside(self) -> Spread:
        return Spread.of(self.probe_outside_max)

    @property
    def client_spread(self) -> dict[str, Spread]:
        return tails_spread(self.client)

    @property
    def server_spread(self) -> dict[str, Spread]:
        return tails_spread(self.server)

    @property
    def probe_spread(self) -> dict[str, Spread]:
        return tails_spread(self.probe)

    @property
    def summary(self) -> dict[str, Any]:
        """Medians over rounds under flat keys (the GPU json's), spreads beside them."""
        flat: dict[str, Any] = {}
        for prefix, spread in (
            ("", self.client_spread),
            ("server_", self.server_spread),
            ("probe_gap_", self.probe_spread),
        ):
            for q, s in spread.items():
                flat[f"{prefix}{q}_ms"] = s.median
        flat["probe_gap_outside_max_ms"] = self.probe_outside.median
        flat["probe_gap_excess_ms"] = self.probe_excess.median
        flat["spread"] = {
            "client": {q: s.to_json() for q, s in self.client_spread.items()},
            "server": {q: s.to_json() for q, s in self.server_spread.items()},
            "probe_gap": {q: s.to_json() for q, s in self.probe_spread.items()},
            "probe_gap_outside_max": self.probe_outside.to_json(),
            "probe_gap_excess": self.probe_excess.to_json(),
        }
        flat["aborted_min"] = min(self.aborted)
        flat["rounds"], flat["pauses_per_round"] = self.rounds, self.pauses
        flat["in_flight"] = self.in_flight
        return flat


@dataclass
class _Round:
    """One round's raw figures: the probe's gaps are split once its log is back."""

    began: float
    ended: float
    windows: list[tuple[float, float]]  # pause call to the resume's answer
    client_ms: list[float]
    server_ms: list[float]
    aborted: list[int]


def _probe_main(url: str, tenant: str, prompt: list[int], conn: Connection) -> None:
    """The probe tenant's streams, in a process of their own, until told to stop."""

    async def stream() -> None:
        log = StreamLog(tenant)
        stop = asyncio.Event()
        task = asyncio.create_task(keep_streaming(url, tenant, prompt, log, stop, 1, 400))
        conn.send("streaming")
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)
        stop.set()
        task.cancel()  # the completion in flight need not finish
        await asyncio.gather(task, return_exceptions=True)
        conn.send(log.streams)

    asyncio.run(stream())


class _Load:
    """Tenant A's ``in_flight`` looping samples and the probe's process, on one server."""

    def __init__(self, url: str, model: Any, prompt: list[int], in_flight: int) -> None:
        self.url, self.model, self.prompt, self.in_flight = url, model, prompt, in_flight
        self.probe = StreamLog(PROBE)
        self.rounds: list[_Round] = []

    async def __aenter__(self) -> _Load:
        self.client = RemoteInferenceClient(self.url)
        await self.client.__aenter__()
        names = {a.lora_name for a in (await self.client.list_adapters()).adapters}
        for name, adapter in ADAPTER_OF.items():
            if name not in names:
                await self.client.load_lora_adapter(name, str(self.model.adapters[adapter]))
        params = {"max_tokens": 400, "temperature": 0.0, "ignore_eos": True}
        self.stop = asyncio.Event()

        async def stream() -> None:  # one sample after another, so all stay in flight
            while not self.stop.is_set():
                await self.client.sample_with_retry(
                    self.prompt, sampling_params=params, lora_name=PAUSED
                )

        self.load = [asyncio.create_task(stream()) for _ in range(self.in_flight)]
        self.conn, child = multiprocessing.get_context("spawn").Pipe()
        self.process = multiprocessing.get_context("spawn").Process(
            target=_probe_main, args=(self.url, self.probe.tenant, self.prompt, child)
        )
        self.process.start()
        await asyncio.get_running_loop().run_in_executor(None, self.conn.recv)
        return self

    async def round(self, pauses: int) -> None:
        client, began = self.client, time.monotonic()
        windows: list[tuple[float, float]] = []
        client_ms: list[float] = []
        server_ms: list[float] = []
        aborted: list[int] = []
        for _ in range(pauses):
            await wait_engine_requests(client, PAUSED, self.in_flight)
            started = time.monotonic()
            (ack,) = await client.pause_generation(lora_name=PAUSED)
            client_ms.append((time.monotonic() - started) * 1000)
            server_ms.append(ack.drain_seconds * 1000)
            aborted.append(ack.aborted)  # a stream between two samples may miss one
            await client.resume_generation(lora_name=PAUSED)
            windows.append((started, time.monotonic()))
        self.rounds.append(_Round(began, time.monotonic(), windows, client_ms, server_ms, aborted))

    async def __aexit__(self, *exc: object) -> None:
        self.stop.set()
        loop = asyncio.get_running_loop()
        self.conn.send("stop")
        self.probe.streams += await loop.run_in_executor(None, self.conn.recv)
        await loop.run_in_executor(None, self.process.join)
        await self.client.resume_generation(lora_name=PAUSED)
        for task in self.load:  # their requests end as their connections close
            task.cancel()
        await asyncio.gather(*self.load, return_exceptions=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # gone before another load starts
            (state,) = [
                a for a in (await self.client.list_adapters()).adapters if a.lora_name == PAUSED
            ]
            if not state.engine_requests:
                break
            await asyncio.sleep(0.05)
        await self.client.__aexit__(None, None, None)

    def figures(self) -> PauseLatency:
        client_tails, server_tails, probe_tails, outside_max, aborted = [], [], [], [], []
        for r in self.rounds:
            across, outside = split_gaps(self.probe.gaps(r.began, r.ended), r.windows)
            check_count("probe gaps", len(across), 1, "probe token gaps over pauses")
            check_count("probe gaps outside", len(outside), 1, "probe token gaps outside pauses")
            client_tails.append(Tail.of(r.client_ms))
            server_tails.append(Tail.of(r.server_ms))
            probe_tails.append(Tail.of(across))
            outside_max.append(max(outside))
            aborted += r.aborted
        pauses = len(self.rounds[0].windows)
        return PauseLatency(
            len(self.rounds),
            pauses,
            self.in_flight,
            client_tails,
            server_tails,
            probe_tails,
            aborted,
            outside_max,
        )


async def run(
    url: str, model: Any, prompt: list[int], rounds: int = 3, pauses: int = 50, in_flight: int = 64
) -> PauseLatency:
    async with _Load(url, model, prompt, in_flight) as load:
        for _ in range(rounds):
            await load.round(pauses)
    return load.figures()


#: The gate as it paced a resume before it waited for the late backlog.
WINDOW_ONLY = ("--resume-backlog-s", "0", "--resume-step-wait-max-ms", "50")


async def ab(
    urls: dict[str, str], model: Any, prompt: list[int], rounds: int, pauses: int, in_flight: int
) -> dict[str, PauseLatency]:
    """Each server's rounds in turn (one load at a time: the cores are shared)."""
    loads = {name: _Load(url, model, prompt, in_flight) for name, url in urls.items()}
    for _ in range(rounds):
        for load in loads.values():
            async with load:
                await load.round(pauses)
    return {name: load.figures() for name, load in loads.items()}


#: Issue 67's bar on a GPU: the probe's longest gap across a pause at most
#: this far over its longest gap outside pauses (median over rounds).
GPU_EXCESS_TARGET_MS = 10.0
#: The random model's adapters' rank, and the largest the GPU server takes.
GPU_RANK = 16
#: The issue's counts of tenant A's requests in flight, measured on a GPU.
GPU_IN_FLIGHT = [64, 256]


def _report(name: str, p: PauseLatency) -> str:
    t, o, e = p.probe_spread["max"], p.probe_outside, p.probe_excess
    return (
        f"{name}: probe's longest gap across a pause {t.median:.1f} ms ({t.min:.1f}-{t.max:.1f}),"
        f" outside pauses {o.median:.1f} ({o.min:.1f}-{o.max:.1f}),"
        f" excess {e.median:.1f} ({e.min:.1f}-{e.max:.1f}); pause p99"
        f" {p.client_spread['p99'].median:.1f} ms; {p.rounds} rounds x {p.pauses} pauses,"
        f" {p.in_flight} in flight"
    )


def run_cpu(args: argparse.Namespace) -> dict[str, PauseLatency]:
    """The embedded model on CPU (twice with ``--ab``), each in-flight count in turn;
    figures named by server, and by count where there are several."""
    from benchmarks.common import collector_paused, greeting_prompt
    from skyrl_lora.server.cluster.local import embedded_server

    extra = ["--max-loras", "8"]
    res: dict[str, PauseLatency] = {}
    with contextlib.ExitStack() as stack:
        url, model = stack.enter_context(embedded_server(extra=extra))
        urls = {"paced": url}
        if args.ab:
            old_url, _ = stack.enter_context(embedded_server(extra=[*extra, *WINDOW_ONLY]))
            urls = {"backlog paced": url, "window only": old_url}
        prompt = greeting_prompt(model)
        for n in args.in_flight:
            with collector_paused():
                if args.ab:
                    got = asyncio.run(ab(urls, model, prompt, args.rounds, args.pauses, n))
                else:
                    got = {
                        "paced": asyncio.run(run(url, model, prompt, args.rounds, args.pauses, n))
                    }
            for name, figures in got.items():
                res[name if len(args.in_flight) == 1 else f"{name}, {n} in flight"] = figures
    return res


def gpu_server_argv(model: EmbeddedModel, gpu_mem: float) -> list[str]:
    """``skyrl-lora serve`` flags for ``--gpu``: the random model in this process
    tree (``--no-ray``) with tenant A's and the probe's adapters loaded at its
    start, two LoRA slots, ``gpu_mem`` of the GPU, and engine_rate's CUDA graph
    sizes (a start minutes shorter than vLLM's 67); the step budget is
    ``serve``'s own on a GPU (the largest graph)."""
    from benchmarks.engine_rate import CAPTURE_SIZES
    from skyrl_lora.server.presets import random_model_server_argv

    modules = [f"{name}={model.adapters[adapter]}" for name, adapter in ADAPTER_OF.items()]
    graphs = json.dumps({"cudagraph_capture_sizes": CAPTURE_SIZES})
    return [
        "--no-ray",
        *random_model_server_argv(
            model.model_dir,
            max_lora_rank=GPU_RANK,
            max_loras=len(ADAPTER_OF),
            gpu_memory_utilization=gpu_mem,
            extra=["--lora-modules", *modules, "--compilation-config", graphs],
        ),
    ]


def run_gpu(args: argparse.Namespace) -> dict[str, Any]:
    """One server on the GPU, each in-flight count in rounds of its own against it.

    The JSON is written after each count, so a run cut short keeps what it measured.
    """
    from benchmarks.common import collector_paused, greeting_prompt
    from skyrl_lora.server.cluster.process import serving
    from skyrl_lora.server.embedded.random_model import build_random_model

    size = args.size
    args.work.mkdir(parents=True, exist_ok=True)
    built = time.monotonic()
    model = build_random_model(args.work, rank=GPU_RANK, size=size)
    argv = gpu_server_argv(model, args.gpu_mem)
    result: dict[str, Any] = {
        "commit": args.commit,
        "date": time.strftime("%Y-%m-%d"),
        "machine": args.machine,
        "size": size,
        "server_flags": argv,
        "model_build_s": round(time.monotonic() - built, 1),
        "excess_target_ms": GPU_EXCESS_TARGET_MS,
        "in_flight": {},
    }
    # A compile cache of its own, as engine_rate's servers: vLLM keys it by the
    # model, not by the LoRA kernels its graphs call.
    env = {"VLLM_CACHE_ROOT": str(args.work / "vllm-cache")}
    started = time.monotonic()
    with serving(argv, args.log or args.work / "server.log", timeout_s=900, env=env) as server:
        result["server_start_s"] = round(time.monotonic() - started, 1)
        print(f"server up in {result['server_start_s']} s", flush=True)
        prompt = greeting_prompt(model)
        for n in args.in_flight:
            with collector_paused():
                figures = asyncio.run(run(server.url, model, prompt, args.rounds, args.pauses, n))
            summary = figures.summary
            summary["meets_target"] = summary["probe_gap_excess_ms"] <= GPU_EXCESS_TARGET_MS
            result["in_flight"][str(n)] = summary
            verdict = "meets" if summary["meets_target"] else "MISSES"
            print(f"{_report(size, figures)}; {verdict} +{GPU_EXCESS_TARGET_MS:g} ms", flush=True)
            if args.json:
                args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.pause_latency", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--ab", action="store_true", help="against the window-only pacing (CPU)")
    parser.add_argument("--rounds", type=int, default=3, help="per in-flight count")
    parser.add_argument("--pauses", type=int, default=30, help="per round")
    parser.add_argument(
        "--in-flight",
        type=int_list,
        help="tenant A's requests in flight, comma-separated, each in rounds of its own"
        f" (default 64; {','.join(map(str, GPU_IN_FLIGHT))} with --gpu)",
    )
    parser.add_argument("--json", type=Path, help="write the figures here")
    gpu = parser.add_argument_group("--gpu: one skyrl-lora serve on CUDA vLLM")
    gpu.add_argument("--gpu", action="store_true", help="serve the random perf model on a GPU")
    gpu.add_argument("--size", help="the random model's shape (0.8b, 8b; default 0.8b)")
    gpu.add_argument("--gpu-mem", type=float, default=0.3, help="the server's GPU share")
    gpu.add_argument(
        "--work",
        type=Path,
        default=Path("/tmp/pause-latency"),
        help="where the model, its adapters and vLLM's compile cache go",
    )
    gpu.add_argument("--log", type=Path, help="the server's log (default: under --work)")
    gpu.add_argument("--machine", default="", help="the GPU machine, for the JSON")
    gpu.add_argument("--commit", default=current_commit(), help="default: the checkout's")
    args = parser.parse_args(argv)
    if args.gpu and args.ab:
        parser.error("--ab serves the embedded model twice on CPU; not with --gpu")
    if args.gpu:
        from skyrl_lora.server.embedded.random_model import DEFAULT_SIZE, SIZES

        args.size = args.size or DEFAULT_SIZE
        if args.size not in SIZES:
            parser.error(f"--size {args.size}: choose from {', '.join(sorted(SIZES))}")
    else:
        given = [f for f in ("size", "log", "machine") if getattr(args, f)]
        if given:
            parser.error(f"--{given[0]} is for --gpu only")
    if args.in_flight is None:
        args.in_flight = GPU_IN_FLIGHT if args.gpu else [64]
    if not args.in_flight or min(args.in_flight) < 1:
        parser.error(f"--in-flight takes counts of 1 or more, not {args.in_flight}")
    if args.rounds < 1 or args.pauses < 1:
        parser.error("--rounds and --pauses take 1 or more")
    return args


def main() -> None:
    args = parse_args()
    if args.gpu:
        run_gpu(args)
        return
    res = run_cpu(args)
    for name, figures in res.items():
        print(_report(name, figures))
    if args.json:
        with open(args.json, "w") as out:
            json.dump({n: f.summary for n, f in res.items()}, out, indent=2)


if __name__ == "__main__":
    main()
