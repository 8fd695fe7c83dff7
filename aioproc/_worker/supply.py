"""What a pool gives each start of a worker: its resources, and the template to fork from.

Slots: with ``capacity=`` the pool reserves its ``size`` first slots at
once (``reserve``), before anything starts: two pools that reserved one
slot per worker could each hold half of a budget and wait for the other for
ever.  Each first start takes over one reserved slot (``resources``); a slot
whose start never ran goes back with ``release``, once the pool's owner
ends.  A worker gives its slot back once it is reaped
(``WorkerProcess._shutdown``), so a replacement, which asks for a new one,
never overlaps the worker it replaces.

Template: under ``start_method="forkserver"`` the pool holds a lease on
the template for its ``preload`` for its whole life, so replacements fork
at once; a template that died is replaced by the next start that needs it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from .._base.shield import shielded
from .._func import template as _template
from .._func.template import Template
from .._group.resources import CpusArg, GroupResources
from .options import WorkerOptions

__all__ = ["Supply"]


class Supply:
    """The slots, placements, CPUs and template lease of one pool (see the module).

    Args:
        names: the name of each position's worker.
        options: the pool's options (``limits``, ``capacity``, ``preload``).
        cpus: each position's own ``cpus`` (``options.worker_cpus``).
    """

    def __init__(
        self, names: Sequence[str], options: WorkerOptions, cpus: Sequence[CpusArg]
    ) -> None:
        self._names = names
        self._options = options
        self._cpus = cpus
        self._prepaid: set[int] = set()  # positions whose slot was reserved, not yet taken
        self._reported = False  # see resources
        self.template: Template | None = None  # the lease held for the pool's life
        self._renewing: asyncio.Lock | None = None  # one start replaces a dead template

    async def reserve(self) -> None:
        """Every first worker's slot at once, then the template lease; all or nothing.

        Raises:
            What ``open_pool`` raises for a template that cannot start.

        Cancellation: a cancelled wait holds nothing.
        """
        capacity = self._options.capacity
        if capacity is not None:
            await capacity.acquire(len(self._names))
            self._prepaid = set(range(len(self._names)))
        try:
            if self._options.preload is not None:
                # cancelled or failed, acquire leaves nothing behind
                self.template = await _template.acquire(self._options.preload)
        except BaseException:
            self._give_back_prepaid()
            raise

    def resources(self, i: int) -> GroupResources:
        """The resources of a new worker at ``i``: its placement, CPUs and slot."""
        options = self._options
        resources = GroupResources(
            self._names[i], 1, options.limits, options.capacity, self._cpus[i]
        )
        # one INFO line (and WARNING) per pool: its workers share their limits
        resources.report, self._reported = not self._reported, True
        if i in self._prepaid:
            self._prepaid.discard(i)
            resources.granted()
        return resources

    async def live_template(self) -> Template | None:
        """The pool's template, replaced first if it died (killed, OOM): forkserver only.

        Raises:
            What ``open_pool`` raises for a template that cannot start.

        Cancellation: the pool keeps a lease on one template, old or new.
        """
        if self.template is None or self.template.usable:
            return self.template
        if self._renewing is None:
            self._renewing = asyncio.Lock()
        async with self._renewing:  # the other starts wait for the one replacement
            old = self.template
            if not old.usable:
                # the running one for the same preload (another group's), or a new one
                self.template = await _template.acquire(old.preload)
                await shielded(_template.release(old))
        return self.template

    async def release(self) -> None:
        """Once every start and retirement is over: slots never taken, then the template.

        Cancellation: bounded (``_func.template.release``); the caller shields it.
        """
        self._give_back_prepaid()
        if self.template is not None:
            await _template.release(self.template)
            self.template = None

    def _give_back_prepaid(self) -> None:
        capacity = self._options.capacity
        if self._prepaid and capacity is not None:
            count, self._prepaid = len(self._prepaid), set()
            capacity.release(count)
