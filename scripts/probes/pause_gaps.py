"""A timeline of the pause-latency row's pauses, as another tenant sees them (probe).

``.venv/bin/python scripts/probes/pause_gaps.py [--pauses N] [--in-flight 64] [--out DIR]
[-- serve flags]`` serves the embedded model (``skyrl-lora serve --embedded --no-ray``,
with ``gap_hooks`` and the hooks below in the API and engine processes),
runs the pause-latency row's load (``in_flight`` looping ``sample_with_retry``
calls of tenant A, one streamed probe of tenant B) and pauses A ``--pauses``
times, each once all of A's requests are in the engine. Then, per pause, it
prints the probe's gap across the pause beside what happened in it, on one
clock (``time.monotonic``, CLOCK_MONOTONIC in every process):

  engine steps (duration, requests, tokens, new requests, prefill tokens),
  the aborts the engine received (when, how many ids, how long),
  requests added to the engine, the API loop's lateness over 2 ms,
  garbage collections over 1 ms,

and the probe's longest gaps outside pauses with their steps. Raw rows go
to ``DIR`` (``gap_<pid>.jsonl``, ``client.json``).
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _rec(row: tuple) -> None:  # type: ignore[type-arg]
    import gap_hooks

    gap_hooks._rec(row)


def _patch_scheduler() -> None:
    """Per step: what it scheduled; aborts and adds, with their sizes."""
    from vllm.v1.core.sched import scheduler as sched

    klass = sched.Scheduler
    schedule, finish, add = klass.schedule, klass.finish_requests, klass.add_request

    def timed_schedule(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        t0 = time.monotonic()
        out = schedule(self, *args, **kwargs)
        scheduled = getattr(out, "num_scheduled_tokens", None) or {}
        _rec(
            (
                "shape",
                t0,
                len(scheduled),
                int(out.total_num_scheduled_tokens),
                len(out.scheduled_new_reqs),
                sum(n for n in scheduled.values() if n > 1),
                len(self.waiting),
                len(self.running),
            )
        )
        return out

    def timed_finish(self, request_ids, finished_status, *args, **kwargs):  # type: ignore[no-untyped-def]
        t0 = time.monotonic()
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids or ())
        try:
            return finish(self, request_ids, finished_status, *args, **kwargs)
        finally:
            _rec(("finish", t0, time.monotonic() - t0, len(ids), str(finished_status)))

    def timed_add(self, request, *args, **kwargs):  # type: ignore[no-untyped-def]
        _rec(("add", time.monotonic(), len(request.prompt_token_ids or ())))
        return add(self, request, *args, **kwargs)

    klass.schedule = timed_schedule
    klass.finish_requests = timed_finish
    klass.add_request = timed_add


def _patch_gated() -> None:
    """API process: each abort call the gate sends, and each pause route's span."""
    from skyrl_lora.server.engine import gated

    abort = gated.GatedEngine.abort_requests
    pause = gated.GatedEngine.pause

    async def timed_abort(self, request_ids):  # type: ignore[no-untyped-def]
        t0 = time.monotonic()
        try:
            return await abort(self, request_ids)
        finally:
            _rec(("api_abort", t0, time.monotonic() - t0, len(request_ids)))

    async def timed_pause(self, lora_name):  # type: ignore[no-untyped-def]
        t0 = time.monotonic()
        try:
            return await pause(self, lora_name)
        finally:
            _rec(("api_pause", t0, time.monotonic() - t0, lora_name))

    gated.GatedEngine.abort_requests = timed_abort
    gated.GatedEngine.pause = timed_pause


def install() -> None:
    import gap_hooks

    gap_hooks._patch_engine_core()
    gap_hooks._patch_output_processor()
    gap_hooks._patch_app()
    _patch_scheduler()
    _patch_gated()


if len(sys.argv) > 1 and sys.argv[1] == "serve":
    install()  # at import, so a spawned engine process (which imports __main__) has it too
elif __name__ == "__mp_main__":
    install()


def _serve() -> int:
    from skyrl_lora.server.cli import main

    return main(sys.argv[1:])


# -- the driver ------------------------------------------------------------------------
def _probe_process(url: str, prompt: list, conn) -> None:  # type: ignore[no-untyped-def,type-arg]
    """The probe tenant in a process of its own, as another tenant would be."""
    import asyncio

    from benchmarks.streams import StreamLog, keep_streaming

    async def go() -> None:
        log = StreamLog("lat-probe")
        stop = asyncio.Event()
        task = asyncio.create_task(keep_streaming(url, log.tenant, prompt, log, stop, 1, 400))
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)
        stop.set()
        await task
        conn.send(log.streams)

    asyncio.run(go())


