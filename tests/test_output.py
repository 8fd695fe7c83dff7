"""The output engine: redirects, tee, prefixes, line framing, sinks, progress bars.

Workers are real processes, binary (``python -S out_workers.py <fn> ...``)
or function workers (the same functions, imported by name from
``tests/children/out_workers.py``); they write with ``os.write`` so nothing
waits in a Python buffer.  The console is observed with pytest's ``capfd``:
it swaps fds 1 and 2 (what inherited, untouched worker streams write to)
and also ``sys.stdout``/``sys.stderr`` (what ``ConsoleSink`` writes to, as it
looks them up at write time), so one capture shows both.  Where only the
sink's writes matter, ``capsys`` is enough.

Workers that must be stopped mid-run announce on a FIFO after writing
(``proc_utils.Fifo``) or wait for the test's go-ahead on one
(``helpers.release_fifo``); nothing here synchronises on a sleep.  The
terminal test runs a small supervisor on a pseudo-terminal and replays what
it drew through a minimal terminal emulator.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import io
import itertools
import logging
import os
import random
import re
import signal
import sys
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType
from typing import Any
from unittest import mock

import pytest
from helpers import CHILDREN_DIR, import_child, release_fifo
from hypothesis import example, given, settings
from hypothesis import strategies as st
from proc_utils import Fifo
from terminal import Terminal, run_on_pty

import aioproc
from aioproc import (
    CallbackSink,
    ConsoleSink,
    DefaultLogsSpecs,
    FileSink,
    OutputLine,
    OutputStream,
    PContext,
    RunProcsResult,
    SignalException,
    Sink,
    Std,
    translate_signals,
)
from aioproc._output import tee as _output
from aioproc._output.tee import LineSplitter

WORKERS = os.path.join(CHILDREN_DIR, "out_workers.py")
TQDM_SUPERVISOR = os.path.join(CHILDREN_DIR, "out_tqdm_supervisor.py")
LIMIT = 20  # seconds: bound on any single wait in these tests
SEED = int(os.environ.get("AIOPROC_FAULT_SEED", random.randrange(1 << 30)))
STDS = (Std.NONE, Std.OUT, Std.ERR, Std.ALL)
KINDS = ("binary", "function")


# ------------------------------------------------------------------ helpers


@pytest.fixture
def ow(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """``out_workers``, importable by name here and (via sys.path) in function workers."""
    return import_child(monkeypatch, "out_workers")


def workload(
    kind: str, ow: ModuleType, fn: str, args: dict[int, tuple[Any, ...]]
) -> tuple[Callable[..., Any] | str, dict[int, tuple[Any, ...]]]:
    """(entrypoint, args) running ``out_workers.<fn>(*args[rank])`` as ``kind`` workers."""
    if kind == "binary":
        return sys.executable, {r: ("-S", WORKERS, fn, *map(str, a)) for r, a in args.items()}
    return getattr(ow, fn), args


def logs(tmp_path: Path, **kw: Any) -> DefaultLogsSpecs:
    return DefaultLogsSpecs(log_dir=tmp_path / "logs", **kw)


async def run_group(
    entry: Callable[..., Any] | str,
    args: dict[int, tuple[Any, ...]],
    spec: DefaultLogsSpecs,
    *,
    name: str = "w",
    envs: dict[int, dict[str, str]] | None = None,
    **kw: Any,
) -> tuple[PContext, RunProcsResult]:
    """Run a group to completion (``async with``: closed on the way out)."""
    envs = envs if envs is not None else {r: {} for r in args}
    async with aioproc.start_processes(name, entry, args, envs, spec, **kw) as pc:
        result = await asyncio.wait_for(pc.wait(), LIMIT)
    assert result is not None
    return pc, result


def read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def text_lines(text: str) -> list[str]:
    """Lines of captured console text; the text must end with a newline (or be empty)."""
    if not text:
        return []
    assert text.endswith("\n"), f"console text ends mid-line: {text[-80:]!r}"
    return text[:-1].split("\n")


def of_prefix(lines: Iterable[str], prefix: str) -> list[str]:
    """The lines that start with ``prefix``, with it removed, in order."""
    return [line[len(prefix) :] for line in lines if line.startswith(prefix)]


def attempt_dir(pc: PContext) -> str:
    path = next(p for p in [*pc.stdouts.values(), *pc.stderrs.values()] if p)
    return os.path.dirname(os.path.dirname(path))


# ------------------------------------------------- 1. redirects and tee


def expected_outcome(
    name: str, rank: int, red: Std, tee: Std
) -> tuple[dict[str, str | None], dict[str, list[str]]]:
    """torchelastic's rules for a worker writing ``out-<rank>``/``err-<rank>``.

    Returns the content of each log file (``None``: no file) and the console
    lines of each stream: prefixed when tee'd, nothing when only redirected,
    the raw line when untouched (inherited).
    """
    files: dict[str, str | None] = {}
    console: dict[str, list[str]] = {"out": [], "err": []}
    for std, key in ((Std.OUT, "out"), (Std.ERR, "err")):
        text = f"{key}-{rank}"
        files[key] = f"{text}\n" if (red | tee) & std else None
        if tee & std:
            console[key].append(f"[{name}{rank}]:{text}")
        elif not red & std:
            console[key].append(text)
    return files, console


def check_outcome(
    pc: PContext,
    log_root: Path,
    combos: dict[int, tuple[Std, Std]],
    captured: Any,
) -> None:
    want_out: list[str] = []
    want_err: list[str] = []
    for rank, (red, tee) in combos.items():
        files, console = expected_outcome(pc.name, rank, red, tee)
        want_out += console["out"]
        want_err += console["err"]
        for key, paths in (("out", pc.stdouts), ("err", pc.stderrs)):
            content = files[key]
            path = paths[rank]
            if content is None:
                assert path == "", (rank, key, red, tee)
                continue
            assert path.startswith(str(log_root)), path
            assert path.endswith(os.path.join("attempt_0", str(rank), f"std{key}.log"))
            assert read_bytes(path).decode() == content, (rank, key, red, tee)
    # lines of different ranks come in any order; each line is whole
    assert sorted(text_lines(captured.out)) == sorted(want_out)
    assert sorted(text_lines(captured.err)) == sorted(want_err)


@pytest.mark.parametrize("tee", STDS, ids=lambda s: f"tee={s.name}")
@pytest.mark.parametrize("red", STDS, ids=lambda s: f"red={s.name}")
async def test_redirect_tee_matrix_binary(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], ow: ModuleType, red: Std, tee: Std
) -> None:
    entry, args = workload("binary", ow, "echo", {0: (0,), 1: (1,)})
    pc, result = await run_group(entry, args, logs(tmp_path, redirects=red, tee=tee))
    assert not result.is_failed()
    assert result.stdouts == pc.stdouts and result.stderrs == pc.stderrs
    check_outcome(pc, tmp_path / "logs", {0: (red, tee), 1: (red, tee)}, capfd.readouterr())


@pytest.mark.parametrize("kind", KINDS)
async def test_redirect_tee_every_combination_per_rank(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], ow: ModuleType, kind: str
) -> None:
    """16 ranks in one group, each with its own (redirects, tee) pair."""
    combos = {r: (STDS[r // 4], STDS[r % 4]) for r in range(16)}
    spec = logs(
        tmp_path,
        redirects={r: red for r, (red, _) in combos.items()},
        tee={r: tee for r, (_, tee) in combos.items()},
    )
    entry, args = workload(kind, ow, "echo", {r: (r,) for r in combos})
    pc, result = await run_group(entry, args, spec)
    assert not result.is_failed()
    check_outcome(pc, tmp_path / "logs", combos, capfd.readouterr())


@pytest.mark.parametrize("kind", KINDS)
async def test_redirect_err_tee_out_mixed(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], ow: ModuleType, kind: str
) -> None:
    """Mixed per rank: ``redirects={0: ERR, 1: NONE}, tee={0: OUT, 1: ERR}``."""
    spec = logs(tmp_path, redirects={0: Std.ERR, 1: Std.NONE}, tee={0: Std.OUT, 1: Std.ERR})
    entry, args = workload(kind, ow, "echo", {0: (0,), 1: (1,)})
    pc, _ = await run_group(entry, args, spec)
    captured = capfd.readouterr()
    assert read_bytes(pc.stdouts[0]) == b"out-0\n"
    assert read_bytes(pc.stderrs[0]) == b"err-0\n"
    assert pc.stdouts[1] == ""
    assert read_bytes(pc.stderrs[1]) == b"err-1\n"
    assert sorted(text_lines(captured.out)) == ["[w0]:out-0", "out-1"]
    assert text_lines(captured.err) == ["[w1]:err-1"]


# ------------------------------------------------------ 2. line framing


def model_lines(data: bytes, max_line: int) -> list[str]:
    """What the sinks must get for ``data`` by the framing rules, chunking ignored.

    Lines end at ``\\n``; a line shows only its last non-empty ``\\r``
    segment; a final line without newline counts at EOF; a line longer than
    ``max_line`` bytes comes in pieces of at most ``max_line`` bytes, each cut
    at the last character boundary it can (never inside a UTF-8 character);
    each line (piece) is decoded on its own with replacement characters.
    """
    *complete, tail = data.split(b"\n")
    out: list[str] = []
    for raw in [*complete, tail] if tail else complete:
        shown = [seg for seg in raw.split(b"\r") if seg]
        final = shown[-1] if shown else b""
        while len(final) > max_line:
            cut = next(
                (c for c in range(max_line, max_line - 4, -1) if final[c] & 0xC0 != 0x80),
                max_line,  # no boundary within a character's length: not UTF-8 anyway
            )
            out.append(final[:cut].decode("utf-8", "replace"))
            final = final[cut:]
        out.append(final.decode("utf-8", "replace"))
    return out


def split_feed(data: bytes, cuts: list[int]) -> tuple[list[str], list[str]]:
    """Feed ``data`` cut at ``cuts``; return the lines and the statuses reported."""
    splitter = LineSplitter()
    lines: list[str] = []
    statuses: list[str] = []
    for a, b in itertools.pairwise([0, *sorted(cuts), len(data)]):
        got, status = splitter.feed(data[a:b])
        lines += got
        if status is not None:
            statuses.append(status)
    return lines + splitter.flush(), statuses


# tokens that make framing interesting: line ends, bar updates, 2- and 3-byte
# characters (which chunking may cut), invalid and truncated UTF-8
TOKENS = st.sampled_from(
    [b"a", b"bc", b"\n", b"\r", b"\r\n", "é".encode(), "€".encode(), b"\xe2\x82", b"\xff", b" "]
)


@st.composite
def chunked_streams(draw: st.DrawFn, cr: bool = True) -> tuple[bytes, list[int]]:
    """A byte stream of tokens and arbitrary bytes, and where to cut it into chunks."""
    data = b"".join(draw(st.lists(st.one_of(TOKENS, st.binary(max_size=6)), max_size=60)))
    if not cr:
        data = data.replace(b"\r", b"")
    cuts = draw(st.lists(st.integers(0, len(data)), max_size=12))
    return data, cuts


@st.composite
def chunked_text(draw: st.DrawFn) -> tuple[bytes, list[int]]:
    """Valid UTF-8 lines (characters of 1-3 bytes) without ``\\r``, and chunk cuts."""
    chars = st.characters(max_codepoint=0xFFFF, exclude_categories=["Cs"], exclude_characters="\r")
    data = draw(st.text(chars, max_size=40)).encode()
    cuts = draw(st.lists(st.integers(0, len(data)), max_size=12))
    return data, cuts


# Small MAX_LINE values make long lines cheap; below 4 the splitter's
# character-boundary search may return a zero-length cut (and loop).
SMALL_MAX_LINE = st.sampled_from([4, 5, 8])


@settings(max_examples=400, deadline=None, database=None)
@given(chunked_streams())
@example((b"ab\xe2\x82\xac\r\xe2\x82\xacz\ntail\xff", [3, 4, 7]))
@example((b"\r\r\n\r", [1, 2]))
def test_splitter_chunking_never_matters(stream: tuple[bytes, list[int]]) -> None:
    """Short lines, any bytes: chunk boundaries (even inside a character) change nothing."""
    data, cuts = stream
    lines, statuses = split_feed(data, cuts)
    assert lines == model_lines(data, _output.MAX_LINE)
    for status in statuses:
        assert "\r" not in status and "\n" not in status


@pytest.mark.parametrize("texts", [False, True], ids=["lines", "texts"])
@settings(max_examples=400, deadline=None, database=None)
@given(chunked_streams(), SMALL_MAX_LINE)
@example((b"ab\xe2\x82\xac\nc\xe2\x82\xac\nd", [3, 4, 9]), 8)
@example((b"x" * 7 + b"\n" + b"y" * 9 + b"\nz\n", [12]), 8)
def test_splitter_ranges_of_a_reused_buffer_split_as_their_bytes(
    texts: bool, stream: tuple[bytes, list[int]], max_line: int
) -> None:
    """``feed_range`` over ranges of a buffer that holds other bytes around them
    (a read buffer reused by every read) gives what ``feed`` of those bytes gives.

    ``texts``: as the tee does for sinks that take text, a range goes out as
    one text where ``feed_text`` takes it, through ``feed_range`` where not.
    """
    data, cuts = stream
    splitter = LineSplitter()
    got: list[str] = []
    with mock.patch.object(_output, "MAX_LINE", max_line):
        for a, b in itertools.pairwise([0, *sorted(cuts), len(data)]):
            buf = bytearray(b"\n\xe2" * 3) + data[a:b] + bytearray(b"\x82\r\n")
            text = splitter.feed_text(buf, 6, 6 + b - a) if texts else None
            got += splitter.feed_range(buf, 6, 6 + b - a)[0] if text is None else text.split("\n")
        got += splitter.flush()
        assert got == split_feed(data, cuts)[0]


def test_splitter_gives_plain_lines_as_one_text_and_leaves_the_rest_to_feed_range() -> None:
    splitter = LineSplitter()
    assert splitter.feed_text(b"a\nb\nc", 0, 5) == "a\nb\nc"[:3]  # "c" is held
    assert splitter.feed_text(b"c\n\xffd\n", 0, 5) == "cc\n\ufffdd"
    assert splitter.feed_text(b"no newline", 0, 10) is None  # nothing completed
    assert splitter.feed_text(b"bar\r50%\n", 0, 8) is None  # a progress line: the rules apply
    assert splitter.feed_range(b"no newline\n", 0, 11)[0] == ["no newline"]


class _TextBlocks(Sink):
    """Takes text: records the blocks it got."""

    def __init__(self) -> None:
        self.blocks: list[str] = []

    def lines(self, rank: int, stream: str, prefix: str, lines: list[str]) -> None:
        self.blocks.append("\n".join(lines))

    def text(self, rank: int, stream: str, prefix: str, text: str) -> None:
        self.blocks.append(text)


class _LinesOfAConsole(ConsoleSink):
    """A console sink whose subclass overrides ``lines`` only (a filter, say)."""

    def __init__(self, stream: io.StringIO) -> None:
        super().__init__(stream=stream)
        self.calls = 0

    def lines(self, rank: int, stream: str, prefix: str, lines: list[str]) -> None:
        self.calls += 1
        super().lines(rank, stream, prefix, [line.upper() for line in lines])


def test_a_sink_gets_text_only_where_its_text_is_at_least_as_derived_as_its_lines() -> None:
    from aioproc._group.rank_launcher import _FilteredFileSink
    from aioproc._output.sink import takes_text

    class TextToo(_LinesOfAConsole):
        def text(self, rank: int, stream: str, prefix: str, text: str) -> None:
            pass

    got = {
        cls.__name__: takes_text(cls.__new__(cls))  # type: ignore[arg-type]
        for cls in (Sink, _PerRank, _TextBlocks, ConsoleSink, FileSink, _LinesOfAConsole, TextToo)
    }
    got["_FilteredFileSink"] = takes_text(_FilteredFileSink.__new__(_FilteredFileSink))

    class TextIsState(_TextBlocks):
        text = "what a sink keeps, named text"  # type: ignore[assignment]

    class TextIsAProperty(_PerRank):
        @property
        def text(self) -> str:  # type: ignore[override]
            return "joined"

    got["TextIsState"] = takes_text(TextIsState())
    got["TextIsAProperty"] = takes_text(TextIsAProperty())
    assert got == {
        "Sink": False,
        "_PerRank": False,
        "_TextBlocks": True,
        "ConsoleSink": True,
        "FileSink": True,
        "_LinesOfAConsole": False,  # its lines() would be skipped
        "TextToo": True,
        "_FilteredFileSink": False,
        "TextIsState": False,
        "TextIsAProperty": False,
    }


async def test_text_and_line_sinks_of_one_tee_each_get_every_line_in_order(
    tmp_path: Path,
) -> None:
    """Sinks that take text get blocks of whole lines, the others single lines
    (split once for all of them), a console subclass that overrides ``lines``
    still sees every line through it; all of them get every line, in order."""
    n = 20_000
    # ASCII first, then lines with a two-byte character: both ways out
    want = [f"{i:05d} " + ("y" * 58 if i < n // 2 else "é" * 29) for i in range(n)]
    code = (
        "import os\n"
        f"ascii = [f'{{i:05d}} ' + 'y' * 58 for i in range({n // 2})]\n"
        f"wide = [f'{{i:05d}} ' + '\\u00e9' * 29 for i in range({n // 2}, {n})]\n"
        "data = ''.join(line + '\\n' for line in ascii + wide).encode()\n"
        "view = memoryview(data)\n"
        "while view:\n"
        "    view = view[os.write(1, view):]\n"
    )
    blocks, per_rank, file_path = _TextBlocks(), _PerRank(), tmp_path / "lines.txt"
    console, filtered = io.StringIO(), io.StringIO()
    upper = _LinesOfAConsole(filtered)
    sinks: list[Sink] = [blocks, per_rank, FileSink(str(file_path)), ConsoleSink(console), upper]
    spec = DefaultLogsSpecs(log_dir=tmp_path / "logs", tee=Std.OUT)
    async with aioproc.start_processes(
        "w", sys.executable, {0: ("-c", code)}, {0: {}}, spec, sinks=sinks
    ) as pc:
        result = await asyncio.wait_for(pc.wait(), LIMIT)
    assert result is not None and not result.is_failed(), result
    assert "\n".join(blocks.blocks).split("\n") == want
    assert 1 < len(blocks.blocks) < n // 10  # blocks, not a call per line
    assert per_rank.got[0] == want
    prefix = "[w0]:"
    assert file_path.read_text("utf-8").splitlines() == [prefix + line for line in want]
    assert console.getvalue().splitlines() == [prefix + line for line in want]
    assert filtered.getvalue().splitlines() == [prefix + line.upper() for line in want]
    assert upper.calls == len(blocks.blocks)


async def test_a_pipe_cut_before_its_workers_exit_is_noticed_settles_its_output() -> None:
    """The exit is noticed after the pipe was cut (a stop that gave up on EOF, a
    cancelled start): waiting for the rest of the output ends at once with
    what was read, while the pipe still held unread bytes."""
    from aioproc._base.pipes import connect_read_pipe
    from aioproc._output.tee import TeeProtocol

    lines: list[str] = []
    first = asyncio.Event()

    def on_line(line: OutputLine) -> None:
        lines.append(line.line)
        first.set()

    tee = TeeProtocol(None, 0, "stdout", "", [CallbackSink(on_line)])
    r, w = os.pipe()
    try:
        os.write(w, b"read\n")
        pipe = open(r, "rb", buffering=0)  # noqa: SIM115 - the transport closes it
        transport = await connect_read_pipe(asyncio.get_running_loop(), tee, pipe)
        await asyncio.wait_for(first.wait(), LIMIT)
        os.write(w, b"never read\n")  # still in the pipe when it is cut
        transport.close()
        await asyncio.wait_for(tee.settled(), LIMIT)
        await asyncio.wait_for(tee.closed, LIMIT)
    finally:
        os.close(w)
    assert lines == ["read"]


async def test_buffered_reads_reuse_a_buffer_only_once_its_lines_are_out() -> None:
    """Through ``get_buffer``/``buffer_updated`` (uvloop's pipes) every line arrives
    in order, and a read buffer is lent again only after its last slice is out."""
    from aioproc._output.tee import FAIR_CHUNK, TeeProtocol

    sink = _PerRank()
    tee = TeeProtocol(None, 0, "stdout", "", [sink])
    log: list[tuple[int, str, int]] = []
    transport = _FakePipeTransport(log, 0, {"iteration": 0})
    tee.connection_made(transport)  # type: ignore[arg-type]
    want = [f"{i:06d}" + "z" * 57 for i in range(3000)]  # 64 bytes a line
    data = "".join(f"{line}\n" for line in want).encode()
    lent: list[object] = []  # held: an id is not reused by another buffer meanwhile
    sent = 0
    while sent < len(data):
        if not transport.reading:
            await asyncio.sleep(0)  # the slicer hands the waiting slices out
            continue
        view = tee.get_buffer(-1)
        chunk = data[sent : sent + min(len(view), 3 * FAIR_CHUNK - 100)]
        view[: len(chunk)] = chunk
        lent.append(view.obj)
        del view
        tee.buffer_updated(len(chunk))
        sent += len(chunk)
    tee.connection_lost(None)
    assert sink.got[0] == want
    assert len({id(buf) for buf in lent}) < len(lent)  # reused: not a new buffer per read


@settings(max_examples=300, deadline=None, database=None)
@given(chunked_text(), SMALL_MAX_LINE)
@example((("€" * 3 + "\n").encode() * 2, [1, 5]), 4)
@example((b"x" * 17 + b"\n" + b"y" * 16, [5, 9]), 8)
def test_splitter_long_lines_in_max_line_pieces(
    stream: tuple[bytes, list[int]], max_line: int
) -> None:
    """Lines longer than MAX_LINE (patched small) come in pieces cut between characters."""
    data, cuts = stream
    with mock.patch.object(_output, "MAX_LINE", max_line):
        lines, _ = split_feed(data, cuts)
    assert lines == model_lines(data, max_line)
    assert "\ufffd" not in "".join(lines)


@settings(max_examples=300, deadline=None, database=None)
@given(chunked_streams(cr=False), SMALL_MAX_LINE)
def test_splitter_long_lines_any_bytes_chunking_never_matters(
    stream: tuple[bytes, list[int]], max_line: int
) -> None:
    data, cuts = stream
    with mock.patch.object(_output, "MAX_LINE", max_line):
        assert split_feed(data, cuts)[0] == split_feed(data, [])[0]


def test_splitter_never_splits_a_four_byte_character() -> None:
    line = b"a" * (_output.MAX_LINE - 3) + "😀".encode() + b"\n"
    assert split_feed(line, [])[0] == ["a" * (_output.MAX_LINE - 3), "😀"]


@settings(max_examples=300, deadline=None, database=None)
@given(chunked_streams(), SMALL_MAX_LINE)
@example((b"y" * 8 + b"\rz\n", [9]), 8)
@example((b"x" * 10 + b"\ry\n", [10]), 8)
def test_splitter_long_progress_states_chunking_never_matters(
    stream: tuple[bytes, list[int]], max_line: int
) -> None:
    data, cuts = stream
    with mock.patch.object(_output, "MAX_LINE", max_line):
        assert split_feed(data, cuts)[0] == split_feed(data, [])[0]


def test_splitter_reports_bar_state_as_status() -> None:
    splitter = LineSplitter()
    assert splitter.feed(b"head\n\rstep 1") == (["head"], "step 1")
    assert splitter.feed(b"\rstep 2\r") == ([], "step 2")
    lines, status = splitter.feed(b"\r")
    assert lines == [] and status in (None, "step 2")  # no new state: either will do
    assert splitter.feed(b"\n") == (["step 2"], None)
    assert splitter.feed(b"plain") == ([], None)  # a partial line without \r is no bar
    assert splitter.flush() == ["plain"]
    assert splitter.flush() == []


# ---------------------------------------------- 3. nothing lost, ever


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
        await asyncio.wait_for(ready.reader.readexactly(1), LIMIT)
        if how == "failure":
            go(1)  # rank 1 exits 3: the supervisor stops rank 0
            result = await asyncio.wait_for(pc.wait(), LIMIT)
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
                await asyncio.wait_for(ready.reader.readexactly(1), LIMIT)
                started.set()
                await asyncio.Event().wait()

        task = asyncio.create_task(body())
        await asyncio.wait_for(started.wait(), LIMIT)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    else:
        assert how == "signal"
        with pytest.raises(SignalException) as info:
            async with translate_signals((signal.SIGHUP,)):
                async with start() as pc:
                    pcs.append(pc)
                    await asyncio.wait_for(ready.reader.readexactly(1), LIMIT)
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
                await asyncio.wait_for(exited.wait(), LIMIT)  # the worker is gone
                go(1)
                assert await done.lines(1, LIMIT) == ["d"]
                # wait() closes the group (as torch's): the late line is in by then
                result = await asyncio.wait_for(pc.wait(), LIMIT)
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
                await asyncio.wait_for(exited.wait(), LIMIT)  # the worker is gone
                closing = asyncio.create_task(pc.close())
                go(1)  # the descendant writes while close() is under way
                await asyncio.wait_for(closing, LIMIT)
            finally:
                await pc.close()
            assert await done.lines(1, LIMIT) == ["d"]
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


# ------------------------------------------------------------- 4. sinks


class Recorder(Sink):
    """A ``Sink`` subclass: records ``lines`` and ``status`` calls, and ``aclose``."""

    def __init__(self) -> None:
        self.records: list[OutputLine] = []
        self.statuses: list[tuple[int, str, str | None]] = []
        self.closed = 0

    def lines(self, rank: int, stream: str, prefix: str, lines: list[str]) -> None:
        self.records += [OutputLine(rank, stream, line, prefix) for line in lines]

    def status(self, rank: int, stream: str, prefix: str, text: str | None) -> None:
        self.statuses.append((rank, stream, text))

    async def aclose(self) -> None:
        self.closed += 1


SINK_OUT = {r: f"a{r}\nb{r}\n{'λ' * r}\nlast{r}" for r in range(3)}
SINK_ERR = {r: f"e{r}\n" for r in range(3)}


def sink_expected() -> list[OutputLine]:
    """Records for rank 0 (tee ALL) and rank 1 (tee OUT); rank 2 is only redirected."""
    recs = []
    for r, streams in ((0, ("stdout", "stderr")), (1, ("stdout",))):
        for stream in streams:
            text = SINK_OUT[r] if stream == "stdout" else SINK_ERR[r]
            recs += [OutputLine(r, stream, line, f"[w{r}]:") for line in text.split("\n") if line]
    # rank 0 writes an empty line ('λ' * 0): it is a line too
    recs.insert(2, OutputLine(0, "stdout", "", "[w0]:"))
    return recs


def check_records(got: list[OutputLine], want: list[OutputLine]) -> None:
    """Same multiset, and each (rank, stream) in order; ranks interleave freely."""
    assert sorted(got) == sorted(want)
    for key in {(w.rank, w.stream) for w in want}:
        assert [g for g in got if (g.rank, g.stream) == key] == [
            w for w in want if (w.rank, w.stream) == key
        ]


@pytest.mark.parametrize("kind", KINDS)
async def test_every_sink_kind_gets_exactly_the_teed_lines(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], ow: ModuleType, kind: str
) -> None:
    sync_got: list[OutputLine] = []
    cb_got: list[OutputLine] = []
    async_got: list[OutputLine] = []

    async def collect(rec: OutputLine) -> None:
        await asyncio.sleep(0)  # a real coroutine, awaited by the sink
        async_got.append(rec)

    stream = OutputStream()
    early = asyncio.create_task(_consume(stream))
    recorder = Recorder()
    file_sink_path = tmp_path / "sink.txt"
    str_sink_path = tmp_path / "by-path.txt"
    with open(tmp_path / "open.txt", "w", encoding="utf-8") as open_file:
        spec = logs(tmp_path, redirects={1: Std.ERR, 2: Std.ALL}, tee={0: Std.ALL, 1: Std.OUT})
        entry, args = workload(
            kind,
            ow,
            "hexbytes",
            {r: (SINK_OUT[r].encode().hex(), SINK_ERR[r].encode().hex()) for r in range(3)},
        )
        pc = await aioproc.start_processes(
            "w",
            entry,
            args,
            {r: {} for r in range(3)},
            spec,
            sinks=[
                FileSink(str(file_sink_path)),
                str(str_sink_path),
                open_file,
                sync_got.append,
                collect,
                CallbackSink(cb_got.append),
                stream,
                recorder,
            ],
        )
        try:
            result = await asyncio.wait_for(pc.wait(), LIMIT)
            assert result is not None and not result.is_failed()
            # wait() closed the finished group (as torch's does): the iterator ends
            assert recorder.closed == 1
        finally:
            await pc.close()
    want = sink_expected()
    check_records(recorder.records, want)
    assert recorder.closed == 1
    check_records(sync_got, want)
    check_records(cb_got, want)
    check_records(async_got, want)
    check_records(await asyncio.wait_for(early, LIMIT), want)
    rendered = [rec.render() for rec in want]
    for path in (file_sink_path, str_sink_path, tmp_path / "open.txt"):
        assert sorted(text_lines(path.read_text(encoding="utf-8"))) == sorted(rendered), path
    # custom sinks replace the console sink: nothing tee'd reaches the console
    captured = capfd.readouterr()
    assert captured.out == captured.err == ""
    assert read_bytes(pc.stderrs[2]) == SINK_ERR[2].encode()


async def _consume(stream: OutputStream) -> list[OutputLine]:
    return [rec async for rec in stream]


async def test_output_stream_iterated_after_close_ends(tmp_path: Path, ow: ModuleType) -> None:
    stream = OutputStream()
    first = asyncio.create_task(_consume(stream))
    entry, args = workload("binary", ow, "lines", {0: (2,)})
    await run_group(entry, args, logs(tmp_path, tee=Std.OUT), sinks=[stream])
    assert [rec.line for rec in await asyncio.wait_for(first, LIMIT)] == [
        "line-0..............",
        "line-1..............",
    ]
    # a closed stream has nothing more to give: a new iteration ends at once
    assert await asyncio.wait_for(_consume(stream), 0.5) == []


async def test_async_callable_object_sink(tmp_path: Path, ow: ModuleType) -> None:
    class Collector:
        def __init__(self) -> None:
            self.got: list[str] = []

        async def __call__(self, rec: OutputLine) -> None:
            self.got.append(rec.line)

    collector = Collector()
    entry, args = workload("binary", ow, "lines", {0: (2,)})
    await run_group(entry, args, logs(tmp_path, tee=Std.OUT), sinks=[collector])
    assert collector.got == ow.numbered(2).decode().splitlines()


# --------------------------------- 5. filters, prefixes, local_ranks_filter


async def test_duplicate_filters(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], ow: ModuleType
) -> None:
    """Rank 0 tee'd, rank 1 redirect-only, rank 2 untouched (inherited: not filterable)."""
    # ranks 0 and 1 end on a partial line (filtered at EOF); rank 2's raw output
    # shares the captured console, so it ends its last line
    out = {r: f"keep {r}\nneedle {r} one\nNEEDLE no\nhay needle {r}" for r in range(3)}
    out[2] += "\n"
    err = {r: f"oops {r}\nfine {r}\n" for r in range(3)}
    spec = logs(tmp_path, redirects={1: Std.ALL}, tee={0: Std.ALL})
    entry, args = workload(
        "binary",
        ow,
        "hexbytes",
        {r: (out[r].encode().hex(), err[r].encode().hex()) for r in range(3)},
    )
    pc, _ = await run_group(
        entry,
        args,
        spec,
        duplicate_stdout_filters=["needle", "absent"],
        duplicate_stderr_filters=["oops"],
    )
    attempt = attempt_dir(pc)
    # as torch's api_test reads them: the paths are on the context
    assert pc.filtered_stdout == str(Path(attempt, "filtered_stdout.log"))
    assert pc.filtered_stderr == str(Path(attempt, "filtered_stderr.log"))
    filtered_out = text_lines(Path(pc.filtered_stdout).read_text())
    filtered_err = text_lines(Path(pc.filtered_stderr).read_text())
    for r in (0, 1):
        assert of_prefix(filtered_out, f"[w{r}]:") == [f"needle {r} one", f"hay needle {r}"]
        assert of_prefix(filtered_err, f"[w{r}]:") == [f"oops {r}"]
        # the log files are untouched by filtering
        assert read_bytes(pc.stdouts[r]) == out[r].encode()
        assert read_bytes(pc.stderrs[r]) == err[r].encode()
    assert len(filtered_out) == 4 and len(filtered_err) == 2
    captured = capfd.readouterr()
    assert sorted(text_lines(captured.out)) == sorted(
        [f"[w0]:{line}" for line in out[0].split("\n")] + text_lines(out[2])
    )
    assert sorted(text_lines(captured.err)) == sorted(
        ["[w0]:oops 0", "[w0]:fine 0", "oops 2", "fine 2"]
    )


@pytest.mark.parametrize(
    ("prefixes", "want"),
    [
        (
            "<${role_name}|${rank}|${local_rank}|$$|${unknown}> ",
            ["<w|0|0|$|${unknown}> ", "<w|7|1|$|${unknown}> ", "<w|2|2|$|${unknown}> "],
        ),
        (
            {1: "[${role_name}-${rank}/${local_rank}]>", 2: "plain:"},
            ["[w0]:", "[w-7/1]>", "plain:"],
        ),
        ({}, ["[w0]:", "[w1]:", "[w2]:"]),
    ],
    ids=["template", "per-rank", "empty-dict"],
)
async def test_log_line_prefixes(
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
    ow: ModuleType,
    prefixes: Any,
    want: list[str],
) -> None:
    recorder = Recorder()
    entry, args = workload("binary", ow, "echo", {r: (r,) for r in range(3)})
    pc, _ = await run_group(
        entry,
        args,
        logs(tmp_path, tee=Std.ALL),
        envs={0: {}, 1: {"RANK": "7"}, 2: {}},
        log_line_prefixes=prefixes,
        sinks=[ConsoleSink(), recorder],
    )
    captured = capfd.readouterr()
    assert sorted(text_lines(captured.out)) == sorted(f"{want[r]}out-{r}" for r in range(3))
    assert sorted(text_lines(captured.err)) == sorted(f"{want[r]}err-{r}" for r in range(3))
    assert {(rec.rank, rec.prefix) for rec in recorder.records} == set(enumerate(want))
    for r in range(3):  # files never carry prefixes
        assert read_bytes(pc.stdouts[r]) == f"out-{r}\n".encode()


async def test_local_ranks_filter_hides_console_not_files(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], ow: ModuleType
) -> None:
    entry, args = workload("binary", ow, "echo", {r: (r,) for r in range(3)})
    pc, _ = await run_group(entry, args, logs(tmp_path, tee=Std.ALL, local_ranks_filter={1}))
    captured = capfd.readouterr()
    assert text_lines(captured.out) == ["[w1]:out-1"]
    assert text_lines(captured.err) == ["[w1]:err-1"]
    assert (pc.filtered_stdout, pc.filtered_stderr) == (None, None)  # no duplicate filters
    for r in range(3):
        assert read_bytes(pc.stdouts[r]) == f"out-{r}\n".encode()
        assert read_bytes(pc.stderrs[r]) == f"err-{r}\n".encode()


