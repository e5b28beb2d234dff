"""Where the others' inter-token gap tail comes from (probe).

Serves with gap_hooks (gap_server.py), runs the perf test's load (3 other
tenants in their own processes, 4 streamed + 12 token-in loops each, the
swapper's 16 loops), phases: no swaps, a swap per second (hold 0.3 s), no
swaps. Each streamed token is then timed at four points:

  E  the engine core built the EngineCoreOutputs holding it
  R  the API server's output processor got it
  W  the API server handed its SSE chunk to uvicorn
  C  the client read the chunk

and every client gap over a threshold is split into the engine's own gap and
the change of each leg's latency (R-E, W-R, C-W) between the two tokens.

usage: python scripts/probes/gap_legs.py [--cpu]     (writes into $OUT or /tmp/gap)
"""
from __future__ import annotations

import asyncio
import glob
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, os.getcwd())
import aiohttp  # noqa: E402

from benchmarks.common import TokenMeter, collector_paused, completion_lengths, keep_sampling  # noqa: E402
from skyrl_lora.client import RemoteInferenceClient  # noqa: E402

CPU = "--cpu" in sys.argv
OUT = Path(os.environ.get("OUT") or "/tmp/gap")
MAX_TOKENS = 32 if CPU else 128
PROMPT = list(range(10, 74))
STREAMED, BULK, SWAPPER_LOOPS = (2, 4, 4) if CPU else (4, 12, 16)
WARM_S, A_S, B_S, C_S = (float(x) for x in os.environ.get("GAP_PHASES", "8,20,20,8").split(","))
BIG_MS = float(os.environ.get("GAP_BIG_MS", "25"))


def server_argv() -> tuple[list[str], dict[str, str], str, list[str], list[str]]:
    """(argv, env, swapper, others, reload paths)."""
    if CPU:
        from skyrl_lora.server.embedded import ensure_embedded_model
        from skyrl_lora.server.presets import CPU_ENV, embedded_server_argv

        model = ensure_embedded_model()
        names = sorted(model.adapters)
        paths = [str(model.adapters[n]) for n in names]
        return embedded_server_argv(model), dict(CPU_ENV), names[0], names[1:4], paths[4:] + paths[:1]
    from gpu_tests.perf_model import ADAPTERS, build_perf_model, write_random_adapter
    from gpu_tests.test_gpu_perf import _argv

    root = Path(tempfile.mkdtemp(prefix="gap-"))
    model = build_perf_model(root)
    paths = [str(write_random_adapter(model.model_dir, root / f"re{i}", 16, 20 + i)) for i in (1, 2)]
    argv = _argv(model.model_dir, [f"{n}={p}" for n, p in model.adapters.items()])
    return argv, {}, ADAPTERS[0], list(ADAPTERS[1:4]), paths


