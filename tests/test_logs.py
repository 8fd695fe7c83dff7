"""Tests for aioproc.logs: Std parsing, to_map and DefaultLogsSpecs' log tree."""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

import pytest
from helpers import aioproc_temp_dirs

from aioproc.logs import DefaultLogsSpecs, LogsDest, LogsSpecs, Std, to_map

ERROR_FILE = "TORCHELASTIC_ERROR_FILE"


def envs_for(
    nprocs: int, run_id: str | None = "myrun", restart: str | None = "0"
) -> dict[int, dict[str, str]]:
    env: dict[str, str] = {}
    if run_id is not None:
        env["TORCHELASTIC_RUN_ID"] = run_id
    if restart is not None:
        env["TORCHELASTIC_RESTART_COUNT"] = restart
    return {rank: dict(env) for rank in range(nprocs)}


def only_child(path: Path) -> Path:
    children = list(path.iterdir())
    assert len(children) == 1, children
    return children[0]


@pytest.fixture(autouse=True)
def private_tempdir(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> Path:
    """Point tempfile at a private dir, so concurrent runs cannot confuse the checks."""
    tmp = tmp_path_factory.mktemp("tempdir")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    return tmp


# --- Std ---------------------------------------------------------------------


def test_std_values() -> None:
    assert (Std.NONE, Std.OUT, Std.ERR, Std.ALL) == (0, 1, 2, 3)
    assert Std.ALL == Std.OUT | Std.ERR
    assert Std.ALL & Std.ERR == Std.ERR


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", Std.NONE),
        ("1", Std.OUT),
        ("2", Std.ERR),
        ("3", Std.ALL),
        (" 3 ", Std.ALL),
        ("0:3", {0: Std.ALL}),
        ("0:3,1:0", {0: Std.ALL, 1: Std.NONE}),
        ("0:3,1:0,2:1,3:2", {0: Std.ALL, 1: Std.NONE, 2: Std.OUT, 3: Std.ERR}),
        (" 0:1 , 1 : 2 ", {0: Std.OUT, 1: Std.ERR}),
        ("12:2", {12: Std.ERR}),
    ],
)
def test_std_from_str(text: str, expected: Std | dict[int, Std]) -> None:
    result = Std.from_str(text)
    assert result == expected
    assert type(result) is type(expected)
    if isinstance(result, dict):
        assert all(type(v) is Std for v in result.values())


@pytest.mark.parametrize(
    "bad",
    [
        "",
        " ",
        "4",
        "a",
        "-1",
        "03",
        "1.0",
        "0:",
        ":1",
        "0:9",
        "x:1",
        "0:1,",
        ",0:1",
        "0:1;1:2",
        "0:1,0:2",
    ],
)
def test_std_from_str_rejects(bad: str) -> None:
    with pytest.raises(ValueError, match="local_rank") as info:
        Std.from_str(bad)
    assert repr(bad) in str(info.value)


def test_std_from_str_duplicate_names_the_rank() -> None:
    with pytest.raises(ValueError, match="local rank 1 is given twice"):
        Std.from_str("0:1,1:2,1:3")


# --- to_map ------------------------------------------------------------------


def test_to_map() -> None:
    assert to_map(Std.OUT, 3) == {0: Std.OUT, 1: Std.OUT, 2: Std.OUT}
    assert to_map({1: Std.ERR}, 3) == {0: Std.NONE, 1: Std.ERR, 2: Std.NONE}
    assert to_map(Std.ALL, 0) == {}
    # Ranks outside the group are ignored, as in torch.
    assert to_map({0: Std.ALL, 5: Std.OUT}, 2) == {0: Std.ALL, 1: Std.NONE}


def test_to_map_returns_a_new_dict() -> None:
    given = {0: Std.OUT, 1: Std.ERR}
    result = to_map(given, 2)
    assert result == given
    result[0] = Std.NONE
    assert given[0] == Std.OUT


# --- LogsDest / LogsSpecs ----------------------------------------------------


def test_logs_dest_defaults() -> None:
    dest = LogsDest()
    assert (dest.stdouts, dest.stderrs, dest.tee_stdouts, dest.tee_stderrs) == ({}, {}, {}, {})
    assert dest.error_files == {}
    assert (dest.filtered_stdout, dest.filtered_stderr) == ("", "")


