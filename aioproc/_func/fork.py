"""Forking one worker from a warm-start template, and adopting it (parent side).

``spawn_forked`` is ``spawn``'s counterpart for ``start_method="forkserver"``:
it wires the worker's standard streams and fds, asks a ``Template``
(``_func.template``) for the worker on the helper thread, registers the
answered pid with the guardian, lets the worker through its gate and adopts
it as a ``Child``, exactly like a spawned one.  A function worker boots over
its channel; a worker that runs a Python script itself (``_func.script``)
has no channel and is supervised as the binary worker it stands for.

A start cancelled meanwhile withdraws its request if it was not sent yet;
otherwise it awaits the answer while the template keeps answering (at most
``CANCEL_WAIT``) and kills and reaps the worker, and gives up a template
that answers nothing for ``CANCEL_GRACE`` (``Template.abandon``): its group
is killed and what it forked is swept.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from typing import IO, Any

from .._base.offloop import helper
from .._base.pipes import close_given_ends
from .._base.shield import shielded
from .._output.tee import TeeProtocol
from .._proc import lifeline as _lifeline
from .._proc.channel import Channel
from .._proc.exits import PidProc
from .._proc.spawn import Child, adopt
from . import template as _template
from .boot import process_title
from .script import ScriptCommand
from .template import CLOSE_WAIT, Template, TemplateLost, _Request

logger = logging.getLogger("aioproc")

CANCEL_GRACE = 0.5
"""Seconds without any answer after which a cancelled start gives the template
up as wedged: a healthy one answers in milliseconds."""

CANCEL_WAIT = 2.5
"""Seconds a cancelled start waits at most for its answer from a template that
keeps answering (a long batch ahead of it) before giving it up all the same."""

MAX_FDS = 253
"""Most fds one request can carry (``SCM_MAX_FD``): the worker's and its gate."""


async def spawn_forked(
    template: Template,
    label: str,
    env: Mapping[str, str],
    *,
    stdout: int | IO[Any] | None,
    stderr: int | IO[Any] | None,
    pass_fds: Sequence[int],
    channel_fd: int | None,
    channel: Channel | None,
    tee_out: TeeProtocol | None = None,
    tee_err: TeeProtocol | None = None,
    script: ScriptCommand | None = None,
    join: Callable[[int], None] | None = None,
    modules: Sequence[str] = (),
) -> Child:
    """Fork one worker from ``template``; the same contract as ``spawn``.

    A function worker (``channel_fd``, ``channel``), or with ``script`` a
    worker that runs that Python script itself, as a spawned binary worker
    would (its stdin is then this process's, as a spawned binary's is).
    ``stdout``/``stderr`` are ``None`` (this process's own fd 1/2),
    ``subprocess.PIPE`` (tee), ``subprocess.DEVNULL``, an fd or an open
    file.  ``pass_fds`` (``channel_fd`` among them) keep their numbers.
    The worker runs nothing before the guardian knows it, nor before
    ``join(pid)`` (if given) put it in its placement: the template's
    answer reaches this process while the worker waits at its gate.
    ``modules``: what a function worker imports first (see
    ``Template.submit``).

    Raises:
        TemplateLost: the template died, or stopped answering for
            ``FORK_TIMEOUT``; it was killed, with what it forked meanwhile.
        OSError: the template could not fork, or the worker could not set
            itself up.

    Cancellation: a request not sent yet is withdrawn; a sent one is
    awaited while the template keeps answering (at most ``CANCEL_WAIT``),
    and its worker killed and reaped; a template that answers nothing for
    ``CANCEL_GRACE`` (wedged) is given up: its group is killed and what it
    forked is swept.  A start cancelled while the
    pipes are connected kills the worker's group.
    """
    if len(pass_fds) + 4 > MAX_FDS:
        raise ValueError(f"a forked worker takes at most {MAX_FDS - 4} pass_fds")
    fds: list[int] = []
    targets: list[int] = []
    mine: list[int] = []  # fds opened here, closed once the worker has its copies
    readers: dict[int, IO[bytes]] = {}
    try:
        streams: list[tuple[int, int | IO[Any] | None]] = [(1, stdout), (2, stderr)]
        if script is not None:
            streams.insert(0, (0, None))
        for std, spec in streams:
            if spec is None:
                try:
                    os.fstat(std)
                except OSError:
                    continue  # closed here: the worker gets /dev/null
                fd = std
            elif spec == subprocess.PIPE:
                r, w = os.pipe()
                readers[std] = open(r, "rb")  # noqa: ASYNC230, SIM115 - a pipe; the Child owns it
                mine.append(w)
                fd = w
            elif spec == subprocess.DEVNULL:
                fd = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
                mine.append(fd)
            elif isinstance(spec, int):
                fd = spec
            else:
                fd = spec.fileno()
            fds.append(fd)
            targets.append(std)
        fds.extend(pass_fds)
        targets.extend(pass_fds)
        worker_env = {**env, _lifeline.TOKEN_VAR: _lifeline.lineage()}
        pid = await _fork(
            template,
            fds,
            targets,
            channel_fd,
            worker_env,
            os.getcwd(),
            script,
            join,
            modules,
            process_title(label),
        )
    except BaseException:
        for reader in readers.values():
            reader.close()
        raise
    finally:
        close_given_ends(mine)
    proc = PidProc(pid, readers.get(1), readers.get(2))
    child = await adopt(label, proc, channel, tee_out, tee_err)
    child.execed = False  # forked: its ru_maxrss counts the template's pages, not ours
    return child


