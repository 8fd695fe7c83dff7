"""The same scripts under `aioproc run` and under torch's own `torchrun` (torch 2.13).

Runs only where torch is importable: by this interpreter (CI installs
torch==2.13.0 for 3.11) or by the interpreter named in AIOPROC_TORCH_PYTHON.
Compared: the workers' whole environments key by key, error.json, the
FAILED summary's fields, exit codes and the log layout.  What must differ
(ports, run ids, paths) and what differs on purpose (README, "Differences
from torch") is named below.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO_ROOT

CHILDREN = Path(__file__).parent / "children"
LIMIT = 120


def torch_python() -> str | None:
    named = os.environ.get("AIOPROC_TORCH_PYTHON")
    if named:
        return named
    return sys.executable if importlib.util.find_spec("torch") is not None else None


TORCH_PYTHON = torch_python()
pytestmark = pytest.mark.skipif(TORCH_PYTHON is None, reason="torch is not installed")

# values that must differ between two runs, or that aioproc adds
MUST_DIFFER = {"MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE"}
AIOPROC_ONLY = {"AIOPROC_LIFELINE"}
ON_PURPOSE = {
    # no agent store: rank 0 hosts torch's store (README, Differences from torch)
    "TORCHELASTIC_USE_AGENT_STORE": ("True", "False"),
    # SIGHUP is ignored unless asked (README)
    "TORCHELASTIC_SIGNALS_TO_HANDLE": ("SIGTERM,SIGINT,SIGHUP,SIGQUIT", "SIGTERM,SIGINT,SIGQUIT"),
    # torchrun --standalone names the host; aioproc uses the loopback address
    "MASTER_ADDR": ("localhost", "127.0.0.1"),
}


@pytest.fixture(autouse=True)
def torch_tmpdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun and torch keep files in $TMPDIR (torchelastic_*, torchinductor_<user>)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))


def base_env() -> dict[str, str]:
    # the same small parent environment for both launchers
    env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG", "TMPDIR") if k in os.environ}
    env["PYTHONPATH"] = REPO_ROOT  # aioproc run's workers import this checkout
    return env


def launch(kind: str, log_dir: Path, script: str, *args: str) -> subprocess.CompletedProcess[str]:
    assert TORCH_PYTHON is not None
    python, module = (
        (TORCH_PYTHON, "torch.distributed.run")
        if kind == "torch"
        else (
            sys.executable,
            "aioproc",
        )
    )
    command = [python, "-m", module] + (["run"] if kind == "aioproc" else [])
    command += ["--standalone", "--nproc-per-node", "2", "--log-dir", str(log_dir)]
    command += ["--redirects", "3", script, *args]
    return subprocess.run(
        command, env=base_env(), capture_output=True, text=True, timeout=LIMIT, check=False
    )


def layout(log_dir: Path) -> tuple[str, list[str]]:
    (run,) = list(log_dir.iterdir())
    files = sorted(str(p.relative_to(run)) for p in run.rglob("*") if p.is_file())
    return run.name, files


def root_cause(stderr: str) -> tuple[str, dict[str, str]]:
    """The summary's title and its root-cause fields (``traceback`` with its lines)."""
    lines = stderr.splitlines()
    title = next(line for line in lines if line.endswith(" FAILED"))
    start = lines.index("Root Cause (first observed failure):") + 2
    fields: dict[str, str] = {}
    key = ""
    for line in lines[start:]:
        if line.startswith("=") or line.startswith("Logs: "):
            break
        # a field: two spaces, a lowercase name padded to 10, ": " (torch's template)
        match = re.match(r"  ([a-z_]+) *: (.*)$", line)
        if match and line[12:14] == ": ":
            key = match.group(1)
            fields[key] = match.group(2).rstrip()
        else:
            fields[key] += "\n" + line.rstrip()
    return title, fields


