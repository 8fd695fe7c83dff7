"""aioproc.errors: error.json in both torch layouts, failure ordering, @record."""

from __future__ import annotations

import asyncio
import faulthandler
import json
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
import tracemalloc
import types
import warnings
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from aioproc import errors
from aioproc._child import errorfile
from aioproc._errors import failure
from aioproc.errors import (
    ChildFailedError,
    ErrorHandler,
    ForcedKillWarning,
    ProcessFailure,
    RemoteTraceback,
    record,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
ENV = "TORCHELASTIC_ERROR_FILE"
TRACEBACK = (
    'Traceback (most recent call last):\n  File "train.py", line 3, in <module>\nValueError: boom\n'
)


def torch_record_data(timestamp: str = "1700000000") -> dict[str, Any]:
    """What torch's ErrorHandler.record_exception writes (before json.dump)."""
    return {
        "message": {
            "message": "ValueError: boom",
            "extraInfo": {"py_callstack": TRACEBACK, "timestamp": timestamp},
        }
    }


def write_json(path: Path, data: Any) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fp:
        json.dump(data, fp)  # torch writes with json.dump defaults
    return str(path)


@pytest.fixture(autouse=True)
def _restore_faulthandler() -> Iterator[None]:
    # record() may enable faulthandler on the captured stderr; undo that.
    was_enabled = faulthandler.is_enabled()
    yield
    if not was_enabled:
        faulthandler.disable()


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Times handed out, in order, to ProcessFailures as they are constructed."""
    times: list[float] = []
    monkeypatch.setattr(failure, "time", types.SimpleNamespace(time=lambda: times.pop(0)))
    return times


# ---------------------------------------------------------------- ProcessFailure


def test_failure_reads_torch_record_layout(tmp_path: Path) -> None:
    path = write_json(tmp_path / "error.json", torch_record_data())

    pf = ProcessFailure(local_rank=2, pid=4242, exitcode=1, error_file=path)

    assert pf.message == torch_record_data()["message"]
    assert pf.timestamp == 1700000000
    assert pf.error_file == path
    assert pf.error_file_data == torch_record_data()
    assert pf.stopped is False
    assert pf.signal_name() == "<N/A>"


@pytest.mark.parametrize("timestamp", [10, "10"])
def test_failure_reads_flat_layout(tmp_path: Path, timestamp: int | str) -> None:
    data = {"message": "test error message", "timestamp": timestamp}
    path = write_json(tmp_path / "error.json", data)

    pf = ProcessFailure(local_rank=0, pid=997, exitcode=1, error_file=path)

    assert pf.message == "test error message"
    assert pf.timestamp == 10
    assert pf.error_file_data == data


def test_failure_without_file_timestamp_uses_observation_time(tmp_path: Path) -> None:
    # torch would use 0 for the flat layout, making such a failure the root
    # cause of any group; we use the time the exit was noticed.
    flat = write_json(tmp_path / "flat.json", {"message": "no time"})
    nested = write_json(tmp_path / "nested.json", {"message": {"message": "E: x"}})
    before = int(time.time())

    pf_flat = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=flat)
    pf_nested = ProcessFailure(local_rank=1, pid=2, exitcode=1, error_file=nested)

    after = int(time.time())
    assert pf_flat.message == "no time"
    assert pf_nested.message == {"message": "E: x"}
    assert before <= pf_flat.timestamp <= after
    assert before <= pf_nested.timestamp <= after


def test_failure_without_error_file(tmp_path: Path) -> None:
    before = int(time.time())

    pf = ProcessFailure(
        local_rank=0, pid=4242, exitcode=138, error_file=str(tmp_path / "missing.json")
    )

    assert pf.error_file == "<N/A>"
    # torch's placeholder, traits and exact text (errors/api_test.py)
    assert pf.error_file_data == {
        "message": "<NONE>",
        "errorTraits": {"category": "system_terminated_error", "retryability": "False"},
    }
    assert (
        pf.message == "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"
    )
    assert pf.message == errors.NO_ERROR_FILE_MESSAGE
    assert before <= pf.timestamp <= int(time.time())
    assert pf.signal_name() == "<N/A>"


@pytest.mark.parametrize(
    ("sig", "name"), [(signal.SIGTERM, "SIGTERM"), (signal.SIGSEGV, "SIGSEGV")]
)
def test_failure_by_signal(sig: signal.Signals, name: str) -> None:
    pf = ProcessFailure(local_rank=0, pid=4242, exitcode=-sig, error_file="/nonexistent/e.json")

    assert pf.signal_name() == name
    assert pf.message == f"Signal {int(sig)} ({name}) received by PID 4242"
    assert pf.error_file == "<N/A>"
    assert pf.error_file_data == {"message": "<NONE>"}


def test_failure_by_sigterm_exact_message() -> None:
    pf = ProcessFailure(local_rank=3, pid=4242, exitcode=-15, error_file="", stopped=True)

    assert pf.message == "Signal 15 (SIGTERM) received by PID 4242"
    assert pf.signal_name() == "SIGTERM"
    assert pf.stopped is True


def test_failure_by_unknown_signal_number() -> None:
    pf = ProcessFailure(local_rank=0, pid=7, exitcode=-200, error_file="")

    assert pf.signal_name() == "<N/A>"
    assert pf.message == "Signal 200 (<N/A>) received by PID 7"


def test_failure_with_malformed_json_keeps_raw_text(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "error.json"
    path.write_text('{"message": "truncated\n')

    pf = ProcessFailure(local_rank=1, pid=4242, exitcode=1, error_file=str(path))

    assert pf.message == '{"message": "truncated'
    assert pf.error_file == str(path)
    assert pf.error_file_data == {}
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert caplog.records[0].getMessage() == (
        f"error file {path} of local_rank 1 (pid 4242) is not a torchelastic "
        "error.json; keeping its raw text as the message"
    )


def test_failure_with_unknown_json_layout_keeps_raw_text(tmp_path: Path) -> None:
    # torch raises KeyError here and loses the failure.
    path = write_json(tmp_path / "error.json", {"unknown_key": "unknown_value"})

    pf = ProcessFailure(local_rank=0, pid=997, exitcode=1, error_file=path)

    assert pf.message == '{"unknown_key": "unknown_value"}'
    assert pf.error_file_data == {"unknown_key": "unknown_value"}


BIG_ERROR_FILE = 400 * 1024 * 1024


def sparse_error_file(path: Path, head: bytes = b"") -> str:
    """A 400 MB error file that costs no disk: ``head``, then a hole."""
    path.write_bytes(head)
    os.truncate(path, BIG_ERROR_FILE)
    return str(path)


def traced_peak(fn: Any) -> tuple[Any, int]:
    tracemalloc.start()
    try:
        value = fn()
        return value, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_oversized_error_file_is_not_read_and_the_message_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    head = b'{"message": {"message": "ValueError: boom", "extraInfo": {"py_callstack": "'
    path = sparse_error_file(tmp_path / "error.json", head)

    pf, peak = traced_peak(lambda: ProcessFailure(0, 4242, 1, path))

    assert peak < 256 * 1024, f"constructing the failure allocated {peak} bytes"
    assert pf.message == (
        f"error file {path} is too large to read: 419430400 bytes, over the 1048576-byte "
        f"limit (aioproc.errors.MAX_ERROR_FILE_SIZE); its first 4096 bytes:\n{head.decode()}"
    )
    assert pf.error_file == path
    assert pf.error_file_data == {}
    assert [r.getMessage() for r in caplog.records] == [
        f"error file {path} of local_rank 0 (pid 4242) is 419430400 bytes, over the 1048576 "
        "byte limit; it was not read"
    ]
    # and the report built from it stays small and readable
    text = str(ChildFailedError("train", {0: pf}))
    assert "is too large to read: 419430400 bytes" in text
    assert len(text) < 8192


def test_oversized_error_file_of_nothing_but_a_hole(tmp_path: Path) -> None:
    path = sparse_error_file(tmp_path / "error.json")
    pf = ProcessFailure(0, 4242, 1, path)
    assert pf.message == (
        f"error file {path} is too large to read: 419430400 bytes, over the 1048576-byte "
        "limit (aioproc.errors.MAX_ERROR_FILE_SIZE); it begins with no text"
    )


def test_error_file_at_the_cap_is_read(tmp_path: Path) -> None:
    data = torch_record_data()
    text = json.dumps(data)
    path = tmp_path / "error.json"
    # pad with whitespace (valid JSON) to exactly the cap
    path.write_text(text + " " * (errors.MAX_ERROR_FILE_SIZE - len(text)))
    assert path.stat().st_size == errors.MAX_ERROR_FILE_SIZE
    pf = ProcessFailure(0, 1, 1, str(path))
    assert pf.error_file_data == data
    path.write_text(text + " " * (errors.MAX_ERROR_FILE_SIZE - len(text) + 1))
    assert "is too large to read: 1048577 bytes" in str(ProcessFailure(0, 1, 1, str(path)).message)


async def test_load_reads_the_error_file_off_the_loop_like_the_constructor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    opened_in: list[int] = []
    real_read = errorfile.read_capped

    def spy_read(*args: Any, **kwargs: Any) -> Any:
        opened_in.append(threading.get_ident())
        return real_read(*args, **kwargs)

    monkeypatch.setattr(errorfile, "read_capped", spy_read)
    path = write_json(tmp_path / "error.json", torch_record_data())

    pf = await ProcessFailure.load(2, 4242, 1, path, stopped=True)

    assert opened_in and threading.get_ident() not in opened_in  # read in a worker thread
    expected = ProcessFailure(2, 4242, 1, path, stopped=True)
    assert (pf.message, pf.timestamp, pf.error_file, pf.error_file_data, pf.stopped) == (
        expected.message,
        expected.timestamp,
        expected.error_file,
        expected.error_file_data,
        expected.stopped,
    )
    assert pf == expected
    assert pf._order_key() < expected._order_key()  # ordered by when load was called


async def test_load_with_an_oversized_missing_or_unreadable_error_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    big = sparse_error_file(tmp_path / "big.json", b'{"message": "x')
    pf = await ProcessFailure.load(0, 7, 1, big)
    assert pf.message == ProcessFailure(0, 7, 1, big).message
    assert str(pf.message).startswith(f"error file {big} is too large to read: 419430400 bytes")

    missing = await ProcessFailure.load(0, 7, 3, str(tmp_path / "missing.json"))
    assert missing.error_file == "<N/A>"
    assert missing.message == errors.NO_ERROR_FILE_MESSAGE

    unreadable = tmp_path / "unreadable.json"
    unreadable.write_text("{}")

    def denied(*args: Any, **kwargs: Any) -> Any:
        raise PermissionError(13, "Permission denied", str(unreadable))

    monkeypatch.setattr(errorfile, "read_capped", denied)
    caplog.clear()
    pf = await ProcessFailure.load(1, 8, 2, str(unreadable))
    assert (
        pf.message == f"Process 8 exited with code 2; its error file {unreadable} holds no message"
    )
    assert [r.getMessage() for r in caplog.records] == [
        f"could not read error file {unreadable} of local_rank 1 (pid 8): "
        f"[Errno 13] Permission denied: '{unreadable}'"
    ]


def test_read_error_file_returns_the_content_none_or_the_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the supervisor reads on its helper thread, as the constructor reads it."""
    path = write_json(tmp_path / "error.json", {"message": "m"})
    assert errors.read_error_file(path) == (b'{"message": "m"}', 16)
    assert errors.read_error_file(str(tmp_path / "missing.json")) is None
    assert errors.read_error_file(str(tmp_path)) is None  # a directory is no error file
    assert errors.read_error_file("") is None

    def denied(name: str, *args: Any) -> tuple[bytes, int]:
        raise PermissionError(13, "Permission denied", name)

    monkeypatch.setattr(errorfile, "read_capped", denied)
    error = errors.read_error_file(path)
    assert isinstance(error, PermissionError)
    assert str(error) == f"[Errno 13] Permission denied: '{path}'"


async def test_load_error_file_is_capped(tmp_path: Path) -> None:
    small = write_json(tmp_path / "small.json", {"message": "m"})
    assert await errors.load_error_file(small) == (b'{"message": "m"}', 16)
    big = sparse_error_file(tmp_path / "big.json", b"head")
    data, size = await errors.load_error_file(big)
    assert (data[:4], len(data), size) == (b"head", 4096, BIG_ERROR_FILE)
    assert await errors.load_error_file(small, max_size=10) == (b'{"message": "m"}', 16)
    assert await errors.load_error_file(str(tmp_path)) is None  # a directory: no error file


async def test_group_with_a_400mb_error_file_reports_it_without_reading_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import aioproc
    from aioproc import DefaultLogsSpecs

    monkeypatch.syspath_prepend(str(REPO_ROOT / "tests" / "children"))
    import channel_funcs

    with pytest.raises(ChildFailedError) as info:
        await asyncio.wait_for(
            aioproc.run(
                channel_funcs.huge_error_file_then_exit,
                1,
                args=(BIG_ERROR_FILE,),
                logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path)),
            ),
            30,
        )
    failure = info.value.failures[0]
    assert failure.exitcode == 3
    assert str(failure.message).startswith(
        f"error file {failure.error_file} is too large to read: 419430400 bytes, over the "
        "1048576-byte limit (aioproc.errors.MAX_ERROR_FILE_SIZE); its first 4096 bytes:\n"
        '{"message": "huge"'
    )
    assert os.path.getsize(failure.error_file) == BIG_ERROR_FILE


