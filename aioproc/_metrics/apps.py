"""The metrics page for a server the service already runs: an ASGI app, an aiohttp handler.

A service that has an HTTP server mounts ``/metrics`` on it rather than
opening a second port.  Both render the page as ``serve()`` does, a slice
at a time (``text.render_chunks``), and send it in those chunks, so a large
page never holds the host's loop.  The host's server owns the connections:
its own limits and timeouts apply.

aiohttp is imported only when a handler is made: neither ``aioproc.metrics``
nor the ASGI app needs it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import TYPE_CHECKING, Any

from .families import Registry
from .text import CONTENT_TYPE, render_chunks

if TYPE_CHECKING:
    from aiohttp import web

__all__ = ["MetricsApp", "aiohttp_handler"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_NOT_ALLOWED = b"only GET and HEAD are allowed\n"


class MetricsApp:
    """An ASGI 3 application that answers ``GET`` and ``HEAD`` with the metrics page.

    Every path reaches it (the host routes ``/metrics`` to it); other
    methods get a 405.  As the whole application of a server it also
    answers the lifespan protocol.  Built by ``aioproc.metrics.make_asgi_app()``.
    """

    def __init__(self, source: Callable[[], Registry | None]) -> None:
        self._source = source

    def __repr__(self) -> str:
        return "<MetricsApp: aioproc's metrics over ASGI>"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Answer one ASGI connection (``http``; ``lifespan`` when run alone)."""
        kind = scope["type"]
        if kind == "lifespan":
            await _lifespan(receive, send)
            return
        if kind != "http":
            # a WebSocket routed here: refused, as the ASGI spec has it
            await send({"type": "websocket.close", "code": 1000})
            return
        method = scope["method"]
        if method not in ("GET", "HEAD"):
            await send(_start(405, b"text/plain; charset=utf-8", len(_NOT_ALLOWED), allow=True))
            await send({"type": "http.response.body", "body": _NOT_ALLOWED})
            return
        chunks = await render_chunks(self._source)
        await send(_start(200, CONTENT_TYPE.encode(), sum(len(c) for c in chunks)))
        if method == "GET":
            for chunk in chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})


def _start(status: int, content_type: bytes, length: int, *, allow: bool = False) -> Message:
    headers = [(b"content-type", content_type), (b"content-length", str(length).encode())]
    if allow:
        headers.append((b"allow", b"GET, HEAD"))
    return {"type": "http.response.start", "status": status, "headers": headers}


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


def aiohttp_handler(
    source: Callable[[], Registry | None],
) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """An aiohttp request handler that answers with the metrics page.

    Raises:
        ModuleNotFoundError: aiohttp is not installed.
    """
    from aiohttp import web

    async def metrics_handler(request: web.Request) -> web.StreamResponse:
        """aioproc's metrics, in Prometheus's text format."""
        if request.method not in ("GET", "HEAD"):
            raise web.HTTPMethodNotAllowed(request.method, ["GET", "HEAD"])
        chunks = await render_chunks(source)
        response = web.StreamResponse(headers={"Content-Type": CONTENT_TYPE})
        response.content_length = sum(len(c) for c in chunks)
        await response.prepare(request)
        if request.method == "GET":
            for chunk in chunks:
                await response.write(chunk)
        await response.write_eof()
        return response

    return metrics_handler
