"""aioproc's pytest plugin: multi-process test bodies, group fixtures, leak checks.

Installed with aioproc (entry point ``pytest11``) and inert unless used:
importing it imports pytest and the standard library only, and it changes
nothing for a test that uses none of the following.

- ``@pytest.mark.aioproc(nprocs=N)`` or ``(cluster={"chief": 1, "worker": 2})``
  runs the test function (sync or async) on N fresh worker processes with
  torch's (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) or
  TensorFlow's (``TF_CONFIG``) environment and the test's fixture values;
  ``timeout=`` (default: pytest-timeout's) stops the ranks after dumping
  their stacks into the report.  See ``aioproc.testing`` for use in a body
  (``rank()``, ``world_size()``, ``task()``, ``barrier()``).
- ``aioproc_group`` / ``aioproc_pool`` / ``aioproc_cluster``: factories of
  started groups / open pools / running cluster runners, closed at teardown,
  on the test's loop (pytest-asyncio or anyio).
- ``--aioproc-leakcheck`` (ini ``aioproc_leakcheck = true``), the
  ``aioproc_leakcheck`` fixture or marker: fail a test that leaves child
  processes, fds, threads, aioproc temp dirs or unclosed groups, pools,
  workers or agents behind.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import types
from collections.abc import AsyncIterator, Callable, Generator, Iterator
from typing import Any

import pytest

LEAKCHECK = "aioproc_leakcheck"
_RANKS_MODULE = f"{__package__}._plugin.ranks"
_FACTORIES = ("aioproc_group", "aioproc_pool", "aioproc_cluster")
_DEFAULT_TIMEOUT = pytest.StashKey[float | None]()
"""pytest-timeout's timeout for a multi-rank test, read before the plugin extends it."""
_WORKERS_TMP = "aioproc_leakcheck_tmp"
"""The ``workerinput`` key of the dir under which each xdist worker makes its own temp dir."""
_private_tmp: str | None = None
"""This process's temp dir while the leak check counts aioproc's temp dirs (see below)."""
_private_owned = False
"""Whether this process made ``_private_tmp`` (else: an xdist worker's, in the controller's)."""
_TIMEOUT_BACKSTOP = 30.0
"""Seconds pytest-timeout waits beyond a multi-rank test's own timeout."""


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("aioproc")
    group.addoption(
        "--aioproc-leakcheck",
        action="store_true",
        default=None,
        help="fail every test that leaves child processes, fds, threads, aioproc temp "
        "dirs or unclosed aioproc groups, pools, workers or agents behind",
    )
    parser.addini(
        LEAKCHECK, type="bool", default=False, help="as --aioproc-leakcheck, for every test"
    )
    parser.addini(
        "aioproc_leakcheck_tmpdir",
        default="aioproc",
        help="which new entries of the temp dir count as leaks: 'aioproc' (aioproc's temp "
        "dirs the tests' process makes, in a private temp dir the run removes; default) or "
        "'all' (any but pytest's, for a suite with a TMPDIR of its own)",
    )


@pytest.hookimpl(trylast=True)  # after pytest's tmp_path factory is made
def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "aioproc(nprocs=None, cluster=None, timeout=None): run the test body on nprocs "
        "worker processes (or one per task of a TF cluster spec); it passes when every "
        "rank passes",
    )
    config.addinivalue_line(
        "markers",
        f"{LEAKCHECK}: fail the test if it leaves child processes, fds, threads, aioproc "
        "temp dirs or unclosed aioproc groups, pools, workers or agents behind",
    )
    mode = config.getini("aioproc_leakcheck_tmpdir")
    if mode not in ("aioproc", "all"):
        raise pytest.UsageError(
            f"aioproc_leakcheck_tmpdir must be 'aioproc' or 'all', got {mode!r}"
        )
    if mode == "all" and _leakcheck_on(config) and not os.environ.get("TMPDIR"):
        raise pytest.UsageError(
            "aioproc_leakcheck_tmpdir = 'all' counts every new entry of $TMPDIR, a temp "
            "dir of the suite's own, and TMPDIR is not set"
        )
    if mode == "aioproc" and _leakcheck_on(config):
        # aioproc's temp dirs are told apart by name, and $TMPDIR is shared
        # with every other program, other pytest runs and xdist's other
        # workers included: the check would take their dirs for this
        # process's leaks, and remove them.  This process makes its temp
        # files in a private dir instead (its children still inherit $TMPDIR
        # unchanged), and the check looks there.  An xdist worker's is made
        # inside the controller's: a worker stopped before its cleanup leaves
        # nothing that the controller does not remove.
        global _private_tmp, _private_owned
        workerinput: dict[str, Any] = getattr(config, "workerinput", None) or {}  # xdist's
        parent = workerinput.get(_WORKERS_TMP)
        if parent is not None:
            _private_tmp = tempfile.mkdtemp(prefix=f"{workerinput['workerid']}-", dir=parent)
        else:  # this run's top process (or a worker whose controller lacks this plugin)
            factory = getattr(config, "_tmp_path_factory", None)  # pytest's, for plugins
            if factory is not None and not workerinput:
                # tmp_path's root stays where pytest keeps it (and its last runs)
                factory.getbasetemp()
            _private_tmp = tempfile.mkdtemp(prefix="aioproc-leakcheck-")
            _private_owned = True
        tempfile.tempdir = _private_tmp


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """xdist's controller, before it starts each worker: the dir its temp dir goes in."""
    if _private_tmp is not None:
        node.workerinput[_WORKERS_TMP] = _private_tmp


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    # An xdist worker tells the controller it has finished right after this
    # hook: the controller may end (and its caller look at $TMPDIR) before
    # this worker reaches pytest_unconfigure.  Its temp dir goes now.
    if not _private_owned:
        _remove_private_tmp()


