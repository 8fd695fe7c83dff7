"""A group's rank dirs, made during the launch.

torch's log layout gives every rank a directory (``attempt_<n>/<rank>/``),
made before the rank starts.  A ``mkdir`` next to many siblings costs tens
to hundreds of microseconds of kernel time on some file systems (ext4:
45-200 us each for 1024 siblings on the development machine, varying with
the file system's state), so hundreds of them are kept off the loop and off
the critical path: ``RankDirs`` makes them on a thread of its own while the
first workers start.

That thread must not take the GIL once per directory.  Each ``os.mkdir``
drops the GIL and takes it back; while the loop thread runs Python code, a
thread asking for the GIL back waits up to the switch interval, and the
helper thread starting workers (which drops and takes the GIL around every
spawn and every write to the guardian) then waits behind both.  With a
thousand ``mkdir`` calls that convoy cost the loop more than the
directories themselves.  So the dirs are made in chunks that double in size,
and a chunk of ``PROCESS_FROM`` dirs or more is made by one ``mkdir``
process (the thread waits for it without the GIL); the first chunks, which
the first workers wait for, are small and made in this process.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

from .._base.shield import shielded

PROCESS_FROM = 32
"""Dirs in a chunk from which one ``mkdir`` process makes them: starting it
costs about as much as making 5-20 dirs in this process."""

_mkdir: str | bool | None = False  # the mkdir binary; None: there is none


def _mkdir_binary() -> str | None:
    global _mkdir
    if _mkdir is False:
        # the system's own, never one a worker's PATH would find
        _mkdir = shutil.which("mkdir", path=os.defpath)
    assert _mkdir is not True
    return _mkdir


def chunks(units: Sequence[range], rank_dirs: Mapping[int, str]) -> list[list[range]]:
    """``units`` (the launch's, in order) grouped into the chunks their dirs are made in.

    The first two units alone (the first workers wait for them), then
    groups of whole units of at least ``PROCESS_FROM`` dirs, each at least
    twice the last: a few chunks, the early ones ready early.
    """
    out: list[list[range]] = []
    want = PROCESS_FROM
    current: list[range] = []
    size = 0
    for unit in units:
        current.append(unit)
        size += sum(1 for r in unit if r in rank_dirs)
        if len(out) < 2 or size >= want:
            out.append(current)
            if len(out) > 2:
                want = max(want, 2 * size)
            current, size = [], 0
    if current:
        if len(out) > 2 and size < PROCESS_FROM:
            out[-1] += current  # a short tail joins the last chunk's process
        else:
            out.append(current)
    return out


class RankDirs:
    """Makes the rank dirs ``reify`` left to the launch, chunk by chunk, on a thread of its own.

    Made in rank order, while the helper thread starts the workers whose
    dirs exist (see the module docstring).  The thread exists only during
    the launch.
    """

    def __init__(self, rank_dirs: Mapping[int, str], units: Sequence[range]) -> None:
        self._made: dict[int, concurrent.futures.Future[None]] = {}
        self._pool: ThreadPoolExecutor | None = None
        if not rank_dirs:
            return
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="aioproc-dirs")
        for chunk in chunks(units, rank_dirs):
            paths = [rank_dirs[r] for ranks in chunk for r in ranks if r in rank_dirs]
            made = self._pool.submit(_make_dirs, paths)
            for ranks in chunk:
                self._made[ranks.start] = made

    async def ready(self, first: int) -> None:
        """Until the dirs of the unit starting at rank ``first`` exist; raises OSError."""
        made = self._made.get(first)
        if made is not None:
            await shielded(asyncio.wrap_future(made))

    async def aclose(self) -> None:
        """Cancel the chunks not begun and wait for the one being made."""
        if self._pool is None:
            return
        self._pool.shutdown(wait=False, cancel_futures=True)
        running = {asyncio.wrap_future(f) for f in self._made.values() if not f.cancelled()}
        if running:
            await asyncio.wait(running)
        self._pool.shutdown(wait=True)  # idle now: the thread exits at once


def _make_dirs(paths: Sequence[str]) -> None:
    """Make ``paths`` in order (their parent exists); raises the first OSError."""
    binary = _mkdir_binary() if len(paths) >= PROCESS_FROM else None
    if binary is not None:
        try:
            done = subprocess.run(
                [binary, "--", *paths],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                env={"LC_ALL": "C"},
                check=False,
            )
        except OSError:
            pass  # could not start it (fds, memory): made here instead
        else:
            if done.returncode == 0:
                return
        # it failed part-way (or never ran): what it made is kept, and the
        # first dir that cannot be made here raises with its own error
        for path in paths:
            try:
                os.mkdir(path)
            except FileExistsError:
                if not os.path.isdir(path):
                    raise
        return
    for path in paths:
        os.mkdir(path)
