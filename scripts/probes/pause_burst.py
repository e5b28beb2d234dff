"""What the API server's event loop does right after a per-adapter pause (probe).

A pause aborts the adapter's requests in flight; their partial samples all come
back at once. This serves the embedded model (CPU) or the perf model (GPU),
keeps N non-streamed requests of the swapper in flight and a few streams of
another tenant, pauses and resumes the swapper many times, and profiles the
API process's event-loop thread with cProfile for PROFILE_MS after each pause
call reaches the server (cProfile sees only the thread that enabled it, here
the loop's). Writes the profile's top functions and the stalls the loop
monitor logged.

usage: python scripts/probes/pause_burst.py [--cpu]      (writes into $OUT or /tmp/pb)
"""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.getcwd())
import aiohttp  # noqa: E402

CPU = "--cpu" in sys.argv
OUT = Path(os.environ.get("OUT") or "/tmp/pb")
IN_FLIGHT = int(os.environ.get("PB_IN_FLIGHT", "16"))
PAUSES = int(os.environ.get("PB_PAUSES", "30"))
PROFILE_MS = float(os.environ.get("PB_PROFILE_MS", "60"))
MAX_TOKENS = 128

HOOK = r'''
import cProfile, os, pstats, atexit
def _install():
    from skyrl_lora.server.engine import gated as _engine
    prof = cProfile.Profile()
    state = {"n": 0}
    original = _engine.GatedEngine.pause
    async def pause(self, lora_name):
        import asyncio
        loop = asyncio.get_running_loop()
        prof.enable()
        loop.call_later(float(os.environ["PB_PROFILE_MS"]) / 1000, prof.disable)
        state["n"] += 1
        return await original(self, lora_name)
    if float(os.environ["PB_PROFILE_MS"]) > 0:
        _engine.GatedEngine.pause = pause
    if os.environ.get("PB_ANSWER_PACING") == "0":
        from skyrl_lora.server.engine import gate as _gate
        init = _gate.AdapterGate.__init__
        def unpaced(self, *args, **kwargs):
            kwargs["answer_pacing"] = None
            init(self, *args, **kwargs)
        _gate.AdapterGate.__init__ = unpaced
    def dump():
        if state["n"]:
            prof.dump_stats(os.environ["PB_PROFILE_OUT"])
    atexit.register(dump)
    import signal
    previous = signal.getsignal(signal.SIGTERM)
    def on_term(signum, frame):
        dump()
        if callable(previous):
            previous(signum, frame)
        else:
            raise SystemExit(0)
    signal.signal(signal.SIGTERM, on_term)
_install()
'''


def serve() -> tuple[list[str], dict[str, str], str, str, list[int]]:
    if CPU:
        from skyrl_lora.server.embedded import ensure_embedded_model
        from skyrl_lora.server.presets import CPU_ENV, embedded_server_argv

        model = ensure_embedded_model()
        names = sorted(model.adapters)
        return embedded_server_argv(model, port=8765), dict(CPU_ENV), names[0], names[1], list(range(10, 74))
    from gpu_tests.perf_model import build_perf_model
    from gpu_tests.test_gpu_perf import _argv  # the perf test's server flags

    model = build_perf_model(Path(tempfile.mkdtemp()))
    argv = _argv(model.model_dir, [f"{n}={p}" for n, p in model.adapters.items()])
    argv[argv.index("--port") + 1] = "8765"
    names = sorted(model.adapters)
    return argv, {}, names[0], names[1], list(range(10, 74))


