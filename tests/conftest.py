"""Suite-wide setup: both event loops, a private TMPDIR, and the leak check.

Every async test runs twice, on the default asyncio loop and on uvloop, via
pytest-asyncio's loop-factory hook (``AIOPROC_TEST_LOOPS=asyncio`` narrows that
to the loops named, comma-separated: CI's 3.10 run uses it, see ``.ci/run``).
Every test runs under aioproc's own leak check (``aioproc_leakcheck = true``
in pyproject.toml; the plugin is ``aioproc.pytest_plugin``): it fails a test
that leaves a child process (running or unreaped), an open fd, a thread, an
unclosed group or anything in the suite's ``$TMPDIR`` behind, and removes what
it finds so one leak does not cascade into later tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import os
import shutil
import signal
import tempfile
from collections.abc import Callable, Mapping

import pytest

# fixtures shared by the persistent-worker and pool tests (pw, fifo) and by
# the cluster and barrier tests (runners); the plugin is also registered by
# its pytest11 entry point once aioproc is installed, under this same name,
# so naming it here never registers it twice
pytest_plugins = ["pw_fixtures", "cluster_fixtures", "aioproc.pytest_plugin", "pytester"]

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is declared in the test extra
    uvloop = None


# The suite gets a temp dir of its own (children inherit TMPDIR), so the leak
# check (aioproc_leakcheck_tmpdir = "all") can tell what a test left in it
# from other programs' files.  Under xdist every worker process imports this
# module with the controller's environment: it takes a sibling of the
# controller's dir named after it, ``<controller's>-gw0`` (not a child, nor a
# longer name: the paths the tests print must fit a terminal's line), so the
# controller can remove whatever a worker stopped before its cleanup left.
_BASE_TMP = os.environ.setdefault("AIOPROC_SUITE_BASE_TMP", tempfile.gettempdir())
_CONTROLLER_TMP = os.environ.get("AIOPROC_SUITE_TMP")
_XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
_SUITE_TMP = ""
if _CONTROLLER_TMP and _XDIST_WORKER:
    with contextlib.suppress(FileExistsError):  # taken: a run nested in a worker's test
        os.mkdir(f"{_CONTROLLER_TMP}-{_XDIST_WORKER}", 0o700)
        _SUITE_TMP = f"{_CONTROLLER_TMP}-{_XDIST_WORKER}"
if not _SUITE_TMP:
    _SUITE_TMP = tempfile.mkdtemp(prefix="aioproc-suite-", dir=_BASE_TMP)
    os.environ["AIOPROC_SUITE_TMP"] = _SUITE_TMP
os.environ["TMPDIR"] = _SUITE_TMP
tempfile.tempdir = None  # recomputed from TMPDIR
_MAIN_PID = os.getpid()


def _remove_suite_tmp() -> None:
    """Remove this process's temp dir (and, in the controller, every worker's)."""
    os.environ["TMPDIR"] = _BASE_TMP  # whatever still asks gets a dir that exists
    tempfile.tempdir = None
    shutil.rmtree(_SUITE_TMP, ignore_errors=True)
    if not _XDIST_WORKER:
        for path in glob.glob(glob.escape(_SUITE_TMP) + "-*"):
            shutil.rmtree(path, ignore_errors=True)


# A shell without job control starts a background job (`bash .ci/run &` in
# a script) with SIGINT and SIGQUIT ignored, and an ignored signal stays
# ignored across exec: every worker the suite starts would ignore them, and
# the tests that stop workers with SIGINT would see SIGKILL after the grace
# period instead.  The suite runs as if started from a terminal.
for _sig in (signal.SIGINT, signal.SIGQUIT):
    if signal.getsignal(_sig) is signal.SIG_IGN:
        signal.signal(_sig, signal.default_int_handler if _sig == signal.SIGINT else signal.SIG_DFL)


def _stop_on_sigterm(signum: int, frame: object) -> None:
    """SIGTERM stops the run as Ctrl-C does, so it cleans up (a second one kills at once).

    Ctrl-C reaches every process of the terminal's process group; SIGTERM
    only the one it is sent to: the xdist controller passes it on to its
    workers as SIGINT (it runs no test, so its children are its workers).
    """
    if os.getpid() != _MAIN_PID:  # a test's fork() without exec: as if unhandled
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if _XDIST_CONTROLLER:
        from aioproc._base.children import child_pids

        for pid in child_pids():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGINT)
    raise KeyboardInterrupt


# In the run's top process only: the xdist controller, or the one process of
# a run without xdist (where a test sees it as the host's handler, which
# translate_signals keeps and restores).  In an xdist worker it would be
# every test's SIGTERM handler.
_XDIST_CONTROLLER = False
if not _XDIST_WORKER and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
    signal.signal(signal.SIGTERM, _stop_on_sigterm)


def pytest_configure(config: pytest.Config) -> None:
    global _XDIST_CONTROLLER
    _XDIST_CONTROLLER = config.pluginmanager.has_plugin("dsession")
    config.addinivalue_line(
        "markers",
        "loops(*names, reason): run this async test on these loops only (of those "
        "AIOPROC_TEST_LOOPS allows); for a test whose subject the loop plays no part in",
    )


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    # An xdist worker tells the controller it has finished right after this
    # hook, and the controller may end before the worker reaches
    # pytest_unconfigure: its temp dir goes now.
    if _XDIST_WORKER:
        _remove_suite_tmp()


def pytest_unconfigure(config: pytest.Config) -> None:
    _remove_suite_tmp()
    if signal.getsignal(signal.SIGTERM) is _stop_on_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """How many xdist workers ``-n auto`` (pyproject.toml's default) starts.

    One more than the CPUs: a test spends most of its time waiting for its
    workers to start, answer or exit, which leaves a CPU per xdist worker
    idle part of the time.  ``PYTEST_XDIST_AUTO_NUM_WORKERS`` overrides it, as
    it does xdist's own count.
    """
    named = os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS")
    if named:
        return int(named)
    return len(os.sched_getaffinity(0)) + 1


def _loop_factories() -> dict[str, Callable[[], asyncio.AbstractEventLoop]]:
    factories: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
        "asyncio": asyncio.new_event_loop
    }
    if uvloop is not None:
        factories["uvloop"] = uvloop.new_event_loop
    chosen = os.environ.get("AIOPROC_TEST_LOOPS", "").strip()
    if not chosen:
        return factories
    names = [n.strip() for n in chosen.split(",") if n.strip()]
    unknown = [n for n in names if n not in factories]
    if unknown or not names:
        raise pytest.UsageError(
            f"AIOPROC_TEST_LOOPS={chosen!r}: {', '.join(unknown) or 'no loop'} is not one of "
            f"{', '.join(factories)}"
        )
    return {n: factories[n] for n in names}


_LOOP_FACTORIES = _loop_factories()


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    marker = item.get_closest_marker("loops")
    if marker is None:
        return _LOOP_FACTORIES
    if not marker.args or not marker.kwargs.get("reason"):
        raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.loops needs loop names and a reason")
    unknown = [name for name in marker.args if name not in ("asyncio", "uvloop")]
    if unknown:
        raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.loops: unknown loop {unknown[0]!r}")
    chosen = {name: f for name, f in _LOOP_FACTORIES.items() if name in marker.args}
    return chosen or _LOOP_FACTORIES  # none allowed here: whatever runs, rather than nothing
