"""Acceptance: a real PyTorch DDP script under `aioproc run` and under torchrun."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import free_port

torch = pytest.importorskip(
    "torch", reason="torch is not installed (pip install torch==2.13.0 to run the DDP tests)"
)

SCRIPT = str(Path(__file__).parent / "children" / "ddp_train.py")
pytestmark = pytest.mark.timeout(180)


@pytest.fixture(autouse=True)
def torch_tmpdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun and torch keep files in $TMPDIR (torchelastic_*, torchinductor_<user>)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))


def final_loss(stdout: str) -> str:
    found = re.findall(r"final_loss=([0-9.]+)", stdout)
    assert len(found) == 1, stdout
    return found[0]


def test_ddp_gives_the_same_loss_under_aioproc_run_and_torchrun() -> None:
    common = ["--nproc-per-node", "2", "--master-port", str(free_port())]
    ours = subprocess.run(
        [sys.executable, "-m", "aioproc", "run", "--no-live", *common, SCRIPT],
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert ours.returncode == 0, ours.stdout + ours.stderr
    theirs = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "1",
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
            SCRIPT,
        ],
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert theirs.returncode == 0, theirs.stdout + theirs.stderr
    assert final_loss(ours.stdout) == final_loss(theirs.stdout)


def test_rank_raising_under_torch_record_is_reported_with_its_traceback(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "aioproc",
            "run",
            "--no-live",
            "--nproc-per-node",
            "2",
            "--master-port",
            str(free_port()),
            "--log-dir",
            str(tmp_path),
            SCRIPT,
            "--fail-rank",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    summary = proc.stderr
    assert "FAILED" in summary
    assert "Root Cause" in summary
    root = summary[summary.index("Root Cause") :]
    assert "rank      : 1" in root
    assert "RuntimeError: rank 1 diverged at step 2" in root
    assert "ddp_train.py" in root  # the worker's own traceback
    (error_file,) = tmp_path.glob("*/attempt_0/1/error.json")
    data = json.loads(error_file.read_text())
    assert "rank 1 diverged" in data["message"]["message"]
