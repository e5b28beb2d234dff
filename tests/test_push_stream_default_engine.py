"""A ``skyrl-lora serve`` given no flags takes pushes over its push stream.

The stream is the fast way to push (a fraction of the HTTP body's time for a
large adapter), so ``serve`` opens it by default on a free port
(``--no-push-stream`` turns it off), names the port in ``server_info``, and
the client's ``push_lora_adapter`` sends the weights over it. The server
here is started as a user would start it: ``--embedded`` (the embedded
model and its adapters) and a free ``--port``, nothing else. The HTTP-body
push stays the fallback: ``tests/test_route_walk_engine.py`` runs a server
with ``--no-push-stream``, and ``tests/test_push_engine.py`` a client that
asks for the body. The server is the session's flag-less ``serve``
(``serves``), which ``tests/test_shutdown_engine.py`` then stops with SIGTERM.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from skyrl_lora.client import RemoteInferenceClient
from tests.conftest import SERVE_FLAGLESS, Serves

pytestmark = pytest.mark.engine


@pytest.mark.serve(SERVE_FLAGLESS)
async def test_a_flagless_serve_takes_a_push_over_its_stream(
    embedded_model: Any, tokenizer: Any, serves: Serves
) -> None:
    server = await asyncio.to_thread(serves.use, SERVE_FLAGLESS)
    async with RemoteInferenceClient(server.url) as client:
        assert (await client.server_info()).push_stream_port
        (info,) = await client.push_lora_adapter("pushed", embedded_model.adapters["woof"])
        assert info.version == 1 and info.lora_path.startswith("push-stream:")
        assert client.metrics().pushes_streamed == 1
        out = await client.sample(
            tokenizer.encode("hello", add_special_tokens=False),
            sampling_params={"max_tokens": 8, "temperature": 0.0, "ignore_eos": True},
            lora_name="pushed",
        )
    assert out.adapter_version == 1
    assert set(tokenizer.decode(out.sequences[0].tokens).split()) == {"woof"}
