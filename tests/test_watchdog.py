"""Watchdog timers: aioproc.timer in workers, WatchdogServer in the agent."""

from __future__ import annotations

import array
import asyncio
import json
import logging
import os
import re
import select
import signal
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from proc_utils import still_alive_after

import aioproc.agent.watchdog as wd
from aioproc import Std
from aioproc.agent import AgentEvent, LocalElasticAgent, RestartPolicy, WorkerSpec, WorkerState
from aioproc.agent.watchdog import WatchdogServer, open_watchdog
from aioproc.timer import FD_ENV, INODE_ENV, MAX_PENDING, MAX_SCOPE_LEN, expires

WD_WORKER = str(Path(__file__).parent / "children" / "wd_worker.py")
LIMIT = 10  # seconds: bound on any wait that should be quick


def wd_spec(mode: str, out_dir: Path, n: int = 2, **kw: Any) -> WorkerSpec:
    kw.setdefault("max_restarts", 0)
    return WorkerSpec(
        role="trainer",
        local_world_size=n,
        entrypoint=sys.executable,
        args=(WD_WORKER, mode, str(out_dir)),
        watchdog=True,
        redirects=Std.ALL,
        **kw,
    )


def rank_log(log_dir: Path, rank: int, name: str, attempt: int = 0) -> str:
    (run,) = list(log_dir.iterdir())
    return (run / f"attempt_{attempt}" / str(rank) / name).read_text()


def rejections(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "aioproc" and r.getMessage().startswith("watchdog: rejected")
    ]


def fired(events: list[AgentEvent]) -> list[AgentEvent]:
    return [e for e in events if e.kind == "watchdog_fired"]


# ------------------------------------------------------ 1. through the agent


async def test_expired_timer_dumps_the_stack_and_kills_that_workers_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # only the worker's "dumped" datagram (or its exit) may end the wait for the
    # dump: the line it flushed proves its handler ran before the SIGKILL
    monkeypatch.setattr(wd, "DUMP_TIMEOUT", 30.0)
    events: list[AgentEvent] = []
    logs = tmp_path / "logs"
    agent = LocalElasticAgent(
        wd_spec("hang", tmp_path), log_dir=str(logs), grace_period=5, on_event=events.append
    )
    result = await agent.run()

    assert result.state == WorkerState.FAILED
    assert sorted(result.failures) == [0, 1]
    timed_out, collateral = result.failures[0], result.failures[1]
    assert (timed_out.exitcode, timed_out.stopped) == (-signal.SIGKILL, False)
    assert timed_out.message == "watchdog timer 'step' expired after 0.5 s"
    assert (collateral.exitcode, collateral.stopped) == (-signal.SIGTERM, True)
    (event,) = fired(events)
    assert (event.local_rank, event.pid) == (0, timed_out.pid)
    assert event.message == "watchdog timer 'step' expired after 0.5 s"

    stderr = rank_log(logs, 0, "stderr.log")
    assert re.search(r'File ".*wd_worker\.py", line \d+ in hang_in_step', stderr), stderr
    assert "hang_in_step" not in rank_log(logs, 1, "stderr.log")
    assert rank_log(logs, 0, "stdout.log") == "entering step\n"
    grandchild = int((tmp_path / "grandchild").read_text())
    assert await still_alive_after([grandchild], LIMIT) == set()


async def test_timer_of_a_descendant_dumps_its_stack_and_kills_the_group(
    tmp_path: Path,
) -> None:
    events: list[AgentEvent] = []
    logs = tmp_path / "logs"
    agent = LocalElasticAgent(
        wd_spec("descendant", tmp_path, n=1), log_dir=str(logs), on_event=events.append
    )
    result = await agent.run()

    assert result.state == WorkerState.FAILED
    assert result.failures[0].exitcode == -signal.SIGKILL
    assert result.failures[0].message == "watchdog timer 'child-step' expired after 0.3 s"
    (event,) = fired(events)
    assert event.local_rank == 0
    assert event.pid != result.failures[0].pid  # the forked child held the timer
    assert re.search(r"line \d+ in child_hangs", rank_log(logs, 0, "stderr.log"))


