"""The warm-start template behind ``start_method="forkserver"`` (parent side).

A template is a fresh ``sys.executable`` in a session of its own that has
imported the modules the user named (``preload``) and forks function workers
on request (its side: ``_template_child``).  One template serves every group,
worker and pool of this supervisor process that asks for the same preload
set at the same time: each holds a *lease* (``acquire``/``release``), and
the last release closes it.  An agent or a pool holds a lease for its whole
life, so restarts and replacements reuse the template;
``aioproc.open_forkserver`` lets anyone else keep one warm between groups.

Why the guarantees of spawned workers carry over: the template forks with
``CLONE_PARENT``, so a worker is this process's child exactly like a spawned
one, found by the same pidfd exit watcher, with the true exit status, and
its leader reaped late by ``Child.release``; the template neither waits for
nor signals workers.  Fork requests are sent and answered on the helper
thread, like ``Popen`` calls, every request queued meanwhile at once (the
template forks them all before it waits for the first to set itself up);
each new worker is registered with the guardian there as its answer is
read; the template carries the lifeline token in its exec environment, so
a worker that outruns registration (its ``/proc/<pid>/environ`` is the
template's) is swept by token too.  The
template's own group is registered with the guardian, and it exits on EOF
of its socket, so it never outlives this process.

Besides function workers, the template forks workers that run a Python
script themselves (``_script``: ``aioproc run --start-method forkserver``);
they have no channel and are supervised as the binary workers they stand
for.
"""

from __future__ import annotations

import array
import asyncio
import concurrent.futures
import functools
import marshal
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from pathlib import Path
from typing import IO, Any

from . import _lifeline
from ._boot import boot_blob
from ._channel import Channel
from ._exit import ExitWatcher, PidProc
from ._output import TeeProtocol
from ._script import ScriptCommand
from ._shield import shielded
from ._spawn import Child, adopt, start_off_loop
from .errors import RemoteTraceback

FORK_TIMEOUT = 30.0
"""Seconds a fork request may take before the template is deemed wedged."""

CLOSE_WAIT = 5.0
"""Seconds a closed template gets to exit before it is killed."""

MAX_FDS = 250
"""Most fds one worker can be given (stdout, stderr, channel, ``pass_fds``)."""


class TemplateError(RuntimeError):
    """The template could not start: a preloaded module made it unsafe to fork, or it died."""


@functools.cache
def _source() -> str:
    return (Path(__file__).parent / "_template_child.py").read_text()


@functools.cache
def _script_runner() -> bytes:
    """``_script_child`` compiled and marshalled: the template builds it once."""
    path = Path(__file__).parent / "_script_child.py"
    return marshal.dumps(compile(path.read_text(), str(path), "exec"))


_Request = tuple[bytes, list[int], "concurrent.futures.Future[int]"]
"""A fork request not sent yet: the message, its fds, the pid's future."""


