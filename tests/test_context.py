"""aioproc.context: start_processes, PContext, RunProcsResult and run, end to end.

Every test launches real workers: Python functions (run by aioproc's child
side in a fresh interpreter) or binaries.  Workers that must stay up block
on a FIFO the test releases (``helpers.release_fifo``) or sleep until aioproc
stops them; nothing here synchronises on a sleep.

Worker functions live in two places: a few are defined in this module (the
worker imports ``test_context`` by name, through the parent's ``sys.path``),
and most in ``children/ctx_workers.py``, which imports only the standard
library so a worker boots fast and its ``sys.modules`` shows exactly what
aioproc's child side loaded.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import json
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import threading
import types
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import (
    REPO_ROOT,
    aioproc_temp_dirs,
    child_pids,
    import_child,
    open_fds,
    pid_gone,
    release_fifo,
    write_file,
)
from helpers import envs as envs_for

import aioproc
from aioproc import ChildFailedError, DefaultLogsSpecs, PContext, ProcessFailure, Std
from aioproc._proc.lifeline import TOKEN_VAR as LIFELINE
from aioproc._proc.lifeline import lineage as lifeline_token
from aioproc.errors import ForcedKillWarning, RemoteTraceback

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is in the test extra
    uvloop = None

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
BANNED_IN_WORKERS = (
    "asyncio",
    "anyio",
    "aiofiles",
    "uvloop",
    "aioproc.context",
    "aioproc._supervisor",
    "aioproc._supervisor.spec",
    "aioproc._supervisor.supervisor",
    "aioproc._proc.spawn",
    "aioproc._output",
    "aioproc._proc.channel",
    "aioproc.logs",
    "aioproc.signals",
)
LIMIT = 10  # seconds: bound on any single wait for workers that should be quick


# ----------------------------------------------------------------- workers
# Defined here on purpose: a worker imports this module by name to find them.


def whoami(tag: str) -> dict[str, Any]:
    return {"tag": tag, "cwd": os.getcwd(), "path": list(sys.path)}


def raise_value_error(x: int) -> None:
    raise ValueError(f"bad value {x}")


class CustomError(Exception):
    pass


def raise_custom() -> None:
    raise CustomError("custom trouble")


class NeedsTwoArgs(Exception):
    """Pickles, but cannot be unpickled: ``__init__`` wants two arguments."""

    def __init__(self, a: str, b: str) -> None:
        super().__init__(f"{a}/{b}")


def raise_needs_two() -> None:
    raise NeedsTwoArgs("left", "right")


# ---------------------------------------------------------------- fixtures


@pytest.fixture(autouse=True)
def private_tmpdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """Point ``tempfile`` at a private dir: ``aioproc_*`` dirs are ours alone to count."""
    path = tmp_path / "tmp"
    path.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(path))
    assert tempfile.gettempdir() == str(path)
    return str(path)


@pytest.fixture
def workers(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """``children/ctx_workers``, importable by name in the parent and its workers."""
    return import_child(monkeypatch, "ctx_workers")


@pytest.fixture
def log_dir(tmp_path: Path) -> str:
    path = tmp_path / "logs"
    path.mkdir()
    return str(path)


@pytest.fixture
def fifo(tmp_path: Path) -> Iterator[tuple[str, Callable[[int], None]]]:
    path = str(tmp_path / "release.fifo")
    with release_fifo(path) as release:
        yield path, release


def failure_info(err: ChildFailedError) -> dict[int, tuple[int, bool]]:
    return {r: (f.exitcode, f.stopped) for r, f in err.failures.items()}


# ----------------------------------------------------- 1. function workers


def _tmp_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    mod_dir = tmp_path / "mods"
    mod_dir.mkdir()
    name = f"aioproc_ext_{uuid.uuid4().hex}"
    write_file(
        str(mod_dir / f"{name}.py"),
        "import os, sys\n\n"
        "def whoami(tag):\n"
        "    return {'tag': tag, 'cwd': os.getcwd(), 'path': list(sys.path), 'ext': True}\n",
    )
    monkeypatch.syspath_prepend(str(mod_dir))
    module = importlib.import_module(name)
    monkeypatch.setitem(sys.modules, name, module)  # undone (removed) after the test
    return module


@pytest.mark.parametrize("kind", ["module", "lambda", "closure", "tmp_module"])
async def test_function_worker_kinds(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    extra: dict[str, Any] = {}
    if kind == "module":
        fn: Callable[..., Any] = whoami
    elif kind == "lambda":
        fn = lambda tag: {"tag": tag, "cwd": os.getcwd(), "path": list(sys.path)}  # noqa: E731
    elif kind == "closure":
        secret = uuid.uuid4().hex

        def inner(tag: str) -> dict[str, Any]:
            return {"tag": tag, "cwd": os.getcwd(), "path": list(sys.path), "secret": secret}

        fn = inner
        extra = {"secret": secret}
    else:
        fn = _tmp_module(tmp_path, monkeypatch).whoami
        extra = {"ext": True}
    parent_path = [p for p in sys.path if isinstance(p, str)]

    result = await aioproc.run(fn, 2, args={0: ("a",), 1: ("b",)})

    assert not result.is_failed()
    assert result.failures == {}
    assert sorted(result.return_values) == [0, 1]
    for rank, tag in ((0, "a"), (1, "b")):
        value = result.return_values[rank]
        assert value["tag"] == tag
        assert value["cwd"] == os.getcwd()
        assert [p for p in parent_path if p not in value["path"]] == []
        for key, expected in extra.items():
            assert value[key] == expected


MAIN_SCRIPT = """\
import asyncio, os, sys
import aioproc

print("script body ran", flush=True)

def cube(x):
    return x ** 3

async def main():
    result = await aioproc.run(cube, 3, args={0: (2,), 1: (3,), 2: (4,)})
    print("RESULT", sorted(result.return_values.items()), flush=True)

if __name__ == "__main__":
    if sys.argv[1] == "uvloop":
        import uvloop
        uvloop.run(main())
    else:
        asyncio.run(main())
