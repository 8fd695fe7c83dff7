"""The tee (``aioproc._output.tee``): redirects and tee per stream, line framing, the read budget.

Redirects and tee are checked for every combination, per rank; the line
splitter's framing is checked against a model under any chunking
(hypothesis); a flooding worker must not starve the loop: its reads are
budgeted and its lines reach the sinks a slice per loop iteration.

Workers are real processes, binary (``python -S out_workers.py <fn> ...``)
or function workers (the same functions, imported by name from
``tests/children/out_workers.py``); they write with ``os.write`` so nothing
waits in a Python buffer.  The console is observed with pytest's ``capfd``:
it swaps fds 1 and 2 (what inherited, untouched worker streams write to)
and also ``sys.stdout``/``sys.stderr`` (what ``ConsoleSink`` writes to, as it
looks them up at write time), so one capture shows both.
"""

from __future__ import annotations

import asyncio
import io
import itertools
import logging
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any
from unittest import mock

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from output_helpers import (
    GROUP_LIMIT,
    KINDS,
    logs,
    read_bytes,
    run_group,
    text_lines,
    workload,
)
from output_helpers import ow as ow  # the out_workers fixture

import aioproc
from aioproc import (
    CallbackSink,
    ConsoleSink,
    DefaultLogsSpecs,
    FileSink,
    OutputLine,
    PContext,
    Sink,
    Std,
)
from aioproc._output import tee as _output
from aioproc._output.tee import LineSplitter

STDS = (Std.NONE, Std.OUT, Std.ERR, Std.ALL)

# ---------------------------------------------------- redirects and tee


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


# --------------------------------------------------------- line framing


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
        result = await asyncio.wait_for(pc.wait(), GROUP_LIMIT)
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
        await asyncio.wait_for(first.wait(), GROUP_LIMIT)
        os.write(w, b"never read\n")  # still in the pipe when it is cut
        transport.close()
        await asyncio.wait_for(tee.settled(), GROUP_LIMIT)
        await asyncio.wait_for(tee.closed, GROUP_LIMIT)
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


# ------------------------------------- a flood: the read budget, slices


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
