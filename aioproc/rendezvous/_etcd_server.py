"""The c10d rendezvous's store: an etcd server run by the agent that hosts it.

The server is one of the agent's supervised children, started as workers
are (``_proc.spawn``: a session of its own, registered with the guardian
before it serves anything), so it dies with the agent even when the agent
is SIGKILLed.  It listens on the rendezvous endpoint (the client URL), has a
peer URL on a free loopback port (a single member has no peers to reach),
and keeps its data in a fresh directory under the run's log dir (or the
temp dir), removed when it stops.

Readiness is read from the server's own log, never polled: etcd writes one
line once it serves clients, and a line with the error when it cannot
start (the endpoint's port taken, an address not of this machine).  The
reader is a protocol on the loop, which also keeps etcd's pipe drained for
as long as it runs (its lines go to the debug log).

The data directory outlives a SIGKILLed agent unless somebody else removes
it: the guardian only kills.  So a janitor does: a small ``sys.executable``
in a session of its own, outside the guardian's reach, that blocks on an
flock of a file in that directory.  The agent holds the lock, and etcd
inherits it (the same open file description), so the lock is free only
once both have exited, however they ended; the janitor then removes the
directory and exits.  No timer, no poll: the kernel wakes it.  (A SIGKILL
between the directory's creation and the janitor's start, a few
milliseconds, would still leave it behind.)
"""

from __future__ import annotations

import asyncio
import fcntl
import ipaddress
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

import anyio

from .._base.offloop import run_blocking
from .._base.pipes import connect_read_pipe
from .._base.shield import shielded
from .._proc.exits import ExitWatcher
from .._proc.shutdown import release, stop_groups
from .._proc.spawn import Child, spawn
from ._c10d import format_hostport
from .api import RendezvousError

__all__ = ["EmbeddedEtcd", "EtcdStartError"]

logger = logging.getLogger("aioproc.rendezvous")

READY_MARKS = (b"ready to serve client requests", b"serving client traffic")
"""What etcd logs once its client listener serves (3.5 logs both, 3.4 the second)."""

STOP_GRACE = 5.0
"""Seconds etcd gets to exit after SIGTERM (it takes milliseconds) before SIGKILL."""

JANITOR_WAIT = 5.0
"""Seconds the janitor gets to exit once the lock is free, before it is killed."""

START_TRIES = 3
"""Starts tried when the free peer port chosen was taken before etcd bound it."""

MAX_LINE = 64 * 1024
"""Longest log line kept whole; longer ones are cut (etcd's are far shorter)."""

# The janitor: waits for the lock (free once the agent and etcd have both
# exited), then removes the directory.  The lock file may already be gone
# (the agent cleaned up before the janitor got to open it): nothing to do.
_JANITOR = """\
import fcntl, os, shutil, sys
try:
    fd = os.open(sys.argv[1], os.O_RDONLY)
except OSError:
    sys.exit(0)
fcntl.flock(fd, fcntl.LOCK_EX)
shutil.rmtree(sys.argv[2], ignore_errors=True)
"""


class EtcdStartError(RendezvousError):
    """etcd did not come up; the message says why, in etcd's words.

    A ``RendezvousError``: the store of a c10d rendezvous could not start.

    Attributes:
        endpoint_taken: the endpoint's port was in use (another process,
            often another agent on this machine, serves it).
    """

    def __init__(self, message: str, endpoint_taken: bool = False) -> None:
        super().__init__(message)
        self.endpoint_taken = endpoint_taken