"""


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_function_defined_in_main_script(loop: str, tmp_path: Path) -> None:
    if loop == "uvloop" and uvloop is None:
        pytest.skip("uvloop not installed")
    script = write_file(str(tmp_path / "main_script.py"), MAIN_SCRIPT)
    env = {**os.environ, "PYTHONPATH": REPO_ROOT, "TMPDIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, script, loop],
        capture_output=True,
        text=True,
        env=env,
        cwd=str(tmp_path),
        timeout=30,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    # the workers got `cube` by value: none of them re-ran the script
    assert proc.stdout.splitlines() == ["script body ran", "RESULT [(0, 8), (1, 27), (2, 64)]"]
    assert not aioproc_temp_dirs(str(tmp_path))


@pytest.mark.timeout(40)
async def test_100mb_args_and_return_values(workers: types.ModuleType) -> None:
    size = 100 * 1024 * 1024
    payloads = {r: bytes([r + 1]) * (size - r) for r in range(2)}
    digests = {r: hashlib.sha256(p).hexdigest() for r, p in payloads.items()}

    result = await aioproc.run(workers.roundtrip, 2, args={r: (p,) for r, p in payloads.items()})

    assert sorted(result.return_values) == [0, 1]
    for rank, payload in payloads.items():
        length, digest, back = result.return_values[rank]
        assert length == len(payload)
        assert digest == digests[rank]
        assert back == payload


async def test_worker_exception_error_file_and_child_failed_error(log_dir: str) -> None:
    with pytest.raises(ChildFailedError) as info:
        await aioproc.run(raise_value_error, 1, args=(42,), logs_specs=DefaultLogsSpecs(log_dir))
    err = info.value
    rank, failure = err.get_first_failure()
    assert rank == 0
    assert failure.exitcode == 1
    assert failure.stopped is False
    assert failure.signal_name() == "<N/A>"

    # error.json sits in the rank's own log dir, in torch's @record layout
    assert failure.error_file.startswith(log_dir + os.sep)
    assert os.path.basename(os.path.dirname(failure.error_file)) == "0"
    assert os.path.basename(failure.error_file) == "error.json"
    with open(failure.error_file) as f:
        data = json.load(f)
    assert data == failure.error_file_data
    assert set(data) == {"message"}
    assert data["message"]["message"] == "ValueError: bad value 42"
    callstack = data["message"]["extraInfo"]["py_callstack"]
    assert callstack.startswith("Traceback (most recent call last):")
    assert 'raise ValueError(f"bad value {x}")' in callstack
    assert "in raise_value_error" in callstack
    assert callstack.rstrip().endswith("ValueError: bad value 42")
    assert int(data["message"]["extraInfo"]["timestamp"]) == failure.timestamp
    assert failure.message == data["message"]

    text = str(err)
    assert "raise_value_error FAILED" in text
    assert "ValueError: bad value 42" in text
    assert 'raise ValueError(f"bad value {x}")' in text
    assert err.format_msg() == text

    cause = err.__cause__
    assert type(cause) is ValueError
    assert cause.args == ("bad value 42",)
    remote = cause.__cause__
    assert isinstance(remote, RemoteTraceback)
    assert 'raise ValueError(f"bad value {x}")' in str(remote)
    assert "in raise_value_error" in str(remote)
    assert str(remote).rstrip().endswith("ValueError: bad value 42")


async def test_worker_exception_of_a_custom_class_is_rebuilt() -> None:
    with pytest.raises(ChildFailedError) as info:
        await aioproc.run(raise_custom, 1)
    assert type(info.value.__cause__) is CustomError
    assert str(info.value.__cause__) == "custom trouble"
    assert "CustomError: custom trouble" in str(info.value)


async def test_worker_exception_that_cannot_be_unpickled_becomes_remote_traceback() -> None:
    with pytest.raises(ChildFailedError) as info:
        await aioproc.run(raise_needs_two, 1)
    cause = info.value.__cause__
    assert isinstance(cause, RemoteTraceback)
    assert "NeedsTwoArgs" in str(cause)
    assert "left/right" in str(cause)
    assert isinstance(cause.__cause__, RemoteTraceback)
    assert "raise NeedsTwoArgs" in str(cause.__cause__)


async def test_sys_exit_0_gives_none(workers: types.ModuleType) -> None:
    result = await aioproc.run(workers.exit_with, 2, args=(0,))
    assert result.return_values == {0: None, 1: None}
    assert result.failures == {}


async def test_sys_exit_138_gives_exitcode_138(workers: types.ModuleType) -> None:
    with pytest.raises(ChildFailedError) as info:
        await aioproc.run(workers.exit_with, 1, args=(138,))
    _, failure = info.value.get_first_failure()
    assert failure.exitcode == 138
    assert failure.signal_name() == "<N/A>"
    assert failure.error_file == "<N/A>"
    # torch's text; the summary adds the hint
    assert failure.message == aioproc.errors.NO_ERROR_FILE_MESSAGE
    assert "  hint      : exited with code 138 and wrote no error file" in str(info.value)
    assert "exitcode  : 138" in str(info.value)
    assert pid_gone(failure.pid)


async def test_segfault_gives_sigsegv(workers: types.ModuleType) -> None:
    with pytest.raises(ChildFailedError) as info:
        await aioproc.run(workers.segfault, 1)
    _, failure = info.value.get_first_failure()
    assert failure.exitcode == -signal.SIGSEGV == -11
    assert failure.signal_name() == "SIGSEGV"
    assert failure.message == f"Signal 11 (SIGSEGV) received by PID {failure.pid}"
    assert failure.stopped is False
    assert pid_gone(failure.pid)


@pytest.mark.parametrize(
    ("fn_name", "type_name"), [("return_lock", "lock"), ("return_generator", "generator")]
)
async def test_unpicklable_return_value_fails_the_rank(
    workers: types.ModuleType, fn_name: str, type_name: str
) -> None:
    with pytest.raises(ChildFailedError) as info:
        await aioproc.run(getattr(workers, fn_name), 1)
    _, failure = info.value.get_first_failure()
    assert failure.exitcode == 1
    assert isinstance(failure.message, dict)
    message = failure.message["message"]
    assert message.startswith("TypeError: ")
    assert f"of type {type_name} cannot be pickled" in message
    assert f"of type {type_name} cannot be pickled" in str(info.value)
    assert type(info.value.__cause__) is TypeError


async def test_keyboard_interrupt_in_worker_ends_it_by_sigint(workers: types.ModuleType) -> None:
    with pytest.raises(ChildFailedError) as info:
        await aioproc.run(workers.raise_keyboard_interrupt, 1)
    _, failure = info.value.get_first_failure()
    assert failure.exitcode == -signal.SIGINT
    assert failure.signal_name() == "SIGINT"


async def test_return_value_that_cannot_be_unpickled_fails_the_rank(
    workers: types.ModuleType,
) -> None:
    with pytest.raises(ChildFailedError) as info:
        await aioproc.run(workers.return_unloadable, 1)
    _, failure = info.value.get_first_failure()
    assert failure.exitcode == 0  # the worker itself succeeded
    assert isinstance(failure.message, str)
    assert "could not be unpickled in the supervisor" in failure.message
    assert "refuses to be unpickled" in failure.message
    assert "refuses to be unpickled" in str(info.value)


async def test_function_the_worker_cannot_import_fails_the_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = _tmp_module(tmp_path, monkeypatch)
    os.remove(module.__file__)  # importable in the parent (cached), gone for workers
    with pytest.raises(ChildFailedError) as info:
        await aioproc.run(module.whoami, 1, args=("x",))
    _, failure = info.value.get_first_failure()
    assert failure.exitcode == 1
    assert isinstance(failure.message, dict)
    assert "could not unpickle the worker function" in failure.message["message"]
    assert module.__name__ in failure.message["message"]


# ----------------------------------------------- 2. the child side stays light


def _banned(modules: list[str]) -> list[str]:
    return [m for m in modules if m in BANNED_IN_WORKERS or m.split(".")[0] in BANNED_IN_WORKERS]


async def test_worker_imports_no_event_loop_or_parent_modules(workers: types.ModuleType) -> None:
    result = await aioproc.run(workers.loaded_modules, 1)
    modules = result.return_values[0]
    assert "ctx_workers" in modules  # it really ran our function
    assert _banned(modules) == []
    assert "_pickle" not in modules  # by name with core-type arguments: marshal only
    # the boot code arrives with its channel module bound: no package import
    assert [m for m in modules if m.split(".")[0] == "aioproc"] == [
        "aioproc._child.boot",
        "aioproc._child.channel",
        "aioproc._child.pickling",
    ]


async def test_pickled_worker_imports_no_event_loop_or_parent_modules(
    workers: types.ModuleType,
) -> None:
    # a lambda travels by value (_func.pickling), a different path in the worker
    fn = lambda: sorted(sys.modules)  # noqa: E731
    result = await aioproc.run(fn, 1)
    assert _banned(result.return_values[0]) == []
    assert "cloudpickle" not in result.return_values[0]


async def test_failing_worker_imports_no_event_loop_or_parent_modules(
    workers: types.ModuleType, tmp_path: Path
) -> None:
    dump = str(tmp_path / "modules.txt")
    with pytest.raises(ChildFailedError):
        await aioproc.run(workers.record_modules_then_raise, 1, args=(dump,))
    with open(dump) as f:
        modules = f.read().split("\n")
    assert "ctx_workers" in modules
    assert _banned(modules) == []


# ------------------------------------------------------------ 3. environment


async def test_function_worker_env_is_parent_env_plus_rank_env(
    workers: types.ModuleType, log_dir: str
) -> None:
    before = dict(os.environ)
    envs = {
        0: {"AIOPROC_TEST_RANK": "0", "AIOPROC_TEST_ONLY0": "x y\nz"},
        1: {"AIOPROC_TEST_RANK": "1", "HOME": "/nonexistent-home"},
    }
    async with aioproc.start_processes(
        "env", workers.environment, {0: (), 1: ()}, envs, DefaultLogsSpecs(log_dir)
    ) as pc:
        result = await pc.wait()
    assert result is not None
    assert result.failures == {}
    for rank in (0, 1):
        expected = {**before, **envs[rank], ERROR_FILE_ENV: pc.error_files[rank]}
        # the supervisor's lifeline token: how its guardian finds its workers
        expected[LIFELINE] = lifeline_token()
        assert result.return_values[rank] == expected
        assert pc.error_files[rank].startswith(log_dir + os.sep)
    assert dict(os.environ) == before
    assert envs[0] == {"AIOPROC_TEST_RANK": "0", "AIOPROC_TEST_ONLY0": "x y\nz"}


async def test_binary_worker_env_is_parent_env_plus_rank_env(log_dir: str) -> None:
    before = dict(os.environ)
    envs = {0: {"AIOPROC_TEST_RANK": "0"}, 1: {"AIOPROC_TEST_RANK": "1", "PATH": os.defpath}}
    async with aioproc.start_processes(
        "env",
        "/usr/bin/env",
        {0: ("-0",), 1: ("-0",)},
        envs,
        DefaultLogsSpecs(log_dir, redirects=Std.OUT),
    ) as pc:
        result = await pc.wait()
    assert result is not None
    assert result.return_values == {0: None, 1: None}
    for rank in (0, 1):
        with open(result.stdouts[rank], "rb") as f:
            raw = f.read()
        entries = [e for e in raw.split(b"\0") if e]
        got = dict(os.fsdecode(e).split("=", 1) for e in entries)
        assert got == {
            **before,
            **envs[rank],
            ERROR_FILE_ENV: pc.error_files[rank],
            LIFELINE: lifeline_token(),
        }
    assert dict(os.environ) == before


# ---------------------------------------------------------- 4. all-or-nothing


@pytest.mark.timeout(LIMIT)
async def test_function_worker_failure_stops_the_others(workers: types.ModuleType) -> None:
    with pytest.raises(ChildFailedError) as info:
        await aioproc.run(workers.fail_or_block, 4, args={r: (r, 2) for r in range(4)})
    err = info.value
    root, failure = err.get_first_failure()
    assert root == 2
    assert (failure.exitcode, failure.stopped) == (1, False)
    assert failure.message["message"] == "RuntimeError: rank 2 gave up"
    assert type(err.__cause__) is RuntimeError
    assert str(err.__cause__) == "rank 2 gave up"
    assert failure_info(err) == {0: (-15, True), 1: (-15, True), 2: (1, False), 3: (-15, True)}
    for rank in (0, 1, 3):
        other = err.failures[rank]
        assert other.message == f"Signal 15 (SIGTERM) received by PID {other.pid}"
        assert other.signal_name() == "SIGTERM"
        assert other.error_file == "<N/A>"
    assert "(stopped by aioproc)" in str(err)
    assert all(pid_gone(f.pid) for f in err.failures.values())


@pytest.mark.timeout(LIMIT)
async def test_binary_worker_failure_stops_the_others() -> None:
    args = {0: ("-c", "import sys; sys.exit(3)")}
    args.update({r: ("-c", "import time; time.sleep(60)") for r in (1, 2, 3)})
    with pytest.raises(ChildFailedError) as info:
        await aioproc.run(sys.executable, 4, args=args)
    err = info.value
    root, failure = err.get_first_failure()
    assert root == 0
    assert (failure.exitcode, failure.stopped) == (3, False)
    assert err.__cause__ is None
    assert failure_info(err) == {0: (3, False), 1: (-15, True), 2: (-15, True), 3: (-15, True)}
    for rank in (1, 2, 3):
        other = err.failures[rank]
        assert other.message == f"Signal 15 (SIGTERM) received by PID {other.pid}"
    assert all(pid_gone(f.pid) for f in err.failures.values())


@pytest.mark.timeout(LIMIT)
async def test_start_processes_failure_stops_the_others(workers: types.ModuleType) -> None:
    async with aioproc.start_processes(
        "aon", workers.fail_or_block, {r: (r, 0) for r in range(3)}, envs_for(3)
    ) as pc:
        pids = pc.pids()
        result = await pc.wait()
        assert result is not None
        assert result.is_failed()
        assert result.return_values == {}
        assert {r: (f.exitcode, f.stopped) for r, f in result.failures.items()} == {
            0: (1, False),
            1: (-15, True),
            2: (-15, True),
        }
        assert {r: f.pid for r, f in result.failures.items()} == pids
        # the group is over before close(): the workers were reaped already
        assert all(pid_gone(pid) for pid in pids.values())


# ----------------------------------------------------------- 5. binary workers


async def test_binary_echo_returns_none(log_dir: str) -> None:
    result = await aioproc.run(
        "/bin/echo",
        3,
        args={r: (f"hello from {r}",) for r in range(3)},
        logs_specs=DefaultLogsSpecs(log_dir, redirects=Std.OUT),
    )
    assert result.return_values == {0: None, 1: None, 2: None}
    assert result.failures == {}
    for rank in range(3):
        assert Path(result.stdouts[rank]).read_text() == f"hello from {rank}\n"
        assert result.stderrs[rank] == ""


async def test_binary_found_on_path() -> None:
    result = await aioproc.run("true", 2)
    assert result.return_values == {0: None, 1: None}


async def test_binary_exit_code_propagates() -> None:
    with pytest.raises(ChildFailedError) as info:
        await aioproc.run("/bin/sh", 1, args=("-c", "exit 7"))
    _, failure = info.value.get_first_failure()
    assert failure.exitcode == 7
    assert failure.error_file == "<N/A>"
    assert info.value.name == "sh"
    assert "exitcode  : 7" in str(info.value)


async def test_binary_args_are_stringified(log_dir: str) -> None:
    result = await aioproc.run(
        "/bin/echo",
        1,
        args={0: (1, 2.5, Path("p/q"), "-n-")},
        logs_specs=DefaultLogsSpecs(log_dir, redirects=Std.OUT),
    )
    assert Path(result.stdouts[0]).read_text() == "1 2.5 p/q -n-\n"


async def test_binary_args_are_not_run_through_a_shell(log_dir: str) -> None:
    result = await aioproc.run(
        "/bin/echo",
        1,
        args=("$HOME", "a;b", "`id`", "*"),
        logs_specs=DefaultLogsSpecs(log_dir, redirects=Std.OUT),
    )
    assert Path(result.stdouts[0]).read_text() == "$HOME a;b `id` *\n"


async def test_binary_found_on_the_rank_path(tmp_path: Path, log_dir: str) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    write_file(str(bin_dir / "aioproc-test-tool"), '#!/bin/sh\necho "tool $1"\n', 0o755)
    path = f"{bin_dir}{os.pathsep}{os.environ.get('PATH', os.defpath)}"
    result = await aioproc.run(
        "aioproc-test-tool",
        2,
        args={0: ("a",), 1: ("b",)},
        envs={0: {"PATH": path}, 1: {"PATH": path}},
        logs_specs=DefaultLogsSpecs(log_dir, redirects=Std.OUT),
    )
    assert result.return_values == {0: None, 1: None}
    assert [Path(result.stdouts[r]).read_text() for r in (0, 1)] == ["tool a\n", "tool b\n"]


BINARY_WRITES_ERROR_FILE = """\
import json, os, sys
extra = {"py_callstack": "Traceback: binary frames", "timestamp": "1700000000"}
data = {"message": {"message": "RuntimeError: from a binary", "extraInfo": extra}}
with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
    json.dump(data, f)
