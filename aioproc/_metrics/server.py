"""A small HTTP server on the running loop: ``GET /metrics`` in the text format.

Enough HTTP/1.1 for a Prometheus scraper, curl and a browser: one request
per connection (``Connection: close``), ``GET`` and ``HEAD`` of
``/metrics`` (any query string ignored), 404 for other paths, 405 for other
methods.  It runs in the supervisor, so nothing a client does may cost the
supervisor more than a bounded share of its fds, its memory or its loop:

- **Connections are capped** (``max_connections``, 64 by default).  At the
  cap, a new connection takes the place of the oldest one still sending
  its request head (it has had the longest to send it); when every
  connection is past its head (being answered), the new one gets a 503 and
  is closed.  The server holds at most the cap's sockets plus ``EVICTING``
  (those whose connections are being replaced) and its listening socket:
  at that count it stops accepting (``listener.Listener``), and the
  kernel queues the rest (``BACKLOG``).
- **Deadlines**: the request head must arrive within ``HEADER_TIMEOUT``, in
  at most ``MAX_HEAD`` bytes, with no pause over ``IDLE_TIMEOUT``; the
  response must be taken within ``WRITE_TIMEOUT``, and a client that takes
  nothing for ``IDLE_TIMEOUT`` while the server's send buffer is full is
  cut off.  Nothing a client sends or fails to read holds a connection
  longer.
- **Rendering** happens a slice at a time (``text.render_chunks``) and once
  for every request that arrives while a render runs; a response is
  written a chunk at a time, each when the socket has room, so a slow
  reader costs a bounded buffer, not a copy of the page.
- **Closing** stops listening, drops the connections still sending their
  heads, gives the responses under way ``grace_period`` to finish, then
  drops what is left: ``aclose()`` never waits on a client.  There is no
  task per connection, so a close has nothing to cancel and nothing to
  print.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import socket
import struct
from collections.abc import Callable
from typing import cast

from .._base.checks import check_duration
from .._base.shield import shielded
from .families import Registry
from .listener import Listener
from .text import CONTENT_TYPE, render_chunks

__all__ = [
    "BACKLOG",
    "EVICTING",
    "HEADER_TIMEOUT",
    "IDLE_TIMEOUT",
    "MAX_CONNECTIONS",
    "MAX_HEAD",
    "MetricsServer",
    "WRITE_TIMEOUT",
]

logger = logging.getLogger("aioproc")

MAX_CONNECTIONS = 64
"""Connections served at once by default (``serve(max_connections=)``)."""

BACKLOG = 128
"""The listen backlog: connections the kernel queues until they are accepted."""

EVICTING = 16
"""Sockets beyond ``max_connections`` the server may hold: those accepted at the
cap whose connection replaces another, until the other's socket is closed."""

HEADER_TIMEOUT = 10.0
"""Seconds a client gets to send its request line and headers."""

IDLE_TIMEOUT = 5.0
"""Seconds a connection may make no progress: no byte of its head arriving,
or none of its response leaving a full send buffer."""

WRITE_TIMEOUT = 30.0
"""Seconds a client gets to take the whole response."""

MAX_HEAD = 16 * 1024
"""Bytes a request's line and headers may take."""

_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    500: "Internal Server Error",
    503: "Service Unavailable",
}

# a connection's life: sending its head; waiting for the page; taking the response;
# or, past the cap, refused
_HEAD, _WAIT, _WRITE, _GONE, _REFUSED = "head", "wait", "write", "gone", "refused"
_REFUSED_LINGER = 1.0  # seconds a refused client gets to close its side


