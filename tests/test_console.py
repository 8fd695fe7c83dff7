"""The console writer (``aioproc._output.console``): a console that never blocks.

Tee'd lines reach the parent's stdout/stderr through ``console_write``: a
``ConsoleWriter`` (a private non-blocking fd) for a console that can block
(pipe, socket, terminal), ``safe_write`` for one that cannot (a file, a
stream without an fd); ``release_consoles`` closes the fds idle consoles
keep.  What a user must be able to rely on:

* a console nobody reads never freezes the supervisor (timers, exit
  detection, signals) and never changes the host's own stdout;
* a slow console still gets every line, and a console that keeps up is
  opened once and released when idle, leaving no fd of ours on it;
* the host's own ``print()`` output keeps its place before teed lines;
* characters the console cannot encode are escaped, never losing lines.

Tests that need the supervisor's own stdout to be a stuck pipe run a small
supervisor in a subprocess (``children/out_pressure.py``) on the test's kind
of event loop.  ``ConsoleSink``'s progress bars are drawn through the console
too: rarely and finally once where the console is not a terminal, on status
lines (``Screen``) where it is, replayed through a minimal terminal emulator
(a small supervisor on a pseudo-terminal).  Other sinks under fault are
test_sinks_faults.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from helpers import CHILDREN_DIR, loop_name, release_fifo
from output_helpers import (
    DROPPED,
    FLOOD,
    GROUP_LIMIT,
    LIMIT,
    flood,
    flood_lines,
    logs,
    read_bytes,
    run_group,
    run_pressure,
    spec,
    text_lines,
    workload,
)
from output_helpers import ow as ow  # the out_workers fixture
from terminal import Terminal, run_on_pty

import aioproc
from aioproc import ConsoleSink, Sink, Std

TQDM_SUPERVISOR = os.path.join(CHILDREN_DIR, "out_tqdm_supervisor.py")

# ------------------------------------------------- a console that never blocks


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


class _Upper(io.TextIOWrapper):
    """A text stream whose own write() changes what it writes."""

    def write(self, s: str) -> int:
        return super().write(s.upper())


async def test_plain_ascii_lines_reach_every_kind_of_console_as_written(tmp_path: Path) -> None:
    """ASCII lines go out as bytes where that writes the same text; every other
    console gets them through its own encoding and its own write().

    Consoles: a file (after the host's buffered print), a file and a pipe
    whose encoding is not ASCII-compatible (UTF-16), a stream that upper-cases
    in write(), and one without a binary buffer (``io.StringIO``).
    """
    file_out = open(tmp_path / "file.txt", "w", encoding="utf-8")  # noqa: SIM115 - closed below
    wide_file = open(tmp_path / "wide.txt", "w", encoding="utf-16-le")  # noqa: SIM115
    upper = _Upper(open(tmp_path / "upper.txt", "wb"), encoding="utf-8")  # noqa: SIM115
    memory = io.StringIO()
    r, w = os.pipe()
    wide_pipe = open(w, "w", encoding="utf-16-le")  # noqa: SIM115 - closed below
    reader = open(r, "rb")  # noqa: SIM115 - closed below
    streams = [file_out, wide_file, upper, wide_pipe]
    try:
        read_task = asyncio.create_task(asyncio.to_thread(reader.read))
        print("host before", file=file_out)  # waits in the wrapper's buffer
        entry, args = flood(5000)
        consoles = [ConsoleSink(stream=s) for s in (*streams, memory)]
        async with aioproc.start_processes(
            "w", entry, args, {0: {}}, spec(tmp_path), sinks=consoles
        ) as pc:
            result = await asyncio.wait_for(pc.wait(), LIMIT)
        print("host after", file=file_out)
        for stream in streams:
            stream.close()
        piped = await asyncio.wait_for(read_task, LIMIT)
    finally:
        for stream in streams:
            if not stream.closed:
                stream.close()
        reader.close()
    assert result is not None and not result.is_failed()
    teed = [f"[w0]:{line}" for line in flood_lines(5000)]
    assert (tmp_path / "file.txt").read_text().splitlines() == ["host before", *teed, "host after"]
    assert (tmp_path / "wide.txt").read_text("utf-16-le").splitlines() == teed
    assert piped.decode("utf-16-le").splitlines() == teed
    assert (tmp_path / "upper.txt").read_text().splitlines() == [t.upper() for t in teed]
    assert memory.getvalue().splitlines() == teed


# ------------------------------------------------------ unencodable text


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


# ---------------------------------------------------------- progress bars


async def test_progress_on_non_tty_printed_rarely_final_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], ow: ModuleType
) -> None:
    entry, args = workload("binary", ow, "progress", {0: (50,)})
    pc, result = await run_group(entry, args, logs(tmp_path, tee=Std.ERR))
    assert not result.is_failed()
    lines = text_lines(capsys.readouterr().err)
    assert lines.count("[w0]:step 49") == 1
    assert lines[-1] == "[w0]:step 49"
    assert len(lines) <= 5  # at most one update per second, plus the final state
    assert all(re.fullmatch(r"\[w0\]:step \d+", line) for line in lines)
    assert read_bytes(pc.stderrs[0]) == "".join(f"\rstep {i}" for i in range(50)).encode() + b"\n"


class Probe(Sink):
    """Sets ``event`` once a line or bar state equal to ``text`` passes by.

    Sinks are called in order, so when it fires the sinks listed before it
    have handled that line or state too.
    """

    def __init__(self, text: str) -> None:
        self.text = text
        self.event = asyncio.Event()

    def lines(self, rank: int, stream: str, prefix: str, lines: list[str]) -> None:
        if self.text in lines:
            self.event.set()

    def status(self, rank: int, stream: str, prefix: str, text: str | None) -> None:
        if text == self.text:
            self.event.set()


async def test_progress_final_state_not_repeated_when_lines_follow(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], ow: ModuleType
) -> None:
    """The last update is shown as a status; its newline then arrives with another line."""
    probe = Probe("step 9")
    with release_fifo(str(tmp_path / "go")) as go:
        entry, args = workload("binary", ow, "progress", {0: (10, "done\n", str(tmp_path / "go"))})
        spec = logs(tmp_path, tee=Std.ERR)
        async with aioproc.start_processes(
            "w", entry, args, {0: {}}, spec, sinks=[ConsoleSink(status_interval=0), probe]
        ) as pc:
            await asyncio.wait_for(probe.event.wait(), GROUP_LIMIT)
            go(1)
            await asyncio.wait_for(pc.wait(), GROUP_LIMIT)
    lines = text_lines(capsys.readouterr().err)
    assert lines[-2:] == ["[w0]:step 9", "[w0]:done"]
    assert lines.count("[w0]:step 9") == 1


async def test_console_sink_writes_to_sys_stdout_of_the_moment(
    tmp_path: Path, ow: ModuleType
) -> None:
    """sys.stdout is looked up per write: swapping it mid-run moves later lines."""
    probe = Probe("first")
    before, after = io.StringIO(), io.StringIO()
    with release_fifo(str(tmp_path / "go")) as go:
        entry, args = workload("binary", ow, "two_lines", {0: (str(tmp_path / "go"),)})
        spec = logs(tmp_path, tee=Std.OUT)
        async with contextlib.AsyncExitStack() as stack:
            with contextlib.redirect_stdout(before):
                pc = await stack.enter_async_context(
                    aioproc.start_processes(
                        "w", entry, args, {0: {}}, spec, sinks=[ConsoleSink(), probe]
                    )
                )
                await asyncio.wait_for(probe.event.wait(), GROUP_LIMIT)
            with contextlib.redirect_stdout(after):
                go(1)
                await asyncio.wait_for(pc.wait(), GROUP_LIMIT)
    assert before.getvalue() == "[w0]:first\n"
    assert after.getvalue() == "[w0]:second\n"


class FakeTerminal(io.StringIO):
    """A text stream that says it is a terminal and reports what is written."""

    def __init__(self) -> None:
        super().__init__()
        self.written = ""
        self.changed: asyncio.Event | None = None

    def isatty(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self.written += text
        if self.changed is not None:
            self.changed.set()
        return super().write(text)


def test_console_bars_drawn_after_an_earlier_loop_ended() -> None:
    term = FakeTerminal()

    async def first_run() -> None:
        sink = ConsoleSink(stream=term, redraw_interval=60)
        sink.status(0, "stderr", "[a0]:", "halfway")  # redraw due in 60 s: never runs
        await sink.aclose()

    async def second_run() -> None:
        term.changed = asyncio.Event()
        sink = ConsoleSink(stream=term, redraw_interval=0)
        sink.status(0, "stderr", "[b0]:", "drawn?")
        try:
            while "[b0]:drawn?" not in term.written:
                term.changed.clear()
                await asyncio.wait_for(term.changed.wait(), 0.5)
        finally:
            await sink.aclose()

    asyncio.run(first_run())
    asyncio.run(second_run())


def check_tty_screen(screen: list[str]) -> None:
    prefixes = [f"[bar{r}]:" for r in range(4)]
    for line in screen:
        assert sum(line.count(p) for p in prefixes) <= 1, f"fragment: {line!r}"
        assert any(line.startswith(p) for p in prefixes), f"stray text: {line!r}"
    bars = [line for line in screen if "%|" in line]
    assert sorted(line[: len(prefixes[0])] for line in bars) == prefixes, bars
    for line in bars:
        assert "100%|" in line and "100/100" in line, f"left-over bar state: {line!r}"


def test_parent_progress_bar_is_never_garbled_by_worker_lines(tmp_path: Path) -> None:
    """The parent draws its own tqdm bar; worker lines go through tqdm.write."""
    pytest.importorskip("tqdm", reason="tqdm is not installed: the terminal test needs it")
    code, raw = run_on_pty([sys.executable, TQDM_SUPERVISOR, str(tmp_path / "logs"), "parentbar"])
    assert code == 0, raw.decode(errors="replace")[-2000:]
    term = Terminal()
    term.feed(raw.decode("utf-8", "replace"))
    screen = [line for line in term.screen() if line.strip()]
    # every worker line arrived whole, once, with its prefix
    said = [line for line in screen if "reached" in line]
    want = [f"[bar{r}]:rank {r} reached {k}" for r in range(4) for k in (25, 50, 75, 100)]
    assert sorted(said) == sorted(want)
    # each worker bar shows up once, in its final state
    finals = [line for line in screen if line.startswith("[bar") and "100/100" in line]
    assert len(finals) == 4
    # the parent's own bar is the last line, complete, and appears exactly once
    parent = [line for line in screen if "parent" in line]
    assert len(parent) == 1, screen
    assert screen[-1] == parent[0]
    assert "100%" in parent[0] and "4/4" in parent[0]
    # no line mixes a worker line into the parent's bar or two worker prefixes
    for line in screen:
        assert line.count("[bar") <= 1, line
        if "parent" in line:
            assert "[bar" not in line, line


@pytest.mark.parametrize(
    "mode",
    [
        "bars",
        "mixed",
    ],
)
def test_tqdm_bars_on_a_terminal(tmp_path: Path, mode: str) -> None:
    """4 workers draw tqdm bars through a supervisor whose console is a pty."""
    pytest.importorskip("tqdm", reason="tqdm is not installed: the terminal test needs it")
    code, raw = run_on_pty([sys.executable, TQDM_SUPERVISOR, str(tmp_path / "logs"), mode])
    assert code == 0, raw.decode(errors="replace")[-2000:]
    term = Terminal()
    term.feed(raw.decode("utf-8", "replace"))
    screen = term.screen()
    check_tty_screen(screen)
    if mode == "mixed":
        said = [line for line in screen if "reached" in line]
        want = [f"[bar{r}]:rank {r} reached {k}" for r in range(4) for k in (25, 50, 75, 100)]
        assert sorted(said) == sorted(want)
    else:
        assert len(screen) == 4
