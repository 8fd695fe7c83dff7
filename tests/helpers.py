"""Shared test utilities: stdlib only, so worker processes may import this too.

Import it from a test module with ``from helpers import ...``: ``tests/`` has no
``__init__.py``, so pytest's default ``prepend`` import mode puts ``tests/``
itself on ``sys.path`` (as it does for ``conftest.py``).
"""

from __future__ import annotations

import contextlib
import glob
import os
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

# the plugin's leak check reads /proc the same way the tests do
from aioproc._plugin.leakcheck import child_pids as child_pids
from aioproc._plugin.leakcheck import open_fds as open_fds

if TYPE_CHECKING:
    import asyncio

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
CHILDREN_DIR = os.path.join(TESTS_DIR, "children")
REPO_ROOT = os.path.dirname(TESTS_DIR)


def python(code: str) -> list[str]:
    """argv running ``code`` in a fresh, unbuffered interpreter (never "python3")."""
    return [sys.executable, "-u", "-c", code]


def pid_gone(pid: int) -> bool:
    """True if no process ``pid`` exists at all: not running, and not a zombie either.

    ``kill(pid, 0)`` succeeds for a zombie, so an exited but unreaped child
    counts as still there.
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # exists, owned by someone else (a recycled pid)
    return False


def aioproc_temp_dirs(tmpdir: str) -> set[str]:
    """The private ``aioproc_*`` log dirs ``DefaultLogsSpecs()`` made in ``tmpdir``."""
    return set(glob.glob(os.path.join(glob.escape(tmpdir), "aioproc_*")))


def write_file(path: str, text: str, mode: int = 0o644) -> str:
    """Create ``path`` holding ``text`` with permission bits ``mode``; return it."""
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, mode)
    return path


@contextlib.contextmanager
def release_fifo(path: str) -> Iterator[Callable[[int], None]]:
    """A FIFO workers block on until the test releases them (no sleeps).

    The test holds the FIFO open read-write, so a worker's ``open`` for reading
    never blocks and its one-byte ``read`` blocks until ``release(n)`` writes
    ``n`` bytes (one per worker).  See ``children/ctx_workers.wait_fifo``.
    """
    os.mkfifo(path)
    fd = os.open(path, os.O_RDWR)

    def release(n: int) -> None:
        os.write(fd, b"x" * n)

    try:
        yield release
    finally:
        os.close(fd)


def run_on_new_loop(factory: Callable[[], asyncio.AbstractEventLoop], coro: Any) -> Any:
    """``asyncio.Runner(loop_factory=factory).run(coro)``, also on Python 3.10."""
    loop = factory()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