def pytest_unconfigure(config: pytest.Config) -> None:
    # the top process: once xdist's workers have ended, their dirs with it
    _remove_private_tmp()


def _remove_private_tmp() -> None:
    global _private_tmp, _private_owned
    if _private_tmp is not None:
        tempfile.tempdir = None
        shutil.rmtree(_private_tmp, ignore_errors=True)
        _private_tmp = None
        _private_owned = False


def _plugin_active(config: pytest.Config, module: str) -> bool:
    """Whether the plugin ``module`` is registered, however it was loaded.

    An entry point registers it under its entry-point name (``asyncio``,
    ``timeout``), ``-p module`` under the module's name: ask for the module.
    """
    plugin = sys.modules.get(module)
    return plugin is not None and config.pluginmanager.is_registered(plugin)


def _leakcheck_on(config: pytest.Config) -> bool:
    return bool(config.getoption("aioproc_leakcheck") or config.getini(LEAKCHECK))


def _scope(item: pytest.Item, name: str) -> str:
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs.get(name) if info is not None else None
    return str(defs[-1].scope) if defs else "function"


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    everywhere = _leakcheck_on(config)
    backstop = _plugin_active(config, "pytest_timeout")
    for item in items:
        names: list[str] | None = getattr(item, "fixturenames", None)
        if names is not None and (everywhere or item.get_closest_marker(LEAKCHECK)):
            # First of the function-scoped fixtures: it then wraps the event loop
            # and everything else the test sets up, but not wider-scoped fixtures
            # (set up once, they would be blamed on the first test that uses them).
            if LEAKCHECK in names:
                names.remove(LEAKCHECK)
            at = next((i for i, n in enumerate(names) if _scope(item, n) == "function"), 0)
            names.insert(at, LEAKCHECK)
        marker = item.get_closest_marker("aioproc")
        if marker is not None:
            default = _default_timeout(item)
            item.stash[_DEFAULT_TIMEOUT] = default
            own = marker.kwargs.get("timeout", default)
            if backstop and isinstance(own, (int, float)) and not isinstance(own, bool) and own > 0:
                # the ranks' own timeout reports first, with their stacks;
                # pytest-timeout stays as the backstop should the parent hang
                item.add_marker(pytest.mark.timeout(own + _TIMEOUT_BACKSTOP))


def _default_timeout(item: pytest.Item) -> float | None:
    """pytest-timeout's timeout for ``item``, or None."""
    marker = item.get_closest_marker("timeout")
    value: Any = None
    if marker is not None:
        value = marker.args[0] if marker.args else marker.kwargs.get("timeout")
    elif _plugin_active(item.config, "pytest_timeout"):
        value = item.config.getoption("timeout", None)
        if value is None:
            value = item.config.getini("timeout")
    try:
        seconds = float(value) if value not in (None, "") else 0.0
    except (TypeError, ValueError):
        return None
    return seconds if seconds > 0 else None


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> Generator[None, object, object]:
    marker = pyfuncitem.get_closest_marker("aioproc")
    if marker is None:
        return (yield)
    from ._plugin import ranks as _pytest_ranks

    default = pyfuncitem.stash.get(_DEFAULT_TIMEOUT, None)
    ranks = _pytest_ranks.parse_marker(marker, default)
    call = _pytest_ranks.rank_call(pyfuncitem)

    def run_on_ranks(**_: Any) -> None:
        _pytest_ranks.run_ranks(pyfuncitem, ranks, call)

    # Whoever calls the test (pytest, pytest-asyncio's wrapper, anyio) now
    # calls a plain function that runs the body on the ranks.
    saved = pyfuncitem.obj
    pyfuncitem.obj = run_on_ranks
    try:
        return (yield)
    finally:
        pyfuncitem.obj = saved


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if call.excinfo is None:
        return report
    failed = call.excinfo.value
    if type(failed).__module__ != _RANKS_MODULE:
        return report
    if report.skipped:
        # a rank's skip: point at the test, as a skip in the test itself does
        path, lineno, _ = item.location
        report.longrepr = (path, (lineno or 0) + 1, f"Skipped: {failed}")
    else:
        from ._plugin.report import RanksRepr

        text, summary = getattr(failed, "text", str(failed)), getattr(failed, "summary", "")
        report.longrepr = RanksRepr(text, summary, str(item.path), item)
    return report


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_fixture_setup(
    fixturedef: pytest.FixtureDef[Any], request: pytest.FixtureRequest
) -> Generator[None, object, object]:
    # The factories are async fixtures.  anyio runs them for its tests as they
    # are; pytest-asyncio, in strict mode, only runs fixtures made with
    # pytest_asyncio.fixture: give it such a copy, on the test's loop scope.
    # The copy stays until the fixture is torn down, because pytest-asyncio
    # looks at the fixture again when it calls the test.
    if (
        fixturedef.argname not in _FACTORIES
        or "anyio_backend" in request.fixturenames
        or not _plugin_active(request.config, "pytest_asyncio.plugin")
    ):
        return (yield)
    original = fixturedef.func
    fixturedef.func = _asyncio_fixture(original, request)  # type: ignore[misc]

    def restore() -> None:
        fixturedef.func = original  # type: ignore[misc]

    fixturedef.addfinalizer(restore)
    return (yield)


