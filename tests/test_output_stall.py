"""Sinks that hold their workers back are named: the stall warning.

A sink nobody drains (an ``OutputStream`` read only after ``wait()``)
pauses the output readers and the workers block on their pipes: right, but
silent.  After the sink's ``stall_warning`` seconds, one warning on the
``aioproc`` logger names the sink, the paused workers and what is pending.
The workers flood their stdout with numbered 1000-byte lines
(``children/stall_flood.py``).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import re
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import CHILDREN_DIR

import aioproc
from aioproc import DefaultLogsSpecs, OutputLine, OutputStream, Std
from aioproc._output.tee import READ_SIZE
from aioproc._proc.spawn import PIPE_SIZE
from aioproc.sinks import Flow, Sink

FLOOD = os.path.join(CHILDREN_DIR, "stall_flood.py")
LIMIT = 20  # seconds: bound on any single wait in these tests
LINES = 5000  # 5 MB: more than an OutputStream (1 MiB), the pipe (1 MiB) and a read hold


class StallLog(logging.Handler):
    """The ``aioproc`` logger's records; ``stalled`` is set by the first stall warning.

    The warning is logged by a timer on the event loop, so setting an
    ``asyncio.Event`` from ``emit`` is safe.
    """

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []
        self.stalled = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        if record.levelno >= logging.WARNING and "has been paused" in record.getMessage():
            self.stalled.set()

    def messages(self, level: int) -> list[str]:
        """What the ``aioproc`` logger itself said at ``level`` (not its children)."""
        return [r.getMessage() for r in self.records if r.levelno == level and r.name == "aioproc"]


@pytest.fixture
def stall_log() -> Iterator[StallLog]:
    logger = logging.getLogger("aioproc")
    handler = StallLog()
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def numbered(n: int) -> list[str]:
    """The lines ``stall_flood.py n`` writes, without their newlines."""
    return [f"{i:08d}".ljust(999, ".") for i in range(n)]


async def collect(stream: OutputStream) -> list[OutputLine]:
    return [rec async for rec in stream]


async def start(tmp_path: Path, counts: dict[int, int], stream: Sink) -> aioproc.PContext:
    return await aioproc.start_processes(
        "trainer",
        sys.executable,
        {rank: ("-S", FLOOD, str(n)) for rank, n in counts.items()},
        {rank: {} for rank in counts},
        DefaultLogsSpecs(log_dir=tmp_path / "logs", tee=Std.OUT),
        sinks=[stream],
    )


async def test_an_unread_output_stream_is_named_in_one_warning(
    tmp_path: Path, stall_log: StallLog
) -> None:
    stream = OutputStream(stall_warning=0.3)
    # rank 0 writes one line and exits; rank 1 fills the stream and blocks
    pc = await start(tmp_path, {0: 1, 1: LINES}, stream)
    try:
        await asyncio.wait_for(stall_log.stalled.wait(), LIMIT)
        # a sleep on purpose: the stall goes on, and a warning repeated every
        # threshold would show up three times meanwhile
        await asyncio.sleep(1.0)
        assert pc.poll() is None  # rank 1 is blocked on its pipe, not finished
        reader = asyncio.create_task(collect(stream))
        result = await asyncio.wait_for(pc.wait(), LIMIT)
        got = await asyncio.wait_for(reader, LIMIT)
    finally:
        await pc.close()
    assert result is not None and not result.is_failed()
    assert [rec.line for rec in got if rec.rank == 1] == numbered(LINES)
    assert [rec.line for rec in got if rec.rank == 0] == numbered(1)
    [warning] = stall_log.messages(logging.WARNING)
    match = re.fullmatch(
        r"output of worker trainer/1 \(stdout\) has been paused for \d+\.\d s: "
        r"sink <OutputStream (\d+) buffered> holds (\d+\.\d) (KiB|MiB) \((\d+) lines\) unread; "
        r"the worker blocks on its pipe until the sink takes more \(iterate the stream in a task "
        r"of its own while the group runs, not after wait\(\)\)",
        warning,
    )
    assert match is not None, warning
    buffered, lines = int(match[1]), int(match[4])
    unit = 1024 if match[3] == "KiB" else 1 << 20
    # paused past the high-water mark (1 MiB counted with ~200 bytes per record)
    assert buffered == lines and 850 <= lines < LINES
    # the text, without newlines, rounded to a tenth of the unit
    assert float(match[2]) * unit == pytest.approx(lines * 999, abs=unit * 0.05)
    [resumed] = stall_log.messages(logging.INFO)
    assert re.fullmatch(
        r"output of worker trainer/1 \(stdout\) resumed after \d+\.\d s "
        r"paused by sink <OutputStream \d+ buffered>",
        resumed,
    ), resumed


async def test_an_output_stream_read_while_the_group_runs_is_never_warned_about(
    tmp_path: Path, stall_log: StallLog
) -> None:
    stream = OutputStream(stall_warning=1.0)
    reader = asyncio.create_task(collect(stream))
    try:
        pc = await start(tmp_path, {0: LINES, 1: LINES}, stream)
        try:
            result = await asyncio.wait_for(pc.wait(), LIMIT)
        finally:
            await pc.close()
        got = await asyncio.wait_for(reader, LIMIT)
    finally:
        reader.cancel()
    assert result is not None and not result.is_failed()
    for rank in (0, 1):
        assert [rec.line for rec in got if rec.rank == rank] == numbered(LINES)
    assert stall_log.messages(logging.WARNING) == []


@pytest.mark.parametrize("bad", [-1.0, float("nan"), "10"])
def test_stall_warning_is_checked(bad: object) -> None:
    with pytest.raises((TypeError, ValueError), match=r"^stall_warning must be"):
        OutputStream(stall_warning=bad)  # type: ignore[arg-type]


async def test_a_console_nobody_reads_is_named_in_one_warning(
    tmp_path: Path, stall_log: StallLog
) -> None:
    """The console is a pipe nobody reads: the workers block once it is full,
    the console is named in one warning, and once the pipe is read again every
    line arrives and the group succeeds."""
    read_end, write_end = os.pipe()
    console = os.fdopen(write_end, "w")
    got = bytearray()

    def drain() -> None:
        while chunk := os.read(read_end, 1 << 16):
            got.extend(chunk)

    drained: asyncio.Future[None] | None = None
    try:
        pc = await aioproc.start_processes(
            "trainer",
            sys.executable,
            {0: ("-S", FLOOD, str(LINES))},
            {0: {}},
            DefaultLogsSpecs(log_dir=tmp_path / "logs", tee=Std.OUT),
            sinks=[aioproc.ConsoleSink(stream=console, stall_warning=0.3)],
        )
        try:
            await asyncio.wait_for(stall_log.stalled.wait(), LIMIT)
            assert pc.poll() is None  # blocked on its pipe, not finished
            drained = asyncio.ensure_future(asyncio.to_thread(drain))
            result = await asyncio.wait_for(pc.wait(), LIMIT)
        finally:
            await pc.close()
    finally:
        console.close()  # the reader sees EOF once our private fds are closed too
        if drained is not None:
            await asyncio.wait_for(drained, LIMIT)
        os.close(read_end)
    assert result is not None and not result.is_failed()
    assert got.decode().splitlines() == [f"[trainer0]:{line}" for line in numbered(LINES)]
    [warning] = stall_log.messages(logging.WARNING)
    assert re.fullmatch(
        r"output of worker trainer/0 \(stdout\) has been paused for \d+\.\d s: "
        r"sink ConsoleSink\(<_io\.TextIOWrapper .*>\) holds \d+\.\d (KiB|MiB) the console "
        r"has not accepted; the worker blocks on its pipe until the sink takes more "
        r"\(the supervisor's stdout/stderr is a pipe nobody reads, or a paused terminal\)",
        warning,
    ), warning
    [resumed] = stall_log.messages(logging.INFO)
    assert resumed.startswith("output of worker trainer/0 (stdout) resumed after "), resumed


# ----------------------------------------------- a sink of the user's own
#
# A sink written here, with public names only (``aioproc.sinks.Sink`` and
# ``Flow``; the private sizes above only bound the tests' checks), as a user
# would write one: it queues lines for an upload that
# is down until the test opens it, and takes part in backpressure through
# its ``flow``, ``describe_pending`` and ``drop_pending``.


class SlowUploader(Sink):
    """Queues lines for an "upload" that waits for ``opened``; holds its flow when full."""

    HIGH = 256 << 10  # bytes queued: hold the flow (the workers pause)
    LOW = 64 << 10  # bytes queued: release it (they read on)

    def __init__(self, stall_warning: float | None) -> None:
        self.flow = Flow(self, stall_warning=stall_warning, hint="the upload is down")
        self.opened = asyncio.Event()  # the remote end is up
        self.uploaded: list[str] = []
        self.most_queued = 0  # the most bytes it ever held
        self._queue: collections.deque[str] = collections.deque()
        self._size = 0
        self._wake = asyncio.Event()
        self._closing = False
        self._task: asyncio.Task[None] | None = None

    def __repr__(self) -> str:
        return f"<SlowUploader {len(self._queue)} queued>"

    def lines(self, rank: int, stream: str, prefix: str, lines: list[str]) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._upload())
        self._queue.extend(lines)
        self._size += sum(map(len, lines))
        self.most_queued = max(self.most_queued, self._size)
        if self._size >= self.HIGH:
            self.flow.hold()
        self._wake.set()

    async def _upload(self) -> None:
        while True:
            await self.opened.wait()
            self._wake.clear()
            while self._queue:
                line = self._queue.popleft()
                self._size -= len(line)
                self.uploaded.append(line)
                if self._size < self.LOW:
                    self.flow.release()
                if len(self.uploaded) % 64 == 0:
                    await asyncio.sleep(0)  # a slow consumer: one batch per loop turn
            if self._closing:
                return
            await self._wake.wait()

    def describe_pending(self) -> str:
        return f"holds {len(self._queue)} lines not uploaded"

    async def aclose(self) -> None:
        self._closing = True
        self._wake.set()
        if self._task is not None:
            await self._task

    def drop_pending(self) -> int:
        if self._task is not None:
            self._task.cancel()
        dropped = len(self._queue)
        self._queue.clear()
        self._size = 0
        self.flow.release()
        return dropped


async def test_a_sink_of_ones_own_takes_part_in_backpressure_through_public_api(
    tmp_path: Path, stall_log: StallLog
) -> None:
    """The user's sink holds its flow: the worker blocks on its pipe (alive, its
    log file short of its output), the sink never holds much more than its
    high-water mark, one warning names it with what it says it holds; once the
    upload is up every line arrives, in order."""
    sink = SlowUploader(stall_warning=0.3)
    pc = await start(tmp_path, {0: LINES}, sink)
    try:
        await asyncio.wait_for(stall_log.stalled.wait(), LIMIT)
        assert pc.poll() is None  # blocked on its pipe, not finished
        # nothing was uploaded yet: what it holds now is the most it held so far
        assert sink.most_queued <= SlowUploader.HIGH + READ_SIZE + 999, sink.most_queued
        written = os.path.getsize(pc.stdouts[0])
        # the tee writes the log file as it reads: what the worker could not
        # write yet is still in it (the pipe holds at most 1 MiB)
        assert written < (LINES * 1000) - (2 << 20), written
        sink.opened.set()
        result = await asyncio.wait_for(pc.wait(), LIMIT)
    finally:
        sink.opened.set()
        await pc.close()
    assert result is not None and not result.is_failed()
    assert sink.uploaded == numbered(LINES)
    # bounded: its high-water mark plus what one read of the pipe delivered
    # after it held the flow; and, once the worker exited, what it had left
    # in its pipe, which is read regardless so the log file is complete
    bound = SlowUploader.HIGH + READ_SIZE + PIPE_SIZE + 999
    assert sink.most_queued <= bound < LINES * 1000 // 2, sink.most_queued
    [warning] = stall_log.messages(logging.WARNING)
    assert re.fullmatch(
        r"output of worker trainer/0 \(stdout\) has been paused for \d+\.\d s: "
        r"sink <SlowUploader (\d+) queued> holds \1 lines not uploaded; the worker blocks on "
        r"its pipe until the sink takes more \(the upload is down\)",
        warning,
    ), warning
    [resumed] = stall_log.messages(logging.INFO)
    assert resumed.startswith("output of worker trainer/0 (stdout) resumed after "), resumed


async def test_a_sink_of_ones_own_that_never_drains_is_dropped_at_close_and_counted(
    tmp_path: Path, stall_log: StallLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Closed while its upload is still down: its ``aclose()`` is cut at the close
    deadline, ``drop_pending()`` drops what it holds (releasing its flow), and
    the lines lost are counted in one warning that names it."""
    # the sinks' close deadline (5 s), shortened to keep the test quick
    monkeypatch.setattr("aioproc._output.sinkops.SINK_CLOSE_DEADLINE", 0.5)
    sink = SlowUploader(stall_warning=None)
    held = asyncio.Event()
    sink.flow.watch(lambda flow, blocked: held.set() if blocked else None)
    pc = await start(tmp_path, {0: LINES}, sink)
    try:
        await asyncio.wait_for(held.wait(), LIMIT)  # the worker is held back
        await pc.close(signal.SIGTERM, 5)  # SIGTERM ends the worker; the sink is stuck
        assert not sink.flow.blocked
    finally:
        sink.opened.set()
        await pc.close()
    dropped = [m for m in stall_log.messages(logging.WARNING) if "were dropped" in m]
    assert len(dropped) == 1, stall_log.messages(logging.WARNING)
    match = re.fullmatch(
        r"(\d+) line\(s\) of worker output were dropped: sink\(s\) <SlowUploader 0 queued> "
        r"had not taken them when the group closed .*",
        dropped[0],
    )
    assert match is not None, dropped[0]
    # every line it took and did not upload, and none it uploaded
    assert int(match[1]) + len(sink.uploaded) >= SlowUploader.HIGH // 999
    assert sink.uploaded == []


async def test_a_sink_whose_flow_attribute_is_no_flow_still_gets_every_line(
    tmp_path: Path,
) -> None:
    """A sink of its own making whose ``flow`` means something else (it predates
    the contract) takes no part in backpressure, and loses nothing."""

    class Pipeline(Sink):
        flow = "downstream"  # type: ignore[assignment]

        def __init__(self) -> None:
            self.got: list[str] = []

        def lines(self, rank: int, stream: str, prefix: str, lines: list[str]) -> None:
            self.got.extend(lines)

    sink = Pipeline()
    pc = await start(tmp_path, {0: 300}, sink)
    try:
        result = await asyncio.wait_for(pc.wait(), LIMIT)
    finally:
        await pc.close()
    assert result is not None and not result.is_failed()
    assert sink.got == numbered(300)