async def main() -> None:
    argv, env, swapper, other, prompt = serve()
    OUT.mkdir(parents=True, exist_ok=True)
    hook_dir = Path(tempfile.mkdtemp())
    (hook_dir / "pb_hook.py").write_text(HOOK)
    (hook_dir / "pb_hook.pth").write_text("import pb_hook\n")
    env = {**os.environ, **env, "PB_PROFILE_MS": str(PROFILE_MS), "PB_PROFILE_OUT": str(OUT / "pause.prof")}
    env["PYTHONPATH"] = f"{hook_dir}:{os.getcwd()}:{env.get('PYTHONPATH', '')}"
    # .pth files are read from site dirs only: run python with the hook dir as one
    log = open(OUT / "server.log", "w")
    cmd = [sys.executable, "-c", f"import site; site.addsitedir({str(hook_dir)!r}); from skyrl_lora.server.cli import main; import sys; sys.exit(main(['serve','--no-ray',*sys.argv[1:]]))", *argv]
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = "http://127.0.0.1:8765"
    try:
        async with aiohttp.ClientSession() as http:
            for _ in range(600):
                try:
                    async with http.get(url + "/health") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(1)
            stop = asyncio.Event()
            gaps: list[tuple[float, float]] = []  # (end, length) of the other tenant's token gaps
            swapper_open = asyncio.Event()  # the client's gate: retries of a paused adapter wait here
            swapper_open.set()

            async def swapper_loop() -> None:
                while not stop.is_set():
                    await swapper_open.wait()
                    body = {"prompt_token_ids": prompt, "lora_name": swapper,
                            "sampling_params": {"max_tokens": MAX_TOKENS, "temperature": 1.0}}
                    async with http.post(url + "/skyrl/v1/sample", json=body) as r:
                        await r.read()
                    if r.status == 409 or r.status == 503:
                        await asyncio.sleep(0.01)

            async def other_stream() -> None:
                while not stop.is_set():
                    body = {"model": other, "prompt": prompt, "max_tokens": MAX_TOKENS, "stream": True,
                            "temperature": 1.0, "ignore_eos": True}
                    last = None
                    async with http.post(url + "/v1/completions", json=body) as r:
                        async for _ in r.content:
                            now = time.perf_counter()
                            if last is not None:
                                gaps.append((now, now - last))
                            last = now

            tasks = [asyncio.create_task(swapper_loop()) for _ in range(IN_FLIGHT)]
            tasks += [asyncio.create_task(other_stream()) for _ in range(4)]
            await asyncio.sleep(5)
            pause_ms = []
            pauses = []
            for _ in range(PAUSES):
                await asyncio.sleep(0.7)
                t0 = time.perf_counter()
                swapper_open.clear()
                async with http.post(url + "/skyrl/v1/pause", json={"lora_name": swapper}) as r:
                    await r.read()
                pause_ms.append((time.perf_counter() - t0) * 1000)
                pauses.append(t0)
                await asyncio.sleep(0.3)
                async with http.post(url + "/skyrl/v1/resume", json={"lora_name": swapper}) as r:
                    await r.read()
                swapper_open.set()
            stop.set()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            pause_ms.sort()
            after = sorted(max((g for end, g in gaps if p < end < p + 0.15), default=0) * 1000 for p in pauses)
            calm = sorted(max((g for end, g in gaps if p + 0.4 < end < p + 0.55), default=0) * 1000 for p in pauses)
            print(f"pause ms p50 {pause_ms[len(pause_ms)//2]:.1f} max {pause_ms[-1]:.1f}; "
                  f"the other tenant's longest gap within 150 ms after a pause: median {after[len(after)//2]:.1f} "
                  f"max {after[-1]:.1f} ms; in 150 ms without a swap: median {calm[len(calm)//2]:.1f} max {calm[-1]:.1f} ms")
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()
    stalls = [l for l in open(OUT / "server.log") if "event_loop_stall" in l]
    print(f"{len(stalls)} loop stalls over 10 ms logged")
    if not (OUT / "pause.prof").exists():
        return
    import pstats

    with open(OUT / "profile.txt", "w") as f:
        stats = pstats.Stats(str(OUT / "pause.prof"), stream=f)
        stats.sort_stats("tottime").print_stats(40)
        stats.sort_stats("cumulative").print_stats(60)
    print(f"profile in {OUT / 'profile.txt'}")


if __name__ == "__main__":
    asyncio.run(main())
