"""``aioproc.sinks``: every sink kind gets exactly the tee'd lines; filters, prefixes, logging.

Every kind of sink (a ``Sink`` subclass, ``FileSink``, ``CallbackSink``
sync and async, ``OutputStream``, ``LoggingSink``) is given the same group
and must see every line once, in order, with its rank, stream and prefix;
``duplicate_filters``, ``log_line_prefixes`` and ``local_ranks_filter``
act on the console, never on the files.  Sinks under fault (slow, raising,
hanging, a full disk) are test_sinks_faults.py's.

Workers are real processes, binary (``python -S out_workers.py <fn> ...``)
or function workers (the same functions, imported by name from
``tests/children/out_workers.py``); they write with ``os.write`` so nothing
waits in a Python buffer.  The console is observed with pytest's ``capfd``
or, where only the sink's writes matter, ``capsys``.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from output_helpers import (
    GROUP_LIMIT,
    KINDS,
    attempt_dir,
    logs,
    of_prefix,
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
    FileSink,
    OutputLine,
    OutputStream,
    Sink,
    Std,
)

# ---------------------------------------------------------------- sinks


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
            result = await asyncio.wait_for(pc.wait(), GROUP_LIMIT)
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
    check_records(await asyncio.wait_for(early, GROUP_LIMIT), want)
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
    assert [rec.line for rec in await asyncio.wait_for(first, GROUP_LIMIT)] == [
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


# ------------------------------------ filters, prefixes, local_ranks_filter


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


# ------------------------------------------------------------ the logging sink


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
