"""A tiny HTTP server on the running loop: ``GET /metrics`` in the text format.

Enough HTTP/1.1 for a Prometheus scraper, curl and a browser: one request
per connection (``Connection: close``), ``GET`` and ``HEAD`` of
``/metrics`` (any query string ignored), 404 for other paths, 405 for other
methods.  A client gets ``HEADER_TIMEOUT`` seconds to send its request
head, and at most ``MAX_HEAD`` bytes of it, so a silent or endless
connection never holds a handler.  Closing the server cancels the handlers
still running and waits for them, so ``aclose()`` leaves no socket open.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from types import TracebackType

from .text import CONTENT_TYPE

__all__ = ["HEADER_TIMEOUT", "MAX_HEAD", "MetricsServer", "start"]

HEADER_TIMEOUT = 10.0
"""Seconds a client gets to send its request line and headers."""

MAX_HEAD = 16 * 1024
"""Bytes a request's line and headers may take."""

_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed"}


class MetricsServer:
    """Serves ``GET /metrics`` on a socket of the running loop; built by ``serve()``.

    ``async with await serve(...) as server:`` closes it on exit, as does
    ``await server.aclose()``.
    """

    def __init__(self, render: Callable[[], str]) -> None:
        self._render = render
        self._server: asyncio.AbstractServer | None = None
        self._handlers: set[asyncio.Task[None]] = set()
        self._closed = False
        self.host = ""
        """The address the server listens on."""
        self.port = 0
        """The port the server listens on (the one the system chose, for port 0)."""

    @property
    def url(self) -> str:
        """Where a scraper finds the metrics: ``http://HOST:PORT/metrics``."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def __repr__(self) -> str:
        state = "closed" if self._closed else "serving"
        return f"<MetricsServer {self.url} {state}>"

    async def _start(self, host: str, port: int) -> None:
        self._server = await asyncio.start_server(self._handle, host, port, limit=MAX_HEAD)
        address = self._server.sockets[0].getsockname()
        self.host, self.port = address[0], address[1]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            response = await self._respond(reader)
            if response is not None:
                writer.write(response)
                await writer.drain()
        except (ConnectionError, OSError):
            pass  # the client went away: nothing to answer
        finally:
            self._handlers.discard(task)
            writer.close()
            with contextlib.suppress(ConnectionError, OSError, asyncio.CancelledError):
                await writer.wait_closed()

    async def _respond(self, reader: asyncio.StreamReader) -> bytes | None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEADER_TIMEOUT)
        except asyncio.LimitOverrunError:
            return _response(400, "request head too long\n")
        except (asyncio.IncompleteReadError, asyncio.TimeoutError):
            return None  # closed early or silent: there is no request to answer
        parts = head.split(b"\r\n", 1)[0].split()
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
            return _response(400, "malformed request line\n")
        method, target = parts[0], parts[1]
        if target.split(b"?", 1)[0] != b"/metrics":
            return _response(404, "not found: metrics are at /metrics\n", head=method == b"HEAD")
        if method not in (b"GET", b"HEAD"):
            return _response(405, "only GET and HEAD are allowed\n", allow=True)
        return _response(200, self._render(), CONTENT_TYPE, head=method == b"HEAD")

    async def aclose(self) -> None:
        """Stop listening, end the connections still open, and wait for them.

        A second call does nothing.
        """
        if self._closed:
            return
        self._closed = True
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        handlers = list(self._handlers)
        for task in handlers:
            task.cancel()
        if handlers:
            await asyncio.gather(*handlers, return_exceptions=True)
        await server.wait_closed()

    async def __aenter__(self) -> MetricsServer:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


def _response(
    status: int,
    body: str,
    content_type: str = "text/plain; charset=utf-8",
    *,
    head: bool = False,
    allow: bool = False,
) -> bytes:
    payload = body.encode()
    lines = [
        f"HTTP/1.1 {status} {_REASONS[status]}",
        f"Content-Type: {content_type}",
        f"Content-Length: {len(payload)}",
        "Connection: close",
    ]
    if allow:
        lines.append("Allow: GET, HEAD")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (b"" if head else payload)


async def start(render: Callable[[], str], host: str, port: int) -> MetricsServer:
    """Listen on ``host:port`` and answer ``GET /metrics`` with ``render()``."""
    server = MetricsServer(render)
    await server._start(host, port)
    return server
