"""A group's rank dirs, made during the launch.

torch's log layout gives every rank a directory (``attempt_<n>/<rank>/``),
made before the rank starts.  A ``mkdir`` next to many siblings costs tens
of microseconds of kernel time or more on some file systems, so hundreds of
them are worth keeping off the loop and off the critical path: ``RankDirs``
makes them on a thread of its own while the first workers start.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

from .._base.shield import shielded


class RankDirs:
    """Makes the rank dirs ``reify`` left to the launch, batch by batch, on a thread of its own.

    ``mkdir`` next to thousands of siblings costs this much kernel CPU on
    some file systems (0.76 ms each for 1024 on ext4, growing with their
    number) that making them all before the first worker starts was most of
    what 1024 binary workers took to start.  Made here, in rank order, while
    the helper thread starts the workers whose dirs exist.  The thread
    exists only during the launch.
    """

    def __init__(self, rank_dirs: Mapping[int, str], units: Sequence[range]) -> None:
        self._made: dict[int, concurrent.futures.Future[None]] = {}
        self._pool: ThreadPoolExecutor | None = None
        if not rank_dirs:
            return
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="aioproc-dirs")
        for ranks in units:
            paths = [rank_dirs[r] for r in ranks if r in rank_dirs]
            self._made[ranks.start] = self._pool.submit(_make_dirs, paths)

    async def ready(self, first: int) -> None:
        """Until the dirs of the batch starting at rank ``first`` exist; raises OSError."""
        made = self._made.get(first)
        if made is not None:
            await shielded(asyncio.wrap_future(made))

    async def aclose(self) -> None:
        """Cancel the batches not begun and wait for the one being made."""
        if self._pool is None:
            return
        self._pool.shutdown(wait=False, cancel_futures=True)
        running = [asyncio.wrap_future(f) for f in self._made.values() if not f.cancelled()]
        if running:
            await asyncio.wait(running)
        self._pool.shutdown(wait=True)  # idle now: the thread exits at once


def _make_dirs(paths: Sequence[str]) -> None:
    for path in paths:
        os.mkdir(path)
