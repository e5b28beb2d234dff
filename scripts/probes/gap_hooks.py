"""Timestamps along one token's way, installed in the server's processes (probe).

Imported at the top of ``gap_server.py``, so it runs in the API server and
(fork or spawn) in the engine core process. Records, per process, into a
list that a daemon thread writes out once ``$GAP_OUT/dump`` appears:

  step  t0 dur                       engine core: one busy-loop step (scheduling + model + outputs)
  enc   engine_ts t0 dur             engine core output thread: msgpack encode of one EngineCoreOutputs
  recv  engine_ts now [[id, n], ..]  API server: OutputProcessor.process_outputs (streamed ids only)
  w     t0 t1 body                   API server: ASGI body write of /v1/completions (before / after send)
  gc    t0 dur gen                   any process: a collection over 1 ms
  lag   t0 dur                       API server: event-loop lateness over 2 ms (sampled every 2 ms)
  stage t0 dur mode                  engine: one adapter staging, with the staging-yield mode it ran
                                     under ($GAP_YIELD_MODES, e.g. "off,0.5/1": cycled per staging,
                                     slice/nap in ms; the server must start with staging yield on)

``time.monotonic`` is CLOCK_MONOTONIC: one clock for every process.
"""
from __future__ import annotations

import asyncio
import gc
import json
import os
import sys
import threading
import time

OUT = os.environ.get("GAP_OUT", "/tmp")
_rows: list = []
_pid = [0]
_gc_t = [0.0]


def _rec(row: tuple) -> None:
    if _pid[0] != os.getpid():
        _pid[0] = os.getpid()
        _rows.clear()  # a forked child inherits the parent's rows
        threading.Thread(target=_dump_when_asked, daemon=True).start()
    _rows.append(row)


def _dump_when_asked() -> None:
    flag = os.path.join(OUT, "dump")
    while not os.path.exists(flag):
        time.sleep(0.5)
    rows = list(_rows)
    from collections import Counter

    objs = gc.get_objects()
    top = Counter(type(o).__qualname__ for o in objs).most_common(25)
    rows.append(("heap", time.monotonic(), len(objs), top, gc.get_freeze_count(), gc.get_count(), gc.get_threshold()))
    del objs
    with open(os.path.join(OUT, f"gap_{os.getpid()}.jsonl"), "w") as f:
        for r in rows:
            f.write(json.dumps([x.decode(errors="replace") if isinstance(x, bytes) else x for x in r]) + "\n")
    with open(os.path.join(OUT, f"gap_{os.getpid()}.done"), "w") as f:
        f.write(str(len(rows)))


def _gc_cb(phase: str, info: dict) -> None:
    if phase == "start":
        _gc_t[0] = time.monotonic()
    else:
        d = time.monotonic() - _gc_t[0]
        if d > 0.001:
            _rec(("gc", _gc_t[0], d, info.get("generation")))


gc.callbacks.append(_gc_cb)