class Template:
    """One template process and its leases (see the module docstring)."""

    def __init__(self, preload: tuple[str, ...], path_head: tuple[str, ...] = ()) -> None:
        loop = asyncio.get_running_loop()
        self.preload = preload
        self.path_head = path_head
        self.leases = 0
        self.closed = False
        self.broken = False  # a request failed: new leases start a new template
        self._lock = threading.Lock()  # guards the queue, whatever thread asks
        # fork requests not sent yet, and whether a helper thread is sending
        self._queue: list[_Request] = []
        self._draining = False
        self._buf = bytearray()
        self.ready: asyncio.Future[None] = loop.create_future()
        # an error nobody awaited any more (all waiters cancelled) is not "unretrieved"
        self.ready.add_done_callback(lambda f: f.cancelled() or f.exception())
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        _lifeline.ensure()
        try:
            self.popen = subprocess.Popen(
                [
                    sys.executable,
                    *subprocess._args_from_interpreter_flags(),  # type: ignore[attr-defined]
                    "-c",
                    _source(),
                    str(theirs.fileno()),
                ],
                env={**os.environ, _lifeline.TOKEN_VAR: _lifeline.token()},
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),),
                start_new_session=True,
                close_fds=True,
            )
        except BaseException:
            mine.close()
            _lifeline.forget()
            raise
        finally:
            theirs.close()
        _lifeline.register(self.popen.pid)
        self.pid = self.popen.pid
        self.sock = mine
        self.watcher = ExitWatcher(self.popen)
        # the preload is imported from the supervisor's path, after ``path_head``
        # (a script's own directory: what it imports from there may be preloaded)
        paths = [*path_head, *(p for p in sys.path if isinstance(p, str))]
        # the boot modules' code (see _boot): the template builds them once
        boot = boot_blob()[8:]
        init = marshal.dumps(
            {"sys_path": paths, "preload": list(preload), "boot": boot, "script": _script_runner()}
        )
        # ~50 KB into an empty socket buffer (over 200 KB): does not block
        mine.sendall(len(init).to_bytes(8, "big") + init)
        mine.setblocking(False)
        self._reading: asyncio.AbstractEventLoop | None = loop
        loop.add_reader(mine.fileno(), self._on_readable)

    def __repr__(self) -> str:
        if self.closed:
            state = "closed"
        elif self.watcher.future.done():
            state = "exited"
        elif not self.ready.done():
            state = "starting"
        else:
            state = "running"
        return f"<forkserver template pid={self.pid} preload={list(self.preload)} {state}>"

    @property
    def usable(self) -> bool:
        """Whether a new lease may use this template."""
        if self.closed or self.broken or self.watcher.future.done():
            return False
        if not self.ready.done():
            return self.ready.get_loop() is asyncio.get_running_loop()
        return not self.ready.cancelled() and self.ready.exception() is None

    # ------------------------------------------------------------ start-up

    def _stop_reading(self) -> None:
        if self._reading is not None:
            if not self._reading.is_closed():
                self._reading.remove_reader(self.sock.fileno())
            self._reading = None

    def _on_readable(self) -> None:
        try:
            chunk = self.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._stop_reading()
            self.watcher.future.add_done_callback(self._died_starting)
            return
        self._buf += chunk
        if len(self._buf) < 8 or len(self._buf) < 8 + int.from_bytes(self._buf[:8], "big"):
            return
        self._stop_reading()
        answer = marshal.loads(bytes(self._buf[8:]))
        self._buf.clear()
        if self.ready.done():
            return
        if answer[0] == "ready":
            self.sock.setblocking(True)
            self.sock.settimeout(FORK_TIMEOUT)
            self.ready.set_result(None)
        else:
            self.ready.set_exception(self._preload_error(*answer[1:]))

    def _died_starting(self, fut: asyncio.Future[int]) -> None:
        if not self.ready.done():
            self.ready.set_exception(
                TemplateError(
                    f"forkserver template (pid {self.pid}) exited with status "
                    f"{fut.result()} while importing preload {list(self.preload)}"
                )
            )

    def _preload_error(self, kind: str, name: str, detail: str, tb: str) -> BaseException:
        if kind == "import":
            err: BaseException = ImportError(
                f"forkserver preload: importing {name!r} failed: {detail}", name=name
            )
            err.__cause__ = RemoteTraceback(tb)
            return err
        if kind == "unsafe":
            return TemplateError(
                f"forkserver preload: importing {name!r} {detail}; the template cannot fork "
                f"workers from it: import {name!r} in the workers instead, or use "
                "start_method='spawn'"
            )
        return TemplateError(f"forkserver template cannot fork on this system: {detail}")

    # ------------------------------------------------------------ requests

    def submit(
        self,
        pool: Executor,
        fds: Sequence[int],
        targets: Sequence[int],
        channel: int | None,
        env: Mapping[str, str],
        cwd: str,
        script: ScriptCommand | None = None,
    ) -> concurrent.futures.Future[int]:
        """Ask for one worker: ``fds[i]`` becomes its fd ``targets[i]``; its pid, later.

        A function worker boots over ``channel``; with ``script`` the worker
        runs that script instead (no channel).  ``fds`` must stay open until
        the future is done.

        Requests are sent, and answered, on ``pool``'s thread, every request
        queued meanwhile at once (``_exchange``): the template forks them all
        before it waits for the first to set itself up.  Each new worker is
        registered with the guardian there as its answer arrives.  The future
        raises ``OSError`` if the template could not fork, ``RuntimeError``
        if the template is gone or wedged (no answer within ``FORK_TIMEOUT``).
        """
        request = None if script is None else script.request()
        body = marshal.dumps((list(targets), channel, dict(env), cwd, request))
        future: concurrent.futures.Future[int] = concurrent.futures.Future()
        with self._lock:
            self._queue.append((len(body).to_bytes(8, "big") + body, list(fds), future))
            if not self._draining:
                self._draining = True
                pool.submit(self._drain)
        return future

    def _drain(self) -> None:
        while True:
            with self._lock:
                batch, self._queue = self._queue, []
                if not batch:
                    self._draining = False
                    return
            self._exchange(batch)

    def _exchange(
        self, batch: list[tuple[bytes, list[int], concurrent.futures.Future[int]]]
    ) -> None:
        """Send every request of ``batch``, then read their answers, in order."""
        started = self.ready.done() and not self.ready.cancelled()
        if self.closed or self.broken or not started or self.ready.exception() is not None:
            for *_, future in batch:
                future.set_exception(RuntimeError(f"{self!r} cannot fork workers"))
            return
        answered = 0
        try:
            for message, fds, _ in batch:
                fd_data = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
                sent = self.sock.sendmsg([message], fd_data)
                if sent < len(message):
                    self.sock.sendall(memoryview(message)[sent:])
            for _, _, future in batch:
                answer = self._read_answer()
                answered += 1
                self._resolve(answer, future)
        except OSError as e:
            self.broken = True
            for _, _, future in batch[answered:]:
                error = RuntimeError(
                    f"forkserver template (pid {self.pid}) did not answer a fork request "
                    f"({e or type(e).__name__}); a new template starts with the next group"
                )
                error.__cause__ = e
                future.set_exception(error)

    def _resolve(self, answer: Any, future: concurrent.futures.Future[int]) -> None:
        if answer[0] == "pid":
            _lifeline.register_from_thread(answer[1])  # at once, as for a spawned worker
            future.set_result(int(answer[1]))
        elif answer[0] == "failed":
            # the worker exited before running anything; it is our child: reap it
            os.waitpid(answer[1], 0)
            future.set_exception(
                OSError(f"a worker forked by the template failed to start: {answer[2]}")
            )
        else:
            future.set_exception(
                OSError(
                    answer[1],
                    f"forkserver template (pid {self.pid}) could not fork a worker: {answer[2]}",
                )
            )

    def _read_answer(self) -> Any:
        buf = bytearray()
        need = 8
        while len(buf) < need:
            chunk = self.sock.recv(need - len(buf))
            if not chunk:
                raise ConnectionError("the template exited")
            buf += chunk
            if need == 8 and len(buf) == 8:
                need = 8 + int.from_bytes(buf, "big")
        return marshal.loads(bytes(buf[8:]))

    # --------------------------------------------------------------- close

    async def aclose(self) -> None:
        """Close the socket (the template exits on EOF), wait, kill if need be, reap.

        Cancellation: bounded by ``CLOSE_WAIT``; callers shield it.
        """
        if self.closed:
            return
        self.closed = True
        self._stop_reading()
        self.sock.close()
        if not self.ready.done():
            self.ready.cancel()
        if not self.ready.cancelled() and self.ready.exception() is None:
            pass  # a ready template exits at once on EOF
        else:
            self._kill()  # still importing (or failed): do not wait for the import
        if self.watcher.loop is not asyncio.get_running_loop():
            self.watcher.detach()  # its loop is gone: notice the exit on this one
            self.watcher = ExitWatcher(self.popen)
        fut = self.watcher.future
        try:
            await asyncio.wait_for(asyncio.shield(fut), CLOSE_WAIT)
        except asyncio.TimeoutError:
            self._kill()
            await asyncio.shield(fut)
        _lifeline.forget(self.pid)  # before the reap: the id may be reused after it
        self.watcher.reap()
        await _lifeline.settle()

    def _kill(self) -> None:
        if not self.watcher.reaped:  # unreaped: the group id is still the template's
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


