"""A scriptable stand-in for a skyrl-lora server, for pure client tests.

It speaks the ``/skyrl/v1`` wire format; each ``/sample`` call pops the next
scripted answer (or echoes a default one) and records the request, so tests
can assert exactly what the client resubmitted.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestServer

from skyrl_lora.types import SampleRequest

Answer = dict[str, Any] | Callable[[SampleRequest], Any] | object

#: Scripted answer that drops the connection, as a replica that died would.
DROP = object()


def seq(tokens: list[int], reason: str, version: int | None = 1) -> dict[str, Any]:
    return {
        "tokens": tokens,
        "logprobs": [-0.5 - t / 100 for t in tokens],
        "stop_reason": reason,
        "versions": [{"start": 0, "end": len(tokens), "version": version}],
    }


def answer(
    *sequences: dict[str, Any], version: int | None = 1, lora: str | None = "a"
) -> dict[str, Any]:
    return {
        "sequences": list(sequences),
        "lora_name": lora,
        "adapter_version": version,
        "prompt_logprobs": None,
    }


class FakeServer:
    def __init__(self, max_model_len: int = 1024) -> None:
        self.max_model_len = max_model_len
        self.samples: list[SampleRequest] = []
        self.controls: list[tuple[str, Any]] = []
        self.script: list[Answer] = []
        self.sample_delay = 0.0
        self.control_delay = 0.0
        #: What ``GET /skyrl/v1/adapters`` lists: name -> current version.
        self.versions: dict[str, int] = {}
        #: When set, loads answer 413 with this message (a replica that refuses).
        self.refuse_loads: str | None = None
        app = web.Application()
        app.router.add_post("/skyrl/v1/sample", self._sample)
        controls = ("pause", "resume", "abort_lora_requests", "adapters/load", "adapters/unload")
        for name in (*controls, "adapters/commit", "adapters/rollback"):
            app.router.add_post(f"/skyrl/v1/{name}", self._control(name))
        app.router.add_get("/skyrl/v1/server_info", self._info)
        app.router.add_get("/skyrl/v1/adapters", self._adapters)
        self.server = TestServer(app)

    @property
    def url(self) -> str:
        return str(self.server.make_url("")).rstrip("/")

    async def __aenter__(self) -> FakeServer:
        await self.server.start_server()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.server.close()

    async def _sample(self, request: web.Request) -> web.Response:
        body = SampleRequest.model_validate(await request.json())
        self.samples.append(body)
        if self.sample_delay:
            await asyncio.sleep(self.sample_delay)
        if self.script:
            scripted = self.script.pop(0)
            if scripted is DROP:
                assert request.transport is not None
                request.transport.close()
                await asyncio.sleep(0.1)
                return web.Response()
            result = scripted(body) if callable(scripted) else scripted
            if isinstance(result, web.Response):
                return result
            return web.json_response(result)
        n = body.sampling_params.max_tokens
        return web.json_response(
            answer(*[seq(list(range(n)), "length")] * body.num_samples, lora=body.lora_name)
        )

    def _control(self, name: str) -> Callable[[web.Request], Any]:
        async def handler(request: web.Request) -> web.Response:
            body = await request.json()
            self.controls.append((name, body))
            if self.control_delay:
                await asyncio.sleep(self.control_delay)
            lora = body.get("lora_name")
            if name in ("pause", "resume"):
                return web.json_response(
                    {
                        "lora_name": lora,
                        "paused": name == "pause",
                        "was_paused": False,
                        "aborted": 0,
                    }
                )
            if name in ("adapters/commit", "adapters/rollback"):
                return web.json_response(
                    {"lora_name": lora, "version": body["version"], "changed": True}
                )
            if name == "abort_lora_requests":
                return web.json_response({"lora_name": lora, "aborted": 0, "drain_seconds": 0.0})
            if name == "adapters/load" and self.refuse_loads:
                error = {"type": "payload_too_large", "message": self.refuse_loads}
                return web.json_response({"error": error}, status=413)
            if name == "adapters/load":
                return web.json_response(
                    {
                        "lora_name": lora,
                        "version": body.get("version") or 1,
                        "lora_path": body["lora_path"],
                        "paused": False,
                        "in_flight": 0,
                        "held": 0,
                        "engine_requests": 0,
                    }
                )
            return web.json_response({"lora_name": lora})

        return handler

    async def _adapters(self, request: web.Request) -> web.Response:
        adapters = [
            {
                "lora_name": name,
                "version": version,
                "lora_path": "/fake",
                "paused": False,
                "in_flight": 0,
                "held": 0,
                "engine_requests": 0,
            }
            for name, version in self.versions.items()
        ]
        return web.json_response({"adapters": adapters, "engine_paused": False})

    async def _info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "model": "fake",
                "max_model_len": self.max_model_len,
                "vllm_version": "0",
                "eos_token_id": 2,
            }
        )
