"""Nothing lost: every byte a worker wrote reaches its log and sinks (``aioproc._output.drain``).

A worker's last line without a newline, a worker killed mid-stream, a group
stopped by failure, ``close()``, cancellation or a signal, a grandchild that
writes after its worker exited, a ten-megabyte line, invalid UTF-8: the
output is read to its end (``drain``) and framed whole (``tee``), and a
worker's "started" event comes before its first line.

Workers are real processes, binary (``python -S out_workers.py <fn> ...``)
or function workers (the same functions, imported by name from
``tests/children/out_workers.py``); they write with ``os.write`` so nothing
waits in a Python buffer.  Workers that must be stopped mid-run announce
on a FIFO after writing (``proc_utils.Fifo``) or wait for the test's
go-ahead on one (``helpers.release_fifo``); nothing here synchronises on a
sleep.
"""

from __future__ import annotations

import asyncio
import collections
import os
import random
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from helpers import release_fifo
from output_helpers import (
    GROUP_LIMIT,
    KINDS,
    logs,
    of_prefix,
    read_bytes,
    run_group,
    text_lines,
    workload,
)
from output_helpers import ow as ow  # the out_workers fixture
from proc_utils import Fifo

import aioproc
from aioproc import (
    OutputLine,
    PContext,
    SignalException,
    Std,
    translate_signals,
)
from aioproc._output import tee as _output

SEED = int(os.environ.get("AIOPROC_FAULT_SEED", random.randrange(1 << 30)))

# ------------------------------------------------- nothing lost, ever


@pytest.mark.parametrize("kind", KINDS)
async def test_final_line_without_newline_emitted_once_at_eof(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], ow: ModuleType, kind: str
) -> None:
    entry, args = workload(kind, ow, "lines", {0: (3, "no newline")})
    pc, result = await run_group(entry, args, logs(tmp_path, tee=Std.OUT))
    assert not result.is_failed()
    assert read_bytes(pc.stdouts[0]) == ow.numbered(3) + b"no newline"
    want = [f"[w0]:{line}" for line in ow.numbered(3).decode().splitlines()]
    assert text_lines(capfd.readouterr().out) == [*want, "[w0]:no newline"]


@pytest.mark.parametrize("kind", KINDS)
async def test_worker_killed_mid_stream_loses_nothing(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], ow: ModuleType, kind: str
) -> None:
    """SIGKILL right after 20k lines (400 kB, far more than a pipe holds) and a partial one."""
    n = 20_000
    entry, args = workload(kind, ow, "lines_then_sigkill", {0: (n, "cut")})
    pc, result = await run_group(entry, args, logs(tmp_path, tee=Std.OUT))
    assert result.failures[0].exitcode == -signal.SIGKILL
    assert read_bytes(pc.stdouts[0]) == ow.numbered(n) + b"cut"
    lines = text_lines(capfd.readouterr().out)
    assert len(lines) == n + 1
    assert of_prefix(lines, "[w0]:") == [*ow.numbered(n).decode().splitlines(), "cut"]


async def stop_by(
    how: str, start: Callable[[], Any], ready: Fifo, go: Callable[[int], None]
) -> PContext:
    """Start the group (``start()``), wait until rank 0 is ready, stop it the way ``how``."""
    if how in ("failure", "close"):
        pc: PContext = await start()
        await asyncio.wait_for(ready.reader.readexactly(1), GROUP_LIMIT)
        if how == "failure":
            go(1)  # rank 1 exits 3: the supervisor stops rank 0
            result = await asyncio.wait_for(pc.wait(), GROUP_LIMIT)
            assert result is not None and result.failures[1].exitcode == 3
            assert result.failures[0].exitcode == -signal.SIGTERM
        await pc.close()
        return pc
    pcs: list[PContext] = []
    if how == "cancel":
        started = asyncio.Event()

        async def body() -> None:
            async with start() as pc:
                pcs.append(pc)
                await asyncio.wait_for(ready.reader.readexactly(1), GROUP_LIMIT)
                started.set()
                await asyncio.Event().wait()

        task = asyncio.create_task(body())
        await asyncio.wait_for(started.wait(), GROUP_LIMIT)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    else:
        assert how == "signal"
        with pytest.raises(SignalException) as info:
            async with translate_signals((signal.SIGHUP,)):
                async with start() as pc:
                    pcs.append(pc)
                    await asyncio.wait_for(ready.reader.readexactly(1), GROUP_LIMIT)
                    os.kill(os.getpid(), signal.SIGHUP)
                    await pc.wait()
        assert info.value.sigval == signal.SIGHUP
    result = pcs[0].poll()
    assert result is not None and result.failures[0].exitcode < 0
    return pcs[0]


