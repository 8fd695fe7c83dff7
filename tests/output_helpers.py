"""Shared by the output tests (test_output_*.py, test_sinks*.py, test_console.py).

``workload`` runs a function of ``children/out_workers.py`` as binary workers
(``python -S out_workers.py <fn> ...``) or as function workers (the same
function, imported by name through the ``ow`` fixture); ``run_group`` runs a
group to completion, each wait bounded by ``GROUP_LIMIT``.
``flood`` is a binary worker (``children/out_flood.py``) writing numbered
lines; ``run_pressure`` runs a small supervisor (``children/out_pressure.py``)
whose own stdout is a pipe nobody reads, on a given kind of event loop.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from helpers import CHILDREN_DIR, import_child, result_of

import aioproc
from aioproc import DefaultLogsSpecs, PContext, RunProcsResult, Std

FLOOD = os.path.join(CHILDREN_DIR, "out_flood.py")
PRESSURE = os.path.join(CHILDREN_DIR, "out_pressure.py")
LIMIT = 30.0  # seconds: bound on any single wait here (a hang detector, not a timing)
DROPPED = "line(s) of worker output were dropped"
WORKERS = os.path.join(CHILDREN_DIR, "out_workers.py")
GROUP_LIMIT = 20  # seconds: bound on any single wait for a group of out_workers
KINDS = ("binary", "function")


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


@pytest.fixture
def ow(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """``out_workers``, importable by name here and (via sys.path) in function workers."""
    return import_child(monkeypatch, "out_workers")


def workload(
    kind: str, ow: ModuleType, fn: str, args: dict[int, tuple[Any, ...]]
) -> tuple[Callable[..., Any] | str, dict[int, tuple[Any, ...]]]:
    """(entrypoint, args) running ``out_workers.<fn>(*args[rank])`` as ``kind`` workers."""
    if kind == "binary":
        return sys.executable, {r: ("-S", WORKERS, fn, *map(str, a)) for r, a in args.items()}
    return getattr(ow, fn), args


def logs(tmp_path: Path, **kw: Any) -> DefaultLogsSpecs:
    return DefaultLogsSpecs(log_dir=tmp_path / "logs", **kw)


async def run_group(
    entry: Callable[..., Any] | str,
    args: dict[int, tuple[Any, ...]],
    spec: DefaultLogsSpecs,
    *,
    name: str = "w",
    envs: dict[int, dict[str, str]] | None = None,
    **kw: Any,
) -> tuple[PContext, RunProcsResult]:
    """Run a group to completion (``async with``: closed on the way out)."""
    envs = envs if envs is not None else {r: {} for r in args}
    async with aioproc.start_processes(name, entry, args, envs, spec, **kw) as pc:
        result = await asyncio.wait_for(pc.wait(), GROUP_LIMIT)
    assert result is not None
    return pc, result


def read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def text_lines(text: str) -> list[str]:
    """Lines of captured console text; the text must end with a newline (or be empty)."""
    if not text:
        return []
    assert text.endswith("\n"), f"console text ends mid-line: {text[-80:]!r}"
    return text[:-1].split("\n")


def of_prefix(lines: Iterable[str], prefix: str) -> list[str]:
    """The lines that start with ``prefix``, with it removed, in order."""
    return [line[len(prefix) :] for line in lines if line.startswith(prefix)]


def attempt_dir(pc: PContext) -> str:
    path = next(p for p in [*pc.stdouts.values(), *pc.stderrs.values()] if p)
    return os.path.dirname(os.path.dirname(path))