def test_dump_error_file_refuses_an_oversized_child_file(tmp_path: Path) -> None:
    path = sparse_error_file(tmp_path / "child.json", b"{}")
    with pytest.raises(ValueError, match=r"child.json is 419430400 bytes, over the 1048576-byte"):
        traced_peak(lambda: ErrorHandler().dump_error_file(path))


def test_failure_with_empty_error_file(tmp_path: Path) -> None:
    path = tmp_path / "error.json"
    path.write_text("")

    pf = ProcessFailure(local_rank=0, pid=997, exitcode=2, error_file=str(path))

    assert pf.message == f"Process 997 exited with code 2; its error file {path} holds no message"


def test_failure_with_invalid_timestamp(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, clock: list[float]
) -> None:
    path = write_json(tmp_path / "error.json", {"message": "x", "timestamp": "soon"})
    clock.append(1700000123.5)

    pf = ProcessFailure(local_rank=0, pid=997, exitcode=1, error_file=path)

    assert pf.message == "x"
    assert pf.timestamp == 1700000123
    assert caplog.records[0].getMessage() == (
        f"error file {path} has an invalid timestamp 'soon'; using the time the exit was noticed"
    )


def test_timestamp_isoformat(tmp_path: Path) -> None:
    path = write_json(tmp_path / "error.json", torch_record_data("1700000000"))

    pf = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=path)

    assert pf.timestamp_isoformat() == datetime.fromtimestamp(1700000000).isoformat(sep="_")
    assert len(pf.timestamp_isoformat()) == len("2023-11-14_22:13:20")