def test_logs_specs_is_abstract_and_prune_defaults_to_nothing(tmp_path: Path) -> None:
    with pytest.raises(TypeError):
        LogsSpecs()  # type: ignore[abstract]

    class Fixed(LogsSpecs):
        def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
            return LogsDest(error_files={rank: "e" for rank in envs})

        @property
        def root_log_dir(self) -> str:
            return str(tmp_path)

    spec = Fixed(str(tmp_path), redirects=Std.ALL)
    (tmp_path / "empty.log").touch()
    spec.prune()
    assert (tmp_path / "empty.log").exists()
    assert spec.reify({0: {}}).error_files == {0: "e"}


# --- DefaultLogsSpecs: layout ------------------------------------------------


def test_layout_and_restart(tmp_path: Path) -> None:
    spec = DefaultLogsSpecs(log_dir=str(tmp_path), redirects=Std.ALL)
    assert spec.root_log_dir == str(tmp_path)
    envs = envs_for(2)
    dest = spec.reify(envs)

    run_dir = only_child(tmp_path)
    assert run_dir.is_dir()
    assert run_dir.name.startswith("myrun_")
    attempt = run_dir / "attempt_0"
    assert sorted(p.name for p in attempt.iterdir()) == ["0", "1"]
    assert dest.stdouts == {r: str(attempt / str(r) / "stdout.log") for r in (0, 1)}
    assert dest.stderrs == {r: str(attempt / str(r) / "stderr.log") for r in (0, 1)}
    assert dest.error_files == {r: str(attempt / str(r) / "error.json") for r in (0, 1)}
    assert dest.tee_stdouts == {}
    assert dest.tee_stderrs == {}
    assert dest.filtered_stdout == str(attempt / "filtered_stdout.log")
    assert dest.filtered_stderr == str(attempt / "filtered_stderr.log")
    # Only directories are made; files are the supervisor's and the worker's job.
    assert not any(p.is_file() for p in tmp_path.rglob("*"))
    for rank in (0, 1):
        assert envs[rank][ERROR_FILE] == str(attempt / str(rank) / "error.json")

    (attempt / "0" / "stdout.log").write_text("first attempt\n")
    dest1 = spec.reify(envs_for(2, restart="1"))
    assert only_child(tmp_path) == run_dir
    assert dest1.stdouts[0] == str(run_dir / "attempt_1" / "0" / "stdout.log")
    assert (run_dir / "attempt_1" / "1").is_dir()
    assert (attempt / "0" / "stdout.log").read_text() == "first attempt\n"


def test_same_attempt_again_starts_clean(tmp_path: Path) -> None:
    spec = DefaultLogsSpecs(log_dir=str(tmp_path), redirects=Std.OUT)
    dest = spec.reify(envs_for(1, restart="2"))
    Path(dest.stdouts[0]).write_text("stale\n")
    again = spec.reify(envs_for(1, restart="2"))
    assert again.stdouts == dest.stdouts
    assert not os.path.exists(dest.stdouts[0])


def test_defaults_without_torchelastic_env(tmp_path: Path) -> None:
    spec = DefaultLogsSpecs(log_dir=tmp_path)  # a Path is accepted too
    dest = spec.reify({0: {}})
    run_dir = only_child(tmp_path)
    assert run_dir.name.startswith("test_run_id_")
    assert dest.error_files == {0: str(run_dir / "attempt_0" / "0" / "error.json")}
    assert dest.stdouts == {0: ""}
    assert dest.stderrs == {0: ""}


def test_missing_log_dir_is_created_at_reify(tmp_path: Path) -> None:
    log_dir = tmp_path / "a" / "b"
    spec = DefaultLogsSpecs(log_dir=str(log_dir))
    assert not log_dir.exists()
    spec.reify(envs_for(1))
    assert (only_child(log_dir) / "attempt_0" / "0").is_dir()


def test_relative_log_dir_gives_absolute_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    spec = DefaultLogsSpecs(log_dir="logs", redirects=Std.ERR)
    dest = spec.reify(envs_for(1))
    assert spec.root_log_dir == "logs"
    assert dest.stderrs[0].startswith(str(tmp_path / "logs") + os.sep)
    assert os.path.isabs(dest.error_files[0])


# --- DefaultLogsSpecs: redirects, tee, filter --------------------------------