async def test_local_ranks_filter_with_untouched_streams(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], ow: ModuleType
) -> None:
    """Rank 0 tee'd but filtered: file only; rank 1 shown, untouched; rank 2 dropped."""
    entry, args = workload("binary", ow, "echo", {r: (r,) for r in range(3)})
    spec = logs(tmp_path, tee={0: Std.ALL}, local_ranks_filter={1})
    pc, _ = await run_group(entry, args, spec)
    captured = capfd.readouterr()
    assert text_lines(captured.out) == ["out-1"]
    assert text_lines(captured.err) == ["err-1"]
    assert read_bytes(pc.stdouts[0]) == b"out-0\n"
    assert read_bytes(pc.stderrs[0]) == b"err-0\n"


# ----------------------------------------------------- 6-7. progress bars


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
            await asyncio.wait_for(probe.event.wait(), LIMIT)
            go(1)
            await asyncio.wait_for(pc.wait(), LIMIT)
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
                await asyncio.wait_for(probe.event.wait(), LIMIT)
            with contextlib.redirect_stdout(after):
                go(1)
                await asyncio.wait_for(pc.wait(), LIMIT)
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


class _ChunkCounter(Sink):
    """Counts how many chunks of lines reach it (each ``lines`` call is one chunk)."""

    def __init__(self) -> None:
        self.chunks = 0

    def lines(self, rank: int, stream: str, prefix: str, lines: list[str]) -> None:
        self.chunks += 1


