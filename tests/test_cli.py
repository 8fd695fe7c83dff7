"""``aioproc run``: the real command in a subprocess, as a user runs it.

Async tests run the command on the same kind of event loop as the test
(``AIOPROC_LOOP``), so the suite covers the CLI on asyncio and on uvloop.
The live view is checked on a pseudo-terminal with a small terminal emulator.
"""

from __future__ import annotations

import asyncio
import glob
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import REPO_ROOT, free_port, loop_name, pid_gone
from terminal import Action, Terminal, run_steps_on_pty

from aioproc.agent import RestartPolicy
from aioproc.cli import parse_backoff, parse_nproc

sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))
from soak_cancel import MARK_VAR, clean_up, marked_pids, survivors

CHILDREN = Path(__file__).parent / "children"
ENV_SCRIPT = str(CHILDREN / "cli_env.py")
FAIL_SCRIPT = str(CHILDREN / "cli_fail.py")
RESTART_SCRIPT = str(CHILDREN / "cli_restart.py")
SLEEP_SCRIPT = str(CHILDREN / "cli_sleep.py")
LIVE_SCRIPT = str(CHILDREN / "cli_live.py")
EXIT_SCRIPT = str(CHILDREN / "cli_exit.py")
WATCHDOG_SCRIPT = str(CHILDREN / "cli_watchdog.py")
LIMIT = 30.0
CLI = [sys.executable, "-m", "aioproc"]


# ----------------------------------------------------------------- helpers


@dataclass
class Result:
    code: int
    out: str
    err: str


def cli_env(**extra: str) -> dict[str, str]:
    """The environment for the command: ours, on the test's kind of loop."""
    # torchrun's variables from the developer's shell would change the flags' defaults
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "PET_"))}
    env.pop("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", None)
    env["AIOPROC_LOOP"] = loop_name()
    env["OMP_NUM_THREADS"] = "1"  # keeps the agent's OMP warning out of the output
    env.update(extra)
    return env


async def aioproc_run(
    *args: str, cwd: str | None = None, timeout: float = LIMIT, env: dict[str, str] | None = None
) -> Result:
    """Run ``aioproc run args``; logs go to a temp dir unless ``--log-dir`` is given."""
    with tempfile.TemporaryDirectory(prefix="test_cli_") as logs:
        log_dir = [] if "--log-dir" in args else ["--log-dir", logs]
        proc = await asyncio.create_subprocess_exec(
            *CLI,
            "run",
            *log_dir,
            *args,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=cli_env(**(env or {})),
            cwd=cwd,
        )
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.communicate()
    assert proc.returncode is not None
    return Result(proc.returncode, out.decode(), err.decode())


def env_reports(out: str, prefix: str = "[default{rank}]:") -> dict[int, dict[str, object]]:
    """The ``ENV {...}`` lines of cli_env.py workers, by the rank in their prefix."""
    reports: dict[int, dict[str, object]] = {}
    pattern = re.escape(prefix).replace(re.escape("{rank}"), r"(\d+)") + r"ENV (\{.*\})$"
    for line in out.splitlines():
        m = re.match(pattern, line)
        if m:
            reports[int(m[1])] = json.loads(m[2])
    return reports


def summary_sections(err: str) -> tuple[str, str]:
    """The "Failures:" and "Root Cause" sections of torchrun's failure summary."""
    assert "Failures:" in err and "Root Cause (first observed failure):" in err, err
    others = err.split("Failures:", 1)[1].split("Root Cause (first observed failure):")[0]
    root = err.split("Root Cause (first observed failure):", 1)[1]
    return others, root


