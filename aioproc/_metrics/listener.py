"""A listening socket that accepts only while its sockets fit a budget.

``loop.create_server`` accepts whatever the kernel has queued, up to its
backlog per turn of the loop, and a closed connection's socket is released
a turn or two later; under a flood of connections the sockets held at once
are several backlogs' worth, whatever the server does with them.  Here the
accepting is ours: a socket counts from its ``accept()`` until its
connection is lost, and while the count is at the budget the listening
socket is not read at all (the kernel's queue, then the clients' SYN
retries, hold the rest).  Reading resumes when a socket is released.
"""

from __future__ import annotations

import asyncio
import errno
import socket
from collections.abc import Callable

__all__ = ["Listener"]

_NO_RESOURCES = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
_RETRY_AFTER = 1.0  # out of fds with none of ours to give back: try again (as asyncio does)


class Listener:
    """Accepts connections for ``protocol_factory`` while fewer than ``budget`` sockets are held.

    The protocol reports each connection's end with ``released()``.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        protocol_factory: Callable[[], asyncio.Protocol],
        budget: int,
        backlog: int,
    ) -> None:
        self._loop = loop
        self._factory = protocol_factory
        self._budget = budget
        self._backlog = backlog
        self._sock: socket.socket | None = None
        self._reading = False
        self._retry: asyncio.TimerHandle | None = None
        self._setups: set[asyncio.Task[None]] = set()
        self.held = 0
        """Sockets accepted and not released."""

    async def bind(self, host: str, port: int) -> tuple[str, int]:
        """Listen on the first address ``host`` resolves to; the address and port bound.

        ``""`` is every interface, IPv4 and IPv6: one dual-stack socket on
        ``::`` where the system has IPv6, else ``0.0.0.0``.

        Raises:
            OSError: the address cannot be resolved or bound.
        """
        sock = _dual_stack(port) if host == "" else None
        if sock is None:
            sock = await self._socket_for(host, port)
        try:
            sock.listen(self._backlog)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        name = sock.getsockname()
        self._resume()
        return name[0], name[1]

    async def _socket_for(self, host: str, port: int) -> socket.socket:
        """A socket bound to the first address ``host`` resolves to (IPv6 only, for IPv6)."""
        try:
            # an address needs no lookup: no thread (the loop's resolver runs
            # getaddrinfo on its executor) for the usual 127.0.0.1 or 0.0.0.0
            infos = socket.getaddrinfo(
                host or None,
                port,
                type=socket.SOCK_STREAM,
                flags=socket.AI_PASSIVE | socket.AI_NUMERICHOST,
            )
        except socket.gaierror:
            infos = await self._loop.getaddrinfo(
                host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )
        if not infos:
            raise OSError(f"getaddrinfo({host!r}) returned nothing")
        family, kind, proto, _, address = infos[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
        except BaseException:
            sock.close()
            raise
        return sock

    def _resume(self) -> None:
        if self._sock is not None and not self._reading and self.held < self._budget:
            self._loop.add_reader(self._sock.fileno(), self._accept)
            self._reading = True

    def _pause(self) -> None:
        if self._reading and self._sock is not None:
            self._loop.remove_reader(self._sock.fileno())
            self._reading = False

    def _accept(self) -> None:
        sock = self._sock
        assert sock is not None
        while self.held < self._budget:
            try:
                conn, _ = sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue  # gone before we took it
            except OSError as e:
                if e.errno not in _NO_RESOURCES:
                    raise
                # the process is out of fds: wait for one of ours, or a while
                self._pause()
                if self.held == 0 and self._retry is None:
                    self._retry = self._loop.call_later(_RETRY_AFTER, self._retried)
                return
            conn.setblocking(False)
            self.held += 1
            task = self._loop.create_task(self._setup(conn), name="aioproc-metrics-accept")
            self._setups.add(task)
            task.add_done_callback(self._setups.discard)
        self._pause()  # at the budget: the kernel queues the rest

    def _retried(self) -> None:
        self._retry = None
        self._resume()

    async def _setup(self, conn: socket.socket) -> None:
        try:
            await self._loop.connect_accepted_socket(self._factory, sock=conn)
        except Exception:  # reset before its transport was made: nothing to serve
            conn.close()
            self.released()

    def released(self) -> None:
        """A socket this listener accepted was closed."""
        self.held -= 1
        self._resume()

    async def aclose(self) -> None:
        """Stop listening; wait for the connections being set up (a turn or two)."""
        self._pause()
        if self._retry is not None:
            self._retry.cancel()
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()
        if self._setups:
            await asyncio.wait(set(self._setups))


def _dual_stack(port: int) -> socket.socket | None:
    """A socket bound to ``port`` on every IPv4 and IPv6 address, or None without IPv6.

    Raises:
        OSError: the port is taken (or refused) though IPv6 is there.
    """
    if not socket.has_ipv6:
        return None
    try:
        sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    except OSError:
        return None  # a kernel without IPv6
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # IPv4 clients too, as ::ffff:a.b.c.d (the system's default may say otherwise)
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(("::", port))
    except OSError as e:
        sock.close()
        if e.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
            return None  # IPv6 switched off on every interface
        raise
    except BaseException:
        sock.close()
        raise
    return sock
