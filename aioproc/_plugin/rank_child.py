"""Worker side of ``@pytest.mark.aioproc``: run one rank of a test body.

The parent (``_plugin.ranks``) sends a :class:`RankCall` naming the test by
module file and qualified name, never the function object: the worker loads
the test module itself, through pytest's assertion rewriting, so a failed
``assert`` in a rank explains itself exactly as it would in the parent.

Stacks are dumped by ``faulthandler`` on a fatal signal (a segfaulting rank
shows where) and on ``DUMP_SIGNAL``, which the parent sends to stop ranks
that outlived the test's timeout: the dump is written before the signal's
default action ends the process, so it is complete whenever the rank dies.
"""

from __future__ import annotations

import faulthandler
import importlib.util
import inspect
import signal
import sys
from dataclasses import dataclass, field
from typing import Any

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
    """Makes the event loop of an ``async def`` body (default: asyncio's)."""
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
    if call.anyio_backend is not None:
        import functools

        import anyio

        backend = call.anyio_backend
        name, options = (backend, {}) if isinstance(backend, str) else backend
        return anyio.run(
            functools.partial(fn, **call.kwargs), backend=name, backend_options=options
        )
    import asyncio

    loop = (call.loop_factory or asyncio.new_event_loop)()
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(fn(**call.kwargs))
    finally:
        try:
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            asyncio.set_event_loop(None)
            loop.close()


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