class EmbeddedEtcd:
    """A single-member etcd server on ``host:port``, owned by this agent.

    Args:
        binary: the etcd executable.
        host: the endpoint's host: an address of this machine is listened
            on alone; ``localhost`` means 127.0.0.1; another name means
            every IPv4 interface (as torch's TCP store listens), since other
            hosts may resolve it to an address this one does not.
        port: the endpoint's port.
        root: where its directory is made (None: the temp dir).
    """

    def __init__(self, binary: str, host: str, port: int, root: str | None) -> None:
        self.binary = binary
        self.host = host
        self.port = port
        self.root = root
        self.dir: str | None = None
        self._lock = -1
        self._janitor: subprocess.Popen[bytes] | None = None
        self._child: Child | None = None
        self._log: _EtcdLog | None = None
        self._transport: asyncio.BaseTransport | None = None

    def __repr__(self) -> str:
        if self._child is None:
            state = "not running"
        elif self._child.returncode is None:
            state = f"pid={self._child.pid} running"
        else:
            state = f"pid={self._child.pid} exited {self._child.returncode}"
        return f"<EmbeddedEtcd {self.endpoint} {state}>"

    @property
    def endpoint(self) -> str:
        return format_hostport(self.host, self.port)

    def exited(self) -> str | None:
        """Why the server is gone, if it exited by itself (None while it runs)."""
        child, log = self._child, self._log
        if child is None or child.returncode is None or log is None:
            return None
        code = child.returncode
        how = f"killed by {_signal_name(-code)}" if code < 0 else f"exit status {code}"
        return f"{how}: {log.last_error}" if log.last_error else how

    async def start(self, timeout: float) -> None:
        """Start the server; return once it serves clients on the endpoint.

        Raises:
            EtcdStartError: etcd exited first (its error named), or did not
                serve within ``timeout`` seconds; nothing is left running.
            OSError: the directory could not be made, or etcd not started.

        Cancellation: whatever was started is stopped (shielded, bounded)
        before the cancellation propagates.
        """
        deadline = time.monotonic() + timeout
        try:
            if self.root is not None:
                os.makedirs(self.root, exist_ok=True)
            self.dir = tempfile.mkdtemp(prefix="aioproc_c10d_", dir=self.root)
            lock = os.path.join(self.dir, "lock")
            self._lock = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            fcntl.flock(self._lock, fcntl.LOCK_EX)
            await run_blocking(self._start_janitor, lock, self.dir)
            for attempt in range(1, START_TRIES + 1):
                try:
                    await self._run(deadline)
                    return
                except _PeerPortTaken:
                    if attempt == START_TRIES:
                        raise EtcdStartError(
                            f"etcd found {START_TRIES} free peer ports taken before it "
                            "could bind them"
                        ) from None
        except BaseException:
            await self.stop()
            raise

    def _start_janitor(self, lock: str, path: str) -> None:
        # on the helper thread: kept on the object even if the caller is
        # cancelled meanwhile, so that stop() always reaps it
        self._janitor = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _JANITOR, lock, path],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # no terminal signal reaches it
            close_fds=True,
            env={},  # no lifeline token: the guardian's sweep must spare it
        )

    async def _run(self, deadline: float) -> None:
        assert self.dir is not None
        peer = f"http://127.0.0.1:{_free_port()}"
        argv = [
            self.binary,
            "--name=aioproc-c10d",
            f"--data-dir={os.path.join(self.dir, 'data')}",
            f"--listen-client-urls=http://{format_hostport(_listen_host(self.host), self.port)}",
            f"--advertise-client-urls=http://{self.endpoint}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=aioproc-c10d={peer}",
            "--initial-cluster-state=new",
            "--logger=zap",
            "--log-outputs=stderr",
            # a single member elects itself: a short election timeout costs
            # nothing and saves most of a second at every start
            "--heartbeat-interval=50",
            "--election-timeout=500",
        ]
        # etcd reads ETCD_* variables as flags: the user's must not reconfigure it
        env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD")}
        read_fd, write_fd = os.pipe()
        try:
            child = await spawn(
                "etcd",
                argv,
                env,
                stdout=subprocess.DEVNULL,
                stderr=write_fd,
                stdin=subprocess.DEVNULL,
                pass_fds=(self._lock,),  # etcd holds the lock too (see the module docstring)
            )
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        self._child = child
        log = self._log = _EtcdLog()
        pipe = os.fdopen(read_fd, "rb", buffering=0)
        loop = asyncio.get_running_loop()
        try:
            # shielded: a transport half-registered with the loop could not be closed
            self._transport = await shielded(connect_read_pipe(loop, log, pipe))
        except BaseException:
            pipe.close()
            raise
        exited = child.watcher.future
        either: set[asyncio.Future[Any]] = {log.ready, exited}
        await asyncio.wait(
            either,
            timeout=max(0.0, deadline - time.monotonic()),
            return_when=asyncio.FIRST_COMPLETED,
        )
        if log.ready.done():
            logger.info("hosting the c10d rendezvous store: %r", self)
            return
        if exited.done():
            await asyncio.wait({log.closed}, timeout=1.0)  # its last words, up to EOF
        error = log.last_error or log.last_line or "no output"
        peer_taken = f"{peer[len('http://') :]}: bind: address already in use" in error
        await self._stop_server()
        if peer_taken:
            raise _PeerPortTaken
        if not exited.done():
            raise EtcdStartError(
                f"etcd did not serve {self.endpoint} within the join timeout; its last line: "
                f"{error}"
            )
        taken = f":{self.port}: bind: address already in use" in error
        raise EtcdStartError(f"etcd could not serve {self.endpoint}: {error}", taken)

    async def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL), remove its directory, reap the janitor.

        Idempotent.

        Cancellation: shielded and bounded (the grace period, the kill's
        wait, the janitor's).
        """
        with anyio.CancelScope(shield=True):
            await self._stop_server()
            if self.dir is not None:
                await run_blocking(shutil.rmtree, self.dir, True)
                self.dir = None
            if self._lock >= 0:
                os.close(self._lock)  # the janitor's turn: it finds nothing left and exits
                self._lock = -1
            janitor, self._janitor = self._janitor, None
            if janitor is not None:
                watcher = ExitWatcher(janitor, reap=True)
                await asyncio.wait({watcher.future}, timeout=JANITOR_WAIT)
                if not watcher.future.done():
                    logger.warning("the c10d store's janitor (pid %d) hung: killed", janitor.pid)
                    janitor.kill()
                    await watcher.future

    async def _stop_server(self) -> None:
        child, self._child = self._child, None
        if child is not None:
            forced = await stop_groups([child], signal.SIGTERM, STOP_GRACE)
            if forced:
                logger.warning(
                    "etcd (pid %d) did not exit within %g s of SIGTERM: killed",
                    child.pid,
                    STOP_GRACE,
                )
            await release([child], drain=1.0)
        log, transport, self._transport = self._log, self._transport, None
        if transport is not None:
            if log is not None:
                await asyncio.wait({log.closed}, timeout=1.0)  # EOF follows etcd's exit
            transport.close()


class _PeerPortTaken(Exception):
    """The free port chosen for etcd's peer URL was taken before etcd bound it."""


class _EtcdLog(asyncio.Protocol):
    """etcd's stderr: each line to the debug log; readiness and the last error kept."""

    def __init__(self) -> None:
        loop = asyncio.get_running_loop()
        self.ready: asyncio.Future[None] = loop.create_future()
        self.closed: asyncio.Future[None] = loop.create_future()
        self.last_line = ""
        self.last_error = ""
        self._partial = b""

    def data_received(self, data: bytes) -> None:
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()[-MAX_LINE:]
        for line in lines:
            self._line(line)

    def eof_received(self) -> bool:
        if self._partial:
            self._line(self._partial)
            self._partial = b""
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)

    def _line(self, raw: bytes) -> None:
        text = raw.decode("utf-8", "replace").strip()
        if not text:
            return
        logger.debug("etcd: %s", text)
        if not self.ready.done() and any(mark in raw for mark in READY_MARKS):
            self.ready.set_result(None)
        record = _json(raw) if raw.startswith(b"{") and b'"error"' in raw else None
        if record is not None and record.get("level") in ("warn", "error", "fatal", "panic"):
            self.last_error = f"{record.get('msg', '')}: {record['error']}"
        self.last_line = text[:500]


def _json(raw: bytes) -> dict[str, object] | None:
    try:
        record = json.loads(raw)
    except ValueError:
        return None
    return record if isinstance(record, dict) and "error" in record else None


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _listen_host(host: str) -> str:
    """Where etcd listens for clients, for the endpoint's ``host`` (see ``EmbeddedEtcd``)."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return "127.0.0.1" if host == "localhost" else "0.0.0.0"
    return host


def _free_port() -> int:
    """A loopback port free right now (the peer URL's: a single member never dials it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port
