"""Run cleanup to completion even when the caller is being cancelled."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

import anyio

T = TypeVar("T")


async def shielded(coro: Coroutine[Any, Any, T] | asyncio.Future[T]) -> T:
    """Await ``coro`` (or a task) in its own task, immune to cancellation of the caller.

    If the caller is cancelled meanwhile (natively, or by an anyio cancel
    scope, which would otherwise re-deliver the cancellation on every loop
    iteration), the cleanup still finishes and the cancellation is re-raised
    afterwards.  ``coro`` must bound its own running time.
    """
    task = asyncio.ensure_future(coro)
    cancelled = False
    with anyio.CancelScope(shield=True):
        while True:
            try:
                result = await asyncio.shield(task)
            except asyncio.CancelledError:
                if task.done() and task.cancelled():
                    raise  # the cleanup itself was cancelled (loop shutdown)
                if task.done():
                    result = task.result()
                    cancelled = True
                    break
                cancelled = True
                continue
            break
    if cancelled:
        raise asyncio.CancelledError
    return result