def test_redirects_and_tee_per_rank(tmp_path: Path) -> None:
    spec = DefaultLogsSpecs(
        log_dir=str(tmp_path),
        redirects={0: Std.ERR, 1: Std.NONE},
        tee={0: Std.OUT, 1: Std.ERR},
    )
    dest = spec.reify(envs_for(3))
    a = only_child(tmp_path) / "attempt_0"
    assert dest.stdouts == {0: str(a / "0" / "stdout.log"), 1: "", 2: ""}
    assert dest.stderrs == {0: str(a / "0" / "stderr.log"), 1: str(a / "1" / "stderr.log"), 2: ""}
    assert dest.tee_stdouts == {0: str(a / "0" / "stdout.log")}
    assert dest.tee_stderrs == {1: str(a / "1" / "stderr.log")}
    assert dest.error_files == {r: str(a / str(r) / "error.json") for r in range(3)}
    assert (a / "2").is_dir()


def test_tee_all(tmp_path: Path) -> None:
    dest = DefaultLogsSpecs(log_dir=str(tmp_path), tee=Std.ALL).reify(envs_for(2))
    assert dest.tee_stdouts == dest.stdouts
    assert dest.tee_stderrs == dest.stderrs
    assert all(path.endswith("stdout.log") for path in dest.stdouts.values())


def test_local_ranks_filter(tmp_path: Path) -> None:
    spec = DefaultLogsSpecs(
        log_dir=str(tmp_path),
        redirects={2: Std.OUT},
        tee={0: Std.ALL, 1: Std.ALL},
        local_ranks_filter={0, 4},
    )
    dest = spec.reify(envs_for(4))
    a = only_child(tmp_path) / "attempt_0"
    # Rank 1 is tee'd but filtered out: its files are written, not shown.
    # Streams of filtered-out ranks that go to no file are dropped.
    assert dest.stdouts == {
        0: str(a / "0" / "stdout.log"),
        1: str(a / "1" / "stdout.log"),
        2: str(a / "2" / "stdout.log"),
        3: os.devnull,
    }
    assert dest.stderrs == {
        0: str(a / "0" / "stderr.log"),
        1: str(a / "1" / "stderr.log"),
        2: os.devnull,
        3: os.devnull,
    }
    assert dest.tee_stdouts == {0: str(a / "0" / "stdout.log")}
    assert dest.tee_stderrs == {0: str(a / "0" / "stderr.log")}
    assert sorted(p.name for p in a.iterdir()) == ["0", "1", "2", "3"]


def test_empty_local_ranks_filter_filters_nothing(tmp_path: Path) -> None:
    dest = DefaultLogsSpecs(log_dir=str(tmp_path), tee=Std.OUT, local_ranks_filter=set()).reify(
        envs_for(2)
    )
    assert sorted(dest.tee_stdouts) == [0, 1]
    assert dest.stderrs == {0: "", 1: ""}


def test_envs_keep_their_other_entries(tmp_path: Path) -> None:
    envs = {0: {"A": "1", "TORCHELASTIC_RUN_ID": "r"}, 1: {"B": "2"}}
    dest = DefaultLogsSpecs(log_dir=str(tmp_path)).reify(envs)
    assert envs == {
        0: {"A": "1", "TORCHELASTIC_RUN_ID": "r", ERROR_FILE: dest.error_files[0]},
        1: {"B": "2", ERROR_FILE: dest.error_files[1]},
    }
    assert only_child(tmp_path).name.startswith("r_")


def test_spec_keeps_a_copy_of_the_redirects_map(tmp_path: Path) -> None:
    redirects = {0: Std.OUT}
    spec = DefaultLogsSpecs(log_dir=str(tmp_path), redirects=redirects)
    redirects[0] = Std.NONE
    assert spec.reify(envs_for(1)).stdouts[0].endswith("stdout.log")


# --- DefaultLogsSpecs: os.devnull --------------------------------------------


def test_devnull_writes_nothing() -> None:
    before = aioproc_temp_dirs()
    spec = DefaultLogsSpecs(log_dir=os.devnull, redirects=Std.ALL, tee={0: Std.OUT})
    envs = envs_for(2)
    dest = spec.reify(envs)
    assert spec.root_log_dir == os.devnull
    # as torch: untee'd streams stay on the console; unlike torch, a tee'd one
    # still goes through the pipe to the sinks, its file being devnull
    assert dest.stdouts == {0: os.devnull, 1: ""}
    assert dest.stderrs == {0: "", 1: ""}
    assert dest.tee_stdouts == {0: os.devnull}
    assert dest.tee_stderrs == {}
    assert dest.error_files == {0: os.devnull, 1: os.devnull}
    assert (dest.filtered_stdout, dest.filtered_stderr) == (os.devnull, os.devnull)
    assert envs[0][ERROR_FILE] == ""
    assert envs[1][ERROR_FILE] == ""
    spec.prune()
    assert aioproc_temp_dirs() == before


