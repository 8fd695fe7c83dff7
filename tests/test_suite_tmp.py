"""The suite's own temp dirs (tests/conftest.py): a run stopped part-way leaves none.

The suite runs as a user runs it (``python -m pytest``, xdist on by default,
and without it), on a small module of tests that wait; it is stopped while
they wait, with SIGTERM (to the one process a user or a CI runner knows) or
with Ctrl-C (SIGINT to the whole process group, as a terminal sends it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import CHILDREN_DIR, REPO_ROOT, pid_gone

WAITS = os.path.join(CHILDREN_DIR, "suite_waits.py")


@pytest.mark.parametrize(
    ("workers", "how"),
    [("2", "sigterm"), ("2", "ctrl-c"), ("0", "sigterm"), ("0", "ctrl-c")],
    ids=["xdist-sigterm", "xdist-ctrl-c", "one-process-sigterm", "one-process-ctrl-c"],
)
def test_a_stopped_run_leaves_no_suite_dir(tmp_path: Path, workers: str, how: str) -> None:
    base = tmp_path / "tmp"
    base.mkdir()
    ready = tmp_path / "ready"
    os.mkfifo(ready)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("AIOPROC_SUITE_", "PYTEST_", "AIOPROC_LIFELINE"))
    }
    env.update(TMPDIR=str(base), SUITE_READY=str(ready), AIOPROC_TEST_LOOPS="asyncio")
    run = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-n", workers, WAITS],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group, as a terminal's job
    )
    try:
        # read and write: the first test's line and close is no EOF for the second's
        with open(os.open(ready, os.O_RDWR)) as lines:  # each test waits: every dir is made
            waiting = [int(lines.readline()) for _ in range(2 if workers != "0" else 1)]
        assert sorted(p.name for p in base.iterdir() if p.name.startswith("aioproc-suite-"))
        if how == "sigterm":
            run.send_signal(signal.SIGTERM)
        else:
            os.killpg(run.pid, signal.SIGINT)
        out, _ = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.communicate()
    text = out.decode(errors="replace")
    assert run.returncode == 2, text  # pytest's "interrupted"
    assert "KeyboardInterrupt" in text
    assert [p.name for p in base.iterdir() if not p.name.startswith("pytest-of-")] == []
    for pid in waiting:
        assert pid_gone(pid) or pid == run.pid, pid