def start_server(argv: list[str], env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    log = open(OUT / "gap_server.log", "w")
    extra = os.environ.get("GAP_EXTRA", "").split()
    proc = subprocess.Popen(
        [sys.executable, "scripts/probes/gap_server.py", "serve", "--no-ray", *argv, *extra],
        stdout=subprocess.PIPE, stderr=log, text=True,
        env={**os.environ, **env, "GAP_OUT": str(OUT), "PYTHONUNBUFFERED": "1"},
    )
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited {proc.returncode}; see {log.name}")
            continue
        log.write(line)
        if "server ready at" in line:
            threading.Thread(target=lambda: [log.write(x) for x in proc.stdout], daemon=True).start()
            return proc, line.rsplit(" ", 1)[-1].strip()
    raise TimeoutError("server not ready")


# ---------------------------------------------------------------- tenants
async def _one_stream(session, url, body, chunks) -> None:
    async with session.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            now = time.monotonic()
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", ()):
                ids = choice.get("token_ids") or []
                chunks.append((chunk["id"], now, len(ids)))


async def _tenant(url: str, tenant: str, stop) -> list:
    chunks: list = []
    meter = TokenMeter()
    stopped = asyncio.Event()
    body = {"model": tenant, "prompt": PROMPT, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session, \
            RemoteInferenceClient(url) as client:
        async def loop(i: int) -> None:
            for n in completion_lengths(MAX_TOKENS, 0.5, seed=f"{tenant}:{i}"):
                if stopped.is_set():
                    return
                await _one_stream(session, url, {**body, "max_tokens": n}, chunks)

        load = asyncio.gather(*(loop(i) for i in range(STREAMED)),
                              keep_sampling(client, tenant, PROMPT, meter, stopped, BULK, MAX_TOKENS, 0.5))
        while not stop.is_set():
            await asyncio.sleep(0.05)
        stopped.set()
        await load
    return chunks


def tenant_main(url: str, tenant: str, stop, conn) -> None:
    with collector_paused():
        chunks = asyncio.run(_tenant(url, tenant, stop))
    conn.send(chunks)


# ---------------------------------------------------------------- driver
async def drive(url: str, swapper: str, paths: list[str]) -> dict[str, tuple[float, float]]:
    meter = TokenMeter()
    stopped = asyncio.Event()
    async with RemoteInferenceClient(url) as client:
        load = asyncio.create_task(keep_sampling(client, swapper, PROMPT, meter, stopped, SWAPPER_LOOPS, MAX_TOKENS, 0.5))
        await asyncio.sleep(WARM_S)
        phases = {}
        t = time.monotonic()
        await asyncio.sleep(A_S)
        phases["A_no_swap"] = (t, time.monotonic())
        t = time.monotonic()
        swaps = []
        i = 0
        while time.monotonic() < t + B_S:
            s = time.monotonic()
            await client.pause_generation(lora_name=swapper)
            await asyncio.sleep(0.3)
            await client.reload_lora_adapter(swapper, paths[i % 2])
            await client.resume_generation(lora_name=swapper)
            swaps.append((s, time.monotonic()))
            i += 1
            await asyncio.sleep(max(0.0, s + 1.0 - time.monotonic()))
        phases["B_swaps"] = (t, time.monotonic())
        t = time.monotonic()
        await asyncio.sleep(C_S)
        phases["C_no_swap"] = (t, time.monotonic())
        stopped.set()
        await load
    phases["swaps"] = swaps
    return phases


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def show(label: str, xs_s: list[float]) -> None:
    xs = [x * 1000 for x in xs_s]
    if xs:
        print(f"  {label:44s} n {len(xs):6d}  p50 {statistics.median(xs):6.2f}  p99 {pct(xs, 0.99):6.2f}  max {max(xs):6.2f} ms")


def analyze(client_chunks: list, phases: dict) -> None:
    rows = []
    for f in glob.glob(str(OUT / "gap_*.jsonl")):
        pid = f.rsplit("_", 1)[1].split(".")[0]
        rows += [(pid, json.loads(line)) for line in open(f)]
    by = defaultdict(list)
    for pid, r in rows:
        by[r[0]].append((pid, r))
    print("rows:", {k: len(v) for k, v in by.items()})
    E, R, W, C = (defaultdict(list) for _ in range(4))
    for _, (_, ets, now, seen) in by["recv"]:
        for ext, n in seen:
            E[ext] += [ets] * n
            R[ext] += [now] * n
    for _, (_, t0, t1, body) in by["w"]:
        for line in body.split("\n"):
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                for ch in chunk.get("choices", ()):
                    n = len(ch.get("token_ids") or [])
                    W[f"{chunk['id']}-{ch.get('index', 0)}"] += [t0] * n
    for cid, t, n in client_chunks:
        C[f"{cid}-0"] += [t] * n
    swaps = phases.pop("swaps")

    def in_swap(t: float) -> bool:
        return any(a - 0.005 <= t <= b + 0.005 for a, b in swaps)

    for name, (lo, hi) in phases.items():
        for label, keep in (("", lambda t: True),) if not name.startswith("B") else (
                ("during swaps", in_swap), ("outside swaps", lambda t: not in_swap(t))):
            print(f"\n== {name} {label} ({hi - lo:.0f} s)")
            gaps = {k: [] for k in "ERWC"}
            legs = {"R-E": [], "W-R": [], "C-W": []}
            big = []
            for rid, cs in C.items():
                es, rs, ws = E.get(rid), R.get(rid), W.get(rid)
                if not es or not ws or len(es) < len(cs) or len(ws) < len(cs):
                    continue
                for k in range(1, len(cs)):
                    if not (lo <= cs[k - 1] and cs[k] < hi and keep(cs[k])):
                        continue
                    if cs[k] == cs[k - 1]:
                        continue  # same chunk
                    g = {"E": es[k] - es[k - 1], "R": rs[k] - rs[k - 1], "W": ws[k] - ws[k - 1], "C": cs[k] - cs[k - 1]}
                    for x in g:
                        gaps[x].append(g[x])
                    legs["R-E"].append(rs[k] - es[k])
                    legs["W-R"].append(ws[k] - rs[k])
                    legs["C-W"].append(cs[k] - ws[k])
                    if g["C"] * 1000 > BIG_MS:
                        big.append((g["C"], g["E"], (rs[k] - es[k]) - (rs[k - 1] - es[k - 1]),
                                    (ws[k] - rs[k]) - (ws[k - 1] - rs[k - 1]),
                                    (cs[k] - ws[k]) - (cs[k - 1] - ws[k - 1]), es[k - 1], cs[k]))
            for x, label2 in (("E", "gap at engine (E)"), ("R", "gap at API output processor (R)"),
                              ("W", "gap at API write (W)"), ("C", "gap at client (C)")):
                show(label2, gaps[x])
            for x, v in legs.items():
                show(f"latency {x}", v)
            if big:
                n = len(big)
                sums = [sum(b[i] for b in big) for i in range(1, 5)]
                tot = sum(b[0] for b in big)
                print(f"  client gaps > {BIG_MS:.0f} ms: {n}; share of their time: engine gap {sums[0] / tot:.0%},"
                      f" E->R {sums[1] / tot:.0%}, R->W {sums[2] / tot:.0%}, W->C {sums[3] / tot:.0%}")
                print("  worst (C gap = E gap + dE->R + dR->W + dW->C, ms; t at E rel. phase):")
                seen_e = set()
                for b in sorted(big, reverse=True)[:12]:
                    print(f"    {b[0]*1000:6.1f} = {b[1]*1000:6.1f} + {b[2]*1000:6.1f} + {b[3]*1000:6.1f} + {b[4]*1000:6.1f}   t {b[5] - lo:7.3f}")
                    if b[1] > 0.015 and b[5] not in seen_e and len(seen_e) < 5:
                        seen_e.add(b[5])
                        inside = sorted((r[1], r[0], r[2]) for tag in ("sched", "exec", "samp", "upd", "input", "gc", "step")
                                        for _, r in by[tag] if b[5] - 0.001 <= r[1] <= b[5] + b[1] and r[2] > 0.0005)
                        print("       engine between:", " ".join(f"{tag}@{(t - b[5]) * 1000:.0f}:{d * 1000:.1f}" for t, tag, d in inside[:30]))
            # engine steps and process-level pauses in this phase
            steps = [(r[1], r[2]) for _, r in by["step"] if lo <= r[1] < hi and keep(r[1])]
            show("engine step duration", [d for _, d in steps])
            st = sorted(steps)
            show("engine step start-to-start", [b[0] - a[0] for a, b in zip(st, st[1:])])
            show("engine idle between steps", [b[0] - (a[0] + a[1]) for a, b in zip(st, st[1:])])
            for tag, label3 in (("sched", "scheduler.schedule"), ("exec", "model runner execute_model"),
                                ("samp", "model runner sample_tokens"), ("upd", "scheduler.update_from_output"),
                                ("input", "engine input request handling")):
                show(label3, [r[2] for _, r in by[tag] if lo <= r[1] < hi and keep(r[1])])
            encs = [r for _, r in by["enc"] if lo <= r[2] < hi and keep(r[2])]
            show("engine output encode", [r[3] for r in encs])
            show("engine ts -> encode start", [r[2] - r[1] for r in encs])
            lags = [r[2] for _, r in by["lag"] if lo <= r[1] < hi and keep(r[1])]
            print(f"  API loop lateness > 2 ms: {len(lags)}, > 10 ms: {sum(1 for x in lags if x > 0.01)}, max {max(lags, default=0) * 1000:.1f} ms")
            for pid in sorted({p for p, _ in by["gc"]}):
                gcs = [r for p, r in by["gc"] if p == pid and lo <= r[1] < hi and keep(r[1])]
                if gcs:
                    print(f"  gc pid {pid}: {len(gcs)} over 1 ms, max {max(r[2] for r in gcs) * 1000:.1f} ms, gens {sorted({r[3] for r in gcs})}")
    stagings_by_mode(client_chunks, by)


def stagings_by_mode(client_chunks: list, by: dict) -> None:
    """Per staging-yield mode ($GAP_YIELD_MODES): the staging's length, the engine's
    longest step and the others' longest client gap overlapping it; and the same
    for a window as long 0.5 s later (no swap running: the control)."""
    stages = [r for _, r in by["stage"]]
    if not stages:
        return
    per_request = defaultdict(list)
    for cid, t, n in client_chunks:
        per_request[cid].append(t)
    gaps = sorted((a, b) for ts in per_request.values() for a, b in zip(sorted(ts), sorted(ts)[1:]) if b > a)
    steps = [(r[1], r[1] + r[2]) for _, r in by["step"]]

    def longest(spans, lo, hi):
        return max(((b - a) * 1000 for a, b in spans if b > lo and a < hi), default=float("nan"))

    rows = defaultdict(list)
    for _, t0, dur, mode in stages:
        if dur > 0:
            rows[mode].append((dur * 1000, longest(steps, t0, t0 + dur), longest(gaps, t0, t0 + dur),
                               longest(steps, t0 + 0.5, t0 + 0.5 + dur), longest(gaps, t0 + 0.5, t0 + 0.5 + dur)))
    print("\n== stagings by yield mode (ms: median / max over stagings)")
    print(f"  {'mode':8s} {'n':>3s}  {'staging':>13s}  {'engine step':>13s}  {'client gap':>13s}  |  control: {'step':>13s}  {'gap':>13s}")
    for mode, vals in rows.items():
        cols = list(zip(*vals))
        fmt = lambda xs: f"{statistics.median(xs):5.1f} / {max(xs):5.1f}"  # noqa: E731
        print(f"  {mode:8s} {len(vals):3d}  {fmt(cols[0])}  {fmt(cols[1])}  {fmt(cols[2])}  |  control: {fmt(cols[3])}  {fmt(cols[4])}")


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for old in glob.glob(str(OUT / "gap_*")) + [str(OUT / "dump")]:
        if os.path.exists(old):
            os.remove(old)
    argv, env, swapper, others, paths = server_argv()
    proc, url = start_server(argv, env)
    print("server at", url, flush=True)
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    tenants = []
    for name in others:
        rcv, snd = ctx.Pipe(duplex=False)
        p = ctx.Process(target=tenant_main, args=(url, name, stop, snd), daemon=True)
        p.start()
        tenants.append((p, rcv))
    try:
        with collector_paused():
            phases = asyncio.run(drive(url, swapper, paths))
        stop.set()
        chunks = []
        for p, rcv in tenants:
            chunks += rcv.recv()
            p.join(30)
        (OUT / "dump").write_text("")
        deadline = time.monotonic() + 60
        while len(glob.glob(str(OUT / "gap_*.done"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(2)
    finally:
        proc.terminate()
        proc.wait(60)
    json.dump({"phases": phases, "chunks": chunks}, open(OUT / "gap_client.json", "w"))
    analyze(chunks, phases)


if __name__ == "__main__":
    main()
