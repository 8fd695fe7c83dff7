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
# module with the controller's TMPDIR already set: it takes a sibling of the
# controller's dir (not a child, which would lengthen every path the tests
# print and let the controller's cleanup race the worker).
_BASE_TMP = os.environ.setdefault("AIOPROC_SUITE_BASE_TMP", tempfile.gettempdir())
_SUITE_TMP = tempfile.mkdtemp(prefix="aioproc-suite-", dir=_BASE_TMP)
os.environ["TMPDIR"] = _SUITE_TMP
tempfile.tempdir = None  # recomputed from TMPDIR


# A shell without job control starts a background job (`bash .ci/run &` in
# a script) with SIGINT and SIGQUIT ignored, and an ignored signal stays
# ignored across exec: every worker the suite starts would ignore them, and
# the tests that stop workers with SIGINT would see SIGKILL after the grace
# period instead.  The suite runs as if started from a terminal.
for _sig in (signal.SIGINT, signal.SIGQUIT):
    if signal.getsignal(_sig) is signal.SIG_IGN:
        signal.signal(_sig, signal.default_int_handler if _sig == signal.SIGINT else signal.SIG_DFL)


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(_SUITE_TMP, ignore_errors=True)


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
    return _LOOP_FACTORIES
