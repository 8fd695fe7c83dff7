"""Test utilities for watching processes the tests did not start directly."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from types import TracebackType


class Fifo:
    """A named pipe workers write lines to, read by the test without polling.

    Opened O_RDWR so it never reports EOF between writers.
    """

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        os.mkfifo(self.path)
        self.reader = asyncio.StreamReader()
        self._transport: asyncio.BaseTransport | None = None

    async def __aenter__(self) -> Fifo:
        loop = asyncio.get_running_loop()
        f = os.fdopen(os.open(self.path, os.O_RDWR | os.O_NONBLOCK), "rb", buffering=0)
        self._transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(self.reader), f
        )
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._transport is not None
        self._transport.close()
        await asyncio.sleep(0)  # let the transport finish closing its fd

    async def lines(self, n: int, timeout: float = 20) -> list[str]:
        async def read() -> list[str]:
            return [(await self.reader.readline()).decode().strip() for _ in range(n)]

        return await asyncio.wait_for(read(), timeout)

    async def pid_pairs(self, n: int, timeout: float = 20) -> list[tuple[int, int]]:
        """Read n "<worker pid> <grandchild pid>" lines."""
        out = []
        for line in await self.lines(n, timeout):
            a, b = line.split()
            out.append((int(a), int(b)))
        return out


async def still_alive_after(pids: list[int], timeout: float) -> set[int]:
    """Wait up to ``timeout`` for every pid to exit (zombies count as exited).

    Uses pidfds, which work for any process and become readable at exit.
    Returns the pids still running at the deadline.
    """
    loop = asyncio.get_running_loop()
    waits: dict[int, asyncio.Future[None]] = {}
    fds: list[int] = []
    for pid in pids:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        fds.append(fd)
        fut: asyncio.Future[None] = loop.create_future()
        loop.add_reader(fd, lambda f=fut: f.done() or f.set_result(None))
        waits[pid] = fut
    try:
        if waits:
            await asyncio.wait(waits.values(), timeout=timeout)
        return {pid for pid, fut in waits.items() if not fut.done()}
    finally:
        for fd in fds:
            loop.remove_reader(fd)
            os.close(fd)
