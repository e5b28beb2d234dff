"""Starting the suite's servers two at a time.

A vLLM-CPU server's start is three Python processes importing vLLM one
after another (the API server, the engine core, its worker: 10-13 s each
on the 2-core CPU machine) and about 3 s of model, KV cache, adapters and
our own start-up. There is no compile step to share between starts:
vLLM-CPU turns ``torch.compile`` off wherever LoRA is on (its engine
reports 0.8 s for profile, KV cache and warm-up), so every start is the
same imports again. One start keeps about one core busy, so two side by
side take the time of one. Measured at main 2ba83d6, 2026-11-29, on the
2-core CPU machine: ``serve --embedded --no-ray`` ready in 43 s alone
(1.1 cores busy) and both of two started together in 43 s (2.0 cores);
a Ray-mode ``serve`` in 50 s alone, 52 s beside a ``--no-ray`` one.

Starts are paired with each other, not with tests: the engine's worker
spins between steps, so an engine test keeps both cores busy, and a start
beside 300-token samples took 108 s while the samples ran a third slower
(same machine and commit).

So the servers the selected tests will need start as soon as the first of
them is needed, two at a time: :class:`Serves` for the ``skyrl-lora serve``
processes (the plan comes from the tests' ``serve`` markers),
:class:`ActorStarts` for the server actors in the session's Ray.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

#: Starts that run at once: two fill the 2-core machine's cores.
STARTS_AT_ONCE = 2


def serve_plan(items: Iterable[pytest.Item]) -> list[tuple[str, ...]]:
    """The ``serve`` processes the tests ``items`` use, in the order they run,
    one entry per start. A test marked ``@pytest.mark.serve(argv)`` uses the
    server for ``argv``; with ``take=True`` it stops it, so the next test
    that uses those flags needs a server of its own."""
    plan: list[tuple[str, ...]] = []
    running: set[tuple[str, ...]] = set()
    for item in items:
        for mark in item.iter_markers("serve"):
            argv = tuple(mark.args[0])
            if argv not in running:
                plan.append(argv)
                running.add(argv)
            if mark.kwargs.get("take"):
                running.discard(argv)
    return plan


class Serves:
    """``skyrl-lora serve`` processes shared by argv: ``use`` gives the running
    server for those flags; ``take`` hands it to a test that stops it, so a
    later ``use`` or ``take`` gets the next one.

    :meth:`start` queues starts, which run two at a time; ``use`` starts one
    itself only where nothing for its flags is queued."""

    def __init__(self, folder: Path) -> None:
        self._folder = folder
        self._pool = ThreadPoolExecutor(STARTS_AT_ONCE, thread_name_prefix="serve-start")
        self._logs = itertools.count()
        self._queued: dict[tuple[str, ...], list[Future[Any]]] = {}  # argv -> ServeProcess starts

    def start(self, argvs: Sequence[tuple[str, ...]]) -> None:
        from skyrl_lora.server.cluster.process import start_serve

        for argv in argvs:
            log = self._folder / f"serve-{next(self._logs)}.log"
            self._queued.setdefault(argv, []).append(self._pool.submit(start_serve, argv, log))

    def use(self, argv: tuple[str, ...]) -> Any:
        if not self._queued.get(argv):
            self.start([argv])
        return self._queued[argv][0].result()

    def take(self, argv: tuple[str, ...]) -> Any:
        server = self.use(argv)
        self._queued[argv].pop(0)
        return server

    def close(self) -> None:
        self._pool.shutdown(cancel_futures=True)
        for starts in self._queued.values():
            for start in starts:
                if start.cancelled() or start.exception() is not None:
                    continue
                server = start.result()
                if server.proc.poll() is None:
                    server.stop()
                server.kill_all()


#: A session actor's recipe: its ``vllm serve`` flags, its environment, and
#: what its fixture yields given the actor's handle and URL.
ActorRecipe = tuple[list[str], dict[str, str], Callable[[Any, str], Any]]


class ActorStarts:
    """Server actors in the session's Ray, by fixture name.

    :meth:`launch` launches those of ``needed`` (the session actors the
    selected tests will ask for) that are not launched yet, side by side,
    and waits for none: the session calls it as it begins, so the starts
    run beside its first tests. ``get(name)`` launches ``name``'s (and the
    others) if that has not happened, then waits for ``name``'s alone.
    :meth:`release` stops one after the last test that uses it: an idle
    server still costs about a tenth of a core (its event loop's monitor,
    its engine's threads, its reaper) and 3-4 GB of memory. ``recipes`` makes each actor's
    :data:`ActorRecipe` when it is launched.
    """

    def __init__(
        self, ray: Any, recipes: dict[str, Callable[[], ActorRecipe]], needed: Iterable[str]
    ) -> None:
        wanted = set(needed)
        self._ray = ray
        self._recipes = recipes
        self._needed = [name for name in recipes if name in wanted]
        self._launched: dict[str, tuple[Any, Any, Callable[[Any, str], Any]]] = {}
        self._ready: dict[str, Any] = {}
        self._released: set[str] = set()

    def _launch(self, name: str) -> None:
        from skyrl_lora.server.cluster.actor import ActorOptions, launch_server_actor

        argv, env, made = self._recipes[name]()
        handle, started = launch_server_actor(argv, ActorOptions(env=env))
        self._launched[name] = (handle, started, made)

    def launch(self) -> None:
        for each in self._needed:
            if each not in self._launched and each not in self._released:
                self._launch(each)

    def get(self, name: str) -> Any:
        if name not in self._launched:  # not launched yet, or released
            self._launch(name)
        self.launch()
        if name not in self._ready:
            handle, started, made = self._launched[name]
            self._ready[name] = made(handle, self._ray.get(started))
        return self._ready[name]

    def release(self, name: str) -> None:
        """Stop ``name``'s actor: the selected tests that use it have run."""
        self._released.add(name)
        launched = self._launched.pop(name, None)
        ready = self._ready.pop(name, None) is not None
        if launched is not None:
            self._stop({name: launched[0]}, {name} if ready else set())

    def shutdown(self) -> None:
        """Stop every launched actor, side by side; a failed stop fails the
        session only for a server that started (one that did not has failed
        its tests already)."""
        handles = {name: handle for name, (handle, _, _) in self._launched.items()}
        self._stop(handles, set(self._ready))

    def _stop(self, handles: dict[str, Any], ready: set[str]) -> None:
        stops = {name: handle.shutdown.remote() for name, handle in handles.items()}
        failed = []
        for name, stop in stops.items():
            try:
                self._ray.get(stop, timeout=120)
            except Exception as exc:
                if name in ready:
                    failed.append(exc)
        if failed:
            raise failed[0]
