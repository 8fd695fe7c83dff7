"""A group's rank dirs: made during the launch, removed as their workers exit.

torch's log layout gives every rank a directory (``attempt_<n>/<rank>/``),
made before the rank starts and, in the private temp dir a group makes when
no ``log_dir`` is given, pruned at close.  On this kind of file system a
``mkdir`` or ``rmdir`` next to many siblings costs tens of microseconds of
kernel time or more, so hundreds of them are worth keeping off the loop and
off the critical path: ``RankDirs`` makes them on a thread of its own while
the first workers start; ``EmptyDirSweeper`` removes the empty ones of the
temp dir, on another, as their workers exit, instead of all of them after
the last exit.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

from ._shield import shielded


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


class EmptyDirSweeper:
    """Removes rank dirs left empty by their exited workers, in batches on a thread of its own.

    Only dirs the group's own temp dir holds and that no stream file of the
    group is in are given to ``add`` (see ``DefaultLogsSpecs``): such a dir
    holds a file only if the worker wrote its error file, which was read
    before the dir is offered, and then the ``rmdir`` fails and the dir
    stays for the final prune.  Exits are queued as they come and one job
    at a time removes what is queued (one hand-over per burst, not per
    worker).  Not the helper thread: a batch of ``rmdir`` there would delay
    the ``/proc`` scan and error-file reads of the stop behind it.  The
    thread exists from the first exit until ``settle``.
    """

    def __init__(self) -> None:
        self._queued: list[str] = []
        self._task: asyncio.Task[None] | None = None
        self._pool: ThreadPoolExecutor | None = None

    def add(self, path: str) -> None:
        """Queue ``path`` for removal if it is empty; call on the loop."""
        self._queued.append(path)
        if self._task is None:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="aioproc-sweep")
            self._task = asyncio.get_running_loop().create_task(
                self._drain(self._pool), name="aioproc-rank-dirs"
            )

    async def _drain(self, pool: ThreadPoolExecutor) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self._queued:
                batch, self._queued = self._queued, []
                await shielded(loop.run_in_executor(pool, _remove_empty, batch))
        finally:
            self._task = None

    async def settle(self) -> None:
        """Until what is queued has been removed (or found not empty); then the thread exits.

        Cancellation: the removal in progress finishes first (a half-swept
        batch is left to the final prune) and the cancellation is re-raised.
        """
        task = self._task
        try:
            if task is not None:
                await shielded(task)
        finally:
            pool, self._pool = self._pool, None
            if pool is not None:
                pool.shutdown(wait=True)  # idle now: the thread exits at once


def _remove_empty(paths: Sequence[str]) -> None:
    for path in paths:
        try:
            os.rmdir(path)
        except OSError:
            pass  # holds an error file (kept for the prune to report), or gone
