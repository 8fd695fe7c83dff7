"""Suite-wide fixtures: both event loops, and a leak check around every test.

Every async test runs twice, on the default asyncio loop and on uvloop, via
pytest-asyncio's loop-factory hook.  The autouse ``no_leaks`` fixture fails a
test that leaves a child process (running or unreaped) or an open fd behind,
and kills what it finds so one leak does not cascade into later tests.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest
from helpers import SHARED_CHILDREN, child_pids, open_fds

# fixtures shared by the persistent-worker and pool tests (pw, fifo)
pytest_plugins = ["pw_fixtures"]

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is declared in the test extra
    uvloop = None
else:
    # libuv opens a process-wide pipe the first time any loop is created; open
    # it now so the leak check does not blame the first uvloop test for it.
    uvloop.new_event_loop().close()


# The suite gets a temp dir of its own (children inherit TMPDIR), so the
# leak check can tell what a test left in it from other programs' files.
_SUITE_TMP = tempfile.mkdtemp(prefix="aioproc-suite-")
os.environ["TMPDIR"] = _SUITE_TMP
tempfile.tempdir = None  # recomputed from TMPDIR


def _temp_entries() -> set[str]:
    # pytest's own tmp_path tree lives there too and is pytest's to manage
    return {n for n in os.listdir(_SUITE_TMP) if not n.startswith("pytest-of-")}


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(_SUITE_TMP, ignore_errors=True)


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    factories: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
        "asyncio": asyncio.new_event_loop
    }
    if uvloop is not None:
        factories["uvloop"] = uvloop.new_event_loop
    return factories


def _fd_target(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return "?"


@pytest.fixture(autouse=True)
def no_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    if not sys.platform.startswith("linux"):
        yield
        return
    children_before = child_pids()
    fds_before = open_fds()
    temps_before = _temp_entries()
    yield
    leaked_temps = _temp_entries() - temps_before
    for name in leaked_temps:
        path = os.path.join(_SUITE_TMP, name)
        shutil.rmtree(path, ignore_errors=True)
        if os.path.lexists(path):
            os.unlink(path)
    leaked_children = child_pids() - children_before - SHARED_CHILDREN
    for pid in leaked_children:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
    leaked_fds = open_fds() - fds_before
    problems: list[str] = []
    if leaked_children:
        problems.append(f"child processes left behind: {sorted(leaked_children)}")
    if leaked_fds:
        detail = ", ".join(f"{fd}->{_fd_target(fd)}" for fd in sorted(leaked_fds))
        problems.append(f"file descriptors left open: {detail}")
    if leaked_temps:
        problems.append(f"left in $TMPDIR: {sorted(leaked_temps)}")
    if problems:
        pytest.fail("; ".join(problems))


def pytest_collection_modifyitems(items: list[Any]) -> None:
    # Ensure the leak check wraps the event loop fixture: it must be set up
    # before and torn down after the loop so the loop's own fds do not count.
    for item in items:
        names = getattr(item, "fixturenames", None)
        if names and "no_leaks" in names:
            names.remove("no_leaks")
            names.insert(0, "no_leaks")
