"""``aioproc.torchrun``: torch's ``torch.distributed.run`` for tools that call it from Python.

The parser's flags, dests and defaults and the entry points' signatures
are compared with torch 2.13's own where torch can be run (in a process of
its own), else with the lists pinned here; ``config_from_args`` is compared
with torch's for the same argv, and with what ``aioproc run`` builds from
it (one meaning for every flag).  An accelerate-style caller parses torch's
argv and calls ``run(args)``: success returns, a failing rank raises
``ChildFailedError`` naming it; ``main`` refuses bad combinations with
``ValueError`` before anything starts.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from test_launcher import (
    REQUIRED,
    TORCH_PYTHON,
    blocking_loop,  # noqa: F401 - a fixture
    children,
    needs_torch,
    signature,
    torch_json,
)

from aioproc import DefaultLogsSpecs, torchrun
from aioproc._cli.args import _build_parsers
from aioproc._cli.run import _make_run
from aioproc._cli.torchrun import run_script_path
from aioproc.errors import ChildFailedError
from aioproc.launcher import LaunchConfig

# torch 2.13.0, torch/distributed/run.py, get_args_parser(): each action's
# option strings, dest and default (with no PET_ variable set), in order
TORCHRUN_PARSER: list[tuple[list[str], str, Any]] = [
    (["-h", "--help"], "help", "==SUPPRESS=="),
    (["--nnodes"], "nnodes", "1:1"),
    (["--nproc-per-node", "--nproc_per_node"], "nproc_per_node", "1"),
    (["--rdzv-backend", "--rdzv_backend"], "rdzv_backend", "static"),
    (["--rdzv-endpoint", "--rdzv_endpoint"], "rdzv_endpoint", ""),
    (["--rdzv-id", "--rdzv_id"], "rdzv_id", "none"),
    (["--rdzv-conf", "--rdzv_conf"], "rdzv_conf", ""),
    (["--standalone"], "standalone", False),
    (["--max-restarts", "--max_restarts"], "max_restarts", 0),
    (["--monitor-interval", "--monitor_interval"], "monitor_interval", 0.1),
    (["--start-method", "--start_method"], "start_method", "spawn"),
    (["--event-log-handler", "--event_log_handler"], "event_log_handler", "null"),
    (["--role"], "role", "default"),
    (["-m", "--module"], "module", False),
    (["--no-python", "--no_python"], "no_python", False),
    (["--run-path", "--run_path"], "run_path", False),
    (["--log-dir", "--log_dir"], "log_dir", None),
    (["-r", "--redirects"], "redirects", "0"),
    (["-t", "--tee"], "tee", "0"),
    (["--local-ranks-filter", "--local_ranks_filter"], "local_ranks_filter", ""),
    (["--duplicate-stdout-filters", "--duplicate_stdout_filters"], "duplicate_stdout_filters", []),
    (["--duplicate-stderr-filters", "--duplicate_stderr_filters"], "duplicate_stderr_filters", []),
    (["--node-rank", "--node_rank"], "node_rank", 0),
    (["--master-addr", "--master_addr"], "master_addr", "127.0.0.1"),
    (["--master-port", "--master_port"], "master_port", None),
    (["--local-addr", "--local_addr"], "local_addr", None),
    (["--logs-specs", "--logs_specs"], "logs_specs", None),
    (["--numa-binding", "--numa_binding"], "numa_binding", None),
    (
        ["--signals-to-handle", "--signals_to_handle"],
        "signals_to_handle",
        "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
    ),
    (["--shutdown-timeout", "--shutdown_timeout"], "shutdown_timeout", None),
    (["--virtual-local-rank", "--virtual_local_rank"], "virtual_local_rank", False),
    ([], "training_script", None),
    ([], "training_script_args", None),
]
# the same file's entry points: (name, kind, default) of each parameter
TORCHRUN_SIGNATURES: dict[str, list[tuple[str, str, Any]]] = {
    "get_args_parser": [],
    "parse_args": [("args", "POSITIONAL_OR_KEYWORD", REQUIRED)],
    "parse_min_max_nnodes": [("nnodes", "POSITIONAL_OR_KEYWORD", REQUIRED)],
    "determine_local_world_size": [("nproc_per_node", "POSITIONAL_OR_KEYWORD", REQUIRED)],
    "get_rdzv_endpoint": [("args", "POSITIONAL_OR_KEYWORD", REQUIRED)],
    "get_use_env": [("args", "POSITIONAL_OR_KEYWORD", REQUIRED)],
    "config_from_args": [("args", "POSITIONAL_OR_KEYWORD", REQUIRED)],
    "run_script_path": [
        ("training_script", "POSITIONAL_OR_KEYWORD", REQUIRED),
        ("training_script_args", "VAR_POSITIONAL", REQUIRED),
    ],
    "run": [("args", "POSITIONAL_OR_KEYWORD", REQUIRED)],
    "main": [("args", "POSITIONAL_OR_KEYWORD", None)],
}

SCRIPT = """\
import os, sys
out = sys.argv[1]
with open(os.path.join(out, os.environ["RANK"]), "w") as f:
    f.write(" ".join([os.environ["WORLD_SIZE"], *sys.argv[2:]]))
