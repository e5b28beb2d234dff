"""Nagle's algorithm is off on the server's accepted connections.

vLLM's listening socket is created with ``proto`` 0, for which asyncio skips
its own TCP_NODELAY; without :func:`no_delay` every response written in two
parts waited for the client's delayed ACK (a constant ~44 ms per call on the
GPU machines). This checks the option on real accepted sockets.
"""

from __future__ import annotations

import asyncio
import socket

from skyrl_lora.server.http.app import no_delay


class _Recorder(asyncio.Protocol):
    seen: list[int] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
        sock = transport.get_extra_info("socket")
        type(self).seen.append(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        transport.close()


async def _accepted_nodelay(protocol: type[asyncio.Protocol]) -> int:
    _Recorder.seen = []
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # proto 0, as vLLM makes it
    listener.bind(("127.0.0.1", 0))
    server = await asyncio.get_running_loop().create_server(protocol, sock=listener)
    try:
        _, writer = await asyncio.open_connection(*listener.getsockname())
        for _ in range(200):
            if _Recorder.seen:
                break
            await asyncio.sleep(0.01)
        writer.close()
    finally:
        server.close()
    return _Recorder.seen[0]


async def test_accepted_sockets_have_nodelay() -> None:
    assert await _accepted_nodelay(_Recorder) == 0  # what asyncio alone gives
    assert await _accepted_nodelay(no_delay(_Recorder)) != 0