async def test_worker_stuck_in_c_code_is_dumped_and_killed_after_the_bound(
    tmp_path: Path,
) -> None:
    logs = tmp_path / "logs"
    result = await LocalElasticAgent(wd_spec("c-stuck", tmp_path, n=1), log_dir=str(logs)).run()

    assert result.failures[0].exitcode == -signal.SIGKILL
    assert result.failures[0].message == "watchdog timer 'c' expired after 0.3 s"
    assert re.search(r"line \d+ in stuck_in_c", rank_log(logs, 0, "stderr.log"))


async def test_forged_and_malformed_requests_are_rejected_and_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="aioproc")
    events: list[AgentEvent] = []
    agent = LocalElasticAgent(
        wd_spec("forge", tmp_path, n=1), log_dir=str(tmp_path / "logs"), on_event=events.append
    )
    result = await agent.run()

    assert result.state == WorkerState.SUCCEEDED
    assert fired(events) == []
    (worker,) = [e.pid for e in events if e.kind == "worker_started"]
    got = rejections(caplog)
    expected = [
        f"from pid {worker}: it names pid {os.getpid()} but was sent by pid {worker}",
        f"from pid {worker}: it names pid 1 but was sent by pid {worker}",
        f"from pid {worker}: it names pid -5, which is not a process",
        f"from pid {worker}: malformed request (JSONDecodeError",
        f"from pid {worker}: malformed request (not a JSON object: [1, 2])",
        f"from pid {worker}: unknown op 'explode'",
        f"from pid {worker}: malformed acquire request: 'id' must be an int >= 0, got None",
        f"from pid {worker}: datagram longer than 4096 bytes",
        f"from pid {worker}: malformed request (ValueError: NaN is not a number)",
        f"from pid {worker}: malformed request (UnicodeDecodeError",
    ]
    assert len(got) == len(expected), got
    for want in expected:
        assert any(want in line for line in got), (want, got)


async def test_timers_released_in_time_never_fire(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="aioproc")
    events: list[AgentEvent] = []
    agent = LocalElasticAgent(
        wd_spec("quick", tmp_path), log_dir=str(tmp_path / "logs"), on_event=events.append
    )
    result = await agent.run()

    assert result.state == WorkerState.SUCCEEDED, result.failures
    assert fired(events) == []
    assert rejections(caplog) == []


async def test_timer_of_an_exited_worker_is_dropped(tmp_path: Path) -> None:
    # attempt 0 exits inside expires(after=0.3); its deadline passes during the
    # 1 s backoff, when no worker runs: nothing may fire, nothing be killed
    events: list[AgentEvent] = []
    spec = wd_spec(
        "crash", tmp_path, n=1, max_restarts=1, restart_policy=RestartPolicy(initial_delay=1.0)
    )
    result = await LocalElasticAgent(
        spec, log_dir=str(tmp_path / "logs"), on_event=events.append
    ).run()

    assert result.state == WorkerState.SUCCEEDED
    assert [e.exitcode for e in events if e.kind == "worker_exited"] == [3, 0]
    assert fired(events) == []


# ---------------------------------------------------- 2. WatchdogServer alone