@pytest.mark.parametrize("how", ["failure", "close", "cancel", "signal"])
@pytest.mark.parametrize("kind", KINDS)
async def test_group_stopped_loses_nothing(
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
    ow: ModuleType,
    kind: str,
    how: str,
) -> None:
    """Rank 0 writes 20k lines and a partial one, then the group is stopped."""
    n = 20_000
    spec = logs(tmp_path, tee=Std.ALL)
    go_path = str(tmp_path / "go")
    async with Fifo(tmp_path / "ready") as ready:
        with release_fifo(go_path) as go:
            entry, args = workload(
                kind, ow, "block_or_fail", {r: (r, n, ready.path, go_path) for r in (0, 1)}
            )
            pc = await stop_by(
                how,
                lambda: aioproc.start_processes("w", entry, args, {0: {}, 1: {}}, spec),
                ready,
                go,
            )
    assert read_bytes(pc.stdouts[0]) == ow.numbered(n) + b"tail"
    assert read_bytes(pc.stdouts[1]) == b""
    captured = capfd.readouterr()
    lines = text_lines(captured.out)
    assert lines == [f"[w0]:{line}" for line in [*ow.numbered(n).decode().splitlines(), "tail"]]
    assert captured.err == ""


def _on_exit(event: asyncio.Event) -> Any:
    def on_event(ev: Any) -> None:
        if ev.kind == "exited":
            event.set()

    return on_event


class StartsAndLines:
    """Per rank, in the order the caller saw them: "started" for the worker's
    start event, then ``(stream, line)`` for each line a sink got."""

    def __init__(self) -> None:
        self.seen: dict[int, list[Any]] = collections.defaultdict(list)

    def on_event(self, ev: Any) -> None:
        if ev.kind == "started":
            self.seen[ev.local_rank].append("started")

    def on_line(self, line: OutputLine) -> None:
        self.seen[line.rank].append((line.stream, line.line))


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
@pytest.mark.parametrize("kind", KINDS)
async def test_a_workers_started_event_comes_before_its_first_line(
    tmp_path: Path, ow: ModuleType, kind: str, start_method: str
) -> None:
    """Workers that print at once: each one's "started" event reaches the
    caller before any sink sees its output (the CLI names the log dir then)."""
    n = 20  # more than one batch of binaries
    log = StartsAndLines()
    entry, args = workload(kind, ow, "echo", {r: (r,) for r in range(n)})
    _, result = await run_group(
        entry,
        args,
        logs(tmp_path, tee=Std.ALL),
        sinks=[log.on_line],
        on_event=log.on_event,
        start_method=start_method,
    )
    assert not result.is_failed()
    for rank in range(n):
        mine = log.seen[rank]
        assert mine[0] == "started", (rank, mine)
        assert sorted(mine[1:]) == [("stderr", f"err-{rank}"), ("stdout", f"out-{rank}")], mine