fail = os.environ.get("FAIL_RANK")
sys.exit(4 if fail == os.environ["RANK"] else 0)
"""


RECORDED = """\
import os
from aioproc.errors import record

@record
def main():
    if os.environ["RANK"] == "1":
        raise KeyError("rank 1 fails")

main()
"""


@pytest.fixture(autouse=True)
def no_torchrun_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun's PET_ defaults and variables of the environment stay out of these tests."""
    for name in list(os.environ):
        if name.startswith(("PET_", "TORCHELASTIC_")) or name in (
            "TORCH_ELASTIC_SHUTDOWN_TIMEOUT",
            "PYTHON_EXEC",
        ):
            monkeypatch.delenv(name)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # torch's config_from_args would set it


def parser_table(parser: argparse.ArgumentParser) -> list[tuple[list[str], str, Any]]:
    return [(list(a.option_strings), a.dest, a.default) for a in parser._actions]


def script(tmp_path: Path) -> tuple[Path, Path]:
    path = tmp_path / "script.py"
    path.write_text(SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    return path, out


# ------------------------------------------------------------- torch's shapes


def test_parser_has_torchs_flags_dests_and_defaults_pinned() -> None:
    assert parser_table(torchrun.get_args_parser()) == TORCHRUN_PARSER


@needs_torch
def test_parser_has_torchs_flags_dests_and_defaults() -> None:
    theirs = torch_json(
        "from torch.distributed.run import get_args_parser\n"
        "print(json.dumps([[a.option_strings, a.dest, a.default] "
        "for a in get_args_parser()._actions]))"
    )
    assert [tuple(x) for x in theirs] == TORCHRUN_PARSER


def test_parser_help_names_only_its_own_flags() -> None:
    """The help texts come from aioproc run's, which name flags and a command
    torchrun's parser does not have: none of those is left (``--rdzv-*`` is
    torch's own family of flags)."""
    parser = torchrun.get_args_parser()
    flags = {s for action in parser._actions for s in action.option_strings}
    for action in parser._actions:
        text = action.help or ""
        named = set(re.findall(r"--[a-z][a-z0-9-]*[a-z0-9]", text)) - {"--rdzv"}
        assert named <= flags, (action.dest, named - flags)
        assert "aioproc run" not in text, action.dest


def test_entry_points_have_torchs_signatures_pinned() -> None:
    ours = {name: signature(getattr(torchrun, name)) for name in TORCHRUN_SIGNATURES}
    assert ours == TORCHRUN_SIGNATURES


@needs_torch
def test_entry_points_have_torchs_signatures() -> None:
    names = json.dumps(list(TORCHRUN_SIGNATURES))
    theirs = torch_json(
        "import torch.distributed.run as run\n"
        f"print(json.dumps({{n: signature(getattr(run, n)) for n in {names}}}))"
    )
    assert {k: [tuple(p) for p in v] for k, v in theirs.items()} == TORCHRUN_SIGNATURES


def test_pet_variables_are_the_parsers_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PET_NPROC_PER_NODE", "3")
    monkeypatch.setenv("PET_NNODES", "1:4")
    monkeypatch.setenv("PET_STANDALONE", "1")
    monkeypatch.setenv("PET_MAX_RESTARTS", "2")
    args = torchrun.parse_args(["train.py"])
    assert (args.nproc_per_node, args.nnodes, args.standalone, args.max_restarts) == (
        "3",
        "1:4",
        True,
        2,
    )
    assert torchrun.parse_args(["--nproc-per-node=5", "train.py"]).nproc_per_node == "5"


# argvs config_from_args is compared on, with some of what torch's gives for each
ARGVS: list[tuple[list[str], dict[str, Any]]] = [
    (
        ["--nproc-per-node=2", "{script}", "a", "--b"],
        # called alone (not through run()), torch names the master port it was given
        {"max_nodes": 1, "nproc_per_node": 2, "rdzv_endpoint": "127.0.0.1:None", "run_id": "none"},
    ),
    (
        [
            "--nnodes=1:3",
            "--nproc-per-node=3",
            "--rdzv-backend=c10d",
            "--rdzv-endpoint=node0:29400",
            "--rdzv-id=job7",
            "--rdzv-conf=join_timeout=5,last_call_timeout=1",
            "--max-restarts=2",
            "--role=trainer",
            "--local-addr=10.0.0.2",
            "-m",
            "pkg.train",
            "--lr=1",
        ],
        {"max_nodes": 3, "rdzv_backend": "c10d", "cmd_args": ["-u", "-m", "pkg.train", "--lr=1"]},
    ),
    (
        [
            "--nnodes=2",
            "--node-rank=1",
            "--master-addr=node0",
            "--master-port=1234",
            "--no-python",
            "--shutdown-timeout=7",
            "--duplicate-stdout-filters=loss,acc",
            "--signals-to-handle=SIGTERM,SIGUSR1",
            "--virtual-local-rank",
            "/bin/echo",
            "hello",
        ],
        {"rdzv_configs": {"rank": 1, "timeout": 900}, "rdzv_endpoint": "node0:1234"},
    ),
    (
        ["--run-path", "--monitor-interval=2", "--start-method=fork", "{script}", "x"],
        {"start_method": "fork", "monitor_interval": 2.0, "cmd": "run_script_path"},
    ),
]
CONFIG_FIELDS = [
    "min_nodes",
    "max_nodes",
    "nproc_per_node",
    "run_id",
    "role",
    "rdzv_endpoint",
    "rdzv_backend",
    "rdzv_configs",
    "rdzv_timeout",
    "max_restarts",
    "monitor_interval",
    "start_method",
    "log_line_prefix_template",
    "metrics_cfg",
    "local_addr",
    "event_log_handler",
    "numa_options",
    "signals_to_handle",
    "duplicate_stdout_filters",
    "duplicate_stderr_filters",
    "virtual_local_rank",
    "shutdown_timeout",
]


def described(config: Any, cmd: Any, cmd_args: list[str]) -> dict[str, Any]:
    fields = {name: getattr(config, name) for name in CONFIG_FIELDS}
    return {**fields, "cmd": getattr(cmd, "__name__", cmd), "cmd_args": cmd_args}


def with_script(argv: list[str], tmp_path: Path) -> list[str]:
    path, _ = script(tmp_path)
    return [a.format(script=path) for a in argv]


@pytest.mark.parametrize(("argv", "expected"), ARGVS, ids=range(len(ARGVS)))
def test_config_from_args_builds_what_torchs_builds_pinned(
    argv: list[str], expected: dict[str, Any], tmp_path: Path
) -> None:
    config, cmd, cmd_args = torchrun.config_from_args(
        torchrun.parse_args(with_script(argv, tmp_path))
    )
    ours = described(config, cmd, cmd_args)
    assert expected.items() <= ours.items()
    assert isinstance(config.logs_specs, DefaultLogsSpecs)


@needs_torch
@pytest.mark.parametrize(("argv", "expected"), ARGVS, ids=range(len(ARGVS)))
def test_config_from_args_builds_what_torchs_builds(
    argv: list[str], expected: dict[str, Any], tmp_path: Path
) -> None:
    argv = with_script(argv, tmp_path)
    ours = described(*torchrun.config_from_args(torchrun.parse_args(argv)))
    theirs = torch_json(
        "from torch.distributed.run import config_from_args, parse_args\n"
        f"c, cmd, args = config_from_args(parse_args({argv!r}))\n"
        f"d = {{n: getattr(c, n) for n in {CONFIG_FIELDS!r}}}\n"
        "d.update(cmd=sys.executable if cmd == sys.executable else getattr(cmd, '__name__', cmd),"
        " cmd_args=args)\n"
        "print(json.dumps(d))",
        TMPDIR=str(tmp_path),  # torch's DefaultLogsSpecs makes its temp dir at once
    )
    if theirs["cmd"] == TORCH_PYTHON:  # the interpreter that ran torch's
        theirs["cmd"] = sys.executable
    assert json.loads(json.dumps(ours)) == theirs


@pytest.mark.parametrize(
    "argv", [ARGVS[0][0], ARGVS[2][0], ARGVS[3][0]], ids=["python", "static", "run-path"]
)
def test_aioproc_run_gives_the_flags_the_same_meaning(argv: list[str], tmp_path: Path) -> None:
    """``aioproc run`` with the same flags runs the same command, the same way."""
    argv = with_script(argv, tmp_path)
    config, cmd, cmd_args = torchrun.config_from_args(torchrun.parse_args(argv))
    made = _make_run(_build_parsers()[0].parse_args(["run", "--no-live", *argv]))
    assert (made.spec.entrypoint, list(made.spec.args)) == (cmd, cmd_args)
    assert made.spec.local_world_size == config.nproc_per_node
    assert made.spec.max_restarts == config.max_restarts
    assert made.grace_period == config.shutdown_timeout
    assert made.start_method == ("forkserver" if "--run-path" in argv else "spawn")
    if "--signals-to-handle=SIGTERM,SIGUSR1" in argv:
        assert made.spec.env == {"TORCHELASTIC_SIGNALS_TO_HANDLE": config.signals_to_handle}


def test_legacy_use_env_off_passes_the_local_rank(tmp_path: Path) -> None:
    path, _ = script(tmp_path)
    args = torchrun.parse_args([str(path), "x"])
    args.use_env = False
    _, _, cmd_args = torchrun.config_from_args(args)
    assert cmd_args == ["-u", str(path), "--local-rank=${local_rank}", "x"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nproc-per-node=many", "s.py"], r"--nproc-per-node 'many': expected a positive"),
        (["--nnodes=3:2", "s.py"], r"--nnodes '3:2': expected a number of nodes"),
        (["--max-restarts=-1", "s.py"], r"--max-restarts -1: expected an integer >= 0"),
        (["--redirects=9", "s.py"], r"--redirects '9'"),
        (["--local-ranks-filter=a", "s.py"], r"--local-ranks-filter 'a'"),
        (["--signals-to-handle=SIGNOPE", "s.py"], r"--signals-to-handle 'SIGNOPE'"),
        (["--rdzv-conf=novalue", "s.py"], r"--rdzv-conf 'novalue': expected KEY=VALUE"),
        (["--no-python", "--module", "s.py"], r"--no-python and -m/--module cannot be used"),
        (["--run-path", "missing.py"], r"--run-path needs an existing script"),
        (["--logs-specs=nosuch", "s.py"], r"--logs-specs 'nosuch'"),
    ],
)
def test_config_from_args_refuses_bad_flags_naming_them(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        torchrun.config_from_args(torchrun.parse_args(argv))


def test_helpers_read_values_as_aioproc_run_does() -> None:
    assert torchrun.parse_min_max_nnodes("2") == (2, 2)
    assert torchrun.parse_min_max_nnodes("1:4") == (1, 4)
    with pytest.raises(ValueError, match=r"--nnodes '1:2:3'"):
        torchrun.parse_min_max_nnodes("1:2:3")
    assert torchrun.determine_local_world_size("4") == 4
    assert torchrun.determine_local_world_size("cpu") == len(os.sched_getaffinity(0))
    with pytest.raises(ValueError, match=r"--nproc-per-node 'unknown'"):
        torchrun.determine_local_world_size("unknown")
    static = torchrun.parse_args(["--master-addr=h", "--master-port=9", "s.py"])
    assert torchrun.get_rdzv_endpoint(static) == "h:9"
    assert torchrun.get_use_env(static) is True
    assert torchrun.run_script_path is run_script_path


# ------------------------------------------------------- an accelerate-style caller


@pytest.mark.usefixtures("blocking_loop")
def test_accelerate_style_caller_runs_the_job(tmp_path: Path) -> None:
    path, out = script(tmp_path)
    argv = ["--nproc-per-node=2", f"--log-dir={tmp_path / 'logs'}", str(path), str(out), "-x"]
    args = torchrun.get_args_parser().parse_args(argv)
    assert torchrun.run(args) is None
    assert {p.name: p.read_text() for p in out.iterdir()} == {"0": "2 -x", "1": "2 -x"}
    # torch's run() chose the single-node rendezvous of its own, and a master port
    assert (args.rdzv_backend, args.rdzv_endpoint, args.master_port) == (
        "c10d",
        "localhost:0",
        29500,
    )


@pytest.mark.usefixtures("blocking_loop")
def test_accelerate_style_caller_gets_child_failed_error_naming_the_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, out = script(tmp_path)
    monkeypatch.setenv("FAIL_RANK", "1")
    argv = ["--nproc-per-node=2", f"--log-dir={tmp_path / 'logs'}", str(path), str(out)]
    with pytest.raises(ChildFailedError) as caught:
        torchrun.run(torchrun.get_args_parser().parse_args(argv))
    rank, root = caught.value.get_first_failure()
    assert (rank, root.exitcode) == (1, 4)
    assert caught.value.name == str(path)
    assert "rank      : 1 (local_rank: 1)" in str(caught.value)


@pytest.mark.usefixtures("blocking_loop")
def test_standalone_runs_this_host_alone_whatever_nnodes_says(tmp_path: Path) -> None:
    path, out = script(tmp_path)
    args = torchrun.parse_args(
        ["--standalone", "--nnodes=2", "--nproc-per-node=2", str(path), str(out)]
    )
    torchrun.run(args)
    assert args.rdzv_backend == "c10d"
    assert {p.name: p.read_text() for p in out.iterdir()} == {"0": "2", "1": "2"}


@pytest.mark.usefixtures("blocking_loop")
def test_main_runs_the_command(tmp_path: Path) -> None:
    path, out = script(tmp_path)
    assert torchrun.main(["--nproc-per-node=3", str(path), str(out)]) is None
    assert sorted(p.name for p in out.iterdir()) == ["0", "1", "2"]


@pytest.mark.usefixtures("blocking_loop")
def test_main_raises_child_failed_error_and_writes_the_error_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "recorded.py"
    path.write_text(RECORDED)
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    with pytest.raises(ChildFailedError) as caught:
        torchrun.main(["--nproc-per-node=2", f"--log-dir={tmp_path / 'logs'}", str(path)])
    assert caught.value.get_first_failure()[0] == 1
    # torch's @record on main: the root cause's error file becomes this process's
    written = json.loads(error_file.read_text())
    assert "KeyError: 'rank 1 fails'" in written["message"]["extraInfo"]["py_callstack"]


def test_python_m_aioproc_torchrun_runs_the_job_as_python_m_torch_distributed_run(
    tmp_path: Path,
) -> None:
    """``python -m aioproc.torchrun`` is the command, as ``python -m
    torch.distributed.run`` is torch's: every rank runs, exit 0; a failed rank
    exits 1 with ChildFailedError's report naming it; a bad flag exits 2."""
    path, out = script(tmp_path)
    command = [sys.executable, "-m", "aioproc.torchrun", "--nproc-per-node=2"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_"))}
    done = subprocess.run([*command, str(path), str(out), "-x"], env=env, capture_output=True)
    assert done.returncode == 0, done.stderr.decode()
    assert {p.name: p.read_text() for p in out.iterdir()} == {"0": "2 -x", "1": "2 -x"}
    failed = subprocess.run(
        [*command, str(path), str(out)], env={**env, "FAIL_RANK": "1"}, capture_output=True
    )
    assert failed.returncode == 1
    assert "ChildFailedError" in failed.stderr.decode()
    assert "rank      : 1 (local_rank: 1)" in failed.stderr.decode()
    bad = subprocess.run([*command, "--no-such-flag", str(path)], env=env, capture_output=True)
    assert bad.returncode == 2
    assert "unrecognized arguments: --no-such-flag" in bad.stderr.decode()


def test_main_refuses_no_python_with_module_before_anything_starts(tmp_path: Path) -> None:
    before = children()
    logs = tmp_path / "logs"
    with pytest.raises(ValueError, match=r"--no-python and -m/--module cannot be used together"):
        torchrun.main(["--no-python", "--module", f"--log-dir={logs}", "/bin/true"])
    assert children() == before
    assert not logs.exists()


def test_main_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        torchrun.parse_args(["--start-method=thread", "s.py"])
    assert caught.value.code == 2
    assert "invalid choice: 'thread'" in capsys.readouterr().err


def test_main_lets_the_parsers_exit_through() -> None:
    with pytest.raises(SystemExit) as caught:
        torchrun.main(["--numa-binding=anywhere", "s.py"])
    assert caught.value.code == 2


def test_the_config_is_an_aioproc_launch_config(tmp_path: Path) -> None:
    path, _ = script(tmp_path)
    config, cmd, _ = torchrun.config_from_args(torchrun.parse_args([str(path)]))
    assert isinstance(config, LaunchConfig)
    assert cmd == sys.executable