class Kills:
    """Stands in for os.kill/os.killpg: records, signals nothing."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.killed: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.fd = -1  # the watchdog fd: when set, SIGUSR2 is answered with "dumped"
        monkeypatch.setattr(os, "kill", self.kill)
        monkeypatch.setattr(os, "killpg", self.killpg)

    def expired(self, rank: int, pid: int, scope: str, after: float) -> None:
        self.log.append(("expired", rank, pid, scope, after))

    def kill(self, pid: int, sig: int) -> None:
        self.log.append(("kill", pid, sig))
        if self.fd >= 0 and sig == signal.SIGUSR2:
            send(self.fd, op="dumped", pid=os.getpid())

    def killpg(self, pgid: int, sig: int) -> None:
        self.log.append(("killpg", pgid, sig))
        if not self.killed.done():
            self.killed.set_result(pgid)


def send(fd: int, **fields: Any) -> None:
    os.write(fd, json.dumps(fields).encode())


@pytest.fixture
async def server() -> Any:
    srv: WatchdogServer | None = None

    async def make(on_expired: Any) -> tuple[WatchdogServer, int]:
        nonlocal srv
        srv = WatchdogServer(on_expired)
        await srv.start()
        return srv, int(srv.env()[FD_ENV])

    yield make
    if srv is not None:
        await srv.aclose()


async def test_server_expiry_calls_back_then_dumps_then_kills_the_group(
    server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(wd, "DUMP_TIMEOUT", 30.0)  # only "dumped" ends the wait
    kills = Kills(monkeypatch)
    srv, fd = await server(kills.expired)
    kills.fd = fd
    me = os.getpid()
    assert srv.pass_fds() == (fd,)
    srv.set_workers({3: me})
    send(fd, op="acquire", pid=me, id=1, scope="unit", after=0.05)

    assert await asyncio.wait_for(kills.killed, LIMIT) == me
    assert kills.log == [
        ("expired", 3, me, "unit", 0.05),
        ("kill", me, signal.SIGUSR2),
        ("killpg", me, signal.SIGKILL),
    ]


async def test_server_kills_after_the_bound_without_a_dump_ack(
    server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(wd, "DUMP_TIMEOUT", 0.05)
    kills = Kills(monkeypatch)
    srv, fd = await server(kills.expired)
    me = os.getpid()
    srv.set_workers({0: me})
    send(fd, op="acquire", pid=me, id=1, scope="unit", after=0)

    assert await asyncio.wait_for(kills.killed, LIMIT) == me
    assert [entry[0] for entry in kills.log] == ["expired", "kill", "killpg"]


async def test_server_released_and_replaced_timers_do_not_fire(
    server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    kills = Kills(monkeypatch)
    srv, fd = await server(kills.expired)
    me = os.getpid()
    srv.set_workers({0: me})
    send(fd, op="acquire", pid=me, id=1, scope="released", after=0.01)
    send(fd, op="release", pid=me, id=1)
    send(fd, op="release", pid=me, id=99)  # unknown: ignored
    send(fd, op="acquire", pid=me, id=2, scope="old workers", after=0.01)
    srv._on_readable()  # white box: take them now, while they are rank 0's
    srv.set_workers({1: me})  # same pid, new rank: a new worker, old timers dropped
    send(fd, op="acquire", pid=me, id=4, scope="last", after=0.05)

    await asyncio.wait_for(kills.killed, LIMIT)
    # timers fire in deadline order: any surviving earlier one would come first
    assert [entry for entry in kills.log if entry[0] == "expired"] == [
        ("expired", 1, me, "last", 0.05)
    ]


async def test_server_acts_on_a_request_sent_before_set_workers(
    server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    kills = Kills(monkeypatch)
    srv, fd = await server(kills.expired)
    me = os.getpid()
    send(fd, op="acquire", pid=me, id=1, scope="early", after=0.05)
    srv._on_readable()  # white box: received before the workers are known
    srv.set_workers({2: me})

    await asyncio.wait_for(kills.killed, LIMIT)
    assert kills.log[0] == ("expired", 2, me, "early", 0.05)


def bad_datagrams(me: int) -> Iterator[tuple[bytes, str]]:
    def req(**fields: Any) -> bytes:
        return json.dumps(fields).encode()

    yield (
        req(op="acquire", pid=os.getppid(), id=1, scope="s", after=1),
        (f"it names pid {os.getppid()} but was sent by pid {me}"),
    )
    yield req(op="acquire", pid=-5, id=1, scope="s", after=1), "it names pid -5"
    yield req(op="acquire", pid=0, id=1, scope="s", after=1), "it names pid 0"
    yield req(op="acquire", pid=True, id=1, scope="s", after=1), "'pid' must be an int"
    yield req(op="acquire", pid=str(me), id=1, scope="s", after=1), "'pid' must be an int"
    yield req(op="acquire", id=1, scope="s", after=1), "'pid' must be an int, got None"
    yield b"{", "malformed request (JSONDecodeError"
    yield b"[" * 2000 + b"]" * 2000, "malformed request"
    yield b"\x80", "malformed request (UnicodeDecodeError"
    yield b"null", "not a JSON object"
    yield req(pid=me), "unknown op None"
    yield req(op="ACQUIRE", pid=me), "unknown op 'ACQUIRE'"
    yield req(op="release", pid=me), "'id' must be an int >= 0, got None"
    yield req(op="release", pid=me, id=-1), "'id' must be an int >= 0, got -1"
    yield req(op="release", pid=me, id=1.5), "'id' must be an int >= 0, got 1.5"
    yield req(op="acquire", pid=me, id=1, after=1), "'scope' must be a str"
    yield req(op="acquire", pid=me, id=1, scope=7, after=1), "'scope' must be a str"
    yield (
        req(op="acquire", pid=me, id=1, scope="x" * (MAX_SCOPE_LEN + 1), after=1),
        ("'scope' must be a str of at most"),
    )
    yield req(op="acquire", pid=me, id=1, scope="s"), "'after' must be a number, got None"
    yield req(op="acquire", pid=me, id=1, scope="s", after="1"), "'after' must be a number"
    yield req(op="acquire", pid=me, id=1, scope="s", after=-1), "'after' must be >= 0"
    yield (
        b'{"op":"acquire","pid":%d,"id":1,"scope":"s","after":Infinity}' % me,
        ("Infinity is not a number"),
    )
    yield req(op="acquire", pid=me, id=1, scope="s" * 5000, after=1), "longer than 4096 bytes"


async def test_server_rejects_and_logs_bad_requests(
    server: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="aioproc")
    kills = Kills(monkeypatch)
    srv, fd = await server(kills.expired)
    me = os.getpid()
    srv.set_workers({0: me})
    cases = list(bad_datagrams(me))
    for data, _ in cases:
        os.write(fd, data)
    with socket.socket(fileno=os.dup(fd)) as sock, open(os.devnull) as passed:
        # a valid request carrying an fd: the fd must neither be used nor leak
        fds = array.array("i", [passed.fileno()])
        sock.sendmsg(
            [json.dumps({"op": "release", "pid": me, "id": 1}).encode()],
            [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds.tobytes())],
        )
    send(fd, op="acquire", pid=me, id=1, scope="marker", after=0)  # read after all the rest
    await asyncio.wait_for(kills.killed, LIMIT)

    got = rejections(caplog)
    assert len(got) == len(cases) + 1, got
    for (_, want), line in zip(cases, got[:-1], strict=True):
        assert want in line, (want, line)
    assert re.search("ancillary data|file descriptors", got[-1])
    # only the marker did anything
    assert kills.log[0] == ("expired", 0, me, "marker", 0.0)


async def test_server_rejects_requests_of_processes_that_are_not_workers(
    server: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="aioproc")
    kills = Kills(monkeypatch)
    srv, fd = await server(kills.expired)
    me = os.getpid()
    send(fd, op="acquire", pid=me, id=1, scope="stranger", after=0)
    await srv.aclose()  # reads what is queued: the test process is nobody's worker

    assert rejections(caplog) == [
        f"watchdog: rejected a request from pid {me}: pid {me} is neither a worker "
        "of this agent nor in a worker's process group"
    ]
    assert kills.log == []


async def test_server_lifecycle_misuse(server: Any) -> None:
    srv = WatchdogServer(lambda *a: None)
    assert "not started" in repr(srv)
    with pytest.raises(RuntimeError, match="start"):
        srv.env()
    with pytest.raises(RuntimeError, match="start"):
        srv.pass_fds()
    await srv.aclose()  # closing an unstarted server is fine
    with pytest.raises(RuntimeError, match="twice"):
        await srv.start()
    with pytest.raises(TypeError):
        WatchdogServer("not callable")  # type: ignore[arg-type]

    started, fd = await server(lambda *a: None)
    assert "running" in repr(started)
    env = started.env()
    st = os.fstat(fd)
    assert env == {FD_ENV: str(fd), INODE_ENV: f"{st.st_dev}:{st.st_ino}"}
    with pytest.raises(RuntimeError, match="twice"):
        await started.start()
    with pytest.raises(TypeError, match="local_rank: pid"):
        started.set_workers({0: -1})
    with pytest.raises(TypeError, match="local_rank: pid"):
        started.set_workers([os.getpid()])  # type: ignore[arg-type]
    await started.aclose()
    await started.aclose()  # idempotent
    assert "closed" in repr(started)
    with pytest.raises(RuntimeError, match="not running"):
        started.set_workers({})


# a worker whose timer expires at once, and which ignores the stack dump's SIGUSR2
# and sends no "dumped": only the SIGKILL of its group ends it
EXPIRING = (
    "import json, os, signal, sys, time\n"
    "signal.signal(signal.SIGUSR2, signal.SIG_IGN)\n"
    "request = {'op': 'acquire', 'pid': os.getpid(), 'id': 1, 'scope': 'x', 'after': 0}\n"
    f"os.write(int(os.environ['{FD_ENV}']), json.dumps(request).encode())\n"
    "time.sleep(600)\n"
)


async def test_aclose_from_two_tasks_finishes_the_kill_under_way(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A second ``aclose()`` waits for the first, which ends the kill under way:
    the worker's group is SIGKILLed and the worker gone."""
    monkeypatch.setattr(wd, "DUMP_TIMEOUT", 0.5)  # the dump ack never comes
    expired = asyncio.Event()
    server = await open_watchdog(lambda *a: expired.set())
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        EXPIRING,
        env={**os.environ, **server.env()},
        pass_fds=server.pass_fds(),
        start_new_session=True,
    )
    try:
        server.set_workers({0: proc.pid})
        await asyncio.wait_for(expired.wait(), LIMIT)  # the kill is under way
        first = asyncio.create_task(server.aclose())
        await asyncio.sleep(0)  # the first close is waiting for the kill
        await asyncio.wait_for(server.aclose(), LIMIT)
        assert first.done()  # the second returned only once the first had
        await first
        assert await asyncio.wait_for(proc.wait(), LIMIT) == -signal.SIGKILL
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await server.aclose()
    assert "closed" in repr(server)