# ----------------------------------------------------------------- success


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
async def test_success_gives_torchrun_env_and_prefixed_lines(method: str) -> None:
    r = await aioproc_run(
        "--nproc-per-node", "2", "--tee", "3", "--start-method", method,
        ENV_SCRIPT, "--flag", "x${local_rank}",
    )  # fmt: skip
    assert r.code == 0, r.err
    reports = env_reports(r.out)
    assert sorted(reports) == [0, 1], r.out
    ports = {rep["MASTER_PORT"] for rep in reports.values()}
    run_ids = {rep["TORCHELASTIC_RUN_ID"] for rep in reports.values()}
    assert len(ports) == 1 and len(run_ids) == 1
    port = int(str(ports.pop()))
    assert 0 < port < 65536
    for rank, rep in reports.items():
        assert rep["RANK"] == rep["LOCAL_RANK"] == rep["ROLE_RANK"] == str(rank)
        assert rep["WORLD_SIZE"] == rep["LOCAL_WORLD_SIZE"] == rep["ROLE_WORLD_SIZE"] == "2"
        assert rep["GROUP_RANK"] == "0" and rep["GROUP_WORLD_SIZE"] == "1"
        assert rep["ROLE_NAME"] == "default"
        assert rep["MASTER_ADDR"] == "127.0.0.1"
        assert rep["TORCHELASTIC_RESTART_COUNT"] == "0"
        assert rep["TORCHELASTIC_MAX_RESTARTS"] == "0"
        error_file = str(rep["TORCHELASTIC_ERROR_FILE"])
        assert error_file.endswith(os.path.join("attempt_0", str(rank), "error.json"))
        assert rep["ARGS"] == ["--flag", f"x{rank}"]
        assert rep["SIGHUP"] == "default"  # the agent ignores SIGHUP, its workers do not
        # torchrun sets these two; aioproc hosts no agent store, hence False
        assert rep["TORCHELASTIC_USE_AGENT_STORE"] == "False"
        assert rep["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
        assert rep["TORCHELASTIC_SIGNALS_TO_HANDLE"] == "SIGTERM,SIGINT,SIGQUIT"  # as handled
        assert rep["LEADER"] is True


async def test_without_tee_output_is_inherited_unprefixed() -> None:
    r = await aioproc_run("--nproc-per-node", "2", ENV_SCRIPT)
    assert r.code == 0, r.err
    lines = r.out.splitlines()
    assert len(lines) == 2 and all(line.startswith("ENV {") for line in lines), r.out
    assert sorted(json.loads(line[4:])["RANK"] for line in lines) == ["0", "1"]


async def test_torchrun_spellings_and_rendezvous_flags() -> None:
    port = free_port()
    r = await aioproc_run(
        "--nproc_per_node=2",
        "--max_restarts=0",
        "--master_addr=127.0.0.1",
        f"--master_port={port}",
        "--rdzv_id=job42",
        "--role=trainer",
        "--tee=0:1,1:1",
        "--standalone",
        "--nnodes=1:1",
        "--monitor_interval=0.5",
        ENV_SCRIPT,
    )
    assert r.code == 0, r.err
    reports = env_reports(r.out, "[trainer{rank}]:")
    assert sorted(reports) == [0, 1], r.out
    for rep in reports.values():
        assert rep["MASTER_PORT"] == str(port)
        assert rep["TORCHELASTIC_RUN_ID"] == "job42"
        assert rep["ROLE_NAME"] == "trainer"


@pytest.mark.parametrize(
    "rdzv",
    [
        ["--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", "--nnodes", "1"],
        ["--rdzv_backend=c10d", "--rdzv_endpoint=localhost:29400", "--nnodes=1:1",
         "--node_rank=0", "--rdzv_id=job9", "--rdzv_conf=join_timeout=900,is_host=1"],
        ["--rdzv-backend=static", "--rdzv-endpoint=[::1]:0", "--node-rank", "0"],
    ],
    ids=["dashes", "underscores", "static-ipv6"],
)  # fmt: skip
async def test_single_node_rendezvous_flags_run_standalone(rdzv: list[str]) -> None:
    """Scripts that name a rendezvous on one node get what --standalone gives."""
    standalone = await aioproc_run(
        "--standalone", "--nproc-per-node", "2", "--tee", "1", ENV_SCRIPT
    )
    named = await aioproc_run(*rdzv, "--nproc-per-node", "2", "--tee", "1", ENV_SCRIPT)
    assert standalone.code == named.code == 0, named.err

    def comparable(out: str) -> dict[int, dict[str, object]]:
        # what differs between any two runs: ports, run ids, pids, log paths
        varying = ("MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE", "PID")
        return {
            rank: {k: v for k, v in rep.items() if k not in varying}
            for rank, rep in env_reports(out).items()
        }

    assert sorted(comparable(named.out)) == [0, 1], named.out
    assert comparable(named.out) == comparable(standalone.out)
    if "--rdzv_id=job9" in rdzv:
        assert {r["TORCHELASTIC_RUN_ID"] for r in env_reports(named.out).values()} == {"job9"}


async def test_log_dir_is_named_at_start(tmp_path: Path) -> None:
    r = await aioproc_run("--log-dir", str(tmp_path), "--run-id", "job", ENV_SCRIPT)
    assert r.code == 0, r.err
    (run_dir,) = glob.glob(str(tmp_path / "job_*"))
    assert r.err.splitlines()[0] == f"aioproc run: logs in {run_dir}", r.err


async def test_module_flag_runs_python_dash_m() -> None:
    r = await aioproc_run("--nproc-per-node", "2", "--tee", "3", "-m", "cli_env", cwd=str(CHILDREN))
    assert r.code == 0, r.err
    assert sorted(env_reports(r.out)) == [0, 1], r.out


async def test_no_python_runs_the_binary_directly() -> None:
    r = await aioproc_run(
        "--nproc-per-node", "2", "--tee", "3", "--no-python",
        "sh", "-c", 'echo "rank $RANK of $WORLD_SIZE"',
    )  # fmt: skip
    assert r.code == 0, r.err
    assert sorted(r.out.splitlines()) == ["[default0]:rank 0 of 2", "[default1]:rank 1 of 2"]


async def test_local_ranks_filter_shows_only_those_ranks() -> None:
    r = await aioproc_run(
        "--nproc-per-node", "3", "--tee", "3", "--local-ranks-filter", "0,2", ENV_SCRIPT
    )
    assert r.code == 0, r.err
    assert sorted(env_reports(r.out)) == [0, 2], r.out
    assert "[default1]:" not in r.out


# ----------------------------------------------------------------- failure


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
async def test_failure_prints_torchrun_summary_with_the_traceback(method: str) -> None:
    r = await aioproc_run(
        "--nproc-per-node", "2", "--tee", "3", "--start-method", method, FAIL_SCRIPT
    )
    assert r.code == 1, r.err
    assert f"{FAIL_SCRIPT} FAILED" in r.err
    others, root = summary_sections(r.err)
    assert "rank      : 1 (local_rank: 1)" in root
    assert "exitcode  : 1 (pid: " in root
    assert re.search(r"error_file: \S+attempt_0/1/error\.json", root), root
    assert "Traceback (most recent call last):" in root
    assert 'raise ValueError(f"boom from rank {rank}")' in root
    assert "ValueError: boom from rank 1" in root
    # rank 0 was stopped because rank 1 failed: listed, but not the root cause
    assert "rank      : 0 (local_rank: 0)" in others
    assert "exitcode  : -15" in others and "(stopped by aioproc)" in others
    # the worker's own stderr was tee'd too
    assert "[default1]:ValueError: boom from rank 1" in r.err


async def test_failure_names_the_failing_ranks_log_files(tmp_path: Path) -> None:
    r = await aioproc_run(
        "--nproc-per-node", "2", "--redirects", "3", "--log-dir", str(tmp_path),
        "--run-id", "job", FAIL_SCRIPT,
    )  # fmt: skip
    assert r.code == 1, r.err
    (run_dir,) = glob.glob(str(tmp_path / "job_*"))
    rank_dir = os.path.join(run_dir, "attempt_0", "1")
    after = r.err.split(f"{FAIL_SCRIPT} FAILED", 1)[1]
    # named once, by the summary or after it
    for path in (os.path.join(rank_dir, "stderr.log"), os.path.join(rank_dir, "stdout.log")):
        assert re.search(re.escape(path) + r"(,|\s|$)", after), r.err
    assert "ValueError: boom from rank 1" in Path(rank_dir, "stderr.log").read_text()
    assert re.search(re.escape(run_dir) + r"/?$", after, re.MULTILINE), r.err


async def test_restarts_until_success_with_an_attempt_dir_each(tmp_path: Path) -> None:
    log_dir = tmp_path / "logs"
    r = await aioproc_run(
        "--nproc-per-node", "2", "--max-restarts", "2", "--tee", "3",
        "--log-dir", str(log_dir), "--run-id", "job", RESTART_SCRIPT, "2",
    )  # fmt: skip
    assert r.code == 0, r.err
    # rank 1 of a failed attempt may be stopped before it says anything
    said = set(r.out.splitlines())
    want = {f"[default0]:attempt {a} rank 0" for a in range(3)} | {"[default1]:attempt 2 rank 1"}
    assert want <= said, r.out
    assert said <= want | {f"[default1]:attempt {a} rank 1" for a in range(2)}, r.out
    assert r.err.count("restarting the worker group") == 2, r.err
    run_dirs = glob.glob(str(log_dir / "job_*"))
    assert len(run_dirs) == 1, run_dirs
    attempts = sorted(os.path.basename(p) for p in glob.glob(os.path.join(run_dirs[0], "*")))
    assert attempts == ["attempt_0", "attempt_1", "attempt_2"]
    for a, k in [(0, 0), (1, 0), (2, 0), (2, 1)]:
        log = Path(run_dirs[0], f"attempt_{a}", str(k), "stdout.log")
        assert log.read_text() == f"attempt {a} rank {k}\n"


async def test_restarts_used_up_fail_with_the_last_attempts_summary() -> None:
    r = await aioproc_run("--max-restarts", "1", RESTART_SCRIPT, "5")
    assert r.code == 1, r.err
    assert r.out.splitlines() == ["attempt 0 rank 0", "attempt 1 rank 0"]
    assert "restart 1 of 1" in r.err
    _, root = summary_sections(r.err)
    assert "exitcode  : 3" in root
    assert re.search(r"error_file: <N/A>", root)


async def test_backoff_delays_the_restart() -> None:
    started = time.monotonic()
    r = await aioproc_run("--max-restarts", "1", "--backoff", "0.3,2,10", RESTART_SCRIPT, "1")
    assert r.code == 0, r.err
    assert time.monotonic() - started >= 0.3
    assert "restart 1 of 1 in 0.3 s" in r.err, r.err


async def test_watchdog_flag_serves_timers_to_the_workers() -> None:
    r = await aioproc_run("--nproc-per-node", "2", "--watchdog", WATCHDOG_SCRIPT)
    assert r.code == 1, r.err
    assert f"{WATCHDOG_SCRIPT} FAILED" in r.err
    _, root = summary_sections(r.err)
    assert "rank      : 1 (local_rank: 1)" in root
    assert "exitcode  : -9" in root
    assert "watchdog timer 'stuck step' expired after 0.3 s" in root


# ----------------------------------------------------------------- signals


async def start_sleepers(
    log_dir: Path, *args: str, n: int = 2, env: dict[str, str] | None = None
) -> tuple[asyncio.subprocess.Process, list[int]]:
    """Start the command on cli_sleep.py workers; return it once all said ready."""
    proc = await asyncio.create_subprocess_exec(
        *CLI,
        "run",
        "--log-dir",
        str(log_dir),
        "--nproc-per-node",
        str(n),
        *args,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=cli_env(**(env or {})),
    )
    assert proc.stdout is not None
    pids: list[int] = []
    try:
        while len(pids) < n:
            line = await asyncio.wait_for(proc.stdout.readline(), LIMIT)
            assert line, "the command ended before its workers were ready"
            pids += [int(pid) for pid in re.findall(rb"ready (\d+)", line)]
    except BaseException:
        proc.kill()
        await proc.communicate()
        raise
    return proc, pids


SIGNALS_ENV = "TORCHELASTIC_SIGNALS_TO_HANDLE"


@pytest.mark.parametrize(
    ("flags", "env", "signals", "code"),
    [
        ((), {}, (signal.SIGTERM,), 128 + signal.SIGTERM),
        ((), {}, (signal.SIGINT,), 128 + signal.SIGINT),
        ((), {}, (signal.SIGHUP, signal.SIGTERM), 128 + signal.SIGTERM),
        (("--forward-sighup",), {}, (signal.SIGHUP,), 128 + signal.SIGHUP),
        # torchrun's variable: SIGUSR1 handled (SLURM), SIGHUP still ignored
        ((), {SIGNALS_ENV: "SIGUSR1, SIGTERM"}, (signal.SIGHUP, signal.SIGUSR1), 128 + 10),
        # the flag wins over the variable; SIGHUP listed means handled
        (
            ("--signals-to-handle", "SIGHUP"),
            {SIGNALS_ENV: "SIGUSR1"},
            (signal.SIGHUP,),
            128 + signal.SIGHUP,
        ),
    ],
    ids=[
        "SIGTERM",
        "SIGINT",
        "SIGHUP-ignored",
        "SIGHUP-forwarded",
        "env-SIGUSR1",
        "flag-SIGHUP",
    ],
)
async def test_signal_stops_the_workers_and_sets_the_exit_code(
    flags: tuple[str, ...],
    env: dict[str, str],
    signals: tuple[signal.Signals, ...],
    code: int,
    tmp_path: Path,
) -> None:
    proc, pids = await start_sleepers(
        tmp_path, "--tee", "3", "--grace-period", "20", *flags, SLEEP_SCRIPT, env=env
    )
    for sig in signals:
        proc.send_signal(sig)
    _, err = await asyncio.wait_for(proc.communicate(), LIMIT)
    assert proc.returncode == code, err.decode()
    assert f"got {signal.Signals(code - 128).name}" in err.decode()
    assert [pid for pid in pids if not pid_gone(pid)] == []


@pytest.mark.parametrize(
    ("flags", "env"),
    [
        (["--grace-period", "1"], {}),
        (["--shutdown-timeout", "1"], {}),  # torchrun's name
        (["--shutdown_timeout=1"], {}),
        ([], {"PET_SHUTDOWN_TIMEOUT": "1"}),
        ([], {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "1"}),
        (["--shutdown-timeout", "1"], {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "600"}),
    ],
    ids=["grace-period", "shutdown-timeout", "underscores", "PET", "torch-env", "flag-wins"],
)
async def test_workers_ignoring_sigterm_are_killed_after_the_grace_period(
    tmp_path: Path, flags: list[str], env: dict[str, str]
) -> None:
    proc, pids = await start_sleepers(tmp_path, *flags, SLEEP_SCRIPT, "stubborn", env=env)
    signalled = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = await asyncio.wait_for(proc.communicate(), LIMIT)
    took = time.monotonic() - signalled
    assert proc.returncode == 128 + signal.SIGTERM, err.decode()
    assert 0.9 <= took < 1 + 10, took
    assert "ForcedKillWarning" in err.decode()
    assert [pid for pid in pids if not pid_gone(pid)] == []


async def test_second_sigint_kills_the_workers_at_once(tmp_path: Path) -> None:
    """Ctrl-C twice: the workers ignore the first, the second SIGKILLs them now."""
    proc, pids = await start_sleepers(
        tmp_path, "--tee", "3", "--grace-period", "600", SLEEP_SCRIPT, "stubborn"
    )
    assert proc.stderr is not None
    proc.send_signal(signal.SIGINT)
    said = []
    while True:  # the first is being handled: the grace period runs
        line = (await asyncio.wait_for(proc.stderr.readline(), LIMIT)).decode()
        assert line, said
        said.append(line)
        if "stopping the workers" in line:
            break
    assert said[-1] == (
        "aioproc run: got SIGINT: stopping the workers (SIGKILL in 600 s; "
        "Ctrl-C again kills them now)\n"
    )
    assert all(not pid_gone(pid) for pid in pids)
    proc.send_signal(signal.SIGINT)
    # within the test's time limit, far below the 600 s grace period
    _, rest = await asyncio.wait_for(proc.communicate(), LIMIT)
    err = rest.decode()
    assert proc.returncode == 128 + signal.SIGINT, err
    lines = err.splitlines()
    assert lines[0] == (
        "aioproc run: got SIGINT again: killing the workers now with SIGKILL, "
        "without waiting out the 600 s grace period"
    ), err
    assert re.search(
        r"aioproc: ForcedKillWarning: 2 worker\(s\) did not exit within [\d.]+ s of SIGINT "
        r"and were killed with SIGKILL: default/0 \(pid \d+\), default/1 \(pid \d+\)$",
        err,
        re.MULTILINE,
    ), err
    assert lines[-1] == "aioproc run: got SIGINT: the workers were stopped"
    assert [pid for pid in pids if not pid_gone(pid)] == []


# ---------------------------------------------------------- command line

# ------------------------------------------------------------ forkserver


def worker_lines(r: Result) -> list[str]:
    """Every line the workers wrote (tee'd, prefixed), in order per stream."""
    return [line for line in (r.out + r.err).splitlines() if line.startswith("[default")]


@pytest.mark.parametrize(
    ("end", "exitcode"),
    [
        (["ok"], None),
        (["raise"], 1),
        (["exit", "3"], 3),
        (["exit-text"], 1),
        (["interrupt"], -2),
    ],
    ids=["ok", "raise", "exit-3", "exit-text", "interrupt"],
)
async def test_forked_scripts_run_and_end_as_spawned_ones(
    end: list[str], exitcode: int | None
) -> None:
    spawned = await aioproc_run("--tee", "3", EXIT_SCRIPT, *end)
    forked = await aioproc_run("--tee", "3", "--start-method", "forkserver", EXIT_SCRIPT, *end)
    assert (spawned.code, forked.code) == ((0, 0) if exitcode is None else (1, 1)), forked.err
    # argv, sys.path[0], __main__, stdio, the unterminated last line, the traceback
    assert worker_lines(forked) == worker_lines(spawned)
    lines = worker_lines(forked)
    assert lines[0] == (
        f"[default0]:rank 0 argv={[EXIT_SCRIPT, *end]} path0={CHILDREN} name=__main__ "
        f"file={EXIT_SCRIPT} spec=None stdio=True/False/FileIO backslashreplace 0"
    )
    assert lines[1] == "[default0]:no newline at the end"
    if exitcode is None:
        return
    for r in (spawned, forked):
        _, root = summary_sections(r.err)
        assert f"exitcode  : {exitcode} (pid: " in root
        assert "error_file: <N/A>" in root  # no @record: no error file, as with torchrun
    if end == ["raise"]:
        marks = re.compile(r"\[default0\]: *[~^]+$")  # Python 3.13 underlines calls
        assert [line for line in lines[2:] if not marks.match(line)] == [
            "[default0]:Traceback (most recent call last):",
            f'[default0]:  File "{EXIT_SCRIPT}", line 30, in <module>',
            "[default0]:    fail()",
            f'[default0]:  File "{EXIT_SCRIPT}", line 26, in fail',
            "[default0]:    raise RuntimeError(f\"{mode} from rank {os.environ['RANK']}\")",
            "[default0]:RuntimeError: raise from rank 0",
        ]


async def test_forked_modules_and_directories_run_as_spawned_ones(tmp_path: Path) -> None:
    """``-m module`` and a directory with ``__main__.py``, forked: as spawned (runpy)."""
    app = tmp_path / "app"
    app.mkdir()
    (app / "__main__.py").write_text(
        "import sys\nsys.stdout.write(f'{__name__} {sys.argv} {sys.path[0]}\\n')\n"
    )
    outputs = {}
    for method in ("spawn", "forkserver"):
        module = await aioproc_run(
            "--tee", "3", "--start-method", method, "-m", "cli_env", "a",
            cwd=str(CHILDREN), env={"PYTHONPATH": REPO_ROOT},
        )  # fmt: skip
        directory = await aioproc_run("--tee", "3", "--start-method", method, str(app), "b")
        assert module.code == directory.code == 0, module.err + directory.err
        reports = env_reports(module.out)
        assert reports[0]["ARGS"] == ["a"] and reports[0]["LEADER"] is True
        del reports[0]["PID"], reports[0]["MASTER_PORT"], reports[0]["TORCHELASTIC_RUN_ID"]
        del reports[0]["TORCHELASTIC_ERROR_FILE"]
        outputs[method] = (reports, worker_lines(directory))
    assert outputs["forkserver"] == outputs["spawn"]
    assert outputs["spawn"][1] == [f"[default0]:__main__ {[str(app), 'b']} {app}"]


IMPORT_LOG_ENV = "AIOPROC_TEST_IMPORT_LOG"


async def test_forkserver_preload_is_imported_once_for_all_workers_and_restarts(
    tmp_path: Path,
) -> None:
    """--preload: the module next to the script is imported once, in the template."""
    log = tmp_path / "imports"
    (tmp_path / "cli_heavy.py").write_text(
        f"import os\nwith open(os.environ[{IMPORT_LOG_ENV!r}], 'a') as f:\n"
        "    f.write(f'{os.getpid()}\\n')\n"
    )
    script = tmp_path / "train.py"
    script.write_text(
        "import os, sys\n"
        "loaded = 'cli_heavy' in sys.modules\n"
        "import cli_heavy\n"
        "rank, attempt = os.environ['RANK'], os.environ['TORCHELASTIC_RESTART_COUNT']\n"
        "sys.stdout.write(f'attempt {attempt} rank {rank} loaded {loaded} {os.getpid()}\\n')\n"
        "sys.exit(5 if (rank, attempt) == ('1', '0') else 0)\n"
    )
    r = await aioproc_run(
        "--nproc-per-node", "2", "--max-restarts", "1", "--start-method", "forkserver",
        "--preload", "cli_heavy", str(script),
        env={IMPORT_LOG_ENV: str(log)},
    )  # fmt: skip
    assert r.code == 0, r.err
    seen = {}
    for m in re.finditer(r"^attempt (\d) rank (\d) loaded (\w+) (\d+)$", r.out, re.M):
        seen[m[1], m[2]] = (m[3], int(m[4]))
    # rank 0 of attempt 0 may be stopped before it says anything
    assert {("0", "1"), ("1", "0"), ("1", "1")} <= set(seen), r.out
    assert {loaded for loaded, _ in seen.values()} == {"True"}
    imports = log.read_text().split()
    assert len(imports) == 1, imports  # one import, in the template
    assert int(imports[0]) not in {pid for _, pid in seen.values()}


async def test_forkserver_preload_that_fails_says_why_and_runs_nothing(tmp_path: Path) -> None:
    (tmp_path / "cli_broken.py").write_text("raise LookupError('cli_broken will not load')\n")
    script = tmp_path / "never.py"
    script.write_text("open(__file__ + '.ran', 'w').close()\n")
    r = await aioproc_run(
        "--start-method", "forkserver", "--preload", "json,cli_broken", str(script)
    )  # fmt: skip
    assert r.code == 1
    lines = r.err.splitlines()
    assert lines[-1] == (
        "aioproc run: forkserver preload: importing 'cli_broken' failed: "
        "LookupError: cli_broken will not load"
    )
    assert "Traceback (most recent call last):" in lines  # the template's own
    assert f'  File "{tmp_path / "cli_broken.py"}", line 1, in <module>' in lines
    assert not (tmp_path / "never.py.ran").exists()


async def test_forkserver_supervisor_sigkilled_leaves_no_worker_nor_template(
    tmp_path: Path,
) -> None:
    mark = uuid.uuid4().hex
    proc, pids = await start_sleepers(
        tmp_path, "--start-method", "forkserver", SLEEP_SCRIPT, env={MARK_VAR: mark}
    )
    try:
        # the workers, the template (and the guardian) carry the mark, as the command does
        marked = marked_pids(mark) - {proc.pid}
    finally:
        proc.kill()
        await proc.communicate()
        left = await survivors(mark, pids)
        if left:
            await clean_up(mark, left)
    assert set(pids) < marked
    assert left == set()


RUN_FLAGS = [
    "--nproc-per-node",
    "--nnodes",
    "--node-rank",
    "--standalone",
    "--rdzv-backend",
    "--rdzv-endpoint",
    "--rdzv-conf",
    "--max-restarts",
    "--backoff",
    "--monitor-interval",
    "--grace-period",
    "--redirects",
    "--tee",
    "--log-dir",
    "--local-ranks-filter",
    "--duplicate-stdout-filters",
    "--duplicate-stderr-filters",
    "--log-line-prefix-template",
    "--logs-specs",
    "--event-log-handler",
    "--role",
    "--run-id",
    "--master-addr",
    "--master-port",
    "--start-method",
    "--preload",
    "--no-python",
    "--module",
    "--run-path",
    "--virtual-local-rank",
    "--numa-binding",
    "--watchdog",
    "--no-live",
    "--forward-sighup",
    "--signals-to-handle",
]


def test_help_lists_every_flag_with_its_default() -> None:
    proc = subprocess.run(
        [*CLI, "run", "--help"],
        capture_output=True,
        text=True,
        timeout=LIMIT,
        env=cli_env(COLUMNS="100"),
    )
    assert proc.returncode == 0, proc.stderr
    # one block per option: from its line ("  -x, --xxx ...") to the next option
    blocks: dict[str, str] = {}
    current = ""
    options = proc.stdout.split("\noptions:\n", 1)[1].split("\n\n", 1)[0]
    for line in options.splitlines():
        m = re.match(r"  (-\w( \S+)?, )?(?P<flag>--[\w-]+)", line)
        if m:
            current = m["flag"]
            blocks[current] = ""
        elif not line.strip() or not line.startswith("   "):
            current = ""
        if current:
            blocks[current] += " " + line.strip()
    # torchrun's short options ("-r STD, --redirects STD"; Python 3.13 prints
    # the metavar once: "-r, --redirects STD")
    assert re.search(r"-r( STD)?, --redirects STD", proc.stdout), proc.stdout
    for flag in RUN_FLAGS:
        assert flag in blocks, f"{flag} missing from --help:\n{proc.stdout}"
        assert "(default:" in blocks[flag], f"{flag} has no default in --help: {blocks[flag]}"
    assert "SIGHUP" in proc.stdout and "torchrun" in proc.stdout
    assert "--rdzv-id" in blocks["--run-id"]
    assert "--shutdown-timeout" in blocks["--grace-period"]
    assert "PET_<NAME>" in proc.stdout


def test_version() -> None:
    from aioproc import __version__

    proc = subprocess.run(
        [*CLI, "--version"], capture_output=True, text=True, timeout=LIMIT, env=cli_env()
    )
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"aioproc {__version__}"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nproc-per-node", "0"], "positive number"),
        (["--nproc-per-node", "gpus"], "or auto, cpu, gpu or xpu, got 'gpus'"),
        (["--tee", "7"], "invalid Std value"),
        (["--redirects", "0:3,0:1"], "given twice"),
        (["--backoff", "1,2"], "initial,factor,max"),
        (["--backoff", "1,0.5,10"], "factor must be >= 1"),
        (["--no-python", "-m"], "cannot be used together"),
        (["--nnodes", "two"], "expected a number of nodes, N or MIN:MAX such as 1:4, got 'two'"),
        (["--nnodes", "2:1"], "got '2:1'"),
        (["--nnodes", "0"], "got '0'"),
        (["--node-rank", "-1"], "expected a node rank >= 0, got '-1'"),
        (["--node-rank", "1"], "--node-rank 1 needs --nnodes > 1"),
        (["--node_rank=3", "--nnodes=1"], "--node-rank 3 needs --nnodes > 1"),
        (["--nnodes=2", "--node-rank=2"], "--node-rank 2 must be < --nnodes 2"),
        (
            ["--nnodes=1:4"],
            "--nnodes 1:4 is elastic: use --rdzv-backend c10d or etcd, or a fixed --nnodes N "
            "with --rdzv-backend static",
        ),
        (
            ["--nnodes=2:3", "--rdzv-backend=c10d"],
            "--rdzv-backend c10d needs --rdzv-endpoint HOST[:PORT] (the host whose agent "
            "serves the rendezvous; port 29400 by default)",
        ),
        (
            ["--nnodes=2:3", "--rdzv-backend=zk"],
            "--rdzv-backend 'zk' cannot join several nodes in aioproc; use c10d, etcd or static",
        ),
        (
            ["--nnodes=2:3", "--rdzv-backend=etcd"],
            "--rdzv-backend etcd needs --rdzv-endpoint HOST:PORT (the etcd server)",
        ),
        (
            ["--nnodes=2:3", "--rdzv-backend=etcd", "--rdzv-endpoint=localhost:2379"],
            "--rdzv-backend etcd needs --rdzv-id (the job's id)",
        ),
        (["--rdzv-endpoint", "localhost:99999"], "expected HOST[:PORT]"),
        (["--rdzv-endpoint", ":29400"], "got ':29400'"),
        (["--rdzv-conf", "join_timeout"], "expected KEY=VALUE pairs"),
        (["--rdzv-backend", ""], "expected a rendezvous backend name"),
        (["--local-ranks-filter", "a"], "comma-separated local ranks"),
        (["--master-port", "70000"], "TCP port"),
        (["--grace-period", "-1"], ">= 0"),
        (["--grace-period", "nan"], "expected a finite number >= 0, got 'nan'"),
        (["--grace-period", "inf"], "expected a finite number >= 0, got 'inf'"),
        (["--monitor-interval", "nan"], "expected a finite number >= 0, got 'nan'"),
        (["--monitor-interval=-inf"], "expected a finite number >= 0, got '-inf'"),
        (["--backoff", "nan,2,60"], "RestartPolicy.initial_delay must be a finite number"),
        (["--backoff", "1,nan,60"], "RestartPolicy.factor must be >= 1 and finite"),
        (["--backoff", "1,2,inf"], "RestartPolicy.max_delay must be a finite number"),
        (["--run-id", "../.."], "run id '../..' contains a path separator"),
        (["--run-id", "a/b"], "run id 'a/b' contains a path separator"),
        (["--run-id", ".."], "run id '..' is not a usable directory name"),
        (["--run-id", "."], "run id '.' is not a usable directory name"),
        (
            ["--signals-to-handle", "SIGTERM,SIGNOPE"],
            "'SIGNOPE' is not a signal name: expected comma-separated signal names "
            "(e.g. 'SIGTERM,SIGINT,SIGUSR1'), got 'SIGTERM,SIGNOPE'",
        ),
        (["--signals-to-handle", "SIGKILL"], "'SIGKILL' cannot be caught"),
        (["--signals-to-handle", "15"], "'15' is not a signal name"),
        (
            ["--preload", "json,os"],
            "--preload json,os needs --start-method forkserver (only the forkserver "
            "template preloads modules)",
        ),
        (["--start-method", "vfork"], "unknown start_method 'vfork'"),
        (
            ["--start-method", "forkserver", "--preload", "json,a b"],
            "expected comma-separated module names (e.g. 'torch,numpy'), got 'json,a b'",
        ),
        (
            ["--start-method", "forkserver", "--preload", "json", "--no-python"],
            "--preload needs a Python script or module: --no-python programs are spawned",
        ),
    ],
)
def test_usage_errors_exit_2_with_a_message(args: list[str], message: str) -> None:
    proc = subprocess.run(
        [*CLI, "run", *args, ENV_SCRIPT],
        capture_output=True,
        text=True,
        timeout=LIMIT,
        env=cli_env(),
    )
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr.splitlines()[-1]
    assert proc.stderr.splitlines()[-1].startswith("aioproc run: error: ")
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""