# ---------------------------------------------------------------- ordering


def test_root_cause_is_first_observed_within_one_second(clock: list[float]) -> None:
    clock.extend([1700000000.25, 1700000000.5, 1700000000.75])
    first = ProcessFailure(local_rank=3, pid=103, exitcode=1, error_file="")
    second = ProcessFailure(local_rank=0, pid=100, exitcode=-15, error_file="", stopped=True)
    third = ProcessFailure(local_rank=1, pid=101, exitcode=-15, error_file="", stopped=True)
    assert first.timestamp == second.timestamp == third.timestamp == 1700000000

    err = ChildFailedError("trainer", {0: second, 1: third, 3: first})

    assert err.get_first_failure() == (3, first)
    assert err.get_first_failure()[1] is first


def test_root_cause_when_the_clock_does_not_move(clock: list[float]) -> None:
    clock.extend([1700000000.5] * 3)
    failures = [
        ProcessFailure(local_rank=r, pid=100 + r, exitcode=1, error_file="") for r in (2, 0, 1)
    ]

    err = ChildFailedError("trainer", {pf.local_rank: pf for pf in reversed(failures)})

    assert err.get_first_failure()[1] is failures[0]
    assert err.get_first_failure()[0] == 2


def test_root_cause_agrees_with_error_file_timestamps(tmp_path: Path) -> None:
    # Noticed first, but its worker wrote a later timestamp: not the root cause.
    late = write_json(tmp_path / "0.json", torch_record_data("1700000005"))
    early = write_json(tmp_path / "1.json", torch_record_data("1700000001"))
    pf_late = ProcessFailure(local_rank=0, pid=100, exitcode=1, error_file=late)
    pf_early = ProcessFailure(local_rank=1, pid=101, exitcode=1, error_file=early)
    pf_signal = ProcessFailure(local_rank=2, pid=102, exitcode=-9, error_file="")

    err = ChildFailedError("trainer", {2: pf_signal, 0: pf_late, 1: pf_early})

    assert err.get_first_failure() == (1, pf_early)