def test_devnull_respects_local_ranks_filter() -> None:
    dest = DefaultLogsSpecs(log_dir=os.devnull, local_ranks_filter={1}).reify(envs_for(2))
    assert dest.stdouts == {0: os.devnull, 1: ""}
    assert dest.stderrs == {0: os.devnull, 1: ""}
    assert dest.tee_stdouts == {}
    dest = DefaultLogsSpecs(log_dir=os.devnull, tee=Std.ERR, local_ranks_filter={1}).reify(
        envs_for(2)
    )
    assert dest.stderrs == {0: os.devnull, 1: os.devnull}
    assert dest.tee_stderrs == {1: os.devnull}


# --- DefaultLogsSpecs: validation --------------------------------------------


def test_log_dir_that_is_a_file(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file.txt"
    not_a_dir.write_text("x")
    before = aioproc_temp_dirs()
    with pytest.raises(NotADirectoryError) as info:
        DefaultLogsSpecs(log_dir=str(not_a_dir))
    assert str(not_a_dir) in str(info.value)
    assert aioproc_temp_dirs() == before
    assert sorted(tmp_path.iterdir()) == [not_a_dir]


def test_log_dir_inside_a_file(tmp_path: Path) -> None:
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    with pytest.raises(NotADirectoryError) as info:
        DefaultLogsSpecs(log_dir=str(a_file / "logs" / "deeper"))
    assert str(info.value) == (
        f"log_dir {str(a_file / 'logs' / 'deeper')!r} cannot be created: "
        f"{str(a_file)!r} exists and is not a directory"
    )
    assert sorted(tmp_path.iterdir()) == [a_file]


def test_log_dir_that_is_a_dangling_symlink(tmp_path: Path) -> None:
    link = tmp_path / "logs"
    link.symlink_to(tmp_path / "gone")
    with pytest.raises(NotADirectoryError, match="exists and is not a directory"):
        DefaultLogsSpecs(log_dir=str(link / "sub"))
    assert list(tmp_path.iterdir()) == [link]


def test_log_dir_with_a_nul_byte() -> None:
    before = aioproc_temp_dirs()
    with pytest.raises(ValueError, match="log_dir contains a NUL byte"):
        DefaultLogsSpecs(log_dir="lo\0gs")
    assert aioproc_temp_dirs() == before


def test_log_dir_that_became_a_file_is_refused_at_reify(tmp_path: Path) -> None:
    path = tmp_path / "logs"
    spec = DefaultLogsSpecs(log_dir=str(path))
    path.write_text("x")
    with pytest.raises(NotADirectoryError, match="exists and is not a directory"):
        spec.reify(envs_for(1))
    assert path.read_text() == "x"


@pytest.mark.parametrize(
    ("run_id", "restart", "message"),
    [
        ("../..", "0", "run id (TORCHELASTIC_RUN_ID) '../..' contains a path separator"),
        ("a/b", "0", "run id (TORCHELASTIC_RUN_ID) 'a/b' contains a path separator"),
        ("/abs", "0", "run id (TORCHELASTIC_RUN_ID) '/abs' contains a path separator"),
        ("..", "0", "run id (TORCHELASTIC_RUN_ID) '..' is not a usable directory name"),
        (".", "0", "run id (TORCHELASTIC_RUN_ID) '.' is not a usable directory name"),
        ("a\0b", "0", "run id (TORCHELASTIC_RUN_ID) contains a NUL byte (at index 1)"),
        ("r" * 247, "0", "is 247 bytes long; a directory name allows 246 bytes"),
        ("ok", "../../x", "restart count (TORCHELASTIC_RESTART_COUNT) '../../x' contains a path"),
        ("ok", "..", "restart count (TORCHELASTIC_RESTART_COUNT) '..' is not a usable"),
    ],
)
@pytest.mark.parametrize("given_log_dir", [True, False])
def test_run_id_and_restart_count_must_be_plain_names(
    tmp_path: Path, run_id: str, restart: str, message: str, given_log_dir: bool
) -> None:
    """They name directories: a path in them would put the logs elsewhere."""
    logs = tmp_path / "deep" / "logs"
    spec = DefaultLogsSpecs(log_dir=str(logs) if given_log_dir else None)
    before = aioproc_temp_dirs()
    envs = envs_for(2, run_id=run_id, restart=restart)
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        spec.reify(envs)
    with pytest.raises(ValueError, match=re.escape(message)) as again:
        spec.validate(envs)
    assert str(again.value) == str(info.value)
    assert list(tmp_path.iterdir()) == []  # nothing made, not even the log dir
    assert aioproc_temp_dirs() == before
    assert all(ERROR_FILE not in env for env in envs.values())


def test_longest_run_id_that_fits_works(tmp_path: Path) -> None:
    spec = DefaultLogsSpecs(log_dir=str(tmp_path))
    spec.reify(envs_for(1, run_id="r" * 246))
    assert only_child(tmp_path).name.startswith("r" * 246 + "_")


def test_validate_is_a_no_op_by_default_and_for_devnull() -> None:
    class Console(LogsSpecs):
        def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
            return LogsDest()

        @property
        def root_log_dir(self) -> str:
            return ""

    bad = envs_for(1, run_id="../..")
    Console().validate(bad)
    DefaultLogsSpecs(log_dir=os.devnull).validate(bad)  # no directory is ever made


@pytest.mark.parametrize(
    "kwargs",
    [
        {"redirects": 3},
        {"redirects": "3"},
        {"tee": {0: 1}},
        {"tee": {"0": Std.OUT}},
        {"tee": {-1: Std.OUT}},
        {"redirects": [Std.OUT]},
        {"local_ranks_filter": [0, 1]},
        {"local_ranks_filter": {"0"}},
        {"local_ranks_filter": {True}},
        {"log_dir": 42},
    ],
)
def test_bad_arguments(kwargs: dict[str, object]) -> None:
    before = aioproc_temp_dirs()
    ((name, value),) = kwargs.items()
    with pytest.raises(TypeError) as info:
        DefaultLogsSpecs(**kwargs)  # type: ignore[arg-type]
    assert name in str(info.value)
    assert repr(value) in str(info.value)
    assert aioproc_temp_dirs() == before


def test_repr(tmp_path: Path) -> None:
    spec = DefaultLogsSpecs(log_dir=str(tmp_path), redirects=Std.ALL, tee={0: Std.ERR})
    text = repr(spec)
    assert text.startswith("DefaultLogsSpecs(")
    assert f"log_dir={str(tmp_path)!r}" in text
    assert f"redirects={Std.ALL!r}" in text
    assert f"tee={ {0: Std.ERR}!r}" in text
    assert "local_ranks_filter=None" in text


# --- DefaultLogsSpecs: the ephemeral temp dir and prune ----------------------


def test_temp_dir_is_made_at_reify_and_pruned_when_empty() -> None:
    before = aioproc_temp_dirs()
    spec = DefaultLogsSpecs(redirects=Std.ALL)
    assert aioproc_temp_dirs() == before
    assert "log_dir=None" in repr(spec)

    dest = spec.reify(envs_for(2))
    (root,) = aioproc_temp_dirs() - before
    assert spec.root_log_dir == root
    assert os.path.basename(root).startswith("aioproc_")
    assert os.path.dirname(root) == tempfile.gettempdir()
    assert dest.stdouts[1].startswith(root + os.sep)
    assert os.path.isdir(os.path.dirname(dest.stdouts[1]))
    Path(dest.stdouts[0]).touch()  # opened by the supervisor, never written

    spec.prune()
    assert not os.path.exists(root)
    assert aioproc_temp_dirs() == before

    # A later attempt gets a fresh temp dir rather than reviving the old name.
    dest = spec.reify(envs_for(1, restart="1"))
    (root2,) = aioproc_temp_dirs() - before
    assert root2 != root
    assert dest.error_files[0].startswith(root2 + os.sep)
    spec.prune()
    assert aioproc_temp_dirs() == before


def test_prune_keeps_written_logs() -> None:
    spec = DefaultLogsSpecs(redirects=Std.ALL)
    dest = spec.reify(envs_for(2))
    Path(dest.stdouts[1]).write_text("hello\n")
    Path(dest.stderrs[1]).touch()
    Path(dest.error_files[0]).write_text("{}")
    spec.prune()
    root = Path(spec.root_log_dir)
    kept = sorted(str(p.relative_to(root)) for p in root.rglob("*"))
    run = only_child(root).name
    assert kept == [
        run,
        f"{run}/attempt_0",
        f"{run}/attempt_0/0",
        f"{run}/attempt_0/0/error.json",
        f"{run}/attempt_0/1",
        f"{run}/attempt_0/1/stdout.log",
    ]
    assert Path(dest.stdouts[1]).read_text() == "hello\n"

    # The next attempt goes to the same run dir and attempt_0 stays.
    dest1 = spec.reify(envs_for(2, restart="1"))
    assert dest1.stdouts[0] == str(root / run / "attempt_1" / "0" / "stdout.log")
    assert Path(dest.stdouts[1]).read_text() == "hello\n"


def test_prune_never_touches_a_given_log_dir(tmp_path: Path) -> None:
    spec = DefaultLogsSpecs(log_dir=str(tmp_path), redirects=Std.ALL)
    dest = spec.reify(envs_for(2))
    Path(dest.stdouts[0]).touch()
    before = sorted(tmp_path.rglob("*"))
    spec.prune()
    assert sorted(tmp_path.rglob("*")) == before
    assert Path(dest.stdouts[0]).exists()


def test_prune_before_reify_does_nothing() -> None:
    before = aioproc_temp_dirs()
    spec = DefaultLogsSpecs()
    spec.prune()
    assert aioproc_temp_dirs() == before


def test_the_temp_dir_gives_a_dir_only_to_ranks_that_write_stream_files(tmp_path: Path) -> None:
    spec = DefaultLogsSpecs(
        redirects={0: Std.NONE, 1: Std.OUT, 2: Std.NONE, 3: Std.NONE},
        tee={2: Std.ERR},
        local_ranks_filter={0, 1, 2},
    )
    dest = spec.reify(envs_for(4))
    attempt = Path(spec.run_log_dir) / "attempt_0"
    assert dest.error_files[0] == str(attempt / "error_0.json")
    assert dest.error_files[3] == str(attempt / "error_3.json")  # filtered out: no file either
    assert dest.error_files[1] == str(attempt / "1" / "error.json")
    assert dest.error_files[2] == str(attempt / "2" / "error.json")
    assert sorted(p.name for p in attempt.iterdir()) == ["1", "2"]
    spec.prune()

    given = DefaultLogsSpecs(log_dir=str(tmp_path))  # the user's: torch's layout
    dest = given.reify(envs_for(2))
    attempt = Path(given.run_log_dir) / "attempt_0"
    assert dest.error_files == {r: str(attempt / str(r) / "error.json") for r in range(2)}
    assert sorted(p.name for p in attempt.iterdir()) == ["0", "1"]


async def test_a_console_ranks_error_file_in_the_temp_dir_is_reported_and_kept(
    tmp_path: Path,
) -> None:
    """Without a log_dir, ranks whose output stays on the console share the attempt
    dir: the one that writes its error file is reported with it, the file outlives
    close, and a given log_dir keeps torch's rank dirs."""
    import sys

    import aioproc

    write_error = (
        "import json, os, sys; "
        "open(os.environ['TORCHELASTIC_ERROR_FILE'], 'w').write("
        "json.dumps({'message': {'message': 'RuntimeError: boom', 'extraInfo': "
        "{'py_callstack': 'Traceback: boom', 'timestamp': '1'}}})); sys.exit(3)"
    )
    for log_dir in (None, str(tmp_path)):
        pc = await aioproc.start_processes(
            "flat",
            sys.executable,
            {0: ("-c", "pass"), 1: ("-c", write_error)},
            {r: {} for r in range(2)},
            DefaultLogsSpecs(log_dir),
        )
        try:
            result = await pc.wait()
        finally:
            await pc.close()
        assert result is not None
        failure = result.failures[1]
        assert failure.exitcode == 3
        assert failure.message["message"] == "RuntimeError: boom"  # torch keeps the dict
        name = "error_1.json" if log_dir is None else os.path.join("1", "error.json")
        assert failure.error_file == os.path.join(pc.logs_specs.run_log_dir, "attempt_0", name)
        assert "boom" in Path(failure.error_file).read_text()
        attempt = Path(failure.error_file).parent if log_dir is None else None
        if attempt is not None:
            assert [p.name for p in attempt.iterdir()] == ["error_1.json"]  # rest pruned
