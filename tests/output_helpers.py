"""Shared by the console and sink tests (test_console.py, test_sinks_faults.py).

``flood`` is a binary worker (``children/out_flood.py``) writing numbered
lines; ``run_pressure`` runs a small supervisor (``children/out_pressure.py``)
whose own stdout is a pipe nobody reads, on a given kind of event loop.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from helpers import CHILDREN_DIR, result_of

from aioproc import DefaultLogsSpecs, Std

FLOOD = os.path.join(CHILDREN_DIR, "out_flood.py")
PRESSURE = os.path.join(CHILDREN_DIR, "out_pressure.py")
LIMIT = 30.0  # seconds: bound on any single wait here (a hang detector, not a timing)
DROPPED = "line(s) of worker output were dropped"


def flood(n: int, width: int = 100) -> tuple[str, dict[int, tuple[str, ...]]]:
    """A binary worker writing ``n`` numbered lines of ``width`` bytes to stdout."""
    return sys.executable, {0: (FLOOD, str(n), str(width))}


def flood_lines(n: int, width: int = 100) -> list[str]:
    return [f"{i:08d}" + "." * (width - 9) for i in range(n)]


def spec(tmp_path: Path, **kw: Any) -> DefaultLogsSpecs:
    return DefaultLogsSpecs(log_dir=tmp_path / "logs", tee=Std.OUT, **kw)


def run_pressure(mode: str, loop: str, *args: str) -> dict[str, Any]:
    """Run ``out_pressure.py`` with stdout a pipe nobody reads; its RESULT dict."""
    r, w = os.pipe()
    try:
        with tempfile.TemporaryDirectory() as logs:
            proc = subprocess.run(
                [sys.executable, PRESSURE, mode, logs, loop, *args],
                stdout=w,
                stderr=subprocess.PIPE,
                timeout=LIMIT,
                env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
            )
    finally:
        os.close(r)
        os.close(w)
    err = proc.stderr.decode()
    result = result_of(proc.returncode, err, err)  # it prints its RESULT line on stderr
    result["stderr"] = err
    return result