def test_worker_environment_and_log_layout_match_torchrun(tmp_path: Path) -> None:
    results = {}
    for kind in ("torch", "aioproc"):
        out = tmp_path / kind
        out.mkdir()
        proc = launch(kind, tmp_path / f"{kind}-logs", str(CHILDREN / "compat_env.py"), str(out))
        assert proc.returncode == 0, proc.stderr
        envs = [json.loads((out / f"env{r}.json").read_text()) for r in (0, 1)]
        results[kind] = (envs, *layout(tmp_path / f"{kind}-logs"))
    (t_envs, t_run, t_files), (a_envs, a_run, a_files) = results["torch"], results["aioproc"]
    assert (
        a_files
        == t_files
        == [f"attempt_0/{r}/{s}.log" for r in (0, 1) for s in ("stderr", "stdout")]
    )
    for kind, run in (("torch", t_run), ("aioproc", a_run)):
        envs = results[kind][0]
        assert run.startswith(envs[0]["TORCHELASTIC_RUN_ID"] + "_")
    for rank, (t, a) in enumerate(zip(t_envs, a_envs, strict=True)):
        assert set(a) - AIOPROC_ONLY == set(t), "keys"
        for key in sorted(set(t) - MUST_DIFFER):
            if key in ON_PURPOSE:
                assert (t[key], a[key]) == ON_PURPOSE[key], key
            else:
                assert a[key] == t[key], key
        for env in (t, a):
            assert env["TORCHELASTIC_ERROR_FILE"].endswith(f"/attempt_0/{rank}/error.json")
            assert 0 < int(env["MASTER_PORT"]) < 65536
        assert a["RANK"] == str(rank) and a["WORLD_SIZE"] == "2"


def test_a_raising_worker_reports_like_torchrun(tmp_path: Path) -> None:
    runs = {}
    for kind in ("torch", "aioproc"):
        logs = tmp_path / f"{kind}-logs"
        proc = launch(kind, logs, str(CHILDREN / "compat_fail.py"), "raise")
        run, files = layout(logs)
        error = json.loads((logs / run / "attempt_0" / "1" / "error.json").read_text())
        runs[kind] = (proc, files, error, root_cause(proc.stderr))
    t_proc, t_files, t_error, (t_title, t_fields) = runs["torch"]
    a_proc, a_files, a_error, (a_title, a_fields) = runs["aioproc"]
    assert a_proc.returncode == t_proc.returncode == 1
    assert a_files == t_files
    assert "attempt_0/1/error.json" in a_files

    # error.json: the same document but for the time and the @record frame's file
    def normal(doc: dict) -> dict:
        inner = doc["message"]
        stack = inner["extraInfo"]["py_callstack"].splitlines()
        user = [line for line in stack if "compat_fail.py" in line or not line.startswith("  ")]
        return {
            "keys": sorted(doc),
            "inner": sorted(inner),
            "extra": sorted(inner["extraInfo"]),
            "message": inner["message"],
            "stack": [line for line in user if "errors" not in line],
            "timestamp_is_int": inner["extraInfo"]["timestamp"].isdigit(),
        }

    assert normal(a_error) == normal(t_error)
    assert normal(a_error)["message"] == "ValueError: rank 1 refuses"

    # the FAILED summary: every torch field, with torch's values
    assert a_title == t_title == f"{CHILDREN / 'compat_fail.py'} FAILED"  # the script as given
    assert set(t_fields) <= set(a_fields)
    assert a_fields["rank"] == t_fields["rank"] == "1 (local_rank: 1)"
    assert a_fields["exitcode"].split()[0] == t_fields["exitcode"].split()[0] == "1"
    for fields in (a_fields, t_fields):
        assert fields["error_file"].endswith("/attempt_0/1/error.json")
    assert a_fields["traceback"].splitlines()[-1] == t_fields["traceback"].splitlines()[-1]
    assert a_fields["traceback"].splitlines()[-1] == "  ValueError: rank 1 refuses"


def test_an_exit_without_an_error_file_reports_like_torchrun(tmp_path: Path) -> None:
    fields = {}
    for kind in ("torch", "aioproc"):
        proc = launch(kind, tmp_path / f"{kind}-logs", str(CHILDREN / "compat_fail.py"), "exit")
        assert proc.returncode == 1, proc.stderr
        fields[kind] = root_cause(proc.stderr)[1]
    t, a = fields["torch"], fields["aioproc"]
    assert set(t) <= set(a)
    for key in ("rank", "error_file", "traceback"):
        assert a[key] == t[key], key
    assert a["traceback"] == (
        "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"
    )
    assert a["error_file"] == "<N/A>"
    assert a["exitcode"].split()[0] == t["exitcode"].split()[0] == "3"
    assert a["hint"].startswith("exited with code 3 and wrote no error file")  # aioproc's extra
