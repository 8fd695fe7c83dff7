"""The warm-start template behind ``start_method="forkserver"`` (parent side).

A template is a fresh ``sys.executable`` in a session of its own that has
imported the modules the user named (``preload``) and forks function workers
on request (its side: ``_child.template``).  One template serves every group,
worker and pool of this supervisor process that asks for the same preload
set at the same time: each holds a *lease* (``acquire``/``release``), and
the last release closes it.  An agent or a pool holds a lease for its whole
life, so restarts and replacements reuse the template (a pool takes a fresh
lease when its template died); ``aioproc.open_forkserver`` lets anyone else
keep one warm between groups.

Why the guarantees of spawned workers carry over: the template forks with
``CLONE_PARENT``, so a worker is this process's child exactly like a spawned
one, found by the same pidfd exit watcher, with the true exit status, and
its leader reaped late by ``Child.release``; the template neither waits for
nor signals workers.  Fork requests are sent and answered on the helper
thread, like ``Popen`` calls, every request queued meanwhile at once (the
template forks them all before it waits for the first to set itself up).

No user code before the guardian knows the worker: every request carries a
*gate*, the read end of a pipe whose write end only this process holds.  A
new worker sets itself up and then blocks on its gate; "go" is written
there only once its pid has been read and registered with the guardian (on
the helper thread as the answer arrives, or on the loop if the guardian was
being replaced).  A worker whose request is given up (the template died or
stopped answering, the start was cancelled) sees EOF instead and runs
nothing; one whose supervisor died does too, and the guardian's token sweep
finds it (the template carries the lifeline token in its exec environment,
which a forked worker's ``/proc/<pid>/environ`` shows).

When a request fails for the template's sake (it died, stopped answering
within ``FORK_TIMEOUT``, or a cancelled start gave it up when it answered
nothing for ``CANCEL_GRACE``, see ``_func.fork``), the template's whole process group is
SIGKILLed and the workers it forked for requests nobody will adopt are found among this
process's children and killed and reaped (``_sweep``): a child is one of
them only if it has this template's own process name (``fork_name``: a
fork keeps it until it passes its gate, and a zombie keeps it too), its
session is the template's, or its exec environment carries the template's
mark (``MARK_VAR``), and it is neither registered with the guardian nor
answered to a start in flight.
Closing a template SIGKILLs its group too: a process a preloaded module
started dies with it.

Besides function workers, the template forks workers that run a Python
script themselves (``_func.script``: ``aioproc run --start-method forkserver``);
they have no channel and are supervised as the binary workers they stand
for.  A worker is started from a template by ``_func.fork.spawn_forked``;
what a template process is made of (its code, its exec environment) and
how its forks are found are in ``_func.template_exec``.
"""

from __future__ import annotations

import array
import asyncio
import collections
import concurrent.futures
import marshal
import os
import secrets
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from typing import Any

from .._base.children import child_pids
from .._base.shield import shielded
from .._errors.failure import RemoteTraceback
from .._proc import lifeline as _lifeline
from .._proc.exits import ExitWatcher
from .boot import boot_blob, code_frame, stub_argv
from .script import ScriptCommand
from .template_exec import (
    MARK_VAR,
    _forked_by,
    _script_runner,
    _source,
    _template_env,
    fork_name,
)

FORK_TIMEOUT = 30.0
"""Seconds a fork request may take before the template is deemed wedged."""

CLOSE_WAIT = 5.0
"""Seconds a closed template gets to exit before it is killed."""

_thread_vars_logged: set[tuple[str, ...]] = set()
"""Preload sets whose thread vars were logged (``_template_env``): warned about once each."""


class TemplateError(RuntimeError):
    """The template could not start: a preloaded module made it unsafe to fork, or it died."""


class TemplateLost(TemplateError):
    """The template died or was given up while forking; nothing it forked is left.

    ``retriable``: the request may go to a fresh template (the template died,
    was given up by another start, or was gone before the request was sent);
    False when it stopped answering, which a fresh one may do again.
    """

    def __init__(self, message: str, *, retriable: bool = True) -> None:
        super().__init__(message)
        self.retriable = retriable