# ---------------------------------------------------------------- ChildFailedError


def test_format_msg_layout(tmp_path: Path, clock: list[float]) -> None:
    # A deep directory makes the error_file line wider than the 60-column cap.
    path = write_json(tmp_path / ("d" * 50) / "error.json", torch_record_data())
    clock.extend([1700000003.0, 1700000004.0])
    root = ProcessFailure(local_rank=0, pid=100, exitcode=1, error_file=path)
    stopped = ProcessFailure(local_rank=1, pid=101, exitcode=-15, error_file="", stopped=True)

    err = ChildFailedError("trainer", {0: root, 1: stopped})

    host = socket.getfqdn()
    t_root = datetime.fromtimestamp(1700000000).isoformat(sep="_")
    t_stopped = datetime.fromtimestamp(1700000004).isoformat(sep="_")
    expected = "\n".join(
        [
            "",
            "=" * 60,
            "trainer FAILED",
            "-" * 60,
            "Failures:",
            "[1]:",
            f"  time      : {t_stopped}",
            f"  host      : {host}",
            "  rank      : 1 (local_rank: 1)",
            "  exitcode  : -15 (pid: 101) (SIGTERM) (stopped by aioproc)",
            "  error_file: <N/A>",
            "  traceback : Signal 15 (SIGTERM) received by PID 101",
            "-" * 60,
            "Root Cause (first observed failure):",
            "[0]:",
            f"  time      : {t_root}",
            f"  host      : {host}",
            "  rank      : 0 (local_rank: 0)",
            "  exitcode  : 1 (pid: 100)",
            f"  error_file: {path}",
            "  traceback : Traceback (most recent call last):",
            '    File "train.py", line 3, in <module>',
            "  ValueError: boom",
            "=" * 60,
        ]
    )
    assert err.format_msg() == expected
    assert str(err) == expected
    assert err.format_msg("*", "~").startswith("\n" + "*" * 60 + "\ntrainer FAILED\n" + "~" * 60)