sys.exit(5)
"""


async def test_binary_worker_error_file_is_read(log_dir: str) -> None:
    with pytest.raises(ChildFailedError) as info:
        await aioproc.run(
            sys.executable,
            1,
            args=("-c", BINARY_WRITES_ERROR_FILE),
            logs_specs=DefaultLogsSpecs(log_dir),
        )
    _, failure = info.value.get_first_failure()
    assert failure.exitcode == 5
    assert failure.error_file.startswith(log_dir + os.sep)
    assert failure.message == {
        "message": "RuntimeError: from a binary",
        "extraInfo": {"py_callstack": "Traceback: binary frames", "timestamp": "1700000000"},
    }
    assert failure.timestamp == 1700000000
    assert "Traceback: binary frames" in str(info.value)


# --------------------------------------------------------------------- 6. API


async def test_pcontext_api_while_running_and_after(
    workers: types.ModuleType, fifo: tuple[str, Callable[[int], None]], log_dir: str
) -> None:
    path, release = fifo
    args = {0: (path, "zero"), 1: (path, "one")}
    envs = {0: {"A": "0"}, 1: {"A": "1"}}
    async with aioproc.start_processes(
        "api", workers.wait_fifo, args, envs, DefaultLogsSpecs(log_dir, redirects=Std.ALL)
    ) as pc:
        assert isinstance(pc, PContext)
        assert repr(pc) == "<PContext api nprocs=2 function running>"
        pids = pc.pids()
        assert sorted(pids) == [0, 1]
        assert len(set(pids.values())) == 2
        assert not any(pid_gone(pid) for pid in pids.values())
        assert set(pids.values()) <= child_pids()

        assert pc.poll() is None
        assert await pc.wait(timeout=0) is None
        assert await pc.wait(timeout=0.2) is None
        assert pc.poll() is None

        # attributes, torch's names
        assert pc.name == "api"
        assert pc.entrypoint is workers.wait_fifo
        assert pc.nprocs == 2
        assert pc.args == args
        for rank in (0, 1):
            assert pc.envs[rank] == {**envs[rank], ERROR_FILE_ENV: pc.error_files[rank]}
            rank_dir = os.path.dirname(pc.error_files[rank])
            assert rank_dir.startswith(log_dir + os.sep)
            assert os.path.basename(rank_dir) == str(rank)
            assert pc.stdouts[rank] == os.path.join(rank_dir, "stdout.log")
            assert pc.stderrs[rank] == os.path.join(rank_dir, "stderr.log")
            assert os.path.exists(pc.stdouts[rank])

        release(2)
        result = await asyncio.wait_for(pc.wait(), LIMIT)
        assert result is not None
        assert result.return_values == {0: "zero", 1: "one"}
        assert result.failures == {}
        assert not result.is_failed()
        assert result.stdouts == pc.stdouts
        assert result.stderrs == pc.stderrs
        assert pc.poll() == result
        assert await pc.wait() == result
        assert await pc.wait(timeout=0) == result
        # as torch's wait(), a final result also closes the group
        assert repr(pc) == "<PContext api nprocs=2 function closed>"
        assert all(pid_gone(pid) for pid in pids.values())
    assert repr(pc) == "<PContext api nprocs=2 function closed>"
    assert pc.poll() == result
    assert pc.pids() == pids


async def test_start_twice_raises(workers: types.ModuleType) -> None:
    pc = await aioproc.start_processes("twice", workers.square, {0: (3,)}, {0: {}})
    try:
        with pytest.raises((RuntimeError, ValueError)) as info:
            await pc.start()
        assert isinstance(info.value, ValueError)  # as torch raises
        assert isinstance(info.value, RuntimeError)
        assert "already started" in str(info.value)
        result = await pc.wait()
        assert result is not None
        assert result.return_values == {0: 9}
    finally:
        await pc.close()
    with pytest.raises((RuntimeError, ValueError)):
        await pc.start()


async def test_close_stops_running_workers_and_is_idempotent(
    workers: types.ModuleType, fifo: tuple[str, Callable[[int], None]]
) -> None:
    path, _release = fifo
    pc = await aioproc.start_processes(
        "closing", workers.wait_fifo, {0: (path,), 1: (path,)}, envs_for(2)
    )
    pids = pc.pids()
    await pc.close()
    result = pc.poll()
    assert result is not None
    assert {r: (f.exitcode, f.stopped) for r, f in result.failures.items()} == {
        0: (-15, True),
        1: (-15, True),
    }
    assert all(pid_gone(pid) for pid in pids.values())
    await pc.close()
    assert pc.poll() == result
    assert repr(pc) == "<PContext closing nprocs=2 function closed>"


async def test_run_timeout_stops_the_workers(workers: types.ModuleType) -> None:
    """The timeout is a named ``TimeoutError`` carrying the partial result, which pickles."""
    with pytest.raises(TimeoutError) as info:
        await aioproc.run(workers.fail_or_block, 2, args={0: (0, -1), 1: (1, -1)}, timeout=0.5)
    assert type(info.value) is aioproc.errors.RunTimeoutError is aioproc.RunTimeoutError
    assert "workers still running after 0.5 s; stopped ranks [0, 1]" in str(info.value)
    partial = info.value.result
    assert partial is not None
    assert {r: (f.exitcode, f.stopped) for r, f in partial.failures.items()} == {
        0: (-15, True),
        1: (-15, True),
    }
    assert all(pid_gone(f.pid) for f in partial.failures.values())
    again = pickle.loads(pickle.dumps(info.value))
    assert (type(again), str(again)) == (type(info.value), str(info.value))
    assert again.result is not None and sorted(again.result.failures) == [0, 1]


async def test_unstarted_pcontext(workers: types.ModuleType) -> None:
    pc = PContext("new", workers.square, {0: (1,)}, {0: {}}, DefaultLogsSpecs())
    assert repr(pc) == "<PContext new nprocs=1 function new>"
    assert pc.pids() == {}
    with pytest.raises(RuntimeError, match="not been started"):
        pc.poll()
    with pytest.raises(RuntimeError, match="not been started"):
        await pc.wait()
    await pc.close()  # nothing to stop


def test_run_procs_result() -> None:
    ok = aioproc.RunProcsResult(return_values={0: 1})
    assert not ok.is_failed()
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file="")
    assert aioproc.RunProcsResult(failures={0: failure}).is_failed()


# -------------------------------------------------------------- 7. bad input


def _lock_closure() -> Callable[[], None]:
    lock = threading.Lock()

    def uses_lock() -> None:
        with lock:
            pass

    return uses_lock


def _bad_inputs(tmp_path: Path, workers: types.ModuleType) -> dict[str, Any]:
    not_exec = write_file(str(tmp_path / "not-executable.sh"), "#!/bin/sh\nexit 0\n", 0o644)
    exec_garbage = write_file(str(tmp_path / "garbage.bin"), "\x7fELFnot really\n", 0o755)
    a_file = write_file(str(tmp_path / "a-file"), "")
    return {
        "missing binary by path": (
            dict(entrypoint="/nonexistent/aioproc-no-such-binary"),
            FileNotFoundError,
            ["/nonexistent/aioproc-no-such-binary"],
        ),
        "missing binary on PATH": (
            dict(entrypoint="aioproc-no-such-binary-on-path"),
            FileNotFoundError,
            ["aioproc-no-such-binary-on-path"],
        ),
        "not executable": (dict(entrypoint=not_exec), PermissionError, [not_exec]),
        "directory": (dict(entrypoint=str(tmp_path)), PermissionError, [str(tmp_path)]),
        "exec format error": (dict(entrypoint=exec_garbage), OSError, [exec_garbage]),
        "args rank keys": (
            dict(args={0: (), 2: ()}, envs={0: {}, 2: {}}),
            RuntimeError,
            ["[0, 1]", "[0, 2]"],
        ),
        "envs rank keys": (dict(envs={0: {}}), RuntimeError, ["envs", "[0, 1]", "[0]"]),
        "entrypoint not callable": (dict(entrypoint=42), TypeError, ["42"]),
        "entrypoint None": (dict(entrypoint=None), TypeError, ["None"]),
        "empty args": (dict(args={}, envs={}), ValueError, ["empty"]),
        "args not tuples": (dict(args={0: 5, 1: ()}), TypeError, ["args[0]", "5"]),
        "env value int": (dict(envs={0: {"ANSWER": 42}, 1: {}}), TypeError, ["ANSWER", "42"]),
        "env value None": (dict(envs={0: {}, 1: {"GONE": None}}), TypeError, ["GONE", "None"]),
        "env key int": (dict(envs={0: {7: "x"}, 1: {}}), TypeError, ["7"]),
        "log_dir is a file": (
            dict(logs_specs=lambda: DefaultLogsSpecs(log_dir=a_file)),
            NotADirectoryError,
            [a_file],
        ),
        "start_method fork": (dict(start_method="fork"), ValueError, ["'fork'"]),
        "start_method bogus": (dict(start_method="bogus"), ValueError, ["'bogus'"]),
        "unpicklable function": (
            dict(entrypoint=_lock_closure()),
            TypeError,
            ["cannot be pickled", "uses_lock"],
        ),
        "unpicklable args": (
            dict(entrypoint=workers.square, args={0: (threading.Lock(),), 1: (1,)}),
            TypeError,
            ["args for local rank 0", "lock"],
        ),
    }


BAD_INPUT_CASES = [
    "missing binary by path",
    "missing binary on PATH",
    "not executable",
    "directory",
    "exec format error",
    "args rank keys",
    "envs rank keys",
    "entrypoint not callable",
    "entrypoint None",
    "empty args",
    "args not tuples",
    "env value int",
    "env value None",
    "env key int",
    "log_dir is a file",
    "start_method fork",
    "start_method bogus",
    "unpicklable function",
    "unpicklable args",
]


@pytest.mark.parametrize("case", BAD_INPUT_CASES)
async def test_bad_input_raises_and_leaves_nothing_behind(
    case: str, tmp_path: Path, workers: types.ModuleType, private_tmpdir: str
) -> None:
    overrides, exc_type, needles = _bad_inputs(tmp_path, workers)[case]
    kwargs: dict[str, Any] = {
        "name": "bad",
        "entrypoint": "/bin/true",
        "args": {0: (), 1: ()},
        "envs": {0: {}, 1: {}},
        "logs_specs": None,
        "start_method": "spawn",
    }
    kwargs.update(overrides)
    children_before = child_pids()
    fds_before = open_fds()

    async def start() -> None:
        if callable(kwargs["logs_specs"]):  # DefaultLogsSpecs itself may raise
            kwargs["logs_specs"] = kwargs["logs_specs"]()
        await aioproc.start_processes(**kwargs)

    with pytest.raises(exc_type) as info:
        await start()

    assert type(info.value) is exc_type or exc_type is OSError
    for needle in needles:
        assert needle in str(info.value)
    assert child_pids() == children_before
    assert open_fds() == fds_before
    assert aioproc_temp_dirs(private_tmpdir) == set()


async def test_exec_format_error_is_errno_8(tmp_path: Path) -> None:
    path = write_file(str(tmp_path / "garbage.bin"), "\x7fELFnot really\n", 0o755)
    with pytest.raises(OSError, match="Exec format error") as info:
        await aioproc.run(path, 2)
    assert info.value.errno == 8
    assert path in str(info.value)


@pytest.mark.parametrize("nprocs", [0, -1, 1.5, True, "2"])
async def test_run_bad_nprocs(nprocs: Any, private_tmpdir: str) -> None:
    children_before = child_pids()
    with pytest.raises(ValueError, match="nprocs") as info:
        await aioproc.run("/bin/true", nprocs)
    assert repr(nprocs) in str(info.value)
    assert child_pids() == children_before
    assert aioproc_temp_dirs(private_tmpdir) == set()


@pytest.mark.parametrize(
    ("args", "named"), [({0: (), 1: ()}, "2 ranks [0, 1]"), ({0: (), 1: (), 5: ()}, "[0, 1, 5]")]
)
async def test_run_args_size_mismatch(
    args: dict[int, tuple[()]], named: str, private_tmpdir: str
) -> None:
    """A ``{local_rank: tuple}`` that does not cover ranks 0..nprocs-1 is a ValueError
    naming the ranks given and ``nprocs``, raised before anything starts."""
    children_before = child_pids()
    with pytest.raises(ValueError, match="but nprocs is 3") as info:
        await aioproc.run("/bin/true", 3, args=args)
    assert not isinstance(info.value, RuntimeError)
    assert named in str(info.value)
    assert "nprocs is 3" in str(info.value)
    assert child_pids() == children_before
    assert aioproc_temp_dirs(private_tmpdir) == set()


async def test_spawn_failure_part_way_stops_started_workers(
    workers: types.ModuleType,
    fifo: tuple[str, Callable[[int], None]],
    monkeypatch: pytest.MonkeyPatch,
    private_tmpdir: str,
) -> None:
    """A worker that cannot be launched (EMFILE, EAGAIN...) after others were: they are reaped."""

    real_spawn = aioproc._proc.spawn.spawn
    started: list[int] = []

    async def spawn_then_fail(label: str, *args: Any, **kwargs: Any) -> Any:
        if label.endswith("/1"):
            raise OSError(24, "Too many open files (simulated)")
        child = await real_spawn(label, *args, **kwargs)
        started.append(child.pid)
        return child

    _patch_spawn(monkeypatch, spawn_then_fail)
    path, _release = fifo
    children_before = child_pids()
    with warnings.catch_warnings():
        # the stop after a failed start is by SIGKILL
        warnings.simplefilter("ignore", ForcedKillWarning)
        with pytest.raises(OSError, match="simulated"):
            await aioproc.start_processes(
                "partial", workers.wait_fifo, {r: (path,) for r in range(3)}, envs_for(3)
            )
    # rank 0 started; rank 2 may have been in flight when rank 1 failed
    assert 1 <= len(started) <= 2
    assert all(pid_gone(pid) for pid in started)
    assert child_pids() == children_before
    assert aioproc_temp_dirs(private_tmpdir) == set()


async def test_spawn_failure_part_way_warns_nothing(
    workers: types.ModuleType,
    fifo: tuple[str, Callable[[int], None]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:

    real_spawn = aioproc._proc.spawn.spawn

    async def spawn_then_fail(label: str, *args: Any, **kwargs: Any) -> Any:
        if label.endswith("/1"):
            raise OSError(24, "Too many open files (simulated)")
        return await real_spawn(label, *args, **kwargs)

    _patch_spawn(monkeypatch, spawn_then_fail)
    path, _release = fifo
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(OSError, match="simulated"):
            await aioproc.start_processes(
                "partial", workers.wait_fifo, {r: (path,) for r in range(2)}, envs_for(2)
            )
    assert [str(w.message) for w in caught if issubclass(w.category, ForcedKillWarning)] == []


def _patch_spawn(monkeypatch: pytest.MonkeyPatch, fake: Any) -> None:
    """Replace ``spawn`` where workers start: binary ones in ``_group.rank_launcher``,
    function ones in ``_func.launch``."""
    import aioproc._func.launch as launch
    import aioproc._group.rank_launcher as ranks

    monkeypatch.setattr(ranks, "spawn", fake)
    monkeypatch.setattr(launch, "spawn", fake)


# -------------------------------------------------------- 8. no leaks at scale


@pytest.mark.timeout(50)
async def test_many_start_close_cycles_leak_nothing(
    workers: types.ModuleType, private_tmpdir: str
) -> None:
    async def cycle(i: int) -> None:
        async with aioproc.start_processes("cycle", "/bin/true", {0: (), 1: ()}, envs_for(2)) as pc:
            if i % 2 == 0:
                result = await pc.wait()
                assert result is not None
                assert result.return_values == {0: None, 1: None}
        # odd cycles close at once, racing the workers' own exit: either way is fine
        assert all(pid_gone(pid) for pid in pc.pids().values())

    # warm up what a loop opens lazily (uvloop keeps a /dev/null fd after a first worker)
    await cycle(-2)
    await aioproc.run(workers.square, 1, args=(1,))
    fds_before = open_fds()
    children_before = child_pids()
    for i in range(200):
        await cycle(i)
    for _ in range(3):
        result = await aioproc.run(workers.square, 2, args=(5,))
        assert result.return_values == {0: 25, 1: 25}
    assert open_fds() == fds_before
    assert child_pids() == children_before
    assert aioproc_temp_dirs(private_tmpdir) == set()


# ------------------------------------------------------- library bugs, pinned


@pytest.mark.timeout(30)
async def test_tee_worker_result_is_recorded(log_dir: str) -> None:
    """Regression: a tee'd worker's pipe EOF is often seen before its exit; the
    watcher used to crash on the closed pipe and wait() never completed."""
    specs = DefaultLogsSpecs(log_dir, tee=Std.OUT)
    outcomes: list[tuple[dict[int, Any], str] | None] = []
    for i in range(10):
        async with aioproc.start_processes(
            "tee", "/bin/echo", {0: (f"line {i}",)}, {0: {}}, specs, grace_period=1
        ) as pc:
            result = await pc.wait(timeout=LIMIT)
        if result is None:
            outcomes.append(None)
            break
        outcomes.append((result.return_values, Path(result.stdouts[0]).read_text()))
    assert None not in outcomes, f"wait() did not complete in cycle {len(outcomes) - 1}"
    assert outcomes == [({0: None}, f"line {i}\n") for i in range(10)]


@pytest.mark.timeout(30)
async def test_failure_during_start_stops_later_ranks(
    workers: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 fails while rank 1 is still being launched.

    Forced, not left to chance: rank 1 is spawned only once the supervisor has
    recorded rank 0's failure (the moment it builds its ProcessFailure).
    Unforced, the same happens with many ranks on uvloop.
    """
    from aioproc._supervisor import exits

    real_spawn = aioproc._proc.spawn.spawn
    noticed = asyncio.Event()

    class NoticedFailure(ProcessFailure):
        def __post_init__(self) -> None:
            super().__post_init__()
            if self.local_rank == 0:
                noticed.set()

    async def late_spawn(label: str, *args: Any, **kwargs: Any) -> Any:
        if label.endswith("/1"):
            await asyncio.wait_for(noticed.wait(), LIMIT)
        return await real_spawn(label, *args, **kwargs)

    _patch_spawn(monkeypatch, late_spawn)
    monkeypatch.setattr(exits, "ProcessFailure", NoticedFailure)
    pc = await aioproc.start_processes(
        "late", workers.fail_or_block, {0: (0, 0), 1: (1, 0)}, envs_for(2), grace_period=1
    )
    try:
        result = await pc.wait(timeout=3)
        assert result is not None, "wait() hangs: rank 1 was never stopped"
        assert {r: (f.exitcode, f.stopped) for r, f in result.failures.items()} == {
            0: (1, False),
            1: (-15, True),
        }
    finally:
        await pc.close(timeout=1)


