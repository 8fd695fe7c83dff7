"""The one launch path for function workers (groups, persistent workers, pools).

A function worker is a fresh ``sys.executable`` booted over a private
socketpair: the child end is inherited, the parent end becomes the worker's
``Channel``.  Once ``spawn`` has returned (the guardian knows the group), the
boot code and the given frames are queued; the worker runs no user code
before they arrive.  Callers supply what differs (streams, tees, the frame
handler and frames); this module never reaches back into them.

Where memfds exist, each worker also gets an fd socket (see ``_child.shm``) for
values in shared memory; its number reaches the worker in a FD_SOCKET frame
sent before the caller's frames.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import IO, TYPE_CHECKING, Any

from .._base.shield import shielded
from .._child import shm as _shm
from .._child.channel import FD_SOCKET, JOIN_LIMIT, header
from .._errors.failure import BrokenWorkerError
from .._output.tee import TeeProtocol
from .._proc.channel import Channel
from .._proc.spawn import Child, spawn
from .boot import boot_argv, boot_head, process_title

if TYPE_CHECKING:
    from .template import Template

Frame = tuple[int, Sequence[bytes]]
"""A control frame to send after boot: ``(kind, body parts)``."""


async def launch_function(
    label: str,
    env: Mapping[str, str],
    *,
    on_frame: Callable[[int, bytearray], None],
    frames: Sequence[Frame],
    stdout: int | IO[Any] | None,
    stderr: int | IO[Any] | None,
    pass_fds: Sequence[int] = (),
    tee_out: TeeProtocol | None = None,
    tee_err: TeeProtocol | None = None,
    template: Template | None = None,
    segments: Sequence[_shm.Segment] = (),
    one_shot: bool = False,
    join: Callable[[int], None] | None = None,
    modules: Sequence[str] = (),
) -> Child:
    """Start one function worker and queue its boot code and ``frames``.

    With a ``template`` (``start_method="forkserver"``) the worker is forked
    from it instead of spawned; everything else is the same.  A ``one_shot``
    worker (one CALL, then it exits) is SIGKILLed with its group if the
    supervisor closes its channel on a protocol error: it may not be reading
    the channel to see it close.

    Returns the ``Child``, whose ``channel`` delivers the worker's frames to
    ``on_frame``.  Raises what ``spawn`` raises, with nothing left running
    and the channel closed.  ``segments``: the memfds of the SHM bodies
    among ``frames``, in order; the caller keeps them and closes them after
    this returns or raises (sent ones are closed already).  ``join(pid)``
    puts the worker in its placement (``_limits``) from this process before
    it runs any user code: a spawned worker waits for its boot code, sent
    after the join; a forked one waits at its gate (see ``spawn_forked``).
    ``modules``: what the worker imports first, for a template to read
    once (see ``Template.submit``).

    Cancellation: a cancelled launch kills the half-started worker's group
    (see ``spawn``) and closes the channel before re-raising.
    """
    # made (read from the package's files, the first time) before anything
    # starts: a failure here, EMFILE at the fd limit among them, leaves no worker
    boot = boot_head() if template is None else None
    parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        fd_pair = _shm.fd_socketpair()
    except BaseException:
        parent_sock.close()
        child_sock.close()
        raise
    fd_socket, child_fd_socket = fd_pair if fd_pair is not None else (None, None)
    extra_fds = () if child_fd_socket is None else (child_fd_socket.fileno(),)
    channel: Channel | None = None
    ender = _EndOnChannelError() if one_shot else None
    # shielded: a cancelled connect could orphan a registered transport
    opening = asyncio.ensure_future(
        Channel.open(parent_sock, on_frame, fd_socket=fd_socket, on_error=ender)
    )
    try:
        channel = await shielded(opening)
        if template is not None:
            from .fork import spawn_forked

            # queued before the fork: the worker finds them at once, while
            # the template forks the next requests, and no send of ours
            # wakes it (see the module docstring for the guardian)
            _queue(channel, frames, extra_fds, segments, None)
            child = await spawn_forked(
                template,
                label,
                env,
                stdout=stdout,
                stderr=stderr,
                pass_fds=(child_sock.fileno(), *extra_fds, *pass_fds),
                channel_fd=child_sock.fileno(),
                channel=channel,
                tee_out=tee_out,
                tee_err=tee_err,
                join=join,
                modules=modules,
            )
        else:
            child = await spawn(
                label,
                boot_argv(child_sock.fileno(), process_title(label)),
                env,
                stdout=stdout,
                stderr=stderr,
                stdin=subprocess.DEVNULL,
                pass_fds=(child_sock.fileno(), *extra_fds, *pass_fds),
                channel=channel,
                tee_out=tee_out,
                tee_err=tee_err,
                join=join,
            )
    except BaseException:
        opened = opening.done() and not opening.cancelled() and opening.exception() is None
        if channel is None and opened:
            channel = opening.result()  # opened, then the caller was cancelled
        if channel is not None:
            channel.abort()
        else:
            parent_sock.close()
            if fd_socket is not None:
                fd_socket.close()
        raise
    finally:
        child_sock.close()
        if child_fd_socket is not None:
            child_fd_socket.close()
    if ender is not None:
        ender.attach(child)
    if template is None:
        _queue(channel, frames, extra_fds, segments, boot)
    return child


class _EndOnChannelError:
    """A one-shot worker's channel error handler: SIGKILL the worker's group.

    The channel may fail before the launch has its ``Child``: the kill then
    comes as soon as it does.  The child is held weakly: it holds the
    channel, which holds this handler, and a cycle would keep the channel's
    buffers (a result's shared memory among them) until the next GC.
    """

    def __init__(self) -> None:
        self._child: weakref.ref[Child] | None = None
        self._failed = False

    def __call__(self, error: BrokenWorkerError) -> None:
        self._failed = True
        child = self._child() if self._child is not None else None
        if child is not None:
            child.signal_group(signal.SIGKILL)

    def attach(self, child: Child) -> None:
        self._child = weakref.ref(child)
        if self._failed:
            child.signal_group(signal.SIGKILL)


def _queue(
    channel: Channel,
    frames: Sequence[Frame],
    extra_fds: Sequence[int],
    segments: Sequence[_shm.Segment],
    boot: bytes | None,
) -> None:
    """Queue the boot code (None for a forked worker: the template has it) and ``frames``."""
    queued: list[Frame] = list(frames)
    if extra_fds:
        queued.insert(0, (FD_SOCKET, [str(extra_fds[0]).encode()]))
    head = [] if boot is None else [boot]
    if not segments and sum(len(p) for _, parts in queued for p in parts) <= JOIN_LIMIT:
        # small frames in one write: one send, one wake-up of the worker
        for kind, parts in queued:
            head += [header(kind, sum(map(len, parts))), *parts]
        channel.send_raw(b"".join(head))
        return
    if head:
        channel.send_raw(head[0])
    for i, (kind, parts) in enumerate(queued):
        # fds queue in order and each SHM frame takes the next: all go first
        channel.send(kind, *parts, segments=segments if i == int(bool(extra_fds)) else ())
