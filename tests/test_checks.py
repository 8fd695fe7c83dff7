"""Input checks: bad input fails before anything starts, naming the rank and the variable.

Every case is given to the public entry points (``start_processes``, ``run``,
``PContext.wait/close``, ``open_worker``, ``open_pool``, the agent's specs
and ``LocalElasticAgent``).  A case passes only if the error has the right
type and names what is wrong, and nothing was started or created: no
worker "started" event, no child process, no fd, no ``aioproc_*`` temp dir,
nothing in the log dir.  The bad value sits on the last rank, so a check
made at launch time (after rank 0 started) would fail these tests.
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers import aioproc_temp_dirs, child_pids, open_fds, pid_gone, write_file

import aioproc
from aioproc import DefaultLogsSpecs, open_pool, open_worker
from aioproc._base.checks import check_duration
from aioproc._group.checks import EXEC_MARGIN
from aioproc.agent import LocalElasticAgent, RestartPolicy, WorkerSpec

LINUX = sys.platform.startswith("linux")
ARG_MAX = min(os.sysconf("SC_ARG_MAX"), 6 << 20) if LINUX else os.sysconf("SC_ARG_MAX")
MAX_ARG_STRLEN = 32 * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture(autouse=True)
def private_tmpdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """Point ``tempfile`` at a private dir: ``aioproc_*`` dirs are ours alone to count."""
    path = tmp_path / "tmp"
    path.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(path))
    return str(path)


@pytest.fixture
def log_dir(tmp_path: Path) -> Path:
    path = tmp_path / "logs"
    path.mkdir()
    return path


class NulStr:
    """An argument whose ``str()`` (what a binary's argv gets) holds a NUL."""

    def __str__(self) -> str:
        return "in\0side"


def too_big_env(rank: int) -> dict[str, str]:
    """Variables under the per-string limit that together pass ARG_MAX."""
    size = 100_000
    return {f"BIG{i:03d}": "x" * size for i in range(ARG_MAX // size + 1)}


# ------------------------------------------------------------ durations


@pytest.mark.parametrize(
    ("value", "kwargs", "expected"),
    [
        (0, {}, 0.0),
        (3, {}, 3.0),
        (2.5, {}, 2.5),
        (None, {"allow_none": True}, None),
        (-1, {"allow_negative": True}, -1.0),
    ],
)
def test_check_duration_accepts(value: Any, kwargs: dict[str, bool], expected: Any) -> None:
    result = check_duration("t", value, **kwargs)
    assert result == expected
    assert result is None or type(result) is float


@pytest.mark.parametrize(
    ("value", "kwargs", "exc_type", "message"),
    [
        (math.nan, {}, ValueError, "t must be a finite number of seconds, got nan"),
        (math.inf, {}, ValueError, "t must be a finite number of seconds, got inf"),
        (-math.inf, {}, ValueError, "t must be a finite number of seconds, got -inf"),
        (10**400, {}, ValueError, "t must be a finite number of seconds"),
        (-1, {}, ValueError, "t must be a number >= 0, got -1"),
        (-0.5, {"allow_none": True}, ValueError, "t must be a number >= 0, got -0.5"),
        (True, {}, TypeError, "t must be a number of seconds, got True"),
        ("1", {}, TypeError, "t must be a number of seconds, got '1'"),
        (None, {}, TypeError, "t must be a number of seconds, got None"),
        ("x", {"allow_none": True}, TypeError, "t must be a number of seconds or None, got 'x'"),
        (math.nan, {"allow_negative": True}, ValueError, "a negative value means no limit"),
        (math.inf, {"allow_none": True}, ValueError, "None means no limit"),
    ],
)
def test_check_duration_rejects(
    value: Any, kwargs: dict[str, bool], exc_type: type[Exception], message: str
) -> None:
    with pytest.raises(exc_type) as info:
        check_duration("t", value, **kwargs)
    assert type(info.value) is exc_type
    assert message in str(info.value)


# ------------------------------------------------ start_processes: bad input


def _cases(tmp_path: Path) -> dict[str, tuple[dict[str, Any], type[Exception], list[str]]]:
    a_file = str(tmp_path / "a-file")  # made by the test
    big = MAX_ARG_STRLEN  # with its NUL, one byte over the limit
    return {
        "NUL in an env value": (
            {"envs": {0: {}, 1: {}, 2: {"FOO": "a\0b"}}},
            ValueError,
            ["envs[2]['FOO']", "local rank 2", "NUL byte", "'a\\x00b'"],
        ),
        "NUL in an env value, function workers": (
            {"entrypoint": abs, "args": {r: (-1,) for r in range(3)}, "envs": {2: {"F": "\0"}}},
            ValueError,
            ["envs[2]['F']", "local rank 2", "NUL byte"],
        ),
        "NUL in an env name": (
            {"envs": {2: {"F\0O": "x"}}},
            ValueError,
            ["envs[2]", "local rank 2", "NUL byte", "'F\\x00O'"],
        ),
        "'=' in an env name": (
            {"envs": {2: {"A=B": "x"}}},
            ValueError,
            ["envs[2]", "local rank 2", "'A=B'", "cannot contain '='"],
        ),
        "empty env name": (
            {"envs": {2: {"": "x"}}},
            ValueError,
            ["envs[2]", "local rank 2", "empty variable name"],
        ),
        "unencodable env value": (
            {"envs": {2: {"X": "\ud800"}}},
            ValueError,
            ["envs[2]['X']", "local rank 2", "cannot be encoded"],
        ),
        "NUL in an arg": (
            {"args": {0: (), 1: (), 2: ("ok", "a\0b")}},
            ValueError,
            ["args[2][1]", "local rank 2", "NUL byte"],
        ),
        "NUL in an arg's str()": (
            {"args": {0: (), 1: (), 2: (NulStr(),)}},
            ValueError,
            ["args[2][0]", "local rank 2", "'in\\x00side'"],
        ),
        "NUL in the entrypoint": (
            {"entrypoint": "/bin/tr\0ue"},
            ValueError,
            ["entrypoint", "NUL byte", "'/bin/tr\\x00ue'"],
        ),
        "prefix of one rank not a str": (
            {"log_line_prefixes": {0: "[a]", 2: 42}},
            TypeError,
            ["log_line_prefixes[2]", "local rank 2", "42"],
        ),
        "prefix template not a str": (
            {"log_line_prefixes": b"[${rank}]"},
            TypeError,
            ["log_line_prefixes", "b'[${rank}]'"],
        ),
        "grace_period NaN": ({"grace_period": math.nan}, ValueError, ["grace_period", "nan"]),
        "grace_period inf": ({"grace_period": math.inf}, ValueError, ["grace_period", "inf"]),
        "grace_period negative": ({"grace_period": -1}, ValueError, ["grace_period", "-1"]),
        "grace_period bool": ({"grace_period": True}, TypeError, ["grace_period", "True"]),
        "log_dir in a file": (
            {"logs_specs": lambda: DefaultLogsSpecs(log_dir=os.path.join(a_file, "logs"))},
            NotADirectoryError,
            [os.path.join(a_file, "logs"), f"{a_file!r} exists and is not a directory"],
        ),
        "log_dir with a NUL": (
            {"logs_specs": lambda: DefaultLogsSpecs(log_dir="lo\0gs")},
            ValueError,
            ["log_dir", "NUL byte"],
        ),
        "run id with a path separator": (
            {"envs": {r: {"TORCHELASTIC_RUN_ID": "../escape"} for r in range(3)}},
            ValueError,
            ["run id (TORCHELASTIC_RUN_ID)", "'../escape'", "path separator"],
        ),
        "run id '..'": (
            {"envs": {r: {"TORCHELASTIC_RUN_ID": ".."} for r in range(3)}},
            ValueError,
            ["run id", "'..'"],
        ),
        "run id with a NUL": (
            {"envs": {r: {"TORCHELASTIC_RUN_ID": "a\0b"} for r in range(3)}},
            ValueError,
            ["local rank 0", "NUL byte"],
        ),
        "run id too long for a directory name": (
            {"envs": {r: {"TORCHELASTIC_RUN_ID": "r" * 250} for r in range(3)}},
            ValueError,
            ["run id", "250 bytes long"],
        ),
        "restart count with a path separator": (
            {"envs": {r: {"TORCHELASTIC_RESTART_COUNT": "0/../../x"} for r in range(3)}},
            ValueError,
            ["restart count (TORCHELASTIC_RESTART_COUNT)", "'0/../../x'"],
        ),
        "an arg over MAX_ARG_STRLEN": (
            {"args": {0: (), 1: (), 2: ("x" * big,)}},
            ValueError,
            ["local rank 2", "args[2][0]", "MAX_ARG_STRLEN"],
        ),
        "an env var over MAX_ARG_STRLEN": (
            {"envs": {2: {"BIG": "x" * big}}},
            ValueError,
            ["local rank 2", "envs[2]['BIG']", "MAX_ARG_STRLEN"],
        ),
        "argv and env over ARG_MAX": (
            {"envs": {2: too_big_env(2)}},
            ValueError,
            ["local rank 2", "over the system limit ARG_MAX", "largest: envs[2]['BIG"],
        ),
        "argv and env over ARG_MAX, function workers": (
            {"entrypoint": abs, "args": {r: (-1,) for r in range(3)}, "envs": {2: too_big_env(2)}},
            ValueError,
            ["local rank 2", "over the system limit ARG_MAX", "largest: envs[2]['BIG"],
        ),
    }


CASES = list(_cases(Path("/nonexistent")))
LINUX_ONLY = {"an arg over MAX_ARG_STRLEN", "an env var over MAX_ARG_STRLEN"}


@pytest.mark.parametrize("case", CASES)
async def test_bad_input_fails_before_any_rank_starts(
    case: str, tmp_path: Path, log_dir: Path, private_tmpdir: str
) -> None:
    if case in LINUX_ONLY and not LINUX:
        pytest.skip("MAX_ARG_STRLEN is Linux's")
    write_file(str(tmp_path / "a-file"), "")
    overrides, exc_type, needles = _cases(tmp_path)[case]
    envs: dict[int, dict[str, str]] = {r: {} for r in range(3)}
    envs.update(overrides.pop("envs", {}))
    events: list[aioproc.WorkerEvent] = []
    kwargs: dict[str, Any] = {
        "name": "bad",
        "entrypoint": "/bin/true",
        "args": {r: () for r in range(3)},
        "envs": envs,
        "logs_specs": lambda: DefaultLogsSpecs(log_dir=str(log_dir)),
        "on_event": events.append,
    }
    kwargs.update(overrides)
    children_before = child_pids()
    fds_before = open_fds()

    with pytest.raises(exc_type) as info:
        kwargs["logs_specs"] = kwargs["logs_specs"]()  # DefaultLogsSpecs itself may raise
        async with aioproc.start_processes(**kwargs):
            pytest.fail("the group started")

    assert type(info.value) is exc_type
    for needle in needles:
        assert needle in str(info.value)
    assert events == []
    assert child_pids() == children_before
    assert open_fds() == fds_before
    assert aioproc_temp_dirs(private_tmpdir) == set()
    assert list(log_dir.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["a-file", "logs", "tmp"])


async def test_a_run_id_cannot_write_outside_the_log_dir(
    tmp_path: Path, private_tmpdir: str
) -> None:
    logs = tmp_path / "deep" / "logs"
    envs = {0: {"TORCHELASTIC_RUN_ID": "../../escape"}}
    with pytest.raises(ValueError, match="path separator"):
        await aioproc.start_processes(
            "job", "/bin/true", {0: ()}, envs, DefaultLogsSpecs(log_dir=str(logs))
        )
    assert [p.name for p in tmp_path.iterdir()] == ["tmp"]  # not even logs/ was made
    assert aioproc_temp_dirs(private_tmpdir) == set()


async def test_a_log_dir_that_became_a_file_fails_at_start(
    tmp_path: Path, private_tmpdir: str
) -> None:
    path = tmp_path / "logs"
    spec = DefaultLogsSpecs(log_dir=str(path))  # fine now: it does not exist yet
    path.write_text("now a file")
    children_before = child_pids()
    with pytest.raises(NotADirectoryError) as info:
        await aioproc.start_processes("job", "/bin/true", {0: ()}, {0: {}}, spec)
    assert f"log_dir {str(path)!r} exists and is not a directory" in str(info.value)
    assert child_pids() == children_before
    assert path.read_text() == "now a file"


async def test_argv_and_env_just_under_the_limit_start(log_dir: Path) -> None:
    """The size check is no stricter than it says: a rank that fits runs."""
    inherited = sum(len(os.fsencode(f"{k}={v}")) + 1 + 8 for k, v in os.environ.items())
    room = ARG_MAX - EXEC_MARGIN - inherited - 4096  # 4 KiB for argv and the error file
    fill: dict[str, str] = {}
    while room > 100:
        key = f"FILL{len(fill):03d}"
        value = "y" * min(100_000, room - len(key) - 10)
        fill[key] = value
        room -= len(key) + 1 + len(value) + 1 + 8
    envs = {0: fill}
    result = await aioproc.run(
        "/bin/true", 1, envs=envs, logs_specs=DefaultLogsSpecs(log_dir=str(log_dir))
    )
    assert result.return_values == {0: None}


async def test_an_oversized_inherited_variable_fails_only_ranks_that_keep_it(
    log_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A variable of the parent's that exec would refuse is named for the
    first rank that inherits it; a rank that overrides it is fine."""
    children_before = child_pids()  # (ps itself could not start with the variable)
    monkeypatch.setenv("AIOPROC_TEST_HUGE", "z" * MAX_ARG_STRLEN)
    with pytest.raises(ValueError, match="MAX_ARG_STRLEN") as info:
        await aioproc.run(
            "/bin/true",
            3,
            envs={0: {"AIOPROC_TEST_HUGE": "small"}, 1: {}, 2: {}},
            logs_specs=DefaultLogsSpecs(log_dir=str(log_dir)),
        )
    message = str(info.value)
    assert message.startswith("local rank 1: os.environ['AIOPROC_TEST_HUGE'] (inherited)")
    assert "MAX_ARG_STRLEN" in message
    assert list(log_dir.iterdir()) == []
    # every rank overrides it: nothing refused, and the workers run
    result = await aioproc.run(
        "/bin/true",
        3,
        envs={r: {"AIOPROC_TEST_HUGE": "small"} for r in range(3)},
        logs_specs=DefaultLogsSpecs(log_dir=str(log_dir)),
    )
    assert result.return_values == {0: None, 1: None, 2: None}
    monkeypatch.delenv("AIOPROC_TEST_HUGE")
    assert child_pids() == children_before


async def test_bytes_args_are_checked_as_their_str(log_dir: Path) -> None:
    """A binary gets ``str(arg)``: ``b"a\\0"`` is the text ``b'a\\x00'``, which is fine."""
    out = log_dir / "out"
    result = await aioproc.run(
        "/bin/sh",
        1,
        args=("-c", f'printf %s "$1" > {out}', "sh", b"a\0"),
        logs_specs=DefaultLogsSpecs(log_dir=str(log_dir)),
    )
    assert result.return_values == {0: None}
    assert out.read_text() == "b'a\\x00'"


# ------------------------------------------------------- run(), wait(), close()


@pytest.mark.parametrize(
    ("kwargs", "exc_type", "needle"),
    [
        ({"timeout": math.nan}, ValueError, "timeout must be a finite number of seconds"),
        ({"timeout": math.inf}, ValueError, "None means no limit"),
        ({"timeout": -1}, ValueError, "timeout must be a number >= 0, got -1"),
        ({"timeout": "10"}, TypeError, "timeout must be a number of seconds or None, got '10'"),
        ({"grace_period": math.nan}, ValueError, "grace_period must be a finite number"),
    ],
)
async def test_run_rejects_bad_durations_before_starting(
    kwargs: dict[str, Any], exc_type: type[Exception], needle: str, private_tmpdir: str
) -> None:
    children_before = child_pids()
    with pytest.raises(exc_type) as info:
        await aioproc.run("/bin/true", 2, **kwargs)
    assert needle in str(info.value)
    assert child_pids() == children_before
    assert aioproc_temp_dirs(private_tmpdir) == set()


async def test_wait_and_close_reject_bad_timeouts_and_the_group_still_closes(
    log_dir: Path,
) -> None:
    specs = DefaultLogsSpecs(log_dir=str(log_dir))
    async with aioproc.start_processes(
        "sleepers", "/bin/sleep", {0: ("60",), 1: ("60",)}, {0: {}, 1: {}}, specs
    ) as pc:
        with pytest.raises(ValueError, match=r"wait\(timeout=\.\.\.\) must be a finite number"):
            await pc.wait(math.nan)
        with pytest.raises(ValueError, match="a negative value means no limit"):
            await pc.wait(math.inf)
        with pytest.raises(TypeError, match=r"wait\(timeout=\.\.\.\) .* got True"):
            await pc.wait(True)
        with pytest.raises(ValueError, match=r"close\(timeout=\.\.\.\) must be a finite number"):
            await pc.close(timeout=math.nan)
        with pytest.raises(ValueError, match=r"close\(timeout=\.\.\.\) must be a number >= 0"):
            await pc.close(timeout=-1)
        assert pc.poll() is None  # a rejected close stopped nothing
        assert await pc.wait(0) is None
        pids = list(pc.pids().values())
        await pc.close(timeout=5)
    assert all(pid_gone(pid) for pid in pids)


# ------------------------------------------------------ workers and pools


@pytest.mark.parametrize(
    ("factory", "exc_type", "needle"),
    [
        (lambda: open_worker(init_timeout=math.nan), ValueError, "init_timeout must be a finite"),
        (lambda: open_worker(init_timeout=-1), ValueError, "init_timeout must be a number >= 0"),
        (lambda: open_worker(shutdown_timeout=math.inf), ValueError, "shutdown_timeout"),
        (lambda: open_worker(shutdown_timeout=False), TypeError, "shutdown_timeout"),
        (lambda: open_worker(env={"A": "x\0y"}), ValueError, "env['A'] contains a NUL byte"),
        (lambda: open_worker(env={"A=B": "x"}), ValueError, "cannot contain '='"),
        (lambda: open_pool(2, idle_timeout=math.nan), ValueError, "idle_timeout must be a finite"),
        (lambda: open_pool(2, init_timeout=math.inf), ValueError, "init_timeout must be a finite"),
        (lambda: open_pool(2, shutdown_timeout=-2), ValueError, "shutdown_timeout must be a"),
        (lambda: open_pool(2, env={"": "x"}), ValueError, "env has an empty variable name"),
    ],
)
def test_worker_and_pool_factories_reject_bad_input_when_called(
    factory: Callable[[], Any], exc_type: type[Exception], needle: str
) -> None:
    children_before = child_pids()
    with pytest.raises(exc_type) as info:
        factory()  # raises at the call, before anything is awaited or started
    assert needle in str(info.value)
    assert child_pids() == children_before


# ---------------------------------------------------------------- the agent


@pytest.mark.parametrize(
    ("make", "exc_type", "needle"),
    [
        (lambda: RestartPolicy(initial_delay=math.nan), ValueError, "initial_delay"),
        (lambda: RestartPolicy(max_delay=math.inf), ValueError, "max_delay"),
        (lambda: RestartPolicy(factor=math.nan), ValueError, "factor must be >= 1 and finite"),
        (lambda: RestartPolicy(jitter=math.nan), ValueError, "jitter must be in [0, 1]"),
        (lambda: RestartPolicy(reset_after=math.nan), ValueError, "reset_after"),
        (lambda: RestartPolicy(initial_delay=True), TypeError, "initial_delay"),
        (lambda: WorkerSpec("r", 1, "/bin/true", monitor_interval=math.nan), ValueError, "monitor"),
        (lambda: WorkerSpec("r", 1, "/bin/true", monitor_interval=-1), ValueError, "monitor"),
        (
            lambda: WorkerSpec("r", 1, "/bin/true", env={"K": "v\0"}),
            ValueError,
            "WorkerSpec.env['K'] contains a NUL byte",
        ),
        (
            lambda: WorkerSpec("r", 1, "/bin/true", args=("ok", "a\0")),
            ValueError,
            "WorkerSpec.args[1] contains a NUL byte",
        ),
        (lambda: WorkerSpec("r\0", 1, "/bin/true"), ValueError, "WorkerSpec.role"),
        (lambda: WorkerSpec("r", 1, "/bin/t\0rue"), ValueError, "WorkerSpec.entrypoint"),
        (lambda: WorkerSpec("r", 1, "/bin/true", master_addr="h\0"), ValueError, "master_addr"),
    ],
)
def test_agent_specs_reject_bad_input(
    make: Callable[[], Any], exc_type: type[Exception], needle: str
) -> None:
    with pytest.raises(exc_type) as info:
        make()
    assert needle in str(info.value)


async def test_agent_run_id_cannot_leave_the_log_dir(tmp_path: Path, log_dir: Path) -> None:
    spec = WorkerSpec("r", 2, "/bin/true", max_restarts=3)
    children_before = child_pids()
    # refused when the agent is built, before any attempt could start
    with pytest.raises(ValueError, match="run_id") as info:
        LocalElasticAgent(spec, logs_specs=DefaultLogsSpecs(log_dir=str(log_dir)), run_id="../x")
    assert "run_id '../x' contains a path separator" in str(info.value)
    assert child_pids() == children_before
    assert list(log_dir.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs", "tmp"]
