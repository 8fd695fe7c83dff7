"""The output engine under attack: slow, raising and hanging sinks, full disks.

What a user embedding aioproc must be able to rely on:

* a slow consumer slows the worker down (backpressure) instead of growing
  the supervisor's memory, and still gets every line, in order;
* a sink that raises or hangs costs nobody else anything, and ``close()``
  always completes, within the documented deadline;
* a full disk is reported, and the sinks still get every line;
* tee pipes are grown only within a budget.

Tests that need the supervisor's peak memory run a small supervisor in a
subprocess (``children/out_pressure.py``) on the test's kind of event loop.
A stuck, slow or ascii-only console (the console writer) is test_console.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import io
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import loop_name, pid_gone
from output_helpers import DROPPED, LIMIT, flood, flood_lines, run_pressure, spec

import aioproc
from aioproc import (
    CallbackSink,
    OutputLine,
    OutputStream,
    Sink,
    sinks,
)
from aioproc._output import sinkops
from aioproc._output.tee import TeeProtocol
from aioproc._proc import spawn as _spawn


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


# ---------------------------------------------- 1. backpressure, bounded memory


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


# --------------------------------------------------------- 2. isolated sinks


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


class RaisingText(Sink):
    """Takes text and raises from text() every time."""

    def __repr__(self) -> str:
        return "<RaisingText sink>"

    def lines(self, rank: int, stream: str, prefix: str, lines: list[str]) -> None:
        raise AssertionError("a text sink gets plain lines through text()")

    def text(self, rank: int, stream: str, prefix: str, text: str) -> None:
        raise RuntimeError("text bug")


async def test_a_raising_text_sink_touches_nobody(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A sink that takes text and raises costs the line sinks, the console and
    the log file nothing; its error is logged once, naming it."""
    bad, good, console = RaisingText(), Collector(), io.StringIO()
    entry, args = flood(20_000)
    async with aioproc.start_processes(
        "w", entry, args, {0: {}}, spec(tmp_path), sinks=[bad, good, sinks.ConsoleSink(console)]
    ) as pc:
        result = await asyncio.wait_for(pc.wait(), LIMIT)
    assert result is not None and not result.is_failed(), result
    assert good.got == flood_lines(20_000)
    assert console.getvalue().splitlines() == ["[w0]:" + line for line in flood_lines(20_000)]
    with open(pc.stdouts[0]) as f:
        assert f.read().splitlines() == flood_lines(20_000)
    errors = sink_errors(caplog, bad)
    assert len(errors) == 1, [r.getMessage() for r in errors]
    assert "text()" in errors[0].getMessage()
    assert errors[0].exc_info is not None and errors[0].exc_info[1].args == ("text bug",)


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
    """5 ms a line for the last 5k of 20k lines, about 25 s of work left when
    close() is called: before, close() took all of it; now the deadline, then a
    count.  (The first 15k are taken at once, so the worker ends without a wait.)"""
    got: list[str] = []

    async def slow(rec: OutputLine) -> None:
        got.append(rec.line)
        if len(got) > 15_000:
            await asyncio.sleep(0.005)

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


# ------------------------------------------------------------- 3. full disks


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


class _BreaksConsoles(Sink):
    """At its first lines, breaks the consoles after it: closes a file console,
    closes the reader of a pipe console."""

    def __init__(self, file_console: io.TextIOWrapper, pipe_reader: int) -> None:
        self._file, self._reader = file_console, pipe_reader
        self.broke = False

    def lines(self, rank: int, stream: str, prefix: str, lines: list[str]) -> None:
        if not self.broke:
            self.broke = True
            self._file.close()
            os.close(self._reader)


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
async def test_consoles_that_break_mid_flood_cost_nobody_anything(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A file console closed by the host, a pipe console whose reader went away
    and a console on a full disk, all mid-flood: the worker ends as it would
    have, the log file and the other sinks get every line, nothing is logged
    as an error, and no fd of ours stays open on the broken pipe."""
    file_console = open(tmp_path / "console.txt", "w", encoding="utf-8")  # noqa: SIM115
    r, w = os.pipe()
    pipe_console = open(w, "w", encoding="utf-8")  # noqa: SIM115 - closed below
    pipe_name = os.readlink(f"/proc/self/fd/{w}")
    full = open("/dev/full", "w", encoding="utf-8")  # noqa: SIM115 - closed below
    breaker, good = _BreaksConsoles(file_console, r), Collector()
    consoles = [sinks.ConsoleSink(stream=s) for s in (file_console, pipe_console, full)]
    entry, args = flood(50_000)
    try:
        async with aioproc.start_processes(
            "w", entry, args, {0: {}}, spec(tmp_path), sinks=[breaker, *consoles, good]
        ) as pc:
            result = await asyncio.wait_for(pc.wait(), LIMIT)
        on_pipe = [fd for fd in os.listdir("/proc/self/fd") if _target(fd) == pipe_name]
    finally:
        for stream in (file_console, pipe_console, full):
            with contextlib.suppress(OSError):
                stream.close()
        if not breaker.broke:
            os.close(r)
    assert breaker.broke
    assert result is not None and not result.is_failed(), result
    assert good.got == flood_lines(50_000)
    with open(pc.stdouts[0]) as f:
        assert f.read().splitlines() == flood_lines(50_000)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    # what the file console took before it was closed is whole lines
    taken = (tmp_path / "console.txt").read_text().splitlines()
    assert taken == ["[w0]:" + line for line in flood_lines(len(taken))]
    # the pipe console's private fd is gone: only the host's own end is left
    assert on_pipe == [str(w)]


def _target(fd: str) -> str | None:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None  # the listing's own fd, closed since


# ------------------------------------------------------------- 4. pipe budget


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