class _Request:
    """One fork request: its message, fds and gate, and the future of its pid."""

    __slots__ = ("fds", "future", "gate", "join", "message")

    def __init__(
        self,
        message: bytes,
        fds: list[int],
        gate: int,
        join: Callable[[int], None] | None = None,
    ) -> None:
        self.message = message
        self.join = join  # puts the worker in its placement while it waits at its gate
        self.fds = fds  # the worker's fds, then the gate's read end (closed once sent)
        self.gate = gate  # the gate's write end, held until "go" or give-up
        self.future: concurrent.futures.Future[int] = concurrent.futures.Future()

    def close_gate(self) -> None:
        """Let go of the worker, if any (EOF on its gate: it exits without running)."""
        if self.gate >= 0:
            os.close(self.gate)
            self.gate = -1

    def sent(self) -> None:
        os.close(self.fds[-1])  # the worker has its own copy of the gate's read end


class Template:
    """One template process and its leases (see the module docstring)."""

    def __init__(self, preload: tuple[str, ...], path_head: tuple[str, ...] = ()) -> None:
        loop = asyncio.get_running_loop()
        self.preload = preload
        self.path_head = path_head
        self.leases = 0
        self.closed = False
        self.broken = False  # a request failed: new leases start a new template
        self.retried = False  # its lost requests were sent to a new template (_func.fork)
        # whether requests it fails may go to a new template (TemplateLost.retriable):
        # not once it stopped answering, for those of the same starts sent later too
        self.retriable = True
        self._abandoned = False  # killed by a cancelled start (see abandon)
        self.progress = time.monotonic()  # when a request was last sent or answered
        self.mark = f"{os.getpid()}-{secrets.token_hex(8)}"
        self.name = fork_name(self.mark)  # its process name, and its forks' (see _sweep)
        self._lock = threading.Lock()  # guards the queue and the gates, whatever thread asks
        # fork requests not sent yet, and whether a helper thread is sending
        self._queue: list[_Request] = []
        self._draining = False
        # answered pids not handed over yet: their gate's write end
        self._gates: dict[int, int] = {}
        self._buf = bytearray()
        self.ready: asyncio.Future[None] = loop.create_future()
        # an error nobody awaited any more (all waiters cancelled) is not "unretrieved"
        self.ready.add_done_callback(lambda f: f.cancelled() or f.exception())
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        _lifeline.ensure()
        try:
            self.popen = subprocess.Popen(
                stub_argv(theirs.fileno(), f"aioproc-template {os.getpid()}"),
                env=_template_env(preload, self.mark, _thread_vars_logged),
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
            {
                "sys_path": paths,
                "preload": list(preload),
                "boot": boot,
                "script": _script_runner(),
                "name": self.name,
            }
        )
        # its source, then ~50 KB: into an empty socket buffer (over 200 KB),
        # which does not block
        mine.sendall(code_frame(_source()) + len(init).to_bytes(8, "big") + init)
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
        # dead, but the loop has not noticed yet: no new lease on it
        try:
            if os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return False
        except ChildProcessError:
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
        join: Callable[[int], None] | None = None,
        modules: Sequence[str] = (),
        title: str = "",
    ) -> _Request:
        """Ask for one worker: ``fds[i]`` becomes its fd ``targets[i]``; its pid, later.

        A function worker boots over ``channel``; with ``script`` the worker
        runs that script instead (no channel).  ``fds`` must stay open until
        the request's future is done.  ``join(pid)``, if given, puts the
        worker in its placement (``_limits``) from this process while the
        worker still waits at its gate: no code of the user's runs outside
        its limits, so the worker needs no copy of ``_limits.join.enter``.
        ``modules``: what the worker's function will import first (the
        module it lives in); the template reads their code once for all its
        workers, which still run it themselves.  ``title``: what ``ps``
        shows for the worker once past its gate ("Title" in ``_child.boot``).
        A worker that cannot be joined is let go unrun and reaped, and the
        future raises the error.

        Requests are sent, and answered, on ``pool``'s thread, every request
        queued meanwhile at once (``_drain``): the template forks them all
        before it waits for the first to set itself up.  Each new worker is
        registered with the guardian there as its answer arrives, and let
        through its gate if that took (else ``go`` does it on the loop).
        The future raises ``OSError`` if the template could not fork,
        ``TemplateLost`` if the template is gone, wedged (no answer within
        ``FORK_TIMEOUT``) or given up (``abandon``).
        """
        request = None if script is None else script.request()
        body = marshal.dumps(
            (list(targets), channel, dict(env), cwd, request, list(modules), title)
        )
        gate_r, gate_w = os.pipe()
        req = _Request(len(body).to_bytes(8, "big") + body, [*fds, gate_r], gate_w, join)
        with self._lock:
            self._queue.append(req)
            if not self._draining:
                self._draining = True
                pool.submit(self._drain)
        return req

    def withdraw(self, req: _Request) -> bool:
        """Take back a request not sent yet (True); False once it is sent."""
        with self._lock:
            if req not in self._queue:
                return False
            self._queue.remove(req)
        req.sent()  # closes the gate's read end: never sent now
        req.close_gate()
        req.future.cancel()
        return True

    def go(self, pid: int) -> None:
        """Let the answered worker ``pid`` run, once the guardian knows it (idempotent)."""
        with self._lock:
            gate = self._gates.pop(pid, -1)
        if gate >= 0:
            try:
                os.write(gate, _GO)
            except OSError:
                pass  # it died (killed from outside): its exit watcher tells
            finally:
                os.close(gate)

    def _drain(self) -> None:
        """Send and answer requests until none is queued or awaiting its answer.

        Pipelined: whatever was queued meanwhile is sent before each answer
        is awaited, so the template always has the next requests to fork
        while a worker sets itself up, rather than only once a whole batch
        is answered.  Answers come in the order requests were sent.
        """
        unanswered: collections.deque[_Request] = collections.deque()
        while True:
            with self._lock:
                batch, self._queue = self._queue, []
                if not batch and not unanswered:
                    self._draining = False
                    return
            try:
                if batch:
                    self._send(batch, unanswered)
                if unanswered:
                    answer = self._read_answer()
                    self.progress = time.monotonic()
                    self._resolve(answer, unanswered.popleft())
            except OSError as e:
                # what is queued next finds the template broken (see _send)
                self._fail(e, list(unanswered))
                unanswered.clear()

    def _send(self, batch: list[_Request], unanswered: collections.deque[_Request]) -> None:
        """Send ``batch``; each request sent then awaits its answer in ``unanswered``.

        Raises:
            OSError: the template is gone or wedged; the requests of
                ``batch`` not sent are in ``unanswered`` too.
        """
        started = self.ready.done() and not self.ready.cancelled()
        if self.closed or self.broken or not started or self.ready.exception() is not None:
            for req in batch:
                req.sent()
                req.close_gate()
                req.future.set_exception(
                    TemplateLost(f"{self!r} cannot fork workers", retriable=self.retriable)
                )
            return
        sent = 0
        try:
            for req in batch:
                fd_data = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", req.fds))]
                n = self.sock.sendmsg([req.message], fd_data)
                req.sent()
                sent += 1
                unanswered.append(req)
                if n < len(req.message):
                    self.sock.sendall(memoryview(req.message)[n:])
                self.progress = time.monotonic()
        except OSError:
            for req in batch[sent:]:
                req.sent()
                unanswered.append(req)
            raise

    def _resolve(self, answer: Any, req: _Request) -> None:
        if answer[0] == "pid":
            pid = int(answer[1])
            if req.join is not None:
                try:
                    req.join(pid)
                except Exception as e:
                    # it never passed its gate: it exits at EOF there, unrun
                    req.close_gate()
                    os.waitpid(pid, 0)
                    req.future.set_exception(e)
                    return
            with self._lock:
                self._gates[pid] = req.gate
            req.gate = -1
            _lifeline.register_from_thread(pid)  # at once, as for a spawned worker
            if pid in _lifeline.registered_groups():
                self.go(pid)
            req.future.set_result(pid)
        elif answer[0] == "failed":
            # the worker exited before running anything; it is our child: reap it
            req.close_gate()  # it waits for this before it exits
            os.waitpid(answer[1], 0)
            req.future.set_exception(
                OSError(f"a worker forked by the template failed to start: {answer[2]}")
            )
        else:
            req.close_gate()
            req.future.set_exception(
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

    # ------------------------------------------------------------ failure

    def abandon(self) -> None:
        """Give the template up (on the loop): kill its group; the exchange sweeps.

        For a start cancelled while its request is unanswered: the
        template's death ends the exchange on the helper thread, which then
        finds and reaps what the template forked for it (``_fail``), and
        nothing queued meanwhile is sent any more.
        """
        self._abandoned = True
        self.broken = True
        self._kill()

    def _fail(self, error: OSError, unanswered: list[_Request]) -> None:
        """On the helper thread: the template failed; nothing it forked may survive.

        Its whole group is SIGKILLed and awaited (so it forks nothing more),
        the workers forked for ``unanswered`` are swept, and only then are
        their gates closed and their futures failed.
        """
        # a start tries a dead template's requests once more on a new one
        # (``_func.fork``); one that stopped answering fails its starts
        self.retriable = not isinstance(error, TimeoutError)
        self.broken = True
        self._kill()
        self._await_exit(CLOSE_WAIT)
        try:
            swept = self._sweep()
        finally:
            for req in unanswered:
                req.close_gate()
        if self._abandoned:
            why = "a cancelled start gave it up, unanswered"
        elif isinstance(error, TimeoutError):
            why = f"it did not answer within {self.sock.gettimeout() or FORK_TIMEOUT:g} s"
        elif isinstance(error, ConnectionError):
            why = "it died"
        else:
            why = f"{error or type(error).__name__}"
        retriable = self.retriable
        message = (
            f"forkserver template (pid {self.pid}) failed while forking workers ({why}); "
            f"it was killed, with the {swept} worker(s) it had not finished forking"
            + ("" if retriable else "; a new template starts with the next group")
        )
        for req in unanswered:
            lost = TemplateLost(message, retriable=retriable)
            lost.__cause__ = error
            req.future.set_exception(lost)

    def _await_exit(self, timeout: float) -> None:
        """Block (helper thread) until the killed template has exited, at most ``timeout``."""
        if self.watcher.reaped:
            return
        try:
            fd = os.pidfd_open(self.pid)
        except (AttributeError, OSError):
            return  # no pidfds: the sweep below still catches every fork it finds
        try:
            select.select([fd], [], [], timeout)
        finally:
            os.close(fd)

    def _sweep(self) -> int:
        """Kill and reap the forks of this template that nobody adopted; how many.

        Run once the template is dead, on the helper thread.  A candidate
        is a child of this process that is neither registered with the
        guardian (adopted) nor answered and waiting for ``go``; it is this
        template's fork if it has the template's process name (every fork
        has, until it passes its gate), is in the template's session, or its
        exec environment carries the template's mark.  The name is what
        finds a fork that a kill of the template's group caught as it made
        its own session: a zombie, its environment gone, its session its
        own.  Those are SIGKILLed (they ran no user code, so they have no
        descendants) and reaped.
        """
        with self._lock:
            waiting = set(self._gates)
        owned = _lifeline.registered_groups() | waiting | {self.pid}
        needle = f"{MARK_VAR}={self.mark}".encode()
        found = [p for p in child_pids() - owned if _forked_by(p, self.pid, self.name, needle)]
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)  # our unreaped child: the pid is still its own
            except ProcessLookupError:
                pass
        for pid in found:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
        return len(found)

    # --------------------------------------------------------------- close

    async def aclose(self) -> None:
        """SIGKILL the template's group, close the socket, wait, reap.

        The template holds nothing a worker needs; killing its group also
        ends what a preloaded module started.

        Cancellation: bounded by ``CLOSE_WAIT``; callers shield it.
        """
        if self.closed:
            return
        self.closed = True
        self._stop_reading()
        self._kill()
        with self._lock:
            gates, self._gates = list(self._gates.values()), {}
        for gate in gates:
            os.close(gate)  # answered to starts that never came back for them
        self.sock.close()
        if not self.ready.done():
            self.ready.cancel()
        if self.watcher.loop is not asyncio.get_running_loop():
            self.watcher.detach()  # its loop is gone: notice the exit on this one
            self.watcher = ExitWatcher(self.popen)
        fut = self.watcher.future
        try:
            await asyncio.wait_for(asyncio.shield(fut), CLOSE_WAIT)
        except asyncio.TimeoutError:
            pass  # unkillable (stuck in the kernel): reaped when it exits
        _lifeline.forget(self.pid)  # before the reap: the id may be reused after it
        if fut.done():
            self.watcher.reap()
        else:
            fut.add_done_callback(lambda _: self.watcher.reap())
        await _lifeline.settle()

    def _kill(self) -> None:
        if not self.watcher.reaped:  # unreaped: the group id is still the template's
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


_GO = b"g"
"""What a worker's gate is told (``_child.template.GO``)."""


_templates: dict[tuple[int, tuple[str, ...]], Template] = {}


async def acquire(preload: tuple[str, ...], path_head: tuple[str, ...] = ()) -> Template:
    """A lease on the running template for ``preload``, starting one if need be.

    ``path_head``: directories searched for ``preload`` before the
    supervisor's ``sys.path`` (a script's own, see ``_func.script``) if a
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