@pytest.mark.parametrize("kind", KINDS)
async def test_starts_cancelled_at_random_moments_show_no_line_before_its_start(
    tmp_path: Path, ow: ModuleType, kind: str
) -> None:
    """Starts of 40 workers that print at once, cancelled at random moments: a sink
    never gets a line of a worker whose "started" event the caller has not had,
    and the workers that did start are all stopped with the cancelled start."""
    rng = random.Random(f"{SEED}-{kind}")
    for i in range(12):
        log = StartsAndLines()
        pids: list[int] = []

        def on_event(ev: Any, log: StartsAndLines = log, pids: list[int] = pids) -> None:
            log.on_event(ev)
            if ev.kind == "started":
                pids.append(ev.pid)

        entry, args = workload(kind, ow, "echo", {r: (r,) for r in range(40)})
        start = asyncio.ensure_future(
            aioproc.start_processes(
                "w",
                entry,
                args,
                {r: {} for r in range(40)},
                logs(tmp_path / str(i), tee=Std.ALL),
                sinks=[log.on_line],
                on_event=on_event,
            )
        )
        await asyncio.sleep(rng.uniform(0, 0.05))
        start.cancel()
        try:
            pc = await start
        except asyncio.CancelledError:
            pass
        else:  # it had finished starting: stopped as a cancelled start would be
            await pc.close()
        for rank, seen in log.seen.items():
            assert seen[0] == "started", (SEED, i, rank, seen)
        for pid in pids:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)


@pytest.mark.parametrize("kind", KINDS)
async def test_a_worker_that_floods_before_its_start_is_announced_loses_nothing(
    tmp_path: Path, ow: ModuleType, kind: str
) -> None:
    """Each worker writes 40 pipe buffers at once: the reader holds the first read
    until the start is announced, the worker blocks on the full pipe meanwhile,
    and then every line reaches the sink and the log file, in order, after the
    worker's "started" event."""
    n, count = 3, 100_000  # 2 MB per worker
    log = StartsAndLines()
    entry, args = workload(kind, ow, "lines", {r: (count,) for r in range(n)})
    pc, result = await run_group(
        entry,
        args,
        logs(tmp_path, tee=Std.OUT),
        sinks=[log.on_line],
        on_event=log.on_event,
        start_method="forkserver",
    )
    assert not result.is_failed()
    want = [("stdout", line) for line in ow.numbered(count).decode().splitlines()]
    for rank in range(n):
        assert log.seen[rank][0] == "started", log.seen[rank][:3]
        assert log.seen[rank][1:] == want, rank
        assert read_bytes(pc.stdouts[rank]) == ow.numbered(count)


async def test_output_pipes_are_closed_once_while_other_threads_open_files(
    tmp_path: Path, ow: ModuleType
) -> None:
    """Groups of tee'd workers run while a thread of the caller's opens and closes
    pipes without pause: closing a worker's pipe never closes that thread's files
    (a second close of a number the kernel has handed out again), every group
    starts, and every line arrives."""
    lost: list[OSError] = []
    stop = threading.Event()

    def churn() -> None:
        while not stop.is_set():
            r, w = os.pipe()
            for fd in (w, r):
                try:
                    os.close(fd)
                except OSError as e:
                    lost.append(e)

    thread = threading.Thread(target=churn, name="test-churn")
    thread.start()
    try:
        for i in range(8):
            log = StartsAndLines()
            entry, args = workload("binary", ow, "echo", {r: (r,) for r in range(40)})
            _, result = await run_group(
                entry, args, logs(tmp_path / str(i), tee=Std.ALL), sinks=[log.on_line]
            )
            assert not result.is_failed(), result.failures
            for rank in range(40):
                assert sorted(log.seen[rank]) == [
                    ("stderr", f"err-{rank}"),
                    ("stdout", f"out-{rank}"),
                ]
    finally:
        stop.set()
        thread.join()
    assert lost == []


@pytest.mark.parametrize("kind", KINDS)
async def test_grandchild_output_after_worker_exit_reaches_sinks(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], ow: ModuleType, kind: str
) -> None:
    """A descendant in the worker's group writes after the worker exited, before close()."""
    spec = logs(tmp_path, tee=Std.OUT)
    go_path = str(tmp_path / "go")
    async with Fifo(tmp_path / "done") as done:
        with release_fifo(go_path) as go:
            entry, args = workload(kind, ow, "late_grandchild", {0: (go_path, done.path, 0)})
            exited = asyncio.Event()
            pc = await aioproc.start_processes(
                "w", entry, args, {0: {}}, spec, on_event=_on_exit(exited)
            )
            try:
                await asyncio.wait_for(exited.wait(), GROUP_LIMIT)  # the worker is gone
                go(1)
                assert await done.lines(1, GROUP_LIMIT) == ["d"]
                # wait() closes the group (as torch's): the late line is in by then
                result = await asyncio.wait_for(pc.wait(), GROUP_LIMIT)
                assert result is not None and not result.is_failed()
            finally:
                await pc.close()
    assert read_bytes(pc.stdouts[0]) == b"early\nlate\n"
    assert text_lines(capfd.readouterr().out) == ["[w0]:early", "[w0]:late"]