def test_bad_signals_to_handle_variable_is_a_usage_error() -> None:
    proc = subprocess.run(
        [*CLI, "run", ENV_SCRIPT],
        capture_output=True,
        text=True,
        timeout=LIMIT,
        env=cli_env(TORCHELASTIC_SIGNALS_TO_HANDLE="SIGTERM,SIGBOGUS"),
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines()[-1] == (
        "aioproc run: error: TORCHELASTIC_SIGNALS_TO_HANDLE: 'SIGBOGUS' is not a signal "
        "name: expected comma-separated signal names (e.g. 'SIGTERM,SIGINT,SIGUSR1'), got "
        "'SIGTERM,SIGBOGUS'"
    )
    assert proc.stdout == ""


@pytest.mark.parametrize("inside", [False, True])
def test_log_dir_that_is_a_file_is_a_usage_error(tmp_path: Path, inside: bool) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    log_dir = str(a_file / "logs") if inside else str(a_file)
    proc = subprocess.run(
        [*CLI, "run", "--log-dir", log_dir, ENV_SCRIPT],
        capture_output=True,
        text=True,
        timeout=LIMIT,
        env=cli_env(),
    )
    assert proc.returncode == 2
    reason = (
        f"cannot be created: {str(a_file)!r} exists and is not a directory"
        if inside
        else "exists and is not a directory"
    )
    assert proc.stderr.splitlines()[-1] == (
        f"aioproc run: error: argument --log-dir/--log_dir: log_dir {log_dir!r} {reason}"
    )
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""
    assert list(tmp_path.iterdir()) == [a_file]


def test_run_id_cannot_write_outside_the_log_dir(tmp_path: Path) -> None:
    log_dir = tmp_path / "deep" / "logs"
    proc = subprocess.run(
        [*CLI, "run", "--log-dir", str(log_dir), "--run-id", "../../escape", ENV_SCRIPT],
        capture_output=True,
        text=True,
        timeout=LIMIT,
        env=cli_env(),
    )
    assert proc.returncode == 2
    assert "run id '../../escape' contains a path separator" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's exec limits")
def test_argv_and_env_too_big_for_exec_is_one_line_and_starts_nothing(tmp_path: Path) -> None:
    """The command itself fits exec's limit, its workers (torchrun's variables added) do not."""
    arg_max = min(os.sysconf("SC_ARG_MAX"), 6 << 20)
    log_dir = tmp_path / "logs"
    argv = [*CLI, "run", "--log-dir", str(log_dir), "--nproc-per-node", "2", ENV_SCRIPT]
    env = cli_env()

    def exec_size() -> int:
        strings = [*argv, *(f"{k}={v}" for k, v in env.items())]
        return sum(len(os.fsencode(s)) + 1 + 8 for s in strings) + len(sys.executable) + 16

    while (room := arg_max - 2048 - exec_size()) > 64:
        env[f"FILL{len(env):03d}"] = "y" * min(100_000, room - 32)
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=LIMIT, env=env)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("aioproc run: error: local rank 0: argv and environment take "), (
        proc.stderr
    )
    assert "over the system limit ARG_MAX" in proc.stderr
    assert "largest: os.environ['FILL" in proc.stderr
    assert proc.stdout == ""  # no worker ran: each would print its environment
    assert not log_dir.exists() or list(log_dir.iterdir()) == []