class _BudgetClock:
    """Stands in for ``time`` in ``aioproc._output.tee``: each reading of the clock
    is one ``SLICE_BUDGET`` later, as if each slice took the whole budget."""

    def __init__(self) -> None:
        from aioproc._output.tee import SLICE_BUDGET

        self.now = 0.0
        self.step = SLICE_BUDGET

    def perf_counter(self) -> float:
        self.now += self.step
        return self.now


@pytest.fixture
def budget_clock(monkeypatch: pytest.MonkeyPatch) -> _BudgetClock:
    clock = _BudgetClock()
    monkeypatch.setattr("aioproc._output.tee.time", clock)
    return clock


async def test_a_flooding_worker_does_not_starve_the_loop(
    tmp_path: Path, budget_clock: _BudgetClock
) -> None:
    """A worker that floods its tee'd stdout gets a bounded share of each loop
    iteration, so the rest of the loop keeps running (uvloop would read up to 32
    chunks at once).  With each slice taking the whole budget: at most the
    iteration's one slice, and a read let through before the budget was known
    spent."""
    counter = _ChunkCounter()
    spec = logs(tmp_path, tee=Std.OUT)
    async with aioproc.start_processes("flood", "yes", {0: ()}, {0: {}}, spec, sinks=[counter]):
        while counter.chunks < 20:  # flooding by now
            await asyncio.sleep(0)
        iterations = 200
        before = counter.chunks
        for _ in range(iterations):
            await asyncio.sleep(0)  # one loop iteration each
        read = counter.chunks - before
    assert 0 < read <= 2 * iterations + 2, f"{read} chunks read in {iterations} iterations"