async def _drive(url: str, pauses: int, in_flight: int, own_process: bool) -> dict:  # type: ignore[type-arg]
    import asyncio
    import multiprocessing

    from benchmarks.common import wait_engine_requests
    from benchmarks.streams import StreamLog, keep_streaming
    from skyrl_lora.client import RemoteInferenceClient
    from skyrl_lora.server.embedded import ensure_embedded_model

    model = ensure_embedded_model()
    from benchmarks.common import greeting_prompt

    prompt = greeting_prompt(model)
    probe = StreamLog("lat-probe")
    windows = []
    async with RemoteInferenceClient(url) as client:
        await client.load_lora_adapter("lat-a", str(model.adapters["meow"]))
        await client.load_lora_adapter(probe.tenant, str(model.adapters["woof"]))
        params = {"max_tokens": 400, "temperature": 0.0, "ignore_eos": True}
        stop = asyncio.Event()

        async def stream() -> None:
            while not stop.is_set():
                await client.sample_with_retry(prompt, sampling_params=params, lora_name="lat-a")

        load = [asyncio.create_task(stream()) for _ in range(in_flight)]
        if own_process:
            parent, child = multiprocessing.Pipe()
            proc = multiprocessing.get_context("spawn").Process(
                target=_probe_process, args=(url, prompt, child)
            )
            proc.start()
        else:
            load.append(
                asyncio.create_task(keep_streaming(url, probe.tenant, prompt, probe, stop, 1, 400))
            )
        lags: list = []  # type: ignore[type-arg]

        async def lag_sampler() -> None:
            while not stop.is_set():
                t = time.monotonic()
                await asyncio.sleep(0.002)
                late = time.monotonic() - t - 0.002
                if late > 0.005:
                    lags.append((t, late))

        load.append(asyncio.create_task(lag_sampler()))
        began = time.monotonic()
        try:
            for _ in range(pauses):
                await wait_engine_requests(client, "lat-a", in_flight)
                t0 = time.monotonic()
                await client.pause_generation(lora_name="lat-a")
                t1 = time.monotonic()
                await client.resume_generation(lora_name="lat-a")
                windows.append((t0, t1, time.monotonic()))
            await asyncio.sleep(2.0)  # the last resume's re-prefill, outside any pause
        finally:
            stop.set()
            await client.resume_generation(lora_name="lat-a")
            await asyncio.gather(*load)
            if own_process:
                parent.send("stop")
                probe.streams = await asyncio.get_running_loop().run_in_executor(None, parent.recv)
                proc.join()
    return {
        "began": began,
        "ended": time.monotonic(),
        "windows": windows,
        "probe": probe.streams,
        "client_lag": lags,
    }


def _load_rows(out: str) -> dict[str, list]:  # type: ignore[type-arg]
    import glob
    import json

    rows: dict[str, list] = {}  # type: ignore[type-arg]
    for path in glob.glob(os.path.join(out, "gap_*.jsonl")):
        with open(path) as f:
            for line in f:
                row = json.loads(line)
                rows.setdefault(row[0], []).append(row)
    for kind in rows:
        rows[kind].sort(key=lambda r: r[1])
    return rows


