"""aioproc.redirects: torch's fd-level redirect context managers (redirects_test.py ideas).

Each case runs in a child process whose fds 1 and 2 are pipes this test reads
(pytest's own capturing does not write Python output through fd 1).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO_ROOT

from aioproc.redirects import redirect, redirect_stdout

CHILD = str(Path(__file__).parent / "children" / "redirect_child.py")


def run_case(case: str, where: Path) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, CHILD, case, str(where)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": REPO_ROOT},  # the child imports this checkout
    )
    assert proc.returncode == 0, proc.stderr
    return proc


@pytest.mark.parametrize("std", ["stdout", "stderr"])
def test_python_c_and_child_output_go_to_the_file(tmp_path: Path, std: str) -> None:
    target = tmp_path / f"{std}.log"
    target.write_text("old content is truncated\n")
    proc = run_case(std, tmp_path)
    # each writer's lines in order; Python's and C's buffers may interleave (as in torch)
    assert sorted(target.read_text().splitlines()) == ["c inside", "child inside", "python inside"]
    shown = proc.stdout if std == "stdout" else proc.stderr
    assert shown.splitlines() == ["before", "c before", "after", "c after"]


def test_an_exception_in_the_block_restores_the_fd(tmp_path: Path) -> None:
    proc = run_case("raise", tmp_path)
    assert (tmp_path / "out.log").read_text() == "inside\n"
    assert proc.stdout == "outside\nfds kept\n"


def test_nested_redirects_unwind_in_order(tmp_path: Path) -> None:
    proc = run_case("nested", tmp_path)
    assert (tmp_path / "outer.log").read_text() == "one\nthree\n"
    assert (tmp_path / "inner.log").read_text() == "two\n"
    assert proc.stdout == "four\n"


def test_bad_stream_name_and_unwritable_file(tmp_path: Path) -> None:
    with (
        pytest.raises(ValueError, match=r"^std must be 'stdout' or 'stderr', got 'stdin'$"),
        redirect("stdin", tmp_path / "x.log"),
    ):
        pass
    assert not (tmp_path / "x.log").exists()
    with pytest.raises(FileNotFoundError), redirect_stdout(tmp_path / "missing" / "x.log"):
        pass