def test_unknown_event_loop_is_a_usage_error() -> None:
    proc = subprocess.run(
        [*CLI, "run", ENV_SCRIPT],
        capture_output=True,
        text=True,
        timeout=LIMIT,
        env=cli_env(AIOPROC_LOOP="trio"),
    )
    assert proc.returncode == 2
    assert "AIOPROC_LOOP" in proc.stderr


def test_no_command_prints_help() -> None:
    proc = subprocess.run(CLI, capture_output=True, text=True, timeout=LIMIT, env=cli_env())
    assert proc.returncode == 2
    assert "run" in proc.stderr and "usage:" in proc.stderr


def test_nproc_and_backoff_parsing() -> None:
    assert parse_nproc("4") == 4
    assert parse_nproc("cpu") == parse_nproc("CPU") == len(os.sched_getaffinity(0))
    assert parse_backoff("1,2,60") == RestartPolicy(initial_delay=1, factor=2, max_delay=60)
    assert parse_backoff(" 0.5, 3, 9, 0.1 ") == RestartPolicy(
        initial_delay=0.5, factor=3, max_delay=9, jitter=0.1
    )


# -------------------------------------------------------------- live view


def test_terminal_emulator() -> None:
    term = Terminal()
    term.feed("\x1b[?25lone\r\ntwo\r\nrow 1\r\nrow 2\r\x1b[2K\x1b[1A\x1b[2Kthree\r\nrow 3\r\n")
    assert term.screen() == ["one", "two", "three", "row 3"]
    term.feed("\x1b[1F\x1b[Jabc\rx\x1b[0m\x1b[1B\x1b[1Ay\x1b[K\x1b[?25h")
    assert term.screen() == ["one", "two", "three", "xy"]


