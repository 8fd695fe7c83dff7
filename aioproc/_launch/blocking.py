"""torch's blocking launch API: ``elastic_launch(config, entrypoint)(*args)`` and ``launch_agent``.

Each call runs one ``Launch`` on an event loop of its own, made for the
call and closed after it (``AIOPROC_LOOP`` picks uvloop, as for ``aioproc
run``), so it works from plain synchronous code and from a thread while
another loop runs elsewhere.  In the main thread the launch runs under
``translate_signals`` with the config's ``signals_to_handle``, as torch's
launcher handles them there: a signal stops the workers with it and
raises ``SignalException``; the handlers are put back afterwards.  A thread
that runs an event loop itself is refused: blocking it would stall that
loop, whose coroutines ``await launch(...)`` instead.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from .._cli.supervise import _loop_factory
from ..signals import translate_signals
from .config import LaunchConfig
from .launch import Launch

__all__ = ["elastic_launch", "launch_agent", "run_blocking"]

T = TypeVar("T")


class elastic_launch:
    """Launch ``entrypoint`` on this node's workers when called (torch's ``elastic_launch``).

    ``elastic_launch(config, fn)(*args)`` blocks until the workers are done
    and returns ``{global_rank: value}`` (``None`` values for a program);
    ``elastic_launch(config, sys.executable)("-u", "train.py", ...)`` runs
    a Python script.  See ``aioproc.launcher.launch``, its awaitable form,
    for the config, the entrypoints and what is raised.

    Args:
        config: the launch.
        entrypoint: a function, or a program.
        health_check_server: accepted for torch's signature; aioproc runs no
            health-check server, and leaves the caller's as it is.
    """

    def __init__(
        self,
        config: LaunchConfig,
        entrypoint: Callable[..., Any] | str | None,
        health_check_server: Any = None,
    ) -> None:
        self._config = config
        self._entrypoint = entrypoint
        self._health_check_server = health_check_server

    def __repr__(self) -> str:
        return f"<elastic_launch {self._entrypoint!r} with {self._config!r}>"

    def __call__(self, *args: Any) -> dict[int, Any]:
        """Run the launch with ``args``; the workers' return values by global rank.

        Raises:
            ChildFailedError: the workers failed after the restarts.
            RuntimeError: called in a thread that runs an event loop.
        """
        return launch_agent(
            self._config,
            self._entrypoint,
            list(args),
            health_check_server=self._health_check_server,
        )


def launch_agent(
    config: LaunchConfig,
    entrypoint: Callable[..., Any] | str | None,
    args: list[Any],
    health_check_server: Any = None,
) -> dict[int, Any]:
    """Launch ``entrypoint(*args)`` and block until it is done (torch's ``launch_agent``).

    Returns:
        The workers' return values by global rank.

    Raises:
        ChildFailedError: the workers failed after the restarts.
        SignalException: in the main thread, one of ``signals_to_handle``
            arrived; the workers were stopped with it.
        RuntimeError: called in a thread that runs an event loop.
        TypeError, ValueError: a bad config field or entrypoint.
    """

    async def main() -> dict[int, Any]:
        job = Launch(config, entrypoint, tuple(args))
        if threading.current_thread() is not threading.main_thread():
            return await job.run()  # Python delivers signals to the main thread only
        async with translate_signals(job.signals):
            return await job.run()

    return run_blocking(main, "elastic_launch(config, entrypoint)(*args)")


def run_blocking(main: Callable[[], Coroutine[Any, Any, T]], what: str) -> T:
    """``main()`` run to its end on a new event loop in this thread.

    Raises:
        RuntimeError: this thread runs an event loop already.
        ValueError: ``AIOPROC_LOOP`` names no loop this interpreter has.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        raise RuntimeError(
            f"{what} blocks until the workers are done, and this thread runs an event loop: "
            f"await aioproc.launcher.launch(config, entrypoint, *args) instead, or call it "
            f"in another thread"
        )
    factory = _loop_factory()
    if sys.version_info >= (3, 11):
        with asyncio.Runner(loop_factory=factory) as runner:
            return runner.run(main())
    if factory is None:  # pragma: no cover - Python 3.10 has no asyncio.Runner
        return asyncio.run(main())
    loop = factory()  # pragma: no cover
    try:  # pragma: no cover
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(main())
    finally:  # pragma: no cover
        asyncio.set_event_loop(None)
        loop.close()