async def _fork(
    template: Template,
    fds: list[int],
    targets: list[int],
    channel_fd: int | None,
    env: dict[str, str],
    cwd: str,
    script: ScriptCommand | None,
    join: Callable[[int], None] | None = None,
    modules: Sequence[str] = (),
    title: str = "",
) -> int:
    """One fork request, answered on the helper thread; the registered, released pid.

    A template that died with the request unanswered (killed, by the OOM
    killer or by hand; given up by another start's cancellation), or was
    gone before it was sent, is no fault of this start: what it forked for
    the request was swept, and the request goes once to a fresh template.
    One that stopped answering fails the start (a fresh one may stall too).

    Cancellation: see ``spawn_forked``.
    """

    def submit(to: Template, pool: Executor) -> _Request:
        return to.submit(pool, fds, targets, channel_fd, env, cwd, script, join, modules, title)

    try:
        return await _fork_once(template, submit)
    except TemplateLost as lost:
        if not lost.retriable:
            raise
        if not template.retried:  # once per template, not per worker it lost
            template.retried = True
            logger.warning("%s; its workers' starts are tried once more on a new template", lost)
    fresh = await _template.acquire(template.preload, template.path_head)
    try:
        return await _fork_once(fresh, submit)
    finally:
        await shielded(_template.release(fresh))  # bounded (see Template.aclose)


async def _fork_once(template: Template, submit: Callable[[Template, Executor], _Request]) -> int:
    """``_fork`` with one template: ``submit(template, pool)`` sends the request.

    Cancellation: see ``spawn_forked``.
    """
    _lifeline.hold()  # the guardian must be there when the answer is registered
    try:
        # the round trip waits for the new worker to set itself up, which
        # takes milliseconds on a busy machine: on the helper thread
        with helper() as pool:
            req = submit(template, pool)
            answer = asyncio.wrap_future(req.future)
            try:
                pid = await asyncio.shield(answer)
            except asyncio.CancelledError:
                await shielded(_give_up(template, req, answer))
                raise
        _lifeline.register(pid)  # a no-op unless the guardian was being replaced
        template.go(pid)  # a no-op unless the helper thread could not register it
    finally:
        _lifeline.unhold()  # dismisses the guardian if the start failed and it is idle
    return pid


async def _give_up(template: Template, req: _Request, answer: asyncio.Future[int]) -> None:
    """A cancelled start: withdraw its request, or discard its worker, or give the template up.

    Cancellation: bounded by ``CANCEL_WAIT`` and ``CLOSE_WAIT``; run shielded.
    """
    if template.withdraw(req):
        return  # never sent: nothing was forked for it
    # a template that keeps answering is shared by others: killing it would
    # fail their starts too, so it is given up only when wedged (stopped,
    # swapping: no answer for CANCEL_GRACE) or slower than CANCEL_WAIT
    waited = 0.0
    while not answer.done():
        await asyncio.wait({answer}, timeout=CANCEL_GRACE)
        waited += CANCEL_GRACE
        stalled = time.monotonic() - template.progress >= CANCEL_GRACE
        if not answer.done() and (stalled or waited >= CANCEL_WAIT):
            # its death ends the exchange, which sweeps what it forked
            template.abandon()
            await asyncio.wait({answer}, timeout=CLOSE_WAIT)
            break
    if answer.done() and not answer.cancelled() and answer.exception() is None:
        _discard_forked(template, answer.result())  # answered after all: not ours to keep


def _discard_forked(template: Template, pid: int) -> None:
    """Kill and reap a forked worker whose start was abandoned (it leads its group)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    with template._lock:
        gate = template._gates.pop(pid, -1)
    if gate >= 0:
        os.close(gate)
    os.waitpid(pid, 0)  # our child (CLONE_PARENT), SIGKILLed: exits at once
    _lifeline.forget(pid)