def run_on_pty(
    args: list[str],
    columns: int = 100,
    lines: int = 40,
    signal_when: tuple[bytes, int, signal.Signals] | None = None,
) -> tuple[int, list[str], bytes]:
    """Run ``aioproc run args`` on a pseudo-terminal: exit code, final screen, raw bytes.

    The screen is every line drawn, scrollback included, on a terminal of
    that size.  ``signal_when=(pattern, n, sig)`` sends ``sig`` to the
    command once ``pattern`` has appeared ``n`` times in what it drew.
    """
    steps = [signal_when] if signal_when is not None else []
    code, term, raw, _ = run_steps(args, columns, lines, steps)
    return code, term.screen(), raw


def run_steps(
    args: list[str],
    columns: int,
    lines: int,
    steps: list[tuple[bytes, int, Action]],
) -> tuple[int, Terminal, bytes, list[int]]:
    """``aioproc run args`` on a pty, with ``run_steps_on_pty``'s steps.

    Returns the exit code, the terminal at the end, all that was drawn,
    and the offsets in it where the steps were taken.
    """
    env = cli_env(TERM="xterm-256color")
    for key in ("NO_COLOR", "FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE"):
        env.pop(key, None)
    with tempfile.TemporaryDirectory(prefix="test_cli_") as logs:
        code, raw, marks = run_steps_on_pty(
            [*CLI, "run", "--log-dir", logs, *args],
            columns=columns,
            lines=lines,
            timeout=LIMIT,
            env=env,
            steps=steps,
        )
    return code, seen(raw, columns, lines), raw, marks