async def test_open_watchdog_with_async_with_and_torchs_stop() -> None:
    async with open_watchdog(lambda *a: None) as server:
        assert "running" in repr(server)
        assert server.pass_fds() == (int(server.env()[FD_ENV]),)
    assert "closed" in repr(server)
    with pytest.raises(RuntimeError, match="not running"):
        server.env()

    server = WatchdogServer(lambda *a: None)  # torch's face: start() then stop()
    await server.start()
    await server.stop()
    assert "closed" in repr(server)
    await server.aclose()  # one close, whichever name
    with pytest.raises(TypeError, match="on_expired must be callable"):
        open_watchdog("not callable")  # type: ignore[arg-type]


# ------------------------------------------------- 3. the worker-side module


def run_python(code: str, env: dict[str, str] | None = None, **kw: Any) -> str:
    full_env = {k: v for k, v in os.environ.items() if k not in (FD_ENV, INODE_ENV)}
    full_env.update(env or {})
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=LIMIT,
        check=True,
        **kw,
    )
    return out.stdout


BANNED = ("asyncio", "anyio", "aiofiles", "uvloop")


def test_import_loads_no_event_loop_or_parent_side_modules() -> None:
    code = """
        import sys
        import aioproc.timer
        print(" ".join(sorted(sys.modules)))
    """
    modules = run_python(code).split()
    assert "aioproc.timer" in modules
    assert [m for m in modules if m.split(".")[0] in BANNED] == []
    assert [m for m in modules if m.startswith("aioproc.") and m != "aioproc.timer"] == []


