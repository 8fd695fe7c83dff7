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
import logging
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import CHILDREN_DIR

import aioproc
from aioproc import DefaultLogsSpecs, OutputLine, OutputStream, Std

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


async def start(tmp_path: Path, counts: dict[int, int], stream: OutputStream) -> aioproc.PContext:
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
