"""``skyrl-lora``: serve, build the embedded model, run the demo.

``skyrl-lora serve [vllm serve flags]`` starts one server in a local Ray
actor and keeps it up until interrupted; ``--embedded`` fills in the flags
for the embedded tiny model and its adapters, and ``--no-ray`` serves in
this process instead (for machines without Ray, and for debugging).

SIGTERM and SIGINT stop ``serve`` cleanly in both modes: the engine's
requests are aborted, open requests get a few seconds to be answered, the
engine and every process the server started are stopped, and the exit
status is 0. A second signal, or a stop that takes longer than
:data:`FORCED_EXIT_AFTER_S`, exits at once with status 1; the reaper
(:mod:`skyrl_lora.server.reaper`) then stops what is left, as it does when
``serve`` is killed outright.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence

from .telemetry.observability import log_to_stderr

logger = logging.getLogger(__name__)

#: Seconds after the first SIGTERM/SIGINT before ``serve`` gives up on a clean stop.
FORCED_EXIT_AFTER_S = 25.0

#: Flags ``serve`` handles itself, before vLLM's parser sees the rest.
SERVE_USAGE = """\
usage: skyrl-lora serve [--embedded] [--no-ray] [skyrl-lora flags] [vllm serve flags]

  --embedded   serve the embedded tiny model and its adapters (no download)
  --no-ray     serve in this process instead of a local Ray actor

skyrl-lora's own flags (--api-keys, --adapter-root, --adapter-snapshot-dir,
--max-adapter-bytes, --no-push-stream, --no-resume-pacing, --no-answer-pacing,
--no-slot-prefill, --no-gpu-staging, --no-staging-yield, --adapter-reader,
--stall-stacks) and every `vllm serve` flag follow.
"""


def _serve_help() -> int:
    """Print ours and vLLM's flags without starting Ray or an engine.

    The full parser is vLLM's, so this imports vLLM (a few seconds) but
    builds nothing; argparse's own ``--help`` exit is turned into a return code.
    """
    from .http.app import parse_server_args

    print(SERVE_USAGE, flush=True)
    try:
        parse_server_args(["--help"])
    except SystemExit as done:
        return int(done.code or 0)
    return 0


def _serve(raw_argv: Sequence[str]) -> int:
    argv = list(raw_argv)
    if "-h" in argv or "--help" in argv:
        return _serve_help()
    env: dict[str, str] = {}
    if "--embedded" in argv:
        from .embedded import ensure_embedded_model
        from .presets import CPU_ENV, embedded_server_argv

        argv.remove("--embedded")
        port = argv[argv.index("--port") + 1] if "--port" in argv else "8000"
        argv = [
            a for i, a in enumerate(argv) if a != "--port" and (i == 0 or argv[i - 1] != "--port")
        ]
        argv = embedded_server_argv(ensure_embedded_model(), port=int(port), extra=argv)
        env.update(CPU_ENV)
    if "--no-ray" in argv:
        argv.remove("--no-ray")
        return _serve_here(argv, env)

    import ray

    from .cluster.actor import ActorOptions, start_server_actor
    from .reaper import start_reaper

    # Ray's own processes (started by ray.init below) go with us, however we end.
    reaper = start_reaper()
    stop = threading.Event()
    try:
        ray.init(ignore_reinit_error=True)
        on_signals(stop.set)  # after ray.init, which installs a SIGTERM handler of its own
        handle, url = start_server_actor(argv, ActorOptions(env=env))
        print(f"skyrl-lora server ready at {url}", flush=True)
        stop.wait()
        ray.get(handle.shutdown.remote())
        ray.shutdown()
    finally:
        if reaper is not None:
            reaper.close()
    return 0


def on_signals(stop: Callable[[], object]) -> None:
    """SIGTERM/SIGINT call ``stop`` once; a second one, or a stop that hangs, exits now.

    Works for threads and event loops alike: ``stop`` must only be safe to
    call from a signal handler (``threading.Event.set``, or
    ``loop.call_soon_threadsafe``).
    """
    signals: list[int] = []

    def handle(sig: int, _frame: object) -> None:
        signals.append(sig)
        name = signal.Signals(sig).name
        if len(signals) > 1:
            logger.warning("second signal (%s): exiting without a clean stop", name)
            os._exit(1)
        logger.info("%s: stopping the server", name)
        timer = threading.Timer(FORCED_EXIT_AFTER_S, _forced_exit)
        timer.daemon = True
        timer.start()
        stop()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handle)


def _forced_exit() -> None:
    logger.warning(
        "the server did not stop in %.0f s: exiting without a clean stop", FORCED_EXIT_AFTER_S
    )
    os._exit(1)


def _serve_here(argv: Sequence[str], env: dict[str, str]) -> int:
    import asyncio
    import os

    from .http.app import RunningServer, parse_server_args, serve

    for key, value in env.items():
        os.environ.setdefault(key, value)

    def ready(running: RunningServer) -> None:
        print(f"skyrl-lora server ready at {running.url}", flush=True)

    async def serve_until_stopped() -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        on_signals(lambda: loop.call_soon_threadsafe(stop.set))
        await serve(parse_server_args(argv), on_ready=ready, stop=stop)

    asyncio.run(serve_until_stopped())
    return 0


def _build_model(argv: Sequence[str]) -> int:
    from .embedded import ensure_embedded_model

    model = ensure_embedded_model()
    print(f"model: {model.model_dir}")
    for name, path in sorted(model.adapters.items()):
        print(f"adapter {name}: {path}")
    return 0


def _demo(argv: Sequence[str]) -> int:
    from .demo import main as demo_main

    return demo_main(argv)


COMMANDS = {"serve": _serve, "build-model": _build_model, "demo": _demo}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        parser = argparse.ArgumentParser(prog="skyrl-lora", description=__doc__)
        parser.add_argument("command", choices=sorted(COMMANDS))
        parser.parse_args(argv[:1])
        return 2
    log_to_stderr()
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
