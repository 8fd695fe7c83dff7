"""Shared test utilities: stdlib only, so worker processes may import this too.

Import it from a test module with ``from helpers import ...``: ``tests/`` has no
``__init__.py``, so pytest's default ``prepend`` import mode puts ``tests/``
itself on ``sys.path`` (as it does for ``conftest.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import glob
import importlib
import json
import os
import socket
import sys
import tempfile
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import TYPE_CHECKING, Any

# the plugin's leak check reads /proc the same way the tests do
from aioproc._plugin.leakcheck import child_pids as child_pids
from aioproc._plugin.leakcheck import open_fds as open_fds

if TYPE_CHECKING:
    import pytest

    from aioproc._limits.cgroups import Host

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
CHILDREN_DIR = os.path.join(TESTS_DIR, "children")
REPO_ROOT = os.path.dirname(TESTS_DIR)


def python(code: str) -> list[str]:
    """argv running ``code`` in a fresh, unbuffered interpreter (never "python3")."""
    return [sys.executable, "-u", "-c", code]


def import_child(monkeypatch: pytest.MonkeyPatch, name: str) -> ModuleType:
    """The module ``children/<name>.py``, imported by name.

    ``children/`` stays on ``sys.path`` for the test, so its functions are
    named ``<name>.<function>`` and function workers import them the same way.
    """
    monkeypatch.syspath_prepend(CHILDREN_DIR)
    return importlib.import_module(name)


def loop_name() -> str:
    """The running event loop's kind, "uvloop" or "asyncio" (also with no loop running)."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return "asyncio"
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"


def envs(n: int) -> dict[int, dict[str, str]]:
    """No extra environment variables for each of ranks ``0 .. n-1``."""
    return {r: {} for r in range(n)}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def result_of(returncode: int, out: str, err: str) -> dict[str, Any]:
    """The dict of the last ``RESULT <json>`` line a child printed on ``out``.

    Fails with the end of ``err`` if it exited non-zero or printed no such line.
    """
    assert returncode == 0, err[-3000:]
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert lines, err[-3000:]
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
    return result


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


def parent_of(pid: int) -> int:
    """``pid``'s parent, or 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def state(pid: int) -> str:
    """``pid``'s state letter (``Z`` for a zombie, ``T`` when stopped), or "" once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return ""
    return stat[stat.rindex(b")") + 2 :].split()[0].decode()


def cmdline(pid: int) -> bytes:
    """``pid``'s command line, NUL-separated, or b"" once it is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def aioproc_temp_dirs(tmpdir: str | None = None) -> set[str]:
    """The private ``aioproc_*`` log dirs ``DefaultLogsSpecs()`` made in ``tmpdir``.

    By default in ``tempfile.gettempdir()`` (as it is now: tests may patch it).
    """
    if tmpdir is None:
        tmpdir = tempfile.gettempdir()
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


# ------------------------------------------- in-process signals (test_signals*)


def kill_self(sig: int) -> None:
    """Send ``sig`` to this process: delivered before ``kill`` returns."""
    os.kill(os.getpid(), sig)


async def forever(limit: float = 5) -> None:
    """Block until cancelled, failing the test after ``limit`` seconds."""
    await asyncio.wait_for(asyncio.Event().wait(), limit)


async def spin(turns: int = 10) -> None:
    """Let the loop run a few iterations (read its wakeup fd, run callbacks)."""
    for _ in range(turns):
        await asyncio.sleep(0)


def cancelling() -> int:
    """The current task's ``cancelling()`` count (0 before Python 3.11)."""
    task = asyncio.current_task()
    assert task is not None
    return task.cancelling() if sys.version_info >= (3, 11) else 0


@functools.cache
def cgroup_host() -> Host:
    """What cgroups this process can make (``_limits.cgroups.discover``), looked at once."""
    from aioproc._limits.cgroups import discover

    return discover()


def need_cgroup(*controllers: str) -> None:
    """Skip, saying why, unless this process can make groups with ``controllers``."""
    import pytest

    host = cgroup_host()
    offered = set().union(*(h.controllers for h in host.hierarchies))
    if not set(controllers) <= offered:
        pytest.skip(
            f"this process cannot make cgroups with {', '.join(controllers)} (needs root or a "
            f"delegated subtree; notes: {'; '.join(host.notes) or 'none'})"
        )