def _asyncio_fixture(func: Callable[..., Any], request: pytest.FixtureRequest) -> Any:
    import pytest_asyncio

    marker = request.node.get_closest_marker("asyncio")
    loop_scope = None
    if marker is not None:
        loop_scope = marker.kwargs.get("loop_scope") or marker.kwargs.get("scope")
    copy = types.FunctionType(
        func.__code__, func.__globals__, func.__name__, func.__defaults__, func.__closure__
    )
    pytest_asyncio.fixture(copy, loop_scope=loop_scope)  # marks ``copy`` as its own
    return copy


@pytest.fixture
async def aioproc_group() -> AsyncIterator[Any]:
    """A factory: ``pc = await aioproc_group(fn_or_binary, nprocs, args=..., envs=...)``.

    Returns the started ``PContext`` (see ``aioproc.start_processes``); every
    group started is closed at teardown, even when the test fails or is cancelled.

    Cancellation: teardown closes the groups newest first; each close is
    shielded and bounded by the group's grace period.
    """
    from ._plugin.fixtures import GroupFactory

    async with contextlib.AsyncExitStack() as stack:
        yield GroupFactory(stack)


@pytest.fixture
async def aioproc_pool() -> AsyncIterator[Any]:
    """A factory: ``pool = await aioproc_pool(4, initializer=...)`` (``aioproc.open_pool``).

    Every pool opened is closed at teardown, even when the test fails or is cancelled.

    Cancellation: teardown closes the pools newest first; each close is
    shielded and bounded by the pool's ``shutdown_timeout``.
    """
    from ._plugin.fixtures import PoolFactory

    async with contextlib.AsyncExitStack() as stack:
        yield PoolFactory(stack)


@pytest.fixture
async def aioproc_cluster() -> AsyncIterator[Any]:
    """A factory: ``runner = await aioproc_cluster(fn, cluster_spec, ...)``.

    Returns a started ``aioproc.cluster.ClusterRunner`` (``await
    runner.join()`` for the result); every runner is stopped at teardown,
    even when the test fails or is cancelled.

    Cancellation: teardown stops the runners newest first; each stop is
    shielded and bounded by the grace period.
    """
    from ._plugin.fixtures import ClusterFactory

    async with contextlib.AsyncExitStack() as stack:
        yield ClusterFactory(stack)


_uvloop_warm = False


def _warm_uvloop() -> None:
    # libuv opens a process-wide pipe the first time any uvloop loop is made:
    # open it now, or the first test to make one would be blamed for it.
    global _uvloop_warm
    uvloop = sys.modules.get("uvloop")
    if uvloop is not None and not _uvloop_warm:
        uvloop.new_event_loop().close()
        _uvloop_warm = True


@pytest.fixture
def aioproc_leakcheck(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail the test if it leaves child processes, fds, threads, aioproc temp dirs
    or unclosed aioproc groups, pools, workers or agents behind (Linux; elsewhere
    it checks nothing).

    What leaked is listed (processes with their command lines, fds with what
    they point at); leaked processes are killed and temp entries removed, so
    one leak does not fail the tests after it.
    """
    from ._plugin.leakcheck import SUPPORTED, Snapshot

    if not SUPPORTED:
        yield
        return
    _warm_uvloop()
    before = Snapshot.take(all_temps=request.config.getini("aioproc_leakcheck_tmpdir") == "all")
    yield
    problems = before.leaks()
    if problems:
        pytest.fail(
            f"{request.node.nodeid} leaked:\n" + "\n".join(f"- {p}" for p in problems),
            pytrace=False,
        )
