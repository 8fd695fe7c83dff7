"""Tests for aioproc.tail: TailLog follows files that appear and grow, and drains at stop."""

from __future__ import annotations

import asyncio
import io
import logging
import os
import random
import re
import sys
import threading
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from aioproc import tail as tail_module
from aioproc._output.tee import MAX_LINE
from aioproc.tail import TailLog, open_tail_log


@pytest.fixture(params=["inotify", "backoff"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test with each readiness mechanism."""
    if request.param == "backoff":
        monkeypatch.setattr(tail_module, "_open_inotify", lambda loop: None)
    elif not sys.platform.startswith("linux"):
        pytest.skip("inotify is Linux only")
    return str(request.param)


def writer_bytes(rank: int, lines: int) -> bytes:
    rng = random.Random(rank)
    return "".join(
        f"writer {rank} line {i:04d} {'x' * rng.randrange(60)}\n" for i in range(lines)
    ).encode()


def write_in_pieces(path: str, data: bytes, seed: int) -> None:
    """Create ``path`` (and its directories) and write ``data`` in random small pieces."""
    rng = random.Random(seed)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        pos = 0
        while pos < len(data):
            n = rng.randint(1, 100)  # cuts lines anywhere, leaves partial lines behind
            os.write(fd, data[pos : pos + n])
            pos += n
    finally:
        os.close(fd)


async def test_many_writers_every_line_once_in_order(tmp_path: Path, mode: str) -> None:
    writers, lines = 32, 1000
    logdir = tmp_path / "run" / "attempt_0"  # neither exists yet
    files = {rank: str(logdir / f"{rank}.log") for rank in range(writers)}
    data = {rank: writer_bytes(rank, lines) for rank in range(writers)}
    out = io.StringIO()
    tailer = await TailLog("w", files, out).start()
    assert repr(tailer) == f"<TailLog w files={writers} running, {mode}>"

    def run_writers() -> None:
        threads = [
            threading.Thread(target=write_in_pieces, args=(files[r], data[r], r))
            for r in range(writers)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    await asyncio.to_thread(run_writers)
    await tailer.stop()
    assert tailer.stopped()

    by_rank: dict[int, list[str]] = defaultdict(list)
    for line in out.getvalue().split("\n")[:-1]:
        m = re.fullmatch(r"\[w(\d+)\]:(.*)", line)
        assert m is not None, line
        by_rank[int(m[1])].append(m[2])
    assert sorted(by_rank) == list(range(writers))
    for rank in range(writers):
        assert by_rank[rank] == data[rank].decode().splitlines()


async def test_lines_arrive_while_running_and_partial_line_at_stop(
    tmp_path: Path, mode: str
) -> None:
    path = tmp_path / "late" / "0.log"
    got: asyncio.Queue[tuple[int, str]] = asyncio.Queue()

    async def sink(rank: int, line: str) -> None:
        await got.put((rank, line))

    async with TailLog("t", {3: str(path)}, sink) as tailer:
        path.parent.mkdir()
        with open(path, "wb", buffering=0) as f:
            f.write(b"hello\nwor")
            assert await got.get() == (3, "hello\n")  # live, no stop() needed
            f.write(b"ld\npar")
            assert await got.get() == (3, "world\n")
            f.write(b"tial")  # the tailer has likely read "par" already
            await tailer.stop()
    assert got.get_nowait() == (3, "partial\n")
    assert got.empty()


async def test_data_written_right_before_stop_is_not_lost(tmp_path: Path, mode: str) -> None:
    out = io.StringIO()
    files = {0: str(tmp_path / "a.log"), 1: str(tmp_path / "b.log")}
    tailer = await TailLog("r", files, out).start()
    Path(files[0]).write_text("".join(f"{i}\n" for i in range(500)) + "last")
    Path(files[1]).write_text("only\n")  # created the instant before stop()
    await tailer.stop()
    text = out.getvalue()
    expected_a = "".join(f"[r0]:{i}\n" for i in range(500)) + "[r0]:last\n"
    assert "".join(line for line in text.splitlines(True) if line.startswith("[r0]")) == expected_a
    assert "[r1]:only\n" in text


async def test_stop_during_a_failed_open_tries_once_more(
    tmp_path: Path, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "racy.log"
    real_open = tail_module._open_regular
    in_open, go_on = threading.Event(), threading.Event()

    def first_open_is_slow(p: str) -> int:
        try:
            return real_open(p)  # the file is not there yet: FileNotFoundError
        finally:
            if not in_open.is_set():
                in_open.set()
                go_on.wait(30)  # ...and reported only after stop() was called

    monkeypatch.setattr(tail_module, "_open_regular", first_open_is_slow)
    out = io.StringIO()
    tailer = await TailLog("r", {0: str(path)}, out).start()
    await asyncio.to_thread(in_open.wait, 30)
    path.write_text("made it\n")
    stopping = asyncio.create_task(tailer.stop())
    await asyncio.sleep(0)  # one loop step: stop() has begun, the failed open is pending
    go_on.set()
    await stopping
    assert out.getvalue() == "[r0]:made it\n"


async def test_directory_logs_error_and_others_continue(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    directory = tmp_path / "not_a_file"
    directory.mkdir()
    good = tmp_path / "good.log"
    good.write_text("fine\n")
    out = io.StringIO()
    with caplog.at_level(logging.ERROR, logger="aioproc"):
        async with TailLog("d", {0: str(directory), 1: str(good)}, out):
            pass
    assert out.getvalue() == "[d1]:fine\n"
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1
    assert str(directory) in errors[0].getMessage()
    assert "directory" in errors[0].getMessage()


async def test_failing_sink_is_logged_and_others_continue(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    bad, good = tmp_path / "bad.log", tmp_path / "good.log"
    bad.write_text("boom\n")
    good.write_text("a\nb\n")
    received: list[tuple[int, str]] = []

    async def sink(rank: int, line: str) -> None:
        if line == "boom\n":
            raise ValueError("sink broke")
        received.append((rank, line))

    with caplog.at_level(logging.ERROR, logger="aioproc"):
        async with TailLog("s", {0: str(bad), 1: str(good)}, sink):
            pass
    assert received == [(1, "a\n"), (1, "b\n")]
    [record] = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert str(bad) in record.getMessage()
    assert record.exc_info is not None and "sink broke" in str(record.exc_info[1])


async def test_log_line_filter_sees_unprefixed_lines(tmp_path: Path) -> None:
    path = tmp_path / "f.log"
    path.write_bytes(b"keep 1\ndrop 2\nkeep 3\nkeep partial")
    seen: list[str] = []

    def keep(line: str) -> bool:
        seen.append(line)
        return line.startswith("keep")

    out = io.StringIO()
    async with TailLog("f", {0: str(path)}, out, log_line_filter=keep):
        pass
    assert out.getvalue() == "[f0]:keep 1\n[f0]:keep 3\n[f0]:keep partial\n"
    assert seen == ["keep 1\n", "drop 2\n", "keep 3\n", "keep partial\n"]


async def test_sink_with_filter_and_custom_prefixes(tmp_path: Path) -> None:
    a, b = tmp_path / "a.log", tmp_path / "b.log"
    a.write_text("x1\ny1\n")
    b.write_text("x2\n")
    received: list[tuple[int, str]] = []

    async def sink(rank: int, line: str) -> None:
        received.append((rank, line))

    async with TailLog(
        "s",
        {0: str(a), 1: str(b)},
        sink,
        log_line_prefixes={0: "<a>"},
        log_line_filter=lambda line: line.startswith("x"),
    ):
        pass
    assert sorted(received) == [(0, "x1\n"), (1, "x2\n")]  # sinks get no prefix

    out = io.StringIO()
    async with TailLog("s", {0: str(a), 1: str(b)}, out, log_line_prefixes={0: "<a> "}):
        pass
    assert sorted(out.getvalue().splitlines()) == ["<a> x1", "<a> y1", "[s1]:x2"]


async def test_path_destination_is_appended(tmp_path: Path) -> None:
    src, dst = tmp_path / "src.log", tmp_path / "dst.log"
    src.write_text("one\ntwo\n")
    dst.write_text("before\n")
    async with TailLog("p", {0: str(src)}, str(dst)):
        pass
    assert dst.read_text() == "before\n[p0]:one\n[p0]:two\n"


async def test_one_megabyte_line_arrives_in_capped_prefixed_pieces(tmp_path: Path) -> None:
    path = tmp_path / "big.log"
    big = "y" * 1_000_000
    path.write_text(f"{big}\nafter\n")
    out = io.StringIO()
    async with TailLog("b", {0: str(path)}, out):
        pass
    lines = out.getvalue().split("\n")
    assert lines.pop() == ""
    assert all(line.startswith("[b0]:") for line in lines)
    pieces = [line.removeprefix("[b0]:") for line in lines]
    assert pieces[-1] == "after"
    assert "".join(pieces[:-1]) == big
    assert all(0 < len(piece) <= MAX_LINE for piece in pieces)
    assert len(pieces) - 1 == -(-len(big) // MAX_LINE)


async def test_invalid_utf8_becomes_replacement_characters(tmp_path: Path) -> None:
    path = tmp_path / "bad.log"
    path.write_bytes(b"ok \xff\xfe end\n\xc3")  # the last line is a truncated sequence
    out = io.StringIO()
    async with TailLog("u", {0: str(path)}, out):
        pass
    assert out.getvalue() == "[u0]:ok \ufffd\ufffd end\n[u0]:\ufffd\n"


async def test_lifecycle_start_twice_stop_idempotent(tmp_path: Path) -> None:
    tailer = TailLog("l", {0: str(tmp_path / "never.log")}, io.StringIO())
    assert repr(tailer) == "<TailLog l files=1 new>"
    assert not tailer.stopped()
    assert await tailer.start() is tailer
    with pytest.raises(RuntimeError, match="starts only once"):
        await tailer.start()
    assert not tailer.stopped()
    await asyncio.gather(tailer.stop(), tailer.stop())  # the file never appeared
    assert tailer.stopped()
    await tailer.stop()
    assert tailer.stopped()
    assert repr(tailer) == "<TailLog l files=1 stopped>"
    with pytest.raises(RuntimeError, match="starts only once"):
        await tailer.start()


async def test_no_files_and_stop_before_start() -> None:
    async with TailLog("e", {}, io.StringIO()) as tailer:
        pass
    assert tailer.stopped()
    never = TailLog("e", {}, io.StringIO())
    await never.stop()
    assert never.stopped()


def test_bad_destination_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="dst must be"):
        TailLog("x", {}, 42)  # type: ignore[arg-type]


async def test_torch_positional_signature_with_interval_sec(tmp_path: Path, mode: str) -> None:
    # torch: TailLog(name, log_files, dst, log_line_prefixes, interval_sec, log_line_filter)
    path = tmp_path / "late.log"
    got: asyncio.Queue[tuple[int, str]] = asyncio.Queue()

    async def sink(rank: int, line: str) -> None:
        await got.put((rank, line))

    keep = lambda line: not line.startswith("drop")  # noqa: E731
    async with TailLog("t", {0: str(path)}, sink, None, 0.01, keep) as tailer:
        with open(path, "wb", buffering=0) as f:
            f.write(b"drop me\nkeep me\n")
            assert await got.get() == (0, "keep me\n")
            await tailer.stop()
    assert got.empty()


@pytest.mark.parametrize(
    ("interval", "error", "text"),
    [
        (0, ValueError, "interval_sec must be positive and finite, got 0"),
        (-1.5, ValueError, "interval_sec must be positive and finite, got -1.5"),
        (float("inf"), ValueError, "interval_sec must be positive and finite, got inf"),
        (float("nan"), ValueError, "interval_sec must be positive and finite, got nan"),
        ("0.1", TypeError, "interval_sec must be a number of seconds, not '0.1'"),
        (True, TypeError, "interval_sec must be a number of seconds, not True"),
    ],
)
def test_bad_interval_sec(interval: Any, error: type[Exception], text: str) -> None:
    with pytest.raises(error) as info:
        TailLog("x", {}, io.StringIO(), interval_sec=interval)
    assert str(info.value) == text


async def test_cancelled_stop_closes_everything(tmp_path: Path, mode: str) -> None:
    path = tmp_path / "c.log"
    path.write_text("stuck\n")
    entered = asyncio.Event()

    async def blocking_sink(rank: int, line: str) -> None:
        entered.set()
        await asyncio.Event().wait()  # never returns

    tailer = await TailLog("c", {0: str(path)}, blocking_sink).start()
    await entered.wait()
    stopping = asyncio.create_task(tailer.stop())
    await asyncio.sleep(0)  # let stop() start waiting for the drain
    stopping.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stopping
    assert tailer.stopped()  # and the leak check sees no fd left open


# ------------------------------------------------- aclose() and open_tail_log


async def test_aclose_drains_every_file_and_is_idempotent_from_another_task(
    tmp_path: Path, mode: str
) -> None:
    """``aclose()`` drains to the end (a partial last line included), a second
    call from another task waits for the first, a third returns at once."""
    path = tmp_path / "a.log"
    path.write_bytes(b"one\ntwo\nno newline")
    out = io.StringIO()
    tailer = await TailLog("a", {0: str(path)}, out).start()
    first = asyncio.create_task(tailer.aclose())
    second = asyncio.create_task(tailer.aclose())  # another task, while the first drains
    await asyncio.gather(first, second)
    assert tailer.stopped()
    assert out.getvalue() == "[a0]:one\n[a0]:two\n[a0]:no newline\n"
    await tailer.aclose()
    assert repr(tailer) == "<TailLog a files=1 stopped>"


async def test_open_tail_log_awaited_or_with_async_with(tmp_path: Path, mode: str) -> None:
    path = tmp_path / "o.log"
    path.write_text("first\n")
    out = io.StringIO()
    tailer = await open_tail_log("o", {0: str(path)}, out, log_line_prefixes={0: "> "})
    assert repr(tailer) == f"<TailLog o files=1 running, {mode}>"
    await tailer.aclose()
    assert out.getvalue() == "> first\n"

    seen: list[str] = []

    async def sink(rank: int, line: str) -> None:
        seen.append(line)

    keep = lambda line: line != "skip\n"  # noqa: E731
    async with open_tail_log("o", {0: str(path)}, sink, log_line_filter=keep) as tailer:
        with open(path, "a") as f:
            f.write("skip\nsecond\n")
    assert tailer.stopped()
    assert seen == ["first\n", "second\n"]


async def test_open_tail_log_checks_its_arguments_at_the_call() -> None:
    with pytest.raises(TypeError, match="dst must be a text stream, a path or an async callable"):
        open_tail_log("x", {}, 42)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="interval_sec must be positive and finite, got 0"):
        open_tail_log("x", {}, io.StringIO(), interval_sec=0)
    with pytest.raises(TypeError, match="positional"):
        open_tail_log("x", {}, io.StringIO(), None)  # type: ignore[misc]


async def test_stop_is_torchs_name_for_aclose(tmp_path: Path) -> None:
    """torch's verbs stay, without a warning (the suite turns warnings into errors)."""
    path = tmp_path / "t.log"
    path.write_text("line\n")
    out = io.StringIO()
    tailer = await TailLog("t", {0: str(path)}, out).start()
    await tailer.stop()
    assert tailer.stopped()
    await tailer.aclose()  # and the other way round: one close
    assert out.getvalue() == "[t0]:line\n"


async def test_aclose_during_a_path_destinations_start(tmp_path: Path) -> None:
    """``aclose()`` from another task while ``start()`` opens its ``dst`` path:
    the start fails clearly and nothing is left open (the leak check)."""
    tailer = TailLog("s", {0: str(tmp_path / "never.log")}, tmp_path / "out.log")
    starting = asyncio.create_task(tailer.start())
    await asyncio.sleep(0)  # the start is opening its path on the helper thread
    await tailer.aclose()
    with pytest.raises(RuntimeError, match="was stopped while starting"):
        await starting
    assert tailer.stopped()