def _report(client: dict, rows: dict[str, list]) -> None:  # type: ignore[type-arg]
    import itertools

    windows = client["windows"]
    gaps = [
        (a, b)
        for s in client["probe"]
        for (a, _), (b, _) in itertools.pairwise(s)
        if a >= client["began"]
    ]

    def across(gap: tuple[float, float]) -> bool:
        return any(gap[0] < w1 and gap[1] > w0 for w0, w1, _ in windows)

    steps = rows.get("step", [])
    shapes = rows.get("shape", [])

    def describe(t0: float, t1: float, base: float) -> None:
        for kind in ("step", "finish", "api_abort", "api_pause", "lag", "gc"):
            for r in rows.get(kind, []):
                start, dur = r[1], r[2]
                if start + dur >= t0 and start <= t1:
                    extra = ""
                    if kind == "step":
                        sh = [s for s in shapes if start - 0.0005 <= s[1] <= start + dur]
                        if sh:
                            s = sh[0]
                            extra = (
                                f" reqs={s[2]} tok={s[3]} new={s[4]} prefill={s[5]}"
                                f" waiting={s[6]} running={s[7]}"
                            )
                    elif kind in ("finish", "api_abort"):
                        extra = f" n={r[3]}"
                    if kind == "step" and dur < 0.03:
                        continue
                    at = (start - base) * 1000
                    print(f"    {kind:9s} +{at:8.1f} ms  {dur * 1000:7.1f} ms{extra}")
        adds = [r for r in rows.get("add", []) if t0 <= r[1] <= t1]
        if adds:
            print(
                f"    adds: {len(adds)} from +{(adds[0][1] - base) * 1000:.1f} to"
                f" +{(adds[-1][1] - base) * 1000:.1f} ms, prompt tokens {sum(a[2] for a in adds)}"
            )

    print(f"{len(windows)} pauses; probe gaps {len(gaps)}")
    for i, (w0, w1, w2) in enumerate(windows):
        over = [g for g in gaps if g[0] < w1 and g[1] > w0]
        longest = max(over, key=lambda g: g[1] - g[0], default=None)
        if longest is None:
            continue
        g_ms = (longest[1] - longest[0]) * 1000
        print(
            f"pause {i}: answered in {(w1 - w0) * 1000:.1f} ms, resumed +{(w2 - w0) * 1000:.1f};"
            f" probe gap {g_ms:.1f} ms from {(longest[0] - w0) * 1000:+.1f} to"
            f" {(longest[1] - w0) * 1000:+.1f} ms"
        )
        if g_ms > 150 or i < 2:
            describe(longest[0], longest[1], w0)
    outside = sorted((g for g in gaps if not across(g)), key=lambda g: g[0] - g[1])
    print("longest gaps outside pauses:")
    for g in outside[:5]:
        prev = max((w for w in windows if w[0] <= g[0]), default=None, key=lambda w: w[0])
        since = f"{(g[0] - prev[2]) * 1000:.0f} ms after a resume" if prev else ""
        print(f"  {(g[1] - g[0]) * 1000:.1f} ms  {since}")
        describe(g[0], g[1], g[0])
    inside = [(b - a) * 1000 for a, b in gaps if across((a, b))]
    outside_ms = [(b - a) * 1000 for a, b in gaps if not across((a, b))]
    # A probe stream may see no gap across a pause at all (it was between
    # samples then): say so rather than fail on an empty list.
    print(
        f"across pauses: max {max(inside, default=0.0):.1f} ms ({len(inside)} gaps);"
        f" outside: max {max(outside_ms, default=0.0):.1f} ms; steps {len(steps)}"
    )


def main() -> int:
    import argparse
    import asyncio
    import json
    import pathlib
    import re
    import socket
    import subprocess

    parser = argparse.ArgumentParser()
    parser.add_argument("--pauses", type=int, default=10)
    parser.add_argument("--in-flight", type=int, default=64)
    parser.add_argument("--out", default="/tmp/pause_gaps")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--probe-process", action="store_true", help="the probe in its own process")
    parser.add_argument("serve_flags", nargs="*")
    args = parser.parse_args()
    out = pathlib.Path(args.out)
    if args.report_only:
        _report(json.loads((out / "client.json").read_text()), _load_rows(str(out)))
        return 0
    out.mkdir(parents=True, exist_ok=True)
    for f in out.glob("gap_*"):
        f.unlink()
    (out / "dump").unlink(missing_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "GAP_OUT": str(out)}
    log = open(out / "server.log", "w")  # noqa: SIM115 (the server's whole life)
    server = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "serve", "--embedded", "--no-ray",
         "--port", str(port), *args.serve_flags],
        env=env, stdout=subprocess.PIPE, stderr=log, text=True,
    )  # fmt: skip
    try:
        assert server.stdout is not None
        for line in server.stdout:
            if (m := re.search(r"ready at (\S+)", line)) is not None:
                url = m.group(1)
                break
        else:
            raise RuntimeError("the server ended before it was ready; see server.log")
        import threading

        def drain() -> None:  # a full pipe would block the server's next print
            for line in server.stdout:  # type: ignore[union-attr]
                log.write(line)

        threading.Thread(target=drain, daemon=True).start()
        client = asyncio.run(_drive(url, args.pauses, args.in_flight, args.probe_process))
        (out / "client.json").write_text(json.dumps(client))
        (out / "dump").touch()
        deadline = time.monotonic() + 30
        while len(list(out.glob("gap_*.done"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        server.terminate()
        server.wait(60)
    _report(client, _load_rows(str(out)))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        sys.exit(_serve())
    sys.exit(main())