class _BatchRecorder(Sink):
    """Records every batch of lines it gets, and the loop iteration it came in."""

    def __init__(self) -> None:
        self.batches: list[tuple[int, list[str]]] = []
        self.iteration = 0

    def lines(self, rank: int, stream: str, prefix: str, lines: list[str]) -> None:
        self.batches.append((self.iteration, list(lines)))


def _one_write_of_lines(n: int) -> str:
    """A worker's code: ``n`` numbered lines of 65 bytes to stdout in one write."""
    return (
        "import os, sys\n"
        f"data = b''.join(b'%05d ' % i + b'y' * 58 + b'\\n' for i in range({n}))\n"
        "view = memoryview(data)\n"
        "while view:\n"
        "    view = view[os.write(1, view):]\n"
    )


async def test_a_big_chunk_reaches_the_sinks_a_slice_per_loop_iteration(
    tmp_path: Path, budget_clock: _BudgetClock
) -> None:
    """One read of 256 KiB of lines (asyncio's and uvloop's size) is not handed to the
    sinks in one callback: a ``FAIR_CHUNK`` of it at a time, as many per loop
    iteration as ``SLICE_BUDGET`` allows (one here), every line in order."""
    from aioproc._output.tee import FAIR_CHUNK

    n = 4000  # 4000 x 65 bytes: one write, far more than FAIR_CHUNK
    code = _one_write_of_lines(n)
    recorder = _BatchRecorder()
    stop = False

    async def count_iterations() -> None:
        while not stop:
            recorder.iteration += 1
            await asyncio.sleep(0)

    counting = asyncio.ensure_future(count_iterations())
    try:
        result = await aioproc.run(
            sys.executable,
            1,
            ("-c", code),
            logs_specs=logs(tmp_path, tee=Std.OUT),
            sinks=[recorder],
        )
    finally:
        stop = True
        await counting
    assert result.return_values == {0: None}
    got = [line for _, batch in recorder.batches for line in batch]
    assert got == [f"{i:05d} " + "y" * 58 for i in range(n)]
    # a slice's lines per batch; per iteration at most a slice and a small read
    # after it (not the 4000 lines of a whole read)
    per_slice = FAIR_CHUNK // 65 + 1
    assert max(len(batch) for _, batch in recorder.batches) <= per_slice
    per_iteration: dict[int, int] = {}
    for iteration, batch in recorder.batches:
        per_iteration[iteration] = per_iteration.get(iteration, 0) + len(batch)
    assert max(per_iteration.values()) <= 2 * per_slice, per_iteration