def test_format_msg_single_failure_and_message_without_traceback(tmp_path: Path) -> None:
    data = {"message": {"message": "RuntimeError: x", "extraInfo": {"timestamp": "1700000000"}}}
    path = write_json(tmp_path / "error.json", data)
    pf = ProcessFailure(local_rank=0, pid=100, exitcode=1, error_file=path)

    msg = str(ChildFailedError("w", {5: pf}))

    assert "\nw FAILED\n" in msg
    assert "\nFailures:\n  <NO_OTHER_FAILURES>\n" in msg
    assert "\nRoot Cause (first observed failure):\n[0]:\n" in msg
    assert "\n  rank      : 5 (local_rank: 0)\n" in msg
    assert msg.endswith("\n  traceback : RuntimeError: x\n" + "=" * 60)


def test_child_failed_error_needs_failures() -> None:
    with pytest.raises(ValueError, match=r"ChildFailedError\('trainer'\) needs at least one"):
        ChildFailedError("trainer", {})


def test_child_failed_error_pickles(tmp_path: Path) -> None:
    error_file = tmp_path / "error.json"
    path = write_json(error_file, torch_record_data())
    root = ProcessFailure(local_rank=0, pid=100, exitcode=1, error_file=path)
    other = ProcessFailure(local_rank=1, pid=101, exitcode=-15, error_file="", stopped=True)
    err = ChildFailedError("trainer", {1: other, 0: root})
    data = pickle.dumps(err)
    error_file.unlink()  # unpickling must not read the file again

    loaded = pickle.loads(data)

    assert type(loaded) is ChildFailedError
    assert loaded.name == "trainer"
    assert loaded.failures == {1: other, 0: root}
    assert list(loaded.failures) == [1, 0]
    assert loaded.failures[0].message == torch_record_data()["message"]
    assert loaded.failures[1].stopped is True
    assert loaded.get_first_failure() == (0, root)
    assert str(loaded) == str(err)


PUBLIC_MODULES = (
    "aioproc",
    "aioproc.agent",
    "aioproc.cli",
    "aioproc.cluster",
    "aioproc.context",
    "aioproc.errors",
    "aioproc.forkserver",
    "aioproc.logs",
    "aioproc.metrics",
    "aioproc.pool",
    "aioproc.rendezvous",
    "aioproc.results",
    "aioproc.runner",
    "aioproc.signals",
    "aioproc.sinks",
    "aioproc.tail",
    "aioproc.testing",
    "aioproc.timer",
    "aioproc.worker",
)


def _public_exceptions() -> dict[str, type[BaseException]]:
    import importlib

    found: dict[str, type[BaseException]] = {}
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            value = getattr(module, name)
            if isinstance(value, type) and issubclass(value, (Exception, Warning)):
                found[name] = value
    return found


def test_every_public_exception_is_drawn_in_the_errors_tree() -> None:
    """Each exception or warning a public module exports has its line in the tree of
    ``aioproc.errors``' docstring, under the base the tree shows."""
    import aioproc.errors

    doc = aioproc.errors.__doc__ or ""
    tree = doc[doc.index("::") : doc.index("Misuse")]
    drawn = {line.strip("│├└─ ").split()[0] for line in tree.splitlines()[2:] if line.strip()}
    exceptions = _public_exceptions()
    assert set(exceptions) <= drawn, f"not drawn: {sorted(set(exceptions) - drawn)}"
    for name, cls in exceptions.items():
        # the parent drawn above it is one of its bases
        lines = [line for line in tree.splitlines() if line.strip("│├└─ ").split()[:1] == [name]]
        (line,) = lines
        depth = len(line) - len(line.lstrip("│├└─ "))
        above = tree.splitlines()[: tree.splitlines().index(line)]
        parent = next(
            p.strip("│├└─ ").split()[0]
            for p in reversed(above)
            if p.strip() and len(p) - len(p.lstrip("│├└─ ")) < depth
        )
        assert parent in {c.__name__ for c in cls.__mro__[1:]}, (name, parent)


def test_the_exceptions_users_meet_are_importable_from_public_modules() -> None:
    import pickle

    import aioproc
    import aioproc.forkserver
    import aioproc.rendezvous
    import aioproc.results
    from aioproc._func.template import TemplateError, TemplateLost
    from aioproc.rendezvous._etcd_server import EtcdStartError

    assert aioproc.errors.RunTimeoutError is aioproc.results.RunTimeoutError
    assert aioproc.RunTimeoutError is aioproc.results.RunTimeoutError
    assert issubclass(aioproc.errors.RunTimeoutError, TimeoutError)
    err = aioproc.errors.RunTimeoutError("late", None)
    assert (str(err), err.result) == ("late", None)
    assert pickle.loads(pickle.dumps(err)).result is None
    assert aioproc.forkserver.TemplateError is TemplateError
    assert aioproc.forkserver.TemplateLost is TemplateLost
    assert TemplateError.__module__ == TemplateLost.__module__ == "aioproc.forkserver"
    assert issubclass(EtcdStartError, aioproc.rendezvous.RendezvousError)
    assert EtcdStartError("no etcd", endpoint_taken=True).endpoint_taken