def seen(raw: bytes, columns: int, lines: int) -> Terminal:
    """A terminal of that size after ``raw`` was drawn on it."""
    term = Terminal(columns, lines)
    term.feed(raw.decode("utf-8", "replace"))
    return term


def table_rows(screen: list[str], rank: int) -> list[str]:
    """The live table's rows of ``rank`` on the screen: "rank pid state ..."."""
    return [
        line for line in screen if re.match(rf"\s*{rank}\s+\d+\s+(exited|killed|running)", line)
    ]


@pytest.fixture
def rich_installed() -> None:
    pytest.importorskip("rich", reason="rich is not installed: the live view is untested")


@pytest.mark.usefixtures("rich_installed")
def test_live_view_shows_one_clean_row_per_rank() -> None:
    code, screen, _ = run_on_pty(["--nproc-per-node", "3", LIVE_SCRIPT])
    text = "\n".join(screen)
    assert code == 0, text
    for rank in range(3):
        rows = table_rows(screen, rank)
        assert len(rows) == 1, f"rank {rank} rows {rows}:\n{text}"
        assert re.match(
            rf"\s*{rank}\s+\d+\s+exited 0\s+\d+s\s+0\s+cpu \S+ max rss \S+\s+rank {rank} done$",
            rows[0],
        )
        prefix = f"[default{rank}]:"
        said = [line for line in screen if line.startswith(prefix)]
        want = [f"rank {rank} line {k}" for k in range(3)]
        want += [f"rank {rank} warning", f"rank {rank} progress 100%", f"rank {rank} done"]
        assert sorted(said) == sorted(prefix + w for w in want), text
    # nothing else: no half-drawn table, no progress fragments, no stray text
    headers = [line for line in screen if re.match(r"rank\s+pid\s+state\s+uptime", line)]
    assert len(headers) == 1, text
    titles = [line for line in screen if "[default x3]" in line]
    assert len(titles) == 1 and "succeeded" in titles[0], text
    assert re.fullmatch(r"aioproc run: logs in /\S+/[0-9a-f]+_\w+", screen[0]), text
    assert len(screen) == 1 + 3 * 6 + 2 + 3, text