class _FakePipeTransport:
    """The reading side of a pipe transport, recording pauses and resumes."""

    def __init__(self, log: list[tuple[int, str, int]], name: int, clock: dict[str, int]) -> None:
        self.reading = True
        self._log = log
        self._name = name
        self._clock = clock

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def is_closing(self) -> bool:
        return False

    def pause_reading(self) -> None:
        self.reading = False
        self._log.append((self._clock["iteration"], "pause", self._name))

    def resume_reading(self) -> None:
        self.reading = True
        self._log.append((self._clock["iteration"], "resume", self._name))


def _resumed_a_few_per_iteration(log: list[tuple[int, str, int]]) -> list[int]:
    """The ranks resumed, in order, after checking that no loop iteration
    resumed more than ``RESUMES_PER_ITERATION`` of them."""
    from aioproc._output.tee import RESUMES_PER_ITERATION

    per_iteration: dict[int, int] = {}
    ranks = []
    for iteration, what, rank in log:
        if what == "resume":
            per_iteration[iteration] = per_iteration.get(iteration, 0) + 1
            ranks.append(rank)
    assert max(per_iteration.values()) <= RESUMES_PER_ITERATION, per_iteration
    return ranks


async def test_streams_a_full_sink_lets_go_resume_a_few_per_loop_iteration() -> None:
    """When a sink that was full (a console) lets go, the streams it held resume
    reading ``RESUMES_PER_ITERATION`` per loop iteration, in the order they
    asked, not all in one iteration: each may then read a whole pipe and write
    it to its log file (up to ~0.5 ms), and with a dozen flooded streams one
    iteration would hold the loop for several milliseconds."""
    from aioproc._output.tee import TeeProtocol
    from aioproc.sinks import Flow

    class FlowSink(Sink):
        def __init__(self) -> None:
            self.flow = Flow()

        def lines(self, rank: int, stream: str, prefix: str, lines: list[str]) -> None:
            pass

    sink = FlowSink()
    assert sink.flow is not None
    log: list[tuple[int, str, int]] = []
    clock = {"iteration": 0}
    n = 16
    tees = [TeeProtocol(None, rank, "stdout", "", [sink]) for rank in range(n)]
    transports = [_FakePipeTransport(log, rank, clock) for rank in range(n)]
    for tee, transport in zip(tees, transports, strict=True):
        tee.connection_made(transport)  # type: ignore[arg-type]
    sink.flow.hold("console full")
    assert not any(t.reading for t in transports)
    log.clear()
    sink.flow.release("console full")
    for _ in range(n):
        clock["iteration"] += 1
        await asyncio.sleep(0)
    assert all(t.reading for t in transports)
    assert _resumed_a_few_per_iteration(log) == list(range(n))  # in order, each once
    for tee in tees:
        tee.connection_lost(None)


