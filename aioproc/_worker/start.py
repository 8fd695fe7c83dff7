"""Start one persistent worker: wait for its slot, launch it, run its initializer.

``start_worker`` is the one way a ``WorkerProcess`` comes to exist, for
``open_worker`` and for every start of a pool (the first ones and the
replacements).  Whatever fails or is cancelled on the way, the half-started
worker is killed and reaped, its placement removed and its slot given back
before the error propagates.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from collections.abc import Callable, Mapping
from typing import Any

from .._base.resource import OpenResource, opening
from .._base.shield import shielded
from .._child import shm as _shm
from .._child.channel import CALL, ERROR, ID_SIZE, INIT
from .._errors.failure import BrokenWorkerError
from .._func import template as _template
from .._func.boot import CallEncoder, init_frame, rebuild_exception
from .._func.launch import Frame, launch_function
from .._func.template import Template
from .._group.resources import CpusArg, GroupResources
from .._output.tee import TeeProtocol
from .._proc.shutdown import release, stop_groups
from .._proc.spawn import Child
from ..sinks import ConsoleSink
from .options import WorkerOptions
from .process import STDERR_TAIL, TailSink, WorkerProcess, exit_text, fill_segments

__all__ = ["open_one", "start_worker"]

_INIT_ID = (0).to_bytes(ID_SIZE, "big")  # the call id of the initializer


def open_one(name: str, options: WorkerOptions, cpus: CpusArg) -> OpenResource[WorkerProcess]:
    """What ``open_worker`` returns: starts the worker when awaited or entered.

    ``cpus``: the worker's own, checked (``worker_cpus``).
    """

    def resources() -> GroupResources:  # a placement per start: it lives and dies with it
        return GroupResources(name, 1, options.limits, options.capacity, cpus)

    async def start() -> WorkerProcess:
        if options.preload is None:
            return await start_worker(name, options, options.env, None, resources())
        template = await _template.acquire(options.preload)
        try:
            return await start_worker(name, options, options.env, template, resources())
        finally:
            # the forked worker does not need the template any more
            await shielded(_template.release(template))

    async def close(worker: WorkerProcess, exc: BaseException | None) -> None:
        await worker.aclose()

    return OpenResource(opening(start), close, "open_worker(...)")  # a leak check names it


async def start_worker(
    name: str,
    options: WorkerOptions,
    env: Mapping[str, str],
    template: Template | None,
    resources: GroupResources,
) -> WorkerProcess:
    """Start one persistent worker: wait for its slot, launch, join, run the initializer.

    ``env`` (the extra variables of this worker: a pool's task has its own
    ``TF_CONFIG``) and ``template`` (forkserver: the template to fork
    from) come with the start; the rest is ``options``.  ``resources`` (a
    group of one, see ``_group.resources``) belong to the worker from here
    on: closed with it, or at once if the start fails.

    Cancellation: a cancelled start holds no slot, and kills and reaps the
    half-started worker (shielded) before its placement is removed.
    """
    try:
        await resources.acquire()  # a pool's replacement waits here for its slot
        joins = resources.open()
        return await _launch_worker(name, options, env, template, resources, joins)
    except BaseException:
        # a slot handed over by a pool goes back too; a launched worker
        # was reaped by _launch_worker before its placement goes
        await shielded(resources.aclose())
        raise


async def _launch_worker(
    name: str,
    options: WorkerOptions,
    env: Mapping[str, str],
    template: Template | None,
    resources: GroupResources,
    joins: Mapping[int, Callable[[int], None]],
) -> WorkerProcess:
    """``start_worker`` once its slot is held and its placement open.

    Cancellation: the half-started worker is killed and reaped (shielded).
    """
    init, init_args = options.initializer, options.initargs
    segments: list[_shm.Segment] | None = _shm.Deferred() if _shm.AVAILABLE else None
    init_parts = CallEncoder(init).encode(init_args, {}, segments) if init is not None else None
    if segments and not await fill_segments(segments):
        segments = None  # no memory for the memfds: the value travels in the frame
        init_parts = CallEncoder(init).encode(init_args, {}, None)
    tail = TailSink(STDERR_TAIL)
    console = ConsoleSink()
    stderr_tee = TeeProtocol(None, 0, "stderr", f"[{name}]:", [console, tail])
    child: Child | None = None
    pending_init: asyncio.Future[tuple[int, bytearray]] | None = None

    def on_frame(kind: int, body: bytearray) -> None:
        # only the initializer's reply comes before the worker exists
        if pending_init is not None and not pending_init.done():
            pending_init.set_result((kind, body))

    boot = init_frame(serve=True, has_init=init_parts is not None, loop=options.worker_loop)
    frames: list[Frame] = [(INIT, [boot])]
    if init_parts is not None:
        pending_init = asyncio.get_running_loop().create_future()
        frames.append((CALL, [*init_parts, _INIT_ID]))
    try:
        child = await launch_function(
            name,
            {**os.environ, **env},
            on_frame=on_frame,
            frames=frames,
            stdout=None,
            stderr=subprocess.PIPE,
            tee_err=stderr_tee,
            template=template,
            segments=segments or (),
            join=joins.get(0),
        )
        for segment in segments or ():
            segment.close()
        assert child.channel is not None
        if pending_init is not None:
            await _initialized(name, child, pending_init, options.init_timeout, resources)
        worker = WorkerProcess(
            name,
            child,
            child.channel,
            options.grace_period,
            tail,
            console,
            resources,
            options.max_concurrency,
        )
        child.channel.deliver_to(worker._on_frame)
        return worker
    except BaseException:
        for segment in segments or ():
            segment.close()
        await shielded(_abandon(child))
        raise


async def _initialized(
    name: str,
    child: Child,
    reply: asyncio.Future[tuple[int, bytearray]],
    init_timeout: float,
    resources: GroupResources,
) -> None:
    """Wait for the initializer's ``reply``: return once it ran, else raise why not.

    Raises:
        Exception: what the initializer raised, with the worker's traceback.
        BrokenWorkerError: the worker broke the protocol or died.
        TimeoutError: no reply within ``init_timeout``.

    Cancellation: nothing of its own to clean up (the caller abandons the worker).
    """
    assert child.channel is not None
    exited = child.watcher.future
    failed = child.channel.failed
    waits: set[asyncio.Future[Any]] = {reply, exited, failed}
    await asyncio.wait(waits, timeout=init_timeout, return_when=asyncio.FIRST_COMPLETED)
    if reply.done():
        kind, body = reply.result()
        if kind == ERROR:
            exc = rebuild_exception(body[:-ID_SIZE])
            raise exc if exc is not None else RuntimeError(f"init of {name} failed")
    elif failed.done():
        raise BrokenWorkerError(f"worker {name} (pid {child.pid}) during init: {failed.result()}")
    elif exited.done():
        settled = child.output_settled()
        if settled:  # an error report written just before the exit is read by now
            await asyncio.wait(settled, timeout=1.0)
        if reply.done() and reply.result()[0] == ERROR:
            exc = rebuild_exception(reply.result()[1][:-ID_SIZE])
            raise exc if exc is not None else RuntimeError(f"init of {name} failed")
        code = exited.result()
        how = exit_text(code, resources.oom(0, child, code))
        raise BrokenWorkerError(f"worker {name} (pid {child.pid}) {how} during init")
    else:
        raise TimeoutError(
            f"worker {name} (pid {child.pid}): init did not finish within "
            f"init_timeout={init_timeout:g} s"
        )


async def _abandon(child: Child | None) -> None:
    """Kill and reap a worker that failed to start (nothing to be graceful about)."""
    children = [] if child is None else [child]
    await stop_groups(children, signal.SIGKILL, 0)
    # settles a guardian dismissed by a failed launch too
    await release(children, drain=1.0)
