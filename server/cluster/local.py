"""One server on the embedded model in the local Ray instance.

The demo, the examples and the benchmarks all want the same thing: a real
server on the tiny embedded model, up for the length of a ``with`` block and
gone afterwards. Ray is started here only if nobody started it, and then it
is also shut down here, so a script that owns Ray keeps it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from ..embedded import EmbeddedModel, ensure_embedded_model
from ..presets import CPU_ENV, embedded_server_argv
from .actor import ActorOptions, start_server_actor

#: Seconds the actor gets to stop its engine before the block raises.
SHUTDOWN_TIMEOUT_S = 120


@contextmanager
def embedded_server(extra: Sequence[str] = ()) -> Iterator[tuple[str, EmbeddedModel]]:
    """Yield ``(url, model)`` of a server on the embedded model; stop it on exit."""
    import ray

    model = ensure_embedded_model()
    owns_ray = not ray.is_initialized()
    if owns_ray:
        ray.init(include_dashboard=False, log_to_driver=False)
    try:
        handle, url = start_server_actor(
            embedded_server_argv(model, extra=extra), ActorOptions(env=CPU_ENV)
        )
        try:
            yield url, model
        finally:
            ray.get(handle.shutdown.remote(), timeout=SHUTDOWN_TIMEOUT_S)
    finally:
        if owns_ray:
            ray.shutdown()