def test_expires_sends_acquire_and_release_without_loading_an_event_loop() -> None:
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    with parent, child:
        st = os.fstat(child.fileno())
        code = """
            import sys
            from aioproc.timer import expires, is_enabled
            with expires(after=2.5, scope="step"):
                with expires(after=1):  # default scope: the caller's file#line
                    pass
            print(is_enabled())
            print(" ".join(sorted(sys.modules)))
        """
        env = {FD_ENV: str(child.fileno()), INODE_ENV: f"{st.st_dev}:{st.st_ino}"}
        out = run_python(code, env, pass_fds=(child.fileno(),)).splitlines()
        parent.setblocking(False)
        requests = [json.loads(parent.recv(4096)) for _ in range(4)]
        with pytest.raises(BlockingIOError):
            parent.recv(4096)
    assert out[0] == "True"
    assert [m for m in out[1].split() if m.split(".")[0] in BANNED] == []
    pid = requests[0]["pid"]
    outer, inner = requests[0]["id"], requests[1]["id"]
    assert outer != inner
    assert requests == [
        {"op": "acquire", "pid": pid, "id": outer, "scope": "step", "after": 2.5},
        {"op": "acquire", "pid": pid, "id": inner, "scope": "<string>#5", "after": 1.0},
        {"op": "release", "pid": pid, "id": inner},
        {"op": "release", "pid": pid, "id": outer},
    ]