def test_forced_kill_warning_is_a_runtime_warning() -> None:
    assert issubclass(ForcedKillWarning, RuntimeWarning)
    with pytest.warns(ForcedKillWarning, match="pid 4242"):
        warnings.warn("worker trainer/0 (pid 4242) needed SIGKILL", ForcedKillWarning, stacklevel=1)


def test_remote_traceback_shows_the_worker_traceback() -> None:
    err = RemoteTraceback(TRACEBACK)

    assert str(err) == TRACEBACK
    assert err.tb == TRACEBACK
    loaded = pickle.loads(pickle.dumps(err))
    assert type(loaded) is RemoteTraceback
    assert str(loaded) == TRACEBACK


# ---------------------------------------------------------------- ErrorHandler


def test_record_exception_outside_except_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # torch formats sys.exc_info() here and writes "NoneType: None".
    path = tmp_path / "error.json"
    monkeypatch.setenv(ENV, str(path))

    ErrorHandler().record_exception(ValueError("never raised"))

    data = json.loads(path.read_text())
    assert data["message"]["message"] == "ValueError: never raised"
    assert data["message"]["extraInfo"]["py_callstack"] == "ValueError: never raised\n"


def test_record_exception_unwritable_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(ENV, str(tmp_path))  # a directory

    ErrorHandler().record_exception(ValueError("x"))

    assert capsys.readouterr().err.startswith(
        f"aioproc: could not write error file {str(tmp_path)!r}"
    )


@pytest.mark.parametrize("already", [True, False])
def test_initialize_enables_faulthandler_like_torch(
    monkeypatch: pytest.MonkeyPatch, already: bool
) -> None:
    # torch enables it whether or not it already is (error_handler_test.py)
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(faulthandler, "is_enabled", lambda: already)
    monkeypatch.setattr(faulthandler, "enable", lambda **kw: calls.append(kw))

    ErrorHandler().initialize()

    assert calls == [{"all_threads": True}]


def test_initialize_tolerates_faulthandler_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(**kw: Any) -> None:
        raise RuntimeError("sys.stderr is None")

    monkeypatch.setattr(faulthandler, "enable", broken)

    with pytest.warns(RuntimeWarning) as caught:
        ErrorHandler().initialize()

    assert [str(w.message) for w in caught] == [
        "could not enable faulthandler: RuntimeError: sys.stderr is None"
    ]


def test_get_error_handler_is_what_record_uses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert type(errors.get_error_handler()) is ErrorHandler
    made: list[ErrorHandler] = []

    class Spy(ErrorHandler):
        def record_exception(self, e: BaseException) -> None:
            made.append(self)

    monkeypatch.setattr(errors, "get_error_handler", Spy)

    @record
    def main() -> None:
        raise ValueError("x")

    with pytest.raises(ValueError, match=r"^x$"):
        main()
    assert [type(h) for h in made] == [Spy]


def test_dump_error_file_without_own_error_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv(ENV, raising=False)
    child = write_json(tmp_path / "child.json", torch_record_data())

    ErrorHandler().dump_error_file(child, 1)

    assert sorted(p.name for p in tmp_path.iterdir()) == ["child.json"]
    assert caplog.records[0].levelno == logging.ERROR
    assert caplog.records[0].getMessage() == (
        f"TORCHELASTIC_ERROR_FILE is not set, so child error file {child} was not copied"
    )


def test_dump_error_file_rejects_unreadable_child_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        ErrorHandler().dump_error_file(str(tmp_path / "missing.json"))
    path = write_json(tmp_path / "list.json", [1, 2])
    with pytest.raises(ValueError, match="holds list, not a JSON object"):
        ErrorHandler().dump_error_file(path)


# ---------------------------------------------------------------- record


def test_record_writes_torch_error_json_and_reraises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "error.json"
    monkeypatch.setenv(ENV, str(path))

    @record
    def main() -> None:
        raise ValueError("boom")

    before = int(time.time())
    with pytest.raises(ValueError, match=r"^boom$"):
        main()
    after = int(time.time())

    text = path.read_text()
    extra = json.loads(text)["message"]["extraInfo"]
    # Same keys, order and separators as torch's json.dump of its dict.
    expected = {
        "message": {
            "message": "ValueError: boom",
            "extraInfo": {"py_callstack": extra["py_callstack"], "timestamp": extra["timestamp"]},
        }
    }
    assert text == json.dumps(expected)
    assert extra["py_callstack"].startswith("Traceback (most recent call last):\n")
    assert ', in main\n    raise ValueError("boom")\n' in extra["py_callstack"]
    assert extra["py_callstack"].endswith("\nValueError: boom\n")
    assert isinstance(extra["timestamp"], str)
    assert before <= int(extra["timestamp"]) <= after