async def test_reads_past_the_loops_read_budget_wait_for_their_turn(
    budget_clock: _BudgetClock,
) -> None:
    """Streams read in one iteration once ``READ_BUDGET`` is spent (each read here
    takes half a millisecond) pause, and resume in later iterations a few at a
    time; every byte is counted as read and every stream reads again."""
    from aioproc._output.tee import READ_BUDGET, TeeProtocol

    log: list[tuple[int, str, int]] = []
    clock = {"iteration": 0}
    n = 8
    tees = [TeeProtocol(None, rank, "stdout", "", []) for rank in range(n)]  # log file only
    transports = [_FakePipeTransport(log, rank, clock) for rank in range(n)]
    for tee, transport in zip(tees, transports, strict=True):
        tee.connection_made(transport)  # type: ignore[arg-type]
    for tee in tees:  # one iteration: every pipe was readable
        tee.data_received(b"x" * 65536)
    within = round(READ_BUDGET / budget_clock.step)  # reads before the budget is spent
    assert [t.reading for t in transports] == [True] * within + [False] * (n - within)
    assert all(tee.progress.received == 65536 for tee in tees)
    for _ in range(n):
        clock["iteration"] += 1
        await asyncio.sleep(0)
    assert all(t.reading for t in transports)
    assert _resumed_a_few_per_iteration(log) == list(range(within, n))
    for tee in tees:
        tee.connection_lost(None)