@pytest.mark.parametrize(
    ("env", "reason"),
    [
        ({}, f"{FD_ENV} is not set"),
        ({FD_ENV: "banana"}, "is not a file descriptor"),
        ({FD_ENV: "1000"}, "is not open in this process"),
        ({FD_ENV: "0"}, "is not a socket"),
    ],
)
def test_expires_without_a_watchdog_is_a_no_op_that_warns_once(
    env: dict[str, str], reason: str
) -> None:
    code = """
        import warnings
        from aioproc.timer import expires, is_enabled
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with expires(after=0):
                pass
            with expires(after=0, scope="again"):
                pass
        print(is_enabled())
        print(len(caught))
        print(caught[0].category.__name__, caught[0].lineno)
        print(caught[0].message)
    """
    enabled, count, where, message = run_python(code, env, stdin=subprocess.DEVNULL).splitlines()
    assert (enabled, count, where) == ("False", "1", "RuntimeWarning 6")
    assert message.startswith("aioproc.timer.expires is a no-op here: ")
    assert reason in message


def test_expires_with_a_foreign_socket_at_that_fd_is_a_no_op() -> None:
    # a descendant that did not inherit the fd may have another socket there
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    with parent, child:
        env = {FD_ENV: str(child.fileno()), INODE_ENV: "1:2"}
        code = """
            import warnings
            from aioproc.timer import expires
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with expires(after=0):
                    pass
            print(caught[0].message)
        """
        out = run_python(code, env, pass_fds=(child.fileno(),))
        parent.setblocking(False)
        with pytest.raises(BlockingIOError):
            parent.recv(4096)
    assert "is not the agent's watchdog socket" in out