def test_record_without_error_file_env(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.chdir(tmp_path)

    @record
    def main() -> None:
        raise KeyError("k")

    with pytest.raises(KeyError):
        main()

    assert list(tmp_path.iterdir()) == []
    assert [r.getMessage() for r in caplog.records] == [
        "TORCHELASTIC_ERROR_FILE is not set, so KeyError was not written to an error file"
    ]


def test_record_success_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "error.json"
    monkeypatch.setenv(ENV, str(path))

    @record
    def add(a: int, b: int = 0) -> int:
        return a + b

    assert add(2, b=3) == 5
    assert not path.exists()


@pytest.mark.parametrize(
    "exc", [SystemExit(None), SystemExit(3), SystemExit("bye"), KeyboardInterrupt()]
)
def test_record_passes_base_exceptions_through(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exc: BaseException
) -> None:
    # torch re-raises every SystemExit whose code is not 0 (None included)
    path = tmp_path / "error.json"
    monkeypatch.setenv(ENV, str(path))

    @record
    def main() -> None:
        raise exc

    with pytest.raises(type(exc)) as info:
        main()

    assert info.value is exc
    assert not path.exists()


@pytest.mark.parametrize("code", [0, False])
async def test_record_swallows_system_exit_zero_like_torch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    path = tmp_path / "error.json"
    monkeypatch.setenv(ENV, str(path))

    @record
    def main() -> int:
        raise SystemExit(code)

    @record
    async def amain() -> int:
        raise SystemExit(code)

    assert main() is None
    assert await amain() is None
    assert not path.exists()


def test_record_with_parentheses_and_custom_handler(tmp_path: Path) -> None:
    seen: list[str] = []

    class Handler(ErrorHandler):
        def initialize(self) -> None:
            seen.append("initialize")

        def record_exception(self, e: BaseException) -> None:
            seen.append(f"record {e!r}")

    @record()
    def plain(x: int) -> int:
        """Doubles x."""
        return 2 * x

    @record(error_handler=Handler())
    def failing() -> None:
        raise OSError("disk")

    assert plain(21) == 42
    assert plain.__name__ == "plain"
    assert plain.__doc__ == "Doubles x."
    assert plain.__wrapped__(1) == 2  # type: ignore[attr-defined]
    with pytest.raises(OSError, match="disk"):
        failing()
    assert seen == ["initialize", "record OSError('disk')"]


def test_record_coroutine_function(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "error.json"
    monkeypatch.setenv(ENV, str(path))

    @record
    async def main() -> None:
        await asyncio.sleep(0)
        raise ValueError("async boom")

    with pytest.raises(ValueError, match="async boom"):
        asyncio.run(main())

    assert json.loads(path.read_text())["message"]["message"] == "ValueError: async boom"


def test_record_child_failure_copies_root_cause(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    child = write_json(tmp_path / "trainer" / "0" / "error.json", torch_record_data())
    parent = tmp_path / "error.json"
    parent.write_text("stale")
    monkeypatch.setenv(ENV, str(parent))

    @record
    def launcher() -> None:
        pf = ProcessFailure(local_rank=0, pid=997, exitcode=-11, error_file=child)
        raise ChildFailedError("trainer", {0: pf})

    with pytest.raises(ChildFailedError):
        launcher()

    expected = torch_record_data()
    expected["message"]["errorCode"] = -11
    assert parent.read_text() == json.dumps(expected)
    assert [r.getMessage() for r in caplog.records] == [
        f"error file {parent} exists and is replaced; it held:\nstale"
    ]


def test_record_child_failure_flat_layout_copied_unchanged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = {"message": "test error message", "timestamp": 10}
    child = write_json(tmp_path / "child.json", data)
    parent = tmp_path / "error.json"
    monkeypatch.setenv(ENV, str(parent))

    @record
    def launcher() -> None:
        pf = ProcessFailure(local_rank=0, pid=997, exitcode=1, error_file=child)
        raise ChildFailedError("trainer", {0: pf})

    with pytest.raises(ChildFailedError):
        launcher()

    assert parent.read_text() == json.dumps(data)


@pytest.mark.parametrize("child_text", [None, "{not json"])
def test_record_child_failure_without_usable_error_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, child_text: str | None
) -> None:
    child = tmp_path / "child.json"
    if child_text is not None:
        child.write_text(child_text)
    parent = tmp_path / "error.json"
    monkeypatch.setenv(ENV, str(parent))

    @record
    def launcher() -> None:
        pf = ProcessFailure(local_rank=0, pid=997, exitcode=1, error_file=str(child))
        raise ChildFailedError("trainer", {0: pf})

    with pytest.raises(ChildFailedError) as info:
        launcher()

    # Not recorded as the launcher's own error either: torch does the same.
    assert not parent.exists()
    assert info.value.failures[0].pid == 997


def test_record_in_child_process_stays_light(tmp_path: Path) -> None:
    error_file = tmp_path / "error.json"
    report = tmp_path / "report.json"
    code = (
        "import faulthandler, json, sys\n"
        "from aioproc.errors import record\n"
        "@record\n"
        "def main():\n"
        "    with open(sys.argv[1], 'w') as f:\n"
        "        json.dump({'modules': sorted(sys.modules),\n"
        "                   'faulthandler': faulthandler.is_enabled()}, f)\n"
        "    raise RuntimeError('child boom')\n"
        "main()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONFAULTHANDLER"}
    env[ENV] = str(error_file)
    env["PYTHONPATH"] = str(REPO_ROOT)

    proc = subprocess.run(
        [sys.executable, "-c", code, str(report)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=30,
    )

    assert proc.returncode == 1
    assert proc.stderr.endswith("RuntimeError: child boom\n")
    message = json.loads(error_file.read_text())["message"]
    assert message["message"] == "RuntimeError: child boom"
    # -c code has no source lines to show, only where it raised.
    assert '  File "<string>", line 8, in main\n' in message["extraInfo"]["py_callstack"]
    child = json.loads(report.read_text())
    assert child["faulthandler"] is True
    assert "aioproc.errors" in child["modules"]
    forbidden = {"asyncio", "anyio", "aiofiles", "uvloop"}
    assert [m for m in child["modules"] if m.split(".")[0] in forbidden] == []


def test_summary_hints_at_record_where_torch_only_links_its_docs(tmp_path: Path) -> None:
    pf = ProcessFailure(local_rank=1, pid=4242, exitcode=3, error_file=str(tmp_path / "no.json"))
    lines = ChildFailedError("train", {5: pf}).format_msg().split("\n")

    at = lines.index(f"  traceback : {errors.NO_ERROR_FILE_MESSAGE}")
    assert lines[at + 1] == (
        "  hint      : exited with code 3 and wrote no error file; decorate its entrypoint "
        "with @aioproc.record (or torch's @record) to capture its traceback"
    )
    assert "  exitcode  : 3 (pid: 4242)" in lines
    # a signal has no error file either, but nothing to decorate: no hint
    killed = ProcessFailure(local_rank=0, pid=7, exitcode=-9, error_file="")
    text = ChildFailedError("train", {0: killed}).format_msg()
    assert "  exitcode  : -9 (pid: 7) (SIGKILL)" in text.split("\n")
    assert "hint" not in text


def test_entrypoint_fn_name_is_logged_never_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # newer torch's error_handler_test: the name goes to the log, not the file
    path = tmp_path / "error.json"
    monkeypatch.setenv(ENV, str(path))
    caplog.set_level(logging.DEBUG, logger="aioproc.errors")
    handler = ErrorHandler()
    handler.set_entrypoint_fn_name("raise_exception_fn")
    handler.record_exception(RuntimeError("foobar"))

    assert "entrypoint raise_exception_fn raised RuntimeError" in caplog.messages
    data = json.loads(path.read_text())
    assert sorted(data["message"]["extraInfo"]) == ["py_callstack", "timestamp"]


def test_record_success_logs_the_name_and_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "error.json"
    monkeypatch.setenv(ENV, str(path))
    caplog.set_level(logging.DEBUG, logger="aioproc.errors")
    ErrorHandler().record_success()  # no name: nothing logged
    assert caplog.messages == []
    handler = ErrorHandler()
    handler.set_entrypoint_fn_name("good_fn")
    handler.record_success()
    assert caplog.messages == ["entrypoint good_fn succeeded"]
    assert not path.exists()


async def test_record_names_the_entrypoint_and_reports_success(tmp_path: Path) -> None:
    calls: list[tuple[str, object]] = []

    class Spy(ErrorHandler):
        def set_entrypoint_fn_name(self, fn_name: str) -> None:
            calls.append(("name", fn_name))

        def record_success(self) -> None:
            calls.append(("success", None))

        def record_exception(self, e: BaseException) -> None:
            calls.append(("exception", type(e).__name__))

    @record(error_handler=Spy())
    def good() -> int:
        return 1

    @record(error_handler=Spy())
    async def agood() -> int:
        return 2

    @record(error_handler=Spy())
    def bad() -> None:
        raise KeyError("x")

    @record(error_handler=Spy())
    def quits() -> None:
        raise SystemExit(0)

    assert good() == 1
    assert await agood() == 2
    with pytest.raises(KeyError):
        bad()
    assert quits() is None
    assert calls == [
        ("name", "good"),
        ("success", None),
        ("name", "agood"),
        ("success", None),
        ("name", "bad"),
        ("exception", "KeyError"),
        ("name", "quits"),
        ("success", None),
    ]
