"""A no-op HTTP server for the client-overhead benchmark (run in its own process).

It answers ``/skyrl/v1/sample`` and ``/v1/completions`` at once with fixed
16-token bodies, so what is measured is the client's own cost per request.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Awaitable, Callable

from aiohttp import web

TOKENS = list(range(100, 116))
SAMPLE = json.dumps(
    {
        "sequences": [
            {
                "tokens": TOKENS,
                "logprobs": [-0.5] * 16,
                "stop_reason": "length",
                "versions": [{"start": 0, "end": 16, "version": 1}],
                "segments": 1,
            }
        ],
        "prompt_logprobs": None,
        "lora_name": "a",
        "adapter_version": 1,
    }
)
COMPLETION = json.dumps(
    {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 0,
        "model": "a",
        "choices": [{"index": 0, "text": " x" * 16, "logprobs": None, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 8, "completion_tokens": 16, "total_tokens": 24},
    }
)


def _fixed(body: str) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def handler(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(text=body, content_type="application/json")

    return handler


def main() -> None:
    app = web.Application()
    app.router.add_post("/skyrl/v1/sample", _fixed(SAMPLE))
    app.router.add_post("/v1/completions", _fixed(COMPLETION))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)  # connections queue until the app accepts them
    print(sock.getsockname()[1], flush=True)
    web.run_app(app, sock=sock, print=None, access_log=None)


if __name__ == "__main__":
    main()