def test_expires_checks_its_arguments() -> None:
    with pytest.raises(TypeError, match="number of seconds"):
        expires(after="1")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="number of seconds"):
        expires(after=True)
    with pytest.raises(ValueError, match="finite number >= 0"):
        expires(after=-1)
    with pytest.raises(ValueError, match="finite number >= 0"):
        expires(after=float("nan"))
    with pytest.raises(TypeError, match="must be a str"):
        expires(after=1, scope=b"x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="characters long"):
        expires(after=1, scope="x" * (MAX_SCOPE_LEN + 1))
    with pytest.raises(TypeError) as info:
        expires(after=1, client="c")  # type: ignore[arg-type]
    assert str(info.value) == "expires(client=...) must be a TimerClient, got 'c'"
    timer = expires(after=1.5, scope="s")
    assert repr(timer) == "<expires 's' after=1.5 s new>"
    here = expires(after=1)
    assert re.fullmatch(r".*test_watchdog\.py#\d+", here.scope)


def start_timer_user(blocks: int) -> tuple[socket.socket, subprocess.Popen[str]]:
    """A process running ``blocks`` expires() blocks against a socket nobody reads yet."""
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    st = os.fstat(child.fileno())
    code = f"""
        import json, sys, warnings
        from aioproc.timer import expires
        accepted = 0
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i in range({blocks}):
                block = expires(after=3600, scope=f"s{{i}}")
                with block:
                    accepted += "active" in repr(block)  # False: not enforced
        # one line: the test waits for it with select(), which sees no
        # second line already in the reader's buffer
        print(json.dumps([accepted, len(caught), [str(w.message) for w in caught]]), flush=True)
        sys.stdin.readline()  # the test has read every request
    """
    env = {k: v for k, v in os.environ.items() if k not in (FD_ENV, INODE_ENV)}
    env.update({FD_ENV: str(child.fileno()), INODE_ENV: f"{st.st_dev}:{st.st_ino}"})
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(code)],
            env=env,
            pass_fds=(child.fileno(),),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
    except BaseException:
        parent.close()
        raise
    finally:
        child.close()
    return parent, proc


def read_line_within(proc: subprocess.Popen[str], seconds: float, what: str) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], seconds)
    assert ready, f"no output within {seconds} s: {what}"
    return proc.stdout.readline().strip()


@pytest.mark.parametrize("blocks", [300, 3 * MAX_PENDING])
def test_expires_never_blocks_when_the_agent_does_not_read(blocks: int) -> None:
    parent, proc = start_timer_user(blocks)
    try:
        # nothing has been read yet: the socket's queue (a few datagrams)
        # filled at once, so a blocking send would hang the worker right here
        line = read_line_within(proc, LIMIT, "the worker blocked on a timer request")
        accepted, warned, messages = json.loads(line)
        parent.settimeout(LIMIT)
        requests = [json.loads(parent.recv(4096)) for _ in range(2 * accepted)]
        assert proc.stdin is not None
        proc.stdin.close()
        assert proc.wait(LIMIT) == 0
        parent.setblocking(False)
        with pytest.raises(BlockingIOError):
            parent.recv(4096)  # nothing more: no request was sent twice
    finally:
        parent.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()
    # every accepted block's acquire then release, in the order they happened
    ids = [r["id"] for r in requests[::2]]
    assert requests == [
        r
        for i in ids
        for r in (
            {"op": "acquire", "pid": proc.pid, "id": i, "scope": f"s{i - 1}", "after": 3600.0},
            {"op": "release", "pid": proc.pid, "id": i},
        )
    ]
    if blocks < MAX_PENDING:
        # queued, not dropped: every block was enforced, nothing warned
        assert (accepted, warned, messages) == (blocks, 0, [])
        assert ids == list(range(1, blocks + 1))
    else:
        # past MAX_PENDING waiting requests, new blocks are not enforced (warned once)
        assert MAX_PENDING // 2 <= accepted < blocks
        assert messages == [
            f"aioproc.timer: the agent is not reading timer requests ({MAX_PENDING} are "
            "waiting); new expires() blocks are not enforced until it catches up"
        ]


def run_timer_code(code: str) -> tuple[list[dict[str, Any]], str, int]:
    """Run ``code`` with a watchdog fd; return the requests it sent, its stdout, its pid."""
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    st = os.fstat(child.fileno())
    env = {k: v for k, v in os.environ.items() if k not in (FD_ENV, INODE_ENV)}
    env.update({FD_ENV: str(child.fileno()), INODE_ENV: f"{st.st_dev}:{st.st_ino}"})
    try:
        proc = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)],
            env=env,
            pass_fds=(child.fileno(),),
            capture_output=True,
            text=True,
            timeout=LIMIT,
        )
        assert proc.returncode == 0, proc.stderr
        parent.setblocking(False)
        requests = []
        while True:
            try:
                requests.append(json.loads(parent.recv(4096)))
            except BlockingIOError:
                break
    finally:
        parent.close()
        child.close()
    out = proc.stdout.splitlines()
    return requests, "\n".join(out[1:]), int(out[0])