@pytest.mark.parametrize("kind", KINDS)
async def test_close_waits_for_detached_descendant_eof(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], ow: ModuleType, kind: str
) -> None:
    """A descendant in its own session still holds stdout: close() reads up to its EOF."""
    spec = logs(tmp_path, tee=Std.OUT)
    go_path = str(tmp_path / "go")
    async with Fifo(tmp_path / "done") as done:
        with release_fifo(go_path) as go:
            entry, args = workload(kind, ow, "late_grandchild", {0: (go_path, done.path, 1)})
            exited = asyncio.Event()
            pc = await aioproc.start_processes(
                "w", entry, args, {0: {}}, spec, on_event=_on_exit(exited)
            )
            try:
                await asyncio.wait_for(exited.wait(), GROUP_LIMIT)  # the worker is gone
                closing = asyncio.create_task(pc.close())
                go(1)  # the descendant writes while close() is under way
                await asyncio.wait_for(closing, GROUP_LIMIT)
            finally:
                await pc.close()
            assert await done.lines(1, GROUP_LIMIT) == ["d"]
    assert read_bytes(pc.stdouts[0]) == b"early\nlate\n"
    assert text_lines(capfd.readouterr().out) == ["[w0]:early", "[w0]:late"]


async def test_lines_of_concurrent_ranks_never_split_or_mixed(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], ow: ModuleType
) -> None:
    """4 ranks write lines of 0-300 bytes in 1000-byte writes that cut lines anywhere."""
    n = 3000
    entry, args = workload("binary", ow, "chunked", {r: (r, n, 1000) for r in range(4)})
    pc, result = await run_group(entry, args, logs(tmp_path, tee=Std.OUT))
    assert not result.is_failed()
    lines = text_lines(capfd.readouterr().out)
    assert len(lines) == 4 * n
    for r in range(4):
        data = ow.rank_lines(r, n)
        assert read_bytes(pc.stdouts[r]) == data
        assert of_prefix(lines, f"[w{r}]:") == data.decode().splitlines()


async def test_ten_megabyte_line(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], ow: ModuleType
) -> None:
    size = 10 * 1024 * 1024
    entry, args = workload("binary", ow, "big_line", {0: (size,)})
    pc, result = await run_group(entry, args, logs(tmp_path, tee=Std.OUT))
    assert not result.is_failed()
    data = read_bytes(pc.stdouts[0])
    assert len(data) == size + 1 and data.endswith(b"\n")
    lines = text_lines(capfd.readouterr().out)
    piece = _output.MAX_LINE
    assert lines == [f"[w0]:{data[i : i + piece].decode()}" for i in range(0, size, piece)]


@pytest.mark.parametrize("kind", KINDS)
async def test_invalid_utf8_never_crashes(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], ow: ModuleType, kind: str
) -> None:
    out = b"ok \xff\xfe bad\n" + "euro € ok\n".encode() + b"\x00nul\nend \xe2\x82"
    err = b"\xc3\n\xc3\xa9\n"
    entry, args = workload(kind, ow, "hexbytes", {0: (out.hex(), err.hex())})
    pc, result = await run_group(entry, args, logs(tmp_path, tee=Std.ALL))
    assert not result.is_failed()
    assert read_bytes(pc.stdouts[0]) == out
    assert read_bytes(pc.stderrs[0]) == err
    captured = capfd.readouterr()
    assert text_lines(captured.out) == [
        "[w0]:ok \ufffd\ufffd bad",
        "[w0]:euro € ok",
        "[w0]:\x00nul",
        "[w0]:end \ufffd",
    ]
    assert text_lines(captured.err) == ["[w0]:\ufffd", "[w0]:é"]