@pytest.mark.usefixtures("rich_installed")
def test_live_view_restarts_then_prints_the_summary_below_the_table() -> None:
    code, screen, _ = run_on_pty(["--nproc-per-node", "2", "--max-restarts", "1", LIVE_SCRIPT, "5"])
    text = "\n".join(screen)
    assert code == 1, text
    for rank in range(2):
        rows = table_rows(screen, rank)
        assert len(rows) == 1, f"rank {rank} rows {rows}:\n{text}"
        assert re.match(rf"\s*{rank}\s+\d+\s+(exited 3|killed by SIGTERM)\s+\d+s\s+1\s", rows[0])
        done = [line for line in screen if line == f"[default{rank}]:rank {rank} done"]
        assert len(done) <= 2
    notes = [line for line in screen if "restarting the worker group" in line]
    assert len(notes) == 1 and "restart 1 of 1" in notes[0], text
    table_end = screen.index(table_rows(screen, 1)[0])
    summary = screen[table_end + 1 :]
    assert f"{LIVE_SCRIPT} FAILED" in summary, text
    assert "Root Cause (first observed failure):" in summary


@pytest.mark.usefixtures("rich_installed")
def test_no_live_gives_plain_lines_on_a_terminal() -> None:
    code, screen, _ = run_on_pty(
        ["--no-live", "--nproc-per-node", "2", "--tee", "3", ENV_SCRIPT], columns=1000
    )
    assert code == 0, screen
    assert screen[0].startswith("aioproc run: logs in "), screen
    assert all(line.startswith(("[default0]:ENV ", "[default1]:ENV ")) for line in screen[1:])
    assert len(screen) == 3