def test_rank_dirs_are_made_in_chunks_that_double_the_big_ones_by_one_process() -> None:
    """A launch's units (rank 0 alone, then batches) are grouped into a few chunks:
    the first two alone, for the first workers, then chunks that double, whose
    dirs one ``mkdir`` process makes, so the thread making them takes the GIL
    a few times instead of once per dir."""
    from aioproc._group import rankdirs as _rankdirs

    units = [range(0, 1), *(range(i, min(i + 16, 1024)) for i in range(1, 1024, 16))]
    dirs = {r: str(r) for r in range(1024)}
    layout = _rankdirs.chunks(units, dirs)
    assert [sum(map(len, chunk)) for chunk in layout] == [1, 16, 32, 64, 128, 256, 527]
    assert [u for chunk in layout for u in chunk] == units  # every unit once, in order
    # function workers start one by one: a unit per rank
    single = [range(r, r + 1) for r in range(6)]
    assert _rankdirs.chunks(single, dirs) == [single[:1], single[1:2], single[2:]]
    # only the ranks that get a dir count
    assert _rankdirs.chunks(units[:3], {0: "0"}) == [units[:1], units[1:2], units[2:3]]


def test_a_chunk_the_mkdir_process_cannot_finish_fails_with_its_own_error(
    tmp_path: Path,
) -> None:
    from aioproc._group import rankdirs as _rankdirs

    attempt = tmp_path / "attempt_0"
    attempt.mkdir()
    paths = [str(attempt / str(r)) for r in range(2 * _rankdirs.PROCESS_FROM)]
    _rankdirs._make_dirs(paths)
    assert sorted(os.listdir(attempt), key=int) == [os.path.basename(p) for p in paths]

    # the 40th of the next chunk would be made inside a file: the process
    # fails, and what follows names that path with the kernel's own error
    (tmp_path / "file").write_text("")
    paths = [str(tmp_path / f"b{r}") for r in range(2 * _rankdirs.PROCESS_FROM)]
    paths[40] = str(tmp_path / "file" / "40")
    with pytest.raises(NotADirectoryError) as info:
        _rankdirs._make_dirs(paths)
    assert info.value.filename == paths[40]
    assert all(os.path.isdir(p) for p in paths[:40])