class _Connection(asyncio.Protocol):
    """One client: reads its request head, then writes the answer a chunk at a time."""

    def __init__(self, server: MetricsServer) -> None:
        self._server = server
        self._loop = server._loop
        self.phase = _HEAD
        self._transport: asyncio.Transport | None = None
        self._head = bytearray()
        self._head_only = False
        self._queue: collections.deque[bytes | memoryview] = collections.deque()
        self._paused = False
        self._lost = False
        self._deadline: asyncio.TimerHandle | None = None
        self._idle: asyncio.TimerHandle | None = None

    # -- the transport's callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, only alike
        self._transport = transport = cast(asyncio.Transport, transport)
        admitted = self._server._admit(self)
        if admitted is None:
            self.phase = _GONE
            transport.abort()  # the server is closing
            return
        if not admitted:
            # Answered and half-closed at once; the socket is closed when the
            # client closes its side, or after a second: closing it with the
            # request unread would reset the connection, and a reset may
            # reach the client before the answer does.
            self.phase = _REFUSED
            transport.write(_response(503, "too many connections, try again\n"))
            transport.write_eof()
            self._deadline = self._loop.call_later(_REFUSED_LINGER, self.drop)
            return
        self._deadline = self._loop.call_later(HEADER_TIMEOUT, self.drop)
        self._idle = self._loop.call_later(IDLE_TIMEOUT, self.drop)

    def data_received(self, data: bytes) -> None:
        if self.phase != _HEAD:
            return  # a body or a second request: one request per connection
        self._head += data
        end = self._head.find(b"\r\n\r\n")
        if end < 0:
            if len(self._head) > MAX_HEAD:
                self._answer(_response(400, "request head too long\n"))
            elif self._idle is not None:
                self._idle.cancel()
                self._idle = self._loop.call_later(IDLE_TIMEOUT, self.drop)
            return
        if end + 4 > MAX_HEAD:
            self._answer(_response(400, "request head too long\n"))
            return
        self._request(bytes(self._head[:end]))

    def eof_received(self) -> bool:
        # a client may shut its side once it has sent its request: still answer it
        return self.phase not in (_HEAD, _REFUSED)

    def pause_writing(self) -> None:
        self._paused = True
        if self.phase == _WRITE:
            self._arm_idle()

    def resume_writing(self) -> None:
        self._paused = False
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        # not from inside the transport's own write path: a close() there
        # would have asyncio report the connection lost twice
        self._loop.call_soon(self._pump)

    def connection_lost(self, exc: Exception | None) -> None:
        self.phase = _GONE
        self._lost = True
        self._queue.clear()
        for timer in (self._deadline, self._idle):
            if timer is not None:
                timer.cancel()
        self._deadline = self._idle = None
        self._server._forget(self)

    # -- the request and its answer

    def _request(self, head: bytes) -> None:
        parts = head.split(b"\r\n", 1)[0].split()
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
            self._answer(_response(400, "malformed request line\n"))
            return
        method, target = parts[0], parts[1]
        self._head_only = method == b"HEAD"
        if target.split(b"?", 1)[0] != b"/metrics":
            body = "not found: metrics are at /metrics\n"
            self._answer(_response(404, body, head_only=self._head_only))
        elif method not in (b"GET", b"HEAD"):
            self._answer(_response(405, "only GET and HEAD are allowed\n", allow=True))
        else:
            self._waiting()
            self._server._wants_page(self)

    def _waiting(self) -> None:
        self.phase = _WAIT
        self._server._reading.pop(self, None)
        self._head = bytearray()
        if self._transport is not None:
            self._transport.pause_reading()
        for timer in (self._deadline, self._idle):
            if timer is not None:
                timer.cancel()
        self._deadline = self._idle = None

    def page(self, chunks: list[bytes] | None) -> None:
        """The page is rendered (None: the render failed): answer with it."""
        if self.phase != _WAIT:
            return
        if chunks is None:
            self._send(_response(500, "rendering the metrics failed; see the aioproc log\n"))
            return
        size = sum(len(c) for c in chunks)
        head = _head(200, CONTENT_TYPE, size)
        self._send(head, *(() if self._head_only else chunks))

    def _answer(self, response: bytes) -> None:
        self._waiting()
        self._send(response)

    def _send(self, *parts: bytes) -> None:
        self.phase = _WRITE
        self._server._reading.pop(self, None)
        for part in parts:
            # handed over in slices, each when the socket has room: a reader
            # that falls behind holds a bounded buffer, not a copy of the page
            view = memoryview(part)
            for at in range(0, len(view), _WRITE_SLICE):
                self._queue.append(view[at : at + _WRITE_SLICE])
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = self._loop.call_later(WRITE_TIMEOUT, self.drop)
        self._pump()

    def _pump(self) -> None:
        transport = self._transport
        if transport is None or self.phase != _WRITE:
            return
        queue = self._queue
        while queue and not self._paused:
            transport.write(queue.popleft())
        if not queue:
            transport.close()  # after what is buffered is sent; the deadline still holds

    def _arm_idle(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
        self._idle = self._loop.call_later(IDLE_TIMEOUT, self.drop)

    def drop(self) -> None:
        """Close the connection now, with a reset, whatever it has not sent or taken."""
        if self._lost or self._transport is None:
            return
        sock = self._transport.get_extra_info("socket")
        if sock is not None:
            # a plain close leaves the kernel sending what is buffered (megabytes
            # to a slow reader) for as long as the client keeps taking it
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
        self._transport.abort()


_WRITE_SLICE = 64 * 1024
_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close with a reset, drop the buffer


class MetricsServer:
    """Serves ``GET /metrics`` on a socket of the running loop; opened by ``serve()``.

    ``server = await serve(...)`` then ``await server.aclose()``, or
    ``async with serve(...) as server:``, which closes it on exit.
    """

    def __init__(
        self, source: Callable[[], Registry | None], max_connections: int = MAX_CONNECTIONS
    ) -> None:
        self._source = source
        self._max = max_connections
        self._loop = asyncio.get_running_loop()
        self._listener = Listener(
            self._loop, lambda: _Connection(self), max_connections + EVICTING, BACKLOG
        )
        # every connection made and not lost (refused ones too); those admitted;
        # and those still sending their heads, oldest first
        self._open: set[_Connection] = set()
        self._connections: dict[_Connection, None] = {}
        self._reading: dict[_Connection, None] = {}
        self._waiters: list[_Connection] = []
        self._render: asyncio.Task[None] | None = None
        self._all_gone: asyncio.Event | None = None
        self._closing: asyncio.Future[None] | None = None
        self.host = ""
        """The address the server listens on."""
        self.port = 0
        """The port the server listens on (the one the system chose, for port 0)."""

    @property
    def url(self) -> str:
        """Where a scraper finds the metrics: ``http://HOST:PORT/metrics``."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    @property
    def connections(self) -> int:
        """Connections open now (at most ``max_connections``)."""
        return len(self._connections)

    def __repr__(self) -> str:
        state = "closed" if self._closing is not None else "serving"
        n = len(self._connections)
        return f"<MetricsServer {self.url} {state}, {n} connection{'' if n == 1 else 's'}>"

    async def _start(self, host: str, port: int) -> None:
        self.host, self.port = await self._listener.bind(host, port)

    # -- connections

    def _admit(self, connection: _Connection) -> bool | None:
        """Take ``connection`` in (True), refuse it (False), or None: closing, drop it."""
        self._open.add(connection)
        if self._closing is not None:
            return None
        if len(self._connections) >= self._max:
            if not self._reading:
                return False  # every slot answers a request: this one waits its turn
            oldest = next(iter(self._reading))
            self._reading.pop(oldest)
            self._connections.pop(oldest, None)  # its socket closes in the next turn
            oldest.drop()
        self._connections[connection] = None
        self._reading[connection] = None
        return True

    def _forget(self, connection: _Connection) -> None:
        self._open.discard(connection)
        self._connections.pop(connection, None)
        self._reading.pop(connection, None)
        self._listener.released()
        if self._listener.held == 0 and self._all_gone is not None:
            self._all_gone.set()

    def _wants_page(self, connection: _Connection) -> None:
        self._waiters.append(connection)
        if self._render is None:
            # one render answers every request that arrives while it runs
            self._render = self._loop.create_task(self._render_page(), name="aioproc-metrics")

    async def _render_page(self) -> None:
        chunks: list[bytes] | None
        try:
            chunks = await render_chunks(self._source)
        except Exception:
            logger.exception("rendering the metrics failed")
            chunks = None
        finally:
            self._render = None
        waiters, self._waiters = self._waiters, []
        for connection in waiters:
            connection.page(chunks)

    # -- closing

    async def aclose(self, *, grace_period: float = 1.0) -> None:
        """Stop listening and close every connection, within ``grace_period`` seconds.

        Connections still sending their request are closed at once; the
        responses under way get ``grace_period`` to finish; then whatever
        is left is closed, taken or not.  A second call waits for the first.

        Args:
            grace_period: seconds the responses under way get to finish.

        Raises:
            TypeError: ``grace_period`` is not a number.
            ValueError: ``grace_period`` is negative, infinite or NaN.

        Cancellation: the close runs to its end (bounded by
        ``grace_period``), then the cancellation is re-raised.
        """
        grace = check_duration("aclose(grace_period=...)", grace_period)
        if self._closing is None:
            self._closing = self._loop.create_future()
            try:
                await shielded(self._close(grace))
            finally:
                self._closing.set_result(None)
        else:
            await asyncio.shield(self._closing)

    async def _close(self, grace_period: float) -> None:
        self._all_gone = all_gone = asyncio.Event()
        await self._listener.aclose()  # every connection accepted is made from here on
        for connection in list(self._reading):
            connection.drop()
        if self._listener.held:
            try:
                await asyncio.wait_for(all_gone.wait(), grace_period)
            except asyncio.TimeoutError:
                pass  # what is left is dropped below
        for connection in list(self._open):
            connection.drop()
        render = self._render
        if render is not None:
            render.cancel()
            await asyncio.wait({render})
        if self._listener.held:
            # an abort reports the connection lost in the loop's next turn or so
            await asyncio.wait_for(all_gone.wait(), _LOST_TIMEOUT)


_LOST_TIMEOUT = 5.0  # an aborted socket is reported lost within a turn; this is the bound


def _head(status: int, content_type: str, length: int, *, allow: bool = False) -> bytes:
    lines = [
        f"HTTP/1.1 {status} {_REASONS[status]}",
        f"Content-Type: {content_type}",
        f"Content-Length: {length}",
        "Connection: close",
    ]
    if allow:
        lines.append("Allow: GET, HEAD")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _response(
    status: int,
    body: str,
    content_type: str = "text/plain; charset=utf-8",
    *,
    head_only: bool = False,
    allow: bool = False,
) -> bytes:
    payload = body.encode()
    head = _head(status, content_type, len(payload), allow=allow)
    return head if head_only else head + payload


async def start(
    source: Callable[[], Registry | None], host: str, port: int, max_connections: int
) -> MetricsServer:
    """Listen on ``host:port`` and answer ``GET /metrics`` with ``source()``'s metrics."""
    server = MetricsServer(source, max_connections)
    await server._start(host, port)
    return server
