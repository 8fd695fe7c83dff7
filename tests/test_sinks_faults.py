"""The output engine under attack: stuck consoles, slow, raising and hanging sinks, full disks.

What a user embedding aioproc must be able to rely on:

* a console nobody reads never freezes the supervisor (timers, exit
  detection, signals) and never changes the host's own stdout;
* a slow consumer slows the worker down (backpressure) instead of growing
  the supervisor's memory, and still gets every line, in order;
* a sink that raises or hangs costs nobody else anything, and ``close()``
  always completes, within the documented deadline;
* a full disk is reported, and the sinks still get every line;
* tee pipes are grown only within a budget;
* characters the console cannot encode are escaped, never losing lines.

Tests that need the supervisor's own stdout to be a stuck pipe, or its peak
memory, run a small supervisor in a subprocess (``children/out_pressure.py``)
on the test's kind of event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import io
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import CHILDREN_DIR, pid_gone

import aioproc
from aioproc import (
    CallbackSink,
    ConsoleSink,
    DefaultLogsSpecs,
    OutputLine,
    OutputStream,
    Sink,
    Std,
    sinks,
)
from aioproc._output import sinkops
from aioproc._output.tee import TeeProtocol
from aioproc._proc import spawn as _spawn

FLOOD = os.path.join(CHILDREN_DIR, "out_flood.py")
PRESSURE = os.path.join(CHILDREN_DIR, "out_pressure.py")
LIMIT = 30.0  # seconds: bound on any single wait here (a hang detector, not a timing)
DROPPED = "line(s) of worker output were dropped"


def loop_name() -> str:
    loop = asyncio.get_running_loop()
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"


def flood(n: int, width: int = 100) -> tuple[str, dict[int, tuple[str, ...]]]:
    """A binary worker writing ``n`` numbered lines of ``width`` bytes to stdout."""
    return sys.executable, {0: (FLOOD, str(n), str(width))}


def flood_lines(n: int, width: int = 100) -> list[str]:
    return [f"{i:08d}" + "." * (width - 9) for i in range(n)]


def spec(tmp_path: Path, **kw: Any) -> DefaultLogsSpecs:
    return DefaultLogsSpecs(log_dir=tmp_path / "logs", tee=Std.OUT, **kw)


def sink_errors(caplog: pytest.LogCaptureFixture, sink: object) -> list[logging.LogRecord]:
    """The error records naming ``sink``."""
    return [
        r
        for r in caplog.records
        if r.name == "aioproc" and r.levelno >= logging.ERROR and repr(sink) in r.getMessage()
    ]


def dropped_warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno == logging.WARNING and DROPPED in r.getMessage()]


def dropped_count(caplog: pytest.LogCaptureFixture) -> int:
    (record,) = dropped_warnings(caplog)
    return int(record.getMessage().split()[0])


def assert_gone(pids: dict[int, int]) -> None:
    assert pids, "the group had no pids"
    assert [pid for pid in pids.values() if not pid_gone(pid)] == []


@pytest.fixture
def short_deadline(monkeypatch: pytest.MonkeyPatch) -> float:
    """Sinks get 1 s to drain at close (default 5 s), so these tests stay quick."""
    monkeypatch.setattr(sinkops, "SINK_CLOSE_DEADLINE", 1.0)
    return 1.0


class Collector(Sink):
    """Records every line; ``closed`` counts aclose() calls."""

    def __init__(self) -> None:
        self.got: list[str] = []
        self.closed = 0

    def lines(self, rank: int, stream: str, prefix: str, lines: list[str]) -> None:
        self.got += lines

    async def aclose(self) -> None:
        self.closed += 1


# -------------------------------------------- 1. a console that never blocks


def run_pressure(mode: str, loop: str, *args: str) -> dict[str, Any]:
    """Run ``out_pressure.py`` with stdout a pipe nobody reads; its RESULT dict."""
    r, w = os.pipe()
    try:
        with tempfile.TemporaryDirectory() as logs:
            proc = subprocess.run(
                [sys.executable, PRESSURE, mode, logs, loop, *args],
                stdout=w,
                stderr=subprocess.PIPE,
                timeout=LIMIT,
                env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
            )
    finally:
        os.close(r)
        os.close(w)
    err = proc.stderr.decode()
    assert proc.returncode == 0, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("RESULT ")]
    assert lines, err[-3000:]
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
    result["stderr"] = err
    return result


async def test_stuck_stdout_never_stalls_the_loop() -> None:
    """Supervisor stdout is a pipe nobody reads; a worker floods its tee'd stdout.

    Before: the supervisor blocked in write() for good (this test timed out).
    """
    res = await asyncio.to_thread(run_pressure, "stall", loop_name())
    # a timer task kept firing on time while the console was stuck
    assert res["max_late"] < 0.5, res
    # the group could be closed, the worker is gone, the log file got the output
    assert res["pid_gone"], res
    assert res["log_bytes"] > 1 << 20, res
    # the host's own stdout was never switched to non-blocking
    assert res["stdout_nonblocking"] is False, res
    # the lines the stuck console could not take are counted, once
    assert res["stderr"].count(DROPPED) == 1, res["stderr"][-2000:]


async def test_cli_with_tee_and_stuck_stdout_exits_143_on_sigterm(tmp_path: Path) -> None:
    """``aioproc run --tee 3`` with stdout a pipe nobody reads still obeys SIGTERM."""
    ready = tmp_path / "ready"
    os.mkfifo(ready)
    ready_fd = os.open(ready, os.O_RDWR)  # the test's end: the worker's open never blocks
    r, w = os.pipe()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}
    env["AIOPROC_LOOP"] = loop_name()
    env["OMP_NUM_THREADS"] = "1"
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "aioproc",
            "run",
            "--log-dir",
            str(tmp_path / "logs"),
            "--tee",
            "3",
            FLOOD,
            "0",
            "100",
            str(ready),
            # past the supervisor's stdout pipe (64 KiB): its console is stuck by now
            str(1 << 20),
            stdout=w,
            stderr=subprocess.PIPE,
            env=env,
        )
        os.close(w)
        w = -1
        try:
            loop = asyncio.get_running_loop()
            got = await asyncio.wait_for(loop.run_in_executor(None, os.read, ready_fd, 1), LIMIT)
            assert got == b"r"
            proc.send_signal(signal.SIGTERM)
            # before: SIGTERM went unhandled while the supervisor sat in write()
            _, err = await asyncio.wait_for(proc.communicate(), LIMIT)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.communicate()
        assert proc.returncode == 128 + signal.SIGTERM, err.decode()[-3000:]
        assert "got SIGTERM" in err.decode()
    finally:
        os.close(ready_fd)
        os.close(r)
        if w >= 0:
            os.close(w)


def slow_read(fd: int) -> bytes:
    """Read ``fd`` to EOF in small bites with pauses: a console slower than the worker."""
    chunks = []
    while data := os.read(fd, 16384):
        chunks.append(data)
        time.sleep(0.001)
    return b"".join(chunks)


@pytest.mark.parametrize("kind", ["pipe", "socket"])
async def test_slow_console_gets_every_line_and_host_fd_stays_blocking(
    tmp_path: Path, kind: str
) -> None:
    """ConsoleSink on a pipe or a socket (systemd's stdout) read slowly by the test."""
    if kind == "pipe":
        r, w = os.pipe()
    else:
        a, b = socket.socketpair()
        r, w = a.detach(), b.detach()
    out = open(w, "w", encoding="utf-8")  # noqa: SIM115 - closed below
    try:
        read_task = asyncio.create_task(asyncio.to_thread(slow_read, r))
        entry, args = flood(50_000)  # 5 MB: past the console writer's buffer
        async with aioproc.start_processes(
            "w", entry, args, {0: {}}, spec(tmp_path), sinks=[ConsoleSink(stream=out)]
        ) as pc:
            result = await asyncio.wait_for(pc.wait(), LIMIT)
        assert result is not None and not result.is_failed()
        assert os.get_blocking(out.fileno())  # the host's fd was never made non-blocking
        out.close()
        data = await asyncio.wait_for(read_task, LIMIT)
    finally:
        if not out.closed:
            out.close()
        os.close(r)
    assert data.decode().splitlines() == [f"[w0]:{line}" for line in flood_lines(50_000)]


def _fds_on(pipe_fd: int) -> int:
    """How many of this process's fds lead to ``pipe_fd``'s pipe (either end)."""
    target = os.readlink(f"/proc/self/fd/{pipe_fd}")
    count = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") == target:
                count += 1
        except OSError:
            continue  # the listing's own fd, closed since
    return count


async def test_a_console_that_keeps_up_is_opened_once_and_released_when_idle(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Writes over many loop iterations share one private fd, closed once they stop."""
    from aioproc._output import console as _console

    opened = []
    real_open = _console._open_backend

    def counting_open(fd: int, st: os.stat_result) -> Any:
        opened.append(fd)
        return real_open(fd, st)

    monkeypatch.setattr(_console, "_open_backend", counting_open)
    r, w = os.pipe()
    os.set_blocking(r, False)
    out = open(w, "w", encoding="utf-8")  # noqa: SIM115 - closed below
    try:
        ours = _fds_on(w)  # the test's two ends
        got = []
        for i in range(50):
            assert _console.console_write(out, f"line {i}\n") is not None
            got.append(os.read(r, 65536))  # the console keeps up: it takes every write
            await asyncio.sleep(0)
        assert b"".join(got).decode().splitlines() == [f"line {i}" for i in range(50)]
        assert len(opened) == 1  # not once per write
        assert _fds_on(w) == ours + 1  # one private fd, kept
        for _ in range(3):
            await asyncio.sleep(0)  # two iterations without a write
        assert _fds_on(w) == ours  # idle: released
    finally:
        out.close()
        os.close(r)


async def test_after_close_a_hosts_console_pipe_reaches_eof_without_another_loop_turn(
    tmp_path: Path,
) -> None:
    """The host closes its end right after the group (its own sink, which aioproc
    never closes) and reads to EOF without running the loop: no fd of ours is left.

    The worker writes until close() stops it, so the tee writes to the console
    up to the end of the close.
    """
    r, w = os.pipe()
    os.set_blocking(r, False)
    out = open(w, "w", encoding="utf-8")  # noqa: SIM115 - closed below
    chunks = []
    try:
        entry, args = flood(10**8)  # runs until stopped
        async with aioproc.start_processes(
            "w", entry, args, {0: {}}, spec(tmp_path), sinks=[ConsoleSink(stream=out)]
        ):
            while sum(map(len, chunks)) < 1 << 20:
                with contextlib.suppress(BlockingIOError):
                    chunks.append(os.read(r, 1 << 20))  # keep up with the tee
                await asyncio.sleep(0.001)
        out.close()
        while True:
            data = os.read(r, 1 << 20)  # BlockingIOError: an fd of ours is still open
            if not data:
                break
            chunks.append(data)
    finally:
        if not out.closed:
            out.close()
        os.close(r)
    got = b"".join(chunks).decode().splitlines()
    want = [f"[w0]:{line}" for line in flood_lines(len(got))]
    assert len(got) > 1000
    assert got[:-1] == want[:-1]
    assert want[-1].startswith(got[-1])  # the line the stop cut, flushed at EOF


async def test_host_prints_keep_their_place_before_teed_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The host's buffered print() text is flushed before worker lines are written."""
    r, w = os.pipe()
    host_stdout = open(w, "w", encoding="utf-8")  # noqa: SIM115 - closed below
    try:
        read_task = asyncio.create_task(asyncio.to_thread(slow_read, r))
        monkeypatch.setattr(sys, "stdout", host_stdout)
        print("host before")  # sits in the TextIOWrapper's buffer: a pipe is block-buffered
        entry, args = flood(3)
        async with aioproc.start_processes("w", entry, args, {0: {}}, spec(tmp_path)) as pc:
            result = await asyncio.wait_for(pc.wait(), LIMIT)
        print("host after")
        monkeypatch.undo()
        host_stdout.close()
        data = await asyncio.wait_for(read_task, LIMIT)
    finally:
        monkeypatch.undo()
        if not host_stdout.closed:
            host_stdout.close()
        os.close(r)
    assert result is not None and not result.is_failed()
    teed = [f"[w0]:{line}" for line in flood_lines(3)]
    assert data.decode().splitlines() == ["host before", *teed, "host after"]


# ------------------------------------------- 2. backpressure, bounded memory


async def test_slow_async_sink_bounds_parent_memory_and_gets_every_line() -> None:
    """200 MB through tee to an async sink slower than the worker.

    Before: the parent's peak RSS grew by about the data size (250 MB).
    """
    res = await asyncio.to_thread(run_pressure, "rss", loop_name(), "200")
    assert res["lines"] == res["want"], res
    assert res["disorder"] == 0, res
    assert not res["failed"], res
    assert res["log_bytes"] == res["want_bytes"], res
    grown_mb = (res["hwm_kb"] - res["base_kb"]) / 1024
    assert grown_mb < 50, res  # the data is 200 MB


async def test_output_stream_consumer_gets_every_line_in_order(tmp_path: Path) -> None:
    """A consumer slower than the worker: the worker is paused, nothing is lost."""
    stream = OutputStream()
    most_buffered = 0

    async def consume() -> list[str]:
        nonlocal most_buffered
        got = []
        async for rec in stream:
            got.append(rec.line)
            if len(got) % 100 == 0:
                # "<OutputStream N buffered>"
                most_buffered = max(most_buffered, int(repr(stream).split()[1]))
                await asyncio.sleep(0)
        return got

    consumer = asyncio.create_task(consume())
    entry, args = flood(100_000, 200)  # 20 MB: far past the stream's buffer
    async with aioproc.start_processes(
        "w", entry, args, {0: {}}, spec(tmp_path), sinks=[stream]
    ) as pc:
        result = await asyncio.wait_for(pc.wait(), LIMIT)
    assert result is not None and not result.is_failed()
    assert await asyncio.wait_for(consumer, LIMIT) == flood_lines(100_000, 200)
    # the worker was held back: the stream never held more than a few MB of its 20
    assert 0 < most_buffered < 20_000
    assert os.path.getsize(pc.stdouts[0]) == 100_000 * 200


# --------------------------------------------------------- 3. isolated sinks


class Raising(Sink):
    """Raises from lines() and status() every time."""

    def __repr__(self) -> str:
        return "<Raising sink>"

    def lines(self, rank: int, stream: str, prefix: str, lines: list[str]) -> None:
        raise RuntimeError("sink bug")

    def status(self, rank: int, stream: str, prefix: str, text: str | None) -> None:
        raise RuntimeError("status bug")


async def test_raising_sync_sink_touches_nobody(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: on uvloop the pipe was closed and the worker died of SIGPIPE."""
    bad, good = Raising(), Collector()
    entry, args = flood(20_000)
    async with aioproc.start_processes(
        "w", entry, args, {0: {}}, spec(tmp_path), sinks=[bad, good]
    ) as pc:
        result = await asyncio.wait_for(pc.wait(), LIMIT)
    assert result is not None and not result.is_failed(), result
    assert good.got == flood_lines(20_000)
    assert good.closed == 1
    with open(pc.stdouts[0]) as f:
        assert f.read().splitlines() == flood_lines(20_000)
    # logged once per failing method, naming the sink, with the error
    errors = sink_errors(caplog, bad)
    assert len(errors) == 2, [r.getMessage() for r in errors]
    assert {r.exc_info[1].args[0] for r in errors if r.exc_info} == {"sink bug", "status bug"}


async def test_raising_async_sinks_never_make_close_raise(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Async callbacks and aclose() that raise: close() completes, everyone is gone."""
    seen: list[str] = []

    async def flaky(rec: OutputLine) -> None:
        seen.append(rec.line)
        if int(rec.line[:8]) % 2:
            raise ValueError(f"odd line {rec.line[:8]}")

    class BadClose(Collector):
        def __repr__(self) -> str:
            return "<BadClose sink>"

        async def aclose(self) -> None:
            raise OSError("cannot close")

    cb, bad_close, good = CallbackSink(flaky), BadClose(), Collector()
    entry, args = flood(1000)
    pc = await aioproc.start_processes(
        "w", entry, args, {0: {}}, spec(tmp_path), sinks=[cb, bad_close, good]
    )
    try:
        result = await asyncio.wait_for(pc.wait(), LIMIT)
        pids = pc.pids()
    finally:
        await asyncio.wait_for(pc.close(), LIMIT)  # must not raise
    assert result is not None and not result.is_failed()
    assert_gone(pids)
    assert seen == good.got == bad_close.got == flood_lines(1000)
    assert len(sink_errors(caplog, cb)) == 1
    assert len(sink_errors(caplog, bad_close)) == 1
    assert repr(pc).endswith("closed>")


async def test_callable_returning_an_awaitable_is_awaited_in_order(tmp_path: Path) -> None:
    """``lambda rec: queue.put(rec)``: before, the coroutine was dropped, never awaited."""
    queue: asyncio.Queue[OutputLine] = asyncio.Queue()
    entry, args = flood(5000)
    async with aioproc.start_processes(
        "w", entry, args, {0: {}}, spec(tmp_path), sinks=[lambda rec: queue.put(rec)]
    ) as pc:
        result = await asyncio.wait_for(pc.wait(), LIMIT)
    assert result is not None and not result.is_failed()
    got = [queue.get_nowait().line for _ in range(queue.qsize())]
    assert got == flood_lines(5000)


async def test_hanging_async_sink_cannot_hang_close(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, short_deadline: float
) -> None:
    """Before: close() hung forever, uncancellable."""
    forever = asyncio.Event()
    got: list[str] = []

    async def hangs(rec: OutputLine) -> None:
        got.append(rec.line)
        await forever.wait()

    class HangingClose(Collector):
        async def aclose(self) -> None:
            await forever.wait()

    entry, args = flood(1000)
    pc = await aioproc.start_processes(
        "w", entry, args, {0: {}}, spec(tmp_path), sinks=[hangs, HangingClose()]
    )
    try:
        result = await asyncio.wait_for(pc.wait(), LIMIT)
        pids = pc.pids()
    finally:
        await asyncio.wait_for(pc.close(), LIMIT)
    assert result is not None and not result.is_failed()
    assert_gone(pids)
    assert got == flood_lines(1)  # the first call never returned
    # every other line is counted in one warning
    assert dropped_count(caplog) == 999


async def test_slow_sink_is_cut_at_the_deadline_and_the_loss_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, short_deadline: float
) -> None:
    """1 ms a line, 20k lines: before, close() took 20 s+; now the deadline, then a count."""
    got: list[str] = []

    async def slow(rec: OutputLine) -> None:
        got.append(rec.line)
        await asyncio.sleep(0.001)

    entry, args = flood(20_000)
    pc = await aioproc.start_processes("w", entry, args, {0: {}}, spec(tmp_path), sinks=[slow])
    try:
        result = await asyncio.wait_for(pc.wait(), LIMIT)
    finally:
        # 20 s of sink work: close() must give up long before this bound
        await asyncio.wait_for(pc.close(), 10)
    assert result is not None and not result.is_failed()
    assert 0 < len(got) < 20_000
    assert got == flood_lines(len(got))  # what arrived came in order
    assert dropped_count(caplog) == 20_000 - len(got)
    with open(pc.stdouts[0]) as f:
        assert len(f.read().splitlines()) == 20_000  # the log file has every line


async def test_close_sinks_never_raises_and_keeps_its_deadline(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``close_sinks`` on its own: a raising, a hanging and a good sink."""
    forever = asyncio.Event()

    class Hangs(Collector):
        async def aclose(self) -> None:
            await forever.wait()

    class Raises(Collector):
        async def aclose(self) -> None:
            raise RuntimeError("boom")

    good = Collector()
    hangs, raises = Hangs(), Raises()
    await asyncio.wait_for(sinks.close_sinks([hangs, raises, good], 0.2), LIMIT)
    assert good.closed == 1
    assert len(sink_errors(caplog, raises)) == 1
    await sinks.close_sinks([], 0.2)  # nothing to do


# ----------------------------------------------------------- 3b. full disks


class FullDisk(io.RawIOBase):
    """A log file whose every write fails with ENOSPC."""

    name = "/fake/logs/stdout.log"

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


async def feed_tee(proto: TeeProtocol, data: bytes) -> None:
    """Run ``proto`` over a real pipe carrying ``data``, to EOF."""
    r, w = os.pipe()
    reader = os.fdopen(r, "rb", buffering=0)
    try:
        await asyncio.get_running_loop().connect_read_pipe(lambda: proto, reader)
    except BaseException:
        reader.close()
        os.close(w)
        raise
    try:
        view = memoryview(data)
        while view:
            n = await asyncio.to_thread(os.write, w, view)
            view = view[n:]
    finally:
        os.close(w)
    await asyncio.wait_for(proto.closed, LIMIT)


@pytest.mark.parametrize("disk", ["raising-file", "dev-full"])
async def test_full_disk_is_reported_and_sinks_get_every_line(
    caplog: pytest.LogCaptureFixture, disk: str
) -> None:
    log: Any = FullDisk() if disk == "raising-file" else open("/dev/full", "wb", buffering=0)  # noqa: SIM115
    good = Collector()
    proto = TeeProtocol(log, 3, "stdout", "[w3]:", [good])
    lines = flood_lines(5000)
    await feed_tee(proto, "".join(f"{line}\n" for line in lines).encode())
    assert good.got == lines
    assert proto.write_error is not None and proto.write_error.errno == errno.ENOSPC
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    path = "/fake/logs/stdout.log" if disk == "raising-file" else "/dev/full"
    assert "stdout log of rank 3" in warnings[0] and path in warnings[0], warnings[0]
    assert log.closed


# ------------------------------------------------------------- 5. pipe budget


def pipe_size(fd: int) -> int:
    return fcntl.fcntl(fd, 1032)  # F_GETPIPE_SZ


@pytest.fixture
def pipes() -> Iterator[list[tuple[int, int]]]:
    made: list[tuple[int, int]] = []
    yield made
    for r, w in made:
        for fd in (r, w):
            try:
                os.close(fd)
            except OSError:
                pass


def test_tee_pipes_grow_only_within_the_budget(
    pipes: list[tuple[int, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: every tee pipe took 1 MiB, exhausting the user's pipe pages after 64."""
    budget = _spawn._pipe_budget()
    assert 0 < budget <= _spawn.PIPE_BUDGET
    monkeypatch.setattr(_spawn, "_grown", {})
    for _ in range(40):
        pipes.append(os.pipe())
        _spawn._grow_pipe(pipes[-1][0])
    default = min(pipe_size(r) for r, _ in pipes)
    grown = [r for r, _ in pipes if pipe_size(r) > default]
    extra = sum(pipe_size(r) - default for r, _ in pipes)
    assert extra <= budget
    if not grown:
        pytest.skip("no pipe could grow: this user is over pipe-user-pages-soft already?")
    try:
        with open("/proc/sys/fs/pipe-max-size") as f:
            max_size = int(f.read())
    except OSError:
        max_size = 0
    if max_size < _spawn.PIPE_SIZE:
        pytest.skip(f"pipe-max-size {max_size} < {_spawn.PIPE_SIZE}: pipes cannot grow here")
    assert len(grown) == budget // (_spawn.PIPE_SIZE - default)
    # closing grown pipes gives their share back to later pipes
    for fd in grown[:2]:
        i = next(i for i, (r, _) in enumerate(pipes) if r == fd)
        r, w = pipes.pop(i)
        os.close(r)
        os.close(w)
    fresh = []
    for _ in range(3):
        pipes.append(os.pipe())
        _spawn._grow_pipe(pipes[-1][0])
        fresh.append(pipe_size(pipes[-1][0]))
    assert fresh == [_spawn.PIPE_SIZE, _spawn.PIPE_SIZE, default]


# ------------------------------------------------------ 6. unencodable text


TEXT = ["plain", "λ and ünïcode ✓", "after"]


async def test_ascii_console_escapes_instead_of_dropping_lines(tmp_path: Path) -> None:
    """An ascii stream without an fd (written directly) and an ascii pipe (non-blocking).

    Before: one unencodable character dropped the whole chunk of lines.
    """
    memory = io.TextIOWrapper(io.BytesIO(), encoding="ascii")
    r, w = os.pipe()
    pipe_out = open(w, "w", encoding="ascii")  # noqa: SIM115 - closed below
    reader = open(r, "rb")  # noqa: SIM115 - closed below
    try:
        read_task = asyncio.create_task(asyncio.to_thread(reader.read))
        data = "".join(f"{line}\n" for line in TEXT).encode().hex()
        entry = sys.executable
        args = {0: ("-S", os.path.join(CHILDREN_DIR, "out_workers.py"), "hexbytes", data)}
        sinks_ = [ConsoleSink(stream=memory), ConsoleSink(stream=pipe_out)]
        async with aioproc.start_processes(
            "w", entry, args, {0: {}}, spec(tmp_path), sinks=sinks_
        ) as pc:
            result = await asyncio.wait_for(pc.wait(), LIMIT)
        assert result is not None and not result.is_failed()
        pipe_out.close()
        piped = await asyncio.wait_for(read_task, LIMIT)
    finally:
        if not pipe_out.closed:
            pipe_out.close()
        reader.close()
    want = ["[w0]:plain", "[w0]:\\u03bb and \\xfcn\\xefcode \\u2713", "[w0]:after"]
    memory.flush()
    assert memory.buffer.getvalue().decode("ascii").splitlines() == want  # type: ignore[attr-defined]
    assert piped.decode("ascii").splitlines() == want