async def test_hundreds_of_ranks_find_their_dirs_made_before_they_start(tmp_path: Path) -> None:
    # rank dirs of the later chunks come from mkdir processes; each worker
    # writes its error file into its own, which must exist when it starts
    n = 200
    code = 'echo "$LOCAL_RANK" > "$TORCHELASTIC_ERROR_FILE"'
    async with aioproc.start_processes(
        "dirs",
        "/bin/sh",
        {r: ("-c", code) for r in range(n)},
        {r: {"LOCAL_RANK": str(r)} for r in range(n)},
        DefaultLogsSpecs(tmp_path),
    ) as pc:
        result = await pc.wait()
    assert result is not None and not result.failures
    assert not [t for t in threading.enumerate() if t.name.startswith("aioproc-dirs")]
    for r in range(n):
        assert Path(pc.error_files[r]).read_text() == f"{r}\n"
        assert os.path.dirname(pc.error_files[r]).endswith(f"/{r}")


async def test_function_workers_start_as_their_own_rank_dir_exists(
    workers: types.ModuleType,
) -> None:
    """The rank dirs of a function group are made on a thread of their own while the
    first workers start; one that cannot be made fails the start with its path,
    and nothing is left: no worker, no thread, no temp dir."""
    from aioproc._group import rankdirs as _rankdirs
    from aioproc._proc import lifeline as _lifeline

    made: list[str] = []

    def make_dirs(paths: list[str]) -> None:
        for path in paths:
            if os.path.basename(path) == "3":
                raise OSError(28, "No space left on device", path)
            os.mkdir(path)
            made.append(path)

    args = {r: (r,) for r in range(6)}
    envs = {r: {} for r in range(6)}
    temp_before = aioproc_temp_dirs(tempfile.gettempdir())
    # a rank dir each for the stream files (without them, no rank has a dir)
    pc = PContext("nospace", workers.square, args, envs, DefaultLogsSpecs(redirects=Std.ALL))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_rankdirs, "_make_dirs", make_dirs)
        with pytest.raises(OSError, match="No space left on device") as info:
            await pc.start()
    assert info.value.filename == os.path.join(os.path.dirname(made[0]), "3")
    assert child_pids() == set()
    assert _lifeline.registered_groups() == frozenset()
    assert not [t for t in threading.enumerate() if t.name.startswith("aioproc-dirs")]
    assert aioproc_temp_dirs(tempfile.gettempdir()) == temp_before  # pruned

    # and when they can all be made, every rank runs with its own dir
    specs = DefaultLogsSpecs(redirects=Std.ALL)
    result = await (await aioproc.start_processes("dirs", workers.square, args, envs, specs)).wait()
    assert result is not None and result.return_values == {r: r * r for r in range(6)}