def test_nested_blocks_of_one_scope_share_a_timer_as_in_torch() -> None:
    # torch's timer servers key timers by (pid, scope): the inner acquire
    # replaces the outer deadline and the inner release ends the timer
    requests, _, pid = run_timer_code(
        """
        import os
        from aioproc.timer import expires
        print(os.getpid(), flush=True)
        with expires(after=10, scope="s"):
            with expires(after=20, scope="s"):
                pass
            with expires(after=30, scope="other"):
                pass
        """
    )
    s_id, other = requests[0]["id"], requests[3]["id"]
    assert other != s_id
    assert requests == [
        {"op": "acquire", "pid": pid, "id": s_id, "scope": "s", "after": 10.0},
        {"op": "acquire", "pid": pid, "id": s_id, "scope": "s", "after": 20.0},
        {"op": "release", "pid": pid, "id": s_id},
        {"op": "acquire", "pid": pid, "id": other, "scope": "other", "after": 30.0},
        {"op": "release", "pid": pid, "id": other},
    ]  # the outer block's exit sends nothing: its timer already ended


def test_configure_client_and_torch_style_api() -> None:
    requests, out, pid = run_timer_code(
        """
        import os, time
        from aioproc import timer
        print(os.getpid(), flush=True)

        class Recorder(timer.TimerClient):
            def acquire(self, scope_id, expiration_time):
                left = expiration_time - time.time()
                print("acquire", scope_id, 4 < left <= 5)
            def release(self, scope_id):
                print("release", scope_id)

        timer.configure(Recorder())
        with timer.expires(after=5, scope="a"):
            pass
        with timer.expires(after=5, scope="b", client=timer.WatchdogClient()):
            pass
        try:
            timer.configure(object())
        except TypeError as e:
            print(e)
        timer.configure(None)  # back to the agent's watchdog
        client = timer.WatchdogClient()
        client.acquire("c", time.time() + 7)
        client.release("c")
        client.release("c")  # nothing running: nothing sent
        """
    )
    assert out.splitlines() == [
        "acquire a True",
        "release a",
        "configure() needs a TimerClient (acquire and release methods), got <object object at "
        + out.splitlines()[2].rsplit(" at ", 1)[1],
    ]
    assert [(r["op"], r.get("scope")) for r in requests] == [
        ("acquire", "b"),
        ("release", None),
        ("acquire", "c"),
        ("release", None),
    ]
    assert 6 < requests[2]["after"] <= 7
    assert {r["pid"] for r in requests} == {pid}


def test_expires_calls_the_clients_acquire_and_release_as_torch_does() -> None:
    # a subclass of the agent's client (instrumented, as torch users wrap
    # theirs) sees every block through its public methods, and the watchdog
    # still gets the requests: the subclass calls up
    requests, out, pid = run_timer_code(
        """
        import os, time
        from aioproc import timer
        print(os.getpid(), flush=True)

        class Counting(timer.WatchdogClient):
            def acquire(self, scope_id, expiration_time):
                left = expiration_time - time.time()
                print("acquire", scope_id, 4 < left <= 5, isinstance(expiration_time, float))
                super().acquire(scope_id, expiration_time)
            def release(self, scope_id):
                print("release", scope_id)
                super().release(scope_id)

        with timer.expires(after=5, scope="passed", client=Counting()):
            pass
        timer.configure(Counting())
        with timer.expires(after=5, scope="configured"):
            pass
        """
    )
    assert out.splitlines() == [
        "acquire passed True True",
        "release passed",
        "acquire configured True True",
        "release configured",
    ]
    ids = [r["id"] for r in requests[::2]]
    assert requests == [
        {"op": "acquire", "pid": pid, "id": ids[0], "scope": "passed", "after": 5.0},
        {"op": "release", "pid": pid, "id": ids[0]},
        {"op": "acquire", "pid": pid, "id": ids[1], "scope": "configured", "after": 5.0},
        {"op": "release", "pid": pid, "id": ids[1]},
    ]
