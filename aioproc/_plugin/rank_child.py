"""Worker side of ``@pytest.mark.aioproc``: run one rank of a test body.

The parent (``_plugin.ranks``) sends a :class:`RankCall` naming the test by
module file and qualified name, never the function object: the worker loads
the test module itself, through pytest's assertion rewriting, so a failed
``assert`` in a rank explains itself exactly as it would in the parent.

Stacks are dumped by ``faulthandler`` on a fatal signal (a segfaulting rank
shows where) and on ``DUMP_SIGNAL``, which the parent sends to stop ranks
that outlived the test's timeout: the dump is written before the signal's
default action ends the process, so it is complete whenever the rank dies.
An ``async def`` body runs as every coroutine worker does (``_child.aio``):
the stop signal cancels it, its ``finally:`` blocks run, then it dies of
the signal.
"""

from __future__ import annotations

import faulthandler
import importlib.util
import inspect
import signal
import sys
from dataclasses import dataclass, field
from typing import Any

from .._child import aio as _aio

DUMP_SIGNAL = signal.SIGUSR1
"""Stops a rank after dumping every thread's stack to its stderr."""

SKIPPED = "skipped"


@dataclass(frozen=True)
class RankCall:
    """What one rank runs: the test function, its fixture values, its event loop."""

    module: str
    """The test module's name in the parent's ``sys.modules``."""
    path: str
    """The test module's file."""
    qualname: str
    """``test_x`` or ``TestClass.test_x``."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    loop_factory: Any = None
    """Makes the event loop of an ``async def`` body (default: asyncio's); see ``_run_async``."""
    anyio_backend: Any = None
    """anyio's backend (name or ``(name, options)``) when the test asked for one."""


def _load_module(name: str, path: str) -> Any:
    """The test module, asserts rewritten by pytest as in the parent."""
    module = sys.modules.get(name)
    if module is not None and getattr(module, "__file__", None) == path:
        return module
    import ast

    from _pytest.assertion.rewrite import rewrite_asserts

    with open(path, "rb") as f:
        source = f.read()
    tree = ast.parse(source, filename=path)
    rewrite_asserts(tree, source, path, None)
    code = compile(tree, path, "exec", dont_inherit=True)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        exec(code, module.__dict__)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _resolve(module: Any, qualname: str) -> Any:
    obj = module
    for part in qualname.split("."):
        obj = getattr(obj, part)
        if inspect.isclass(obj):
            obj = obj()  # pytest runs every test method on a fresh instance
    return obj


def _run_async(call: RankCall, fn: Any) -> Any:
    """Run an ``async def`` body the way every coroutine worker runs (``_child.aio``).

    On a loop of its own, made by the test run's loop factory (pytest-asyncio's,
    or anyio's asyncio options), which a stop signal cancels.  Only anyio's
    other backends (trio) run on their own runner.
    """
    loop: Any = call.loop_factory or "asyncio"
    if call.anyio_backend is not None:
        backend = call.anyio_backend
        name, options = (backend, {}) if isinstance(backend, str) else backend
        if name != "asyncio":
            import functools

            import anyio

            return anyio.run(
                functools.partial(fn, **call.kwargs), backend=name, backend_options=options
            )
        loop = _anyio_loop(options)
    return _aio.run(fn(**call.kwargs), loop=loop)


def _anyio_loop(options: dict[str, Any]) -> Any:
    """The loop anyio's asyncio backend would make with ``options``, as ``_aio.run``'s ``loop``."""
    loop: Any = options.get("loop_factory")
    if loop is None:
        loop = "uvloop" if options.get("use_uvloop") else "asyncio"
    debug = options.get("debug")
    if debug is None:
        return loop

    def make() -> Any:
        made = _aio.new_event_loop(loop)
        made.set_debug(debug)
        return made

    return make


def main(call: RankCall) -> tuple[str, str] | None:
    """Run the test body for this rank.

    Returns:
        ``None`` when it passed, ``(SKIPPED, reason)`` when it called
        ``pytest.skip``; any other exception propagates to the parent.
    """
    faulthandler.enable(all_threads=True)
    faulthandler.register(DUMP_SIGNAL, all_threads=True, chain=True)
    import pytest

    fn = _resolve(_load_module(call.module, call.path), call.qualname)
    try:
        if inspect.iscoroutinefunction(fn):
            _run_async(call, fn)
        else:
            fn(**call.kwargs)
    except pytest.skip.Exception as e:  # not picklable: told as a value
        return (SKIPPED, str(e.msg))
    sys.stdout.flush()
    sys.stderr.flush()
    return None
