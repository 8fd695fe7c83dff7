"""Keep a forkserver template warm between groups: ``open_forkserver``.

A group started with ``start_method="forkserver"`` takes a lease on the
template for its ``preload`` set and gives it back once its workers are
forked; the last lease closes the template.  Holding one more lease with
``open_forkserver`` keeps the template (and its preloaded modules) up, so
the groups, workers and pools started meanwhile fork at once.  Agents and
pools hold a lease of their own for their whole life.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from ._base.checks import check_preload
from ._base.loops import check_loop
from ._base.resource import OpenResource
from ._base.shield import shielded
from ._func import template as _template

__all__ = ["Forkserver", "open_forkserver"]


class Forkserver:
    """A lease on the running template for one preload set (see ``open_forkserver``)."""

    def __init__(self, template: _template.Template) -> None:
        self._template: _template.Template | None = template
        self._closing: asyncio.Future[None] | None = None  # the one release, once asked
        self.preload = template.preload
        self.pid = template.pid

    def __repr__(self) -> str:
        state = "closed" if self._template is None else "open"
        return f"<Forkserver pid={self.pid} preload={list(self.preload)} {state}>"

    async def aclose(self) -> None:
        """Give the lease back; the template exits if nobody else holds it.

        The template is SIGKILLed with its process group when its last lease
        goes (it holds nothing a worker needs, and no user code runs in it),
        so no ``grace_period`` applies.  Idempotent: a second call waits for
        the first.

        Cancellation: shielded, bounded by a few seconds.
        """
        if self._closing is not None:
            if not self._closing.done():
                await asyncio.wait({self._closing})
            return
        assert self._template is not None
        check_loop(self._template.watcher.loop, self)
        template, self._template = self._template, None
        self._closing = asyncio.ensure_future(_template.release(template))
        await shielded(self._closing)


async def _open(preload: tuple[str, ...]) -> Forkserver:
    return Forkserver(await _template.acquire(preload))


async def _close(server: Forkserver, exc: BaseException | None) -> None:
    await server.aclose()


def open_forkserver(preload: Sequence[str] = ()) -> OpenResource[Forkserver]:
    """Start (or share) the forkserver template for ``preload`` and keep it up.

    ``async with open_forkserver(["torch"]):`` keeps the template running
    for the block: every group, worker and pool with
    ``start_method="forkserver"`` and the same ``preload`` started inside
    it forks from that one template.  ``await open_forkserver(...)`` returns
    the lease; ``aclose()`` gives it back.

    Raises:
        TypeError, ValueError: ``preload`` is not a list of module names.
        ImportError: a preloaded module failed to import.
        RuntimeError: a preloaded module started a thread or initialised CUDA.

    Cancellation: a cancelled start kills the template (unless somebody
    else holds it) before the cancellation propagates.
    """
    names = check_preload("forkserver", preload)
    return OpenResource(lambda: _open(names), _close, "open_forkserver(...)")