@pytest.mark.usefixtures("rich_installed")
def test_live_view_ends_cleanly_on_sigterm() -> None:
    code, screen, raw = run_on_pty(
        ["--nproc-per-node", "2", SLEEP_SCRIPT],
        signal_when=(rb"\]:(?:\x1b\[[0-9;]*m)*ready \d+", 2, signal.SIGTERM),
    )
    text = "\n".join(screen)
    assert code == 128 + signal.SIGTERM, text
    pids = []
    for rank in range(2):
        rows = table_rows(screen, rank)
        assert len(rows) == 1, f"rank {rank} rows {rows}:\n{text}"
        assert re.match(rf"\s*{rank}\s+(\d+)\s+killed by SIGTERM\s", rows[0]), rows[0]
        pids.append(int(rows[0].split()[1]))
    assert screen[-1] == "aioproc run: got SIGTERM: the workers were stopped"
    assert raw.rindex(b"\x1b[?25h") > raw.rindex(b"\x1b[?25l")  # the cursor is back
    assert [pid for pid in pids if not pid_gone(pid)] == []


def header_lines(screen: list[str], title: str) -> list[str]:
    """The live view's header lines ("script [role xN] phase  restarts a/b")."""
    return [line for line in screen if title in line and "restarts " in line]


def ready_lines(screen: list[str]) -> list[str]:
    return [line for line in screen if re.fullmatch(r"\[default\d+\]:ready \d+", line)]


@pytest.mark.usefixtures("rich_installed")
def test_live_view_with_many_ranks_keeps_log_lines_visible() -> None:
    """24 ranks on a 20-line terminal: one row per state, the workers' lines above."""
    n, lines = 24, 20
    code, term, raw, marks = run_steps(
        ["--nproc-per-node", str(n), SLEEP_SCRIPT],
        columns=100,
        lines=lines,
        steps=[
            (rb"\]:(?:\x1b\[[0-9;]*m)*ready \d+", n, None),
            # the redraw after the last line: every rank running, in one row
            (rb"24 ranks 0-23", 1, b"\x03"),  # Ctrl-C, typed
        ],
    )
    screen = term.screen()
    text = "\n".join(screen)
    assert code == 128 + signal.SIGINT, text
    # what the user saw when they pressed Ctrl-C: the view in the bottom half,
    # the workers' lines in the top half
    then = seen(raw[: marks[1]], 100, lines).visible()
    shown = "\n".join(then)
    assert len(then) == lines - 1, shown  # and the empty line the cursor waits on
    view = then[then.index(header_lines(then, "[default x24]")[0]) :]
    assert "[default x24] running" in view[0], shown
    assert len(view) + 1 <= lines // 2, shown
    assert re.match(r"running\s+24 ranks 0-23\s+\[\d+\] ready \d+$", view[1]), shown
    above = then[: len(then) - len(view)]
    assert len(above) >= lines // 2 and ready_lines(above) == above[-len(ready_lines(above)) :]
    assert len(ready_lines(above)) >= lines // 2 - 1, shown
    # at the end: every line once, one header, the full table, no "^C" left
    assert len(ready_lines(screen)) == n, text
    headers = header_lines(screen, "[default x24]")
    assert len(headers) == 1 and "stopping (SIGINT)" in headers[0], text
    assert "^C" not in text
    pids = []
    for rank in range(n):
        rows = table_rows(screen, rank)
        assert len(rows) == 1, f"rank {rank} rows {rows}:\n{text}"
        assert re.match(rf"\s*{rank}\s+\d+\s+killed by SIGINT\s", rows[0]), rows[0]
        pids.append(int(rows[0].split()[1]))
    assert screen[-1] == "aioproc run: got SIGINT: the workers were stopped"
    assert [pid for pid in pids if not pid_gone(pid)] == []


@pytest.mark.usefixtures("rich_installed")
def test_ctrl_c_twice_on_a_terminal_kills_at_once_and_leaves_a_clean_screen() -> None:
    code, term, _, _ = run_steps(
        ["--nproc-per-node", "2", "--grace-period", "600", SLEEP_SCRIPT, "stubborn"],
        columns=150,
        lines=20,
        steps=[
            (rb"\]:(?:\x1b\[[0-9;]*m)*ready \d+", 2, b"\x03"),
            (rb"Ctrl-C again kills them now", 1, b"\x03"),
        ],
    )
    screen = term.screen()
    text = "\n".join(screen)
    assert code == 128 + signal.SIGINT, text
    script = os.path.basename(SLEEP_SCRIPT)
    assert screen[0].startswith("aioproc run: logs in "), text
    assert sorted(ready_lines(screen)) == sorted(ready_lines(screen[1:3])), text
    # the notes, in order, and one header: no stale copy of the view anywhere
    notes = [line for line in screen if line.startswith("aioproc")]
    assert notes[1] == (
        "aioproc run: got SIGINT: stopping the workers (SIGKILL in 600 s; "
        "Ctrl-C again kills them now)"
    )
    assert notes[2].startswith("aioproc run: got SIGINT again: killing the workers now"), text
    assert notes[3].startswith("aioproc: ForcedKillWarning: 2 worker(s) did not exit"), text
    assert len(header_lines(screen, "[default x2]")) == 1, text
    assert "^C" not in text
    pids = []
    for rank in range(2):
        rows = table_rows(screen, rank)
        assert len(rows) == 1, f"rank {rank} rows {rows}:\n{text}"
        assert re.match(rf"\s*{rank}\s+\d+\s+killed by SIGKILL\s", rows[0]), rows[0]
        pids.append(int(rows[0].split()[1]))
    assert script in header_lines(screen, "[default x2]")[0]
    assert screen[-1] == "aioproc run: got SIGINT: the workers were stopped"
    assert [pid for pid in pids if not pid_gone(pid)] == []


@pytest.mark.parametrize("tee", [True, False])
async def test_without_log_dir_kept_logs_are_named_and_nothing_else_is_left(
    tmp_path: Path, tee: bool
) -> None:
    """A private temp dir that holds output is named at the end; else it is gone."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    flags = ["--tee", "3"] if tee else []
    proc = await asyncio.create_subprocess_exec(
        *CLI, "run", "--nproc-per-node", "2", *flags, ENV_SCRIPT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=cli_env(TMPDIR=str(tmp)),
    )  # fmt: skip
    _out, err = await asyncio.wait_for(proc.communicate(), LIMIT)
    assert proc.returncode == 0, err.decode()
    kept = [line for line in err.decode().splitlines() if "logs of this run kept in" in line]
    if tee:
        (line,) = kept
        run_dir = line.rsplit(" ", 1)[1]
        assert run_dir.startswith(str(tmp) + os.sep)
        logs = sorted(glob.glob(os.path.join(run_dir, "attempt_0", "*", "stdout.log")))
        assert len(logs) == 2
        assert all(Path(p).read_text() for p in logs)
    else:
        assert kept == []
        assert os.listdir(tmp) == []