class _PerRank(Sink):
    def __init__(self) -> None:
        self.got: dict[int, list[str]] = {}

    def lines(self, rank: int, stream: str, prefix: str, lines: list[str]) -> None:
        self.got.setdefault(rank, []).extend(lines)


async def test_a_slice_that_fails_is_logged_and_every_other_slice_still_goes_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A bug while one slice is handed to the sinks loses that slice only: the
    stream's later slices and the other streams' output still arrive, in order,
    and the log files keep every byte."""
    n = 4000
    code = _one_write_of_lines(n)
    real = _output.TeeProtocol._consume
    calls = {0: 0}

    def failing_once(self: Any, buf: bytes | bytearray, start: int, end: int) -> None:
        if self._rank == 0:
            calls[0] += 1
            if calls[0] == 2:
                raise RuntimeError("a bug in the second slice")
        real(self, buf, start, end)

    monkeypatch.setattr(_output.TeeProtocol, "_consume", failing_once)
    sink = _PerRank()
    spec = logs(tmp_path, tee=Std.OUT)
    with caplog.at_level(logging.ERROR, logger="aioproc"):
        result = await aioproc.run(sys.executable, 2, ("-c", code), logs_specs=spec, sinks=[sink])
    assert result.return_values == {0: None, 1: None}
    want = [f"{i:05d} " + "y" * 58 for i in range(n)]
    assert sink.got[1] == want
    # one slice lost (and the line it cut in two joined from its ends), the
    # rest went out, in order
    known = set(want)
    good = [line for line in sink.got[0] if line in known]
    assert len(sink.got[0]) - len(good) <= 1, sink.got[0]
    assert 0 < len(good) < n and good[-1] == want[-1]
    assert good == [line for line in want if line in set(good)]
    assert any("a bug in the second slice" in r.exc_text for r in caplog.records if r.exc_text)
    for rank in (0, 1):
        assert Path(result.stdouts[rank]).read_text().splitlines() == want


async def test_logging_sink_sends_every_line_with_rank_and_stream(tmp_path: Path) -> None:
    records: list[logging.LogRecord] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    log = logging.getLogger("aioproc.test.workers")
    log.setLevel(logging.DEBUG)
    log.propagate = False
    handler = Collect()
    log.addHandler(handler)
    try:
        spec = logs(tmp_path, tee=Std.ALL)
        code = "import sys; print('out', 1); print('err', 2, file=sys.stderr); print('out', 3)"
        sink = aioproc.LoggingSink(log, level=logging.INFO, stderr_level=logging.WARNING)
        result = await aioproc.run(
            sys.executable, 2, args=("-c", code), logs_specs=spec, name="w", sinks=[sink]
        )
        assert not result.is_failed()
    finally:
        log.removeHandler(handler)
    got = sorted(
        (r.rank, r.stream, r.levelno, r.getMessage())  # type: ignore[attr-defined]
        for r in records
    )
    assert got == sorted(
        (rank, stream, level, f"[w{rank}]:{text}")
        for rank in range(2)
        for stream, level, text in (
            ("stdout", logging.INFO, "out 1"),
            ("stdout", logging.INFO, "out 3"),
            ("stderr", logging.WARNING, "err 2"),
        )
    )
    assert {r.prefix for r in records} == {"[w0]:", "[w1]:"}  # type: ignore[attr-defined]


def test_logging_sink_rejects_what_is_not_a_logger() -> None:
    with pytest.raises(TypeError, match=r"logger must be a logging\.Logger or a name, got 42"):
        aioproc.LoggingSink(42)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="level must be a logging level"):
        aioproc.LoggingSink(level="INFO")  # type: ignore[arg-type]


async def test_output_stream_consumer_lets_the_loop_run_under_a_flood() -> None:
    """A consumer that keeps up never waits on the queue; it must still let the
    loop in while a flood is buffered (exit detection, timers, other requests)."""
    stream = OutputStream()
    n = 50_000  # well over the 2 ms fair slice to consume, on any machine
    for i in range(0, n, 1000):
        stream.lines(0, "stdout", "[w0]:", [f"line {j}" for j in range(i, i + 1000)])
    await stream.aclose()
    seen: list[int] = []  # how many records the consumer had when the loop got in

    async def probe() -> None:
        while True:
            seen.append(len(got))
            await asyncio.sleep(0)

    got: list[OutputLine] = []
    prober = asyncio.ensure_future(probe())
    try:
        async for rec in stream:
            got.append(rec)
    finally:
        prober.cancel()
    assert [rec.line for rec in got] == [f"line {j}" for j in range(n)]
    assert any(0 < k < n for k in seen), "the loop never ran while records were queued"