def _time_method(module: str, cls: str, name: str, tag: str) -> None:
    """Record ("tag", t0, dur) around every call of module.cls.name (if it exists)."""
    import importlib

    try:
        klass = getattr(importlib.import_module(module), cls)
        orig = getattr(klass, name)
    except (ImportError, AttributeError) as exc:
        print(f"gap_hooks: cannot time {module}.{cls}.{name}: {exc}", file=sys.stderr)
        return

    def timed(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        t0 = time.monotonic()
        try:
            return orig(self, *args, **kwargs)
        finally:
            _rec((tag, t0, time.monotonic() - t0))

    setattr(klass, name, timed)


def _patch_engine_core() -> None:
    from vllm.v1.engine import core

    _time_method("vllm.v1.core.sched.scheduler", "Scheduler", "schedule", "sched")
    _time_method("vllm.v1.core.sched.scheduler", "Scheduler", "update_from_output", "upd")
    _time_method("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "execute_model", "exec")
    _time_method("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "sample_tokens", "samp")
    _time_method("vllm.v1.engine.core", "EngineCoreProc", "_handle_client_request", "input")

    step = core.EngineCoreProc._process_engine_step

    def timed_step(self):  # type: ignore[no-untyped-def]
        t0 = time.monotonic()
        r = step(self)
        _rec(("step", t0, time.monotonic() - t0))
        return r

    core.EngineCoreProc._process_engine_step = timed_step
    try:
        from vllm.v1 import serial_utils
    except ImportError:
        return
    enc = serial_utils.MsgpackEncoder.encode_into

    def timed_encode(self, obj, buf):  # type: ignore[no-untyped-def]
        t0 = time.monotonic()
        r = enc(self, obj, buf)
        ts = getattr(obj, "timestamp", None)
        if ts is not None:
            _rec(("enc", ts, t0, time.monotonic() - t0))
        return r

    serial_utils.MsgpackEncoder.encode_into = timed_encode


def _patch_output_processor() -> None:
    from vllm.v1.engine import output_processor as op

    process = op.OutputProcessor.process_outputs

    def timed_process(self, outputs, engine_core_timestamp=None, *args, **kwargs):  # type: ignore[no-untyped-def]
        now = time.monotonic()
        seen = []
        for o in outputs:
            st = self.request_states.get(o.request_id)
            ext = getattr(st, "external_req_id", None) if st is not None else None
            if ext and ext.startswith("cmpl-") and o.new_token_ids:
                seen.append((ext, len(o.new_token_ids)))
        if seen:
            _rec(("recv", engine_core_timestamp, now, tuple(seen)))
        return process(self, outputs, engine_core_timestamp, *args, **kwargs)

    op.OutputProcessor.process_outputs = timed_process


class _WriteTimes:
    """ASGI wrapper: when each streamed /v1/completions chunk is handed to uvicorn."""

    def __init__(self, app) -> None:  # type: ignore[no-untyped-def]
        self.app = app
        self.state = app.state

    async def __call__(self, scope, receive, send):  # type: ignore[no-untyped-def]
        if scope["type"] != "http" or scope.get("path") != "/v1/completions":
            await self.app(scope, receive, send)
            return

        async def timed_send(message):  # type: ignore[no-untyped-def]
            if message["type"] == "http.response.body" and message.get("body"):
                t0 = time.monotonic()
                await send(message)
                _rec(("w", t0, time.monotonic(), bytes(message["body"])))
            else:
                await send(message)

        await self.app(scope, receive, timed_send)


async def _lag_sampler() -> None:
    while True:
        t = time.monotonic()
        await asyncio.sleep(0.002)
        late = time.monotonic() - t - 0.002
        if late > 0.002:
            _rec(("lag", t, late))


def _patch_app() -> None:
    from skyrl_lora.server.http import app as skyapp

    build = skyapp.build_skyrl_app

    async def wrapped(engine_client, args):  # type: ignore[no-untyped-def]
        app, gated = await build(engine_client, args)
        asyncio.get_running_loop().create_task(_lag_sampler())
        return _WriteTimes(app), gated

    skyapp.build_skyrl_app = wrapped


def _patch_staging() -> None:
    """Cycle the staging-yield modes of $GAP_YIELD_MODES, one per staging (a within-run A/B)."""
    modes = [m for m in os.environ.get("GAP_YIELD_MODES", "").split(",") if m]
    from skyrl_lora.server.loading import staging
    from skyrl_lora.server.loading.staging_yield import StagingYield

    configs = []
    for mode in modes:
        if mode == "off":
            configs.append(None)
        else:
            slice_ms, nap_ms = (float(x) for x in mode.split("/"))
            configs.append(StagingYield(slice_s=slice_ms / 1000, nap_s=nap_ms / 1000))
    load = staging._WorkerStaging._timed_load
    count = [0]

    def cycled(self, lora_request):  # type: ignore[no-untyped-def]
        mode = "default"
        if not hasattr(self, "_gap_yield_on"):  # its yield points are in place
            self._gap_yield_on = self.yield_points.config is not None
        if configs and self._gap_yield_on:
            i = count[0] % len(configs)
            count[0] += 1
            self.yield_points.config = configs[i]
            mode = modes[i]
        t0 = time.monotonic()
        try:
            return load(self, lora_request)
        finally:
            _rec(("stage", t0, time.monotonic() - t0, mode))

    staging._WorkerStaging._timed_load = cycled


def install() -> None:
    _patch_staging()
    _patch_engine_core()
    _patch_output_processor()
    _patch_app()
