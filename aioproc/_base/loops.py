"""Which event loop aioproc runs on, with clear errors for the common mistakes.

aioproc needs a running asyncio event loop (the default one or uvloop): its
exit watchers and pipes are registered with it.  Every handle (a group, a
persistent worker, a pool) belongs to the loop it was started on, since its
futures and transports do; using it from another loop would hang, so it is
refused at once instead.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any


def running_loop(what: str) -> asyncio.AbstractEventLoop:
    """The running asyncio loop, or a RuntimeError that says what is needed."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        pass
    hint = ""
    trio: Any = sys.modules.get("trio")  # only if the caller imported it
    if trio is not None:
        try:
            trio.lowlevel.current_task()
            hint = (
                " It is running under trio: aioproc is built on asyncio (run it with "
                "asyncio.run, in an asyncio thread, or through trio-asyncio)."
            )
        except (AttributeError, RuntimeError):
            pass
    raise RuntimeError(
        f"{what} needs a running asyncio event loop (asyncio.run() or uvloop); "
        f"none is running in this thread.{hint}"
    )


def check_loop(owner: asyncio.AbstractEventLoop | None, handle: object) -> None:
    """Refuse to use ``handle`` from a loop other than the one it belongs to."""
    if owner is None:
        return
    try:
        current = asyncio.get_running_loop()
    except RuntimeError:
        current = None
    if current is not owner:
        raise RuntimeError(
            f"{handle!r} belongs to the event loop it was started on and cannot be used "
            f"from {'another loop' if current is not None else 'outside it'}; start one "
            "per loop (its processes, pipes and futures live on that loop)"
        )