_templates: dict[tuple[int, tuple[str, ...]], Template] = {}


async def acquire(preload: tuple[str, ...], path_head: tuple[str, ...] = ()) -> Template:
    """A lease on the running template for ``preload``, starting one if need be.

    ``path_head``: directories searched for ``preload`` before the
    supervisor's ``sys.path`` (a script's own, see ``_script``) if a
    template has to be started; a running one imported ``preload`` already
    and is shared whatever its ``path_head`` was.

    Raises:
        ImportError: a preloaded module failed to import (the template's
            traceback is the ``__cause__``).
        TemplateError: a preloaded module started a thread or initialised
            CUDA, or the template died while starting (a ``RuntimeError``).

    Cancellation: the lease is released, and a template nobody else waits
    for is killed and reaped before the cancellation propagates.
    """
    key = (os.getpid(), preload)
    template = _templates.get(key)
    if template is None or not template.usable:
        template = _templates[key] = Template(preload, path_head)
    template.leases += 1
    try:
        await asyncio.shield(template.ready)
    except BaseException:
        await shielded(release(template))  # bounded (see Template.aclose)
        raise
    return template


async def release(template: Template) -> None:
    """Give a lease back; the last one closes the template.

    Cancellation: bounded by ``CLOSE_WAIT``; callers shield it.
    """
    template.leases -= 1
    if template.leases > 0:
        return
    key = (os.getpid(), template.preload)
    if _templates.get(key) is template:
        del _templates[key]
    await template.aclose()


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
) -> Child:
    """Fork one worker from ``template``; the same contract as ``spawn``.

    A function worker (``channel_fd``, ``channel``), or with ``script`` a
    worker that runs that Python script itself, as a spawned binary worker
    would (its stdin is then this process's, as a spawned binary's is).
    ``stdout``/``stderr`` are ``None`` (this process's own fd 1/2),
    ``subprocess.PIPE`` (tee), ``subprocess.DEVNULL``, an fd or an open
    file.  ``pass_fds`` (``channel_fd`` among them) keep their numbers.

    Cancellation: as ``spawn``: the fork itself cannot be interrupted, and
    a start cancelled while the pipes are connected kills the worker's group.
    """
    if len(pass_fds) + 2 > MAX_FDS:
        raise ValueError(f"a forked worker takes at most {MAX_FDS - 2} pass_fds")
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
        worker_env = {**env, _lifeline.TOKEN_VAR: _lifeline.token()}
        cwd = os.getcwd()

        def submit(pool: Executor) -> concurrent.futures.Future[int]:
            # the round trip waits for the new worker to set itself up, which
            # takes milliseconds on a busy machine: on the helper thread
            return template.submit(pool, fds, targets, channel_fd, worker_env, cwd, script)

        pid = await start_off_loop(submit, lambda p: p, _discard_forked)
    except BaseException:
        for reader in readers.values():
            reader.close()
        raise
    finally:
        for fd in mine:
            os.close(fd)
    proc = PidProc(pid, readers.get(1), readers.get(2))
    return await adopt(label, proc, channel, tee_out, tee_err)


def _discard_forked(pid: int) -> None:
    """Kill and reap a forked worker whose start was abandoned (it leads its group)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    os.waitpid(pid, 0)  # our child (CLONE_PARENT), SIGKILLed: exits at once
    _lifeline.forget(pid)
