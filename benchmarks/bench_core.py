"""P1 and P2: launching a group and collecting every result, against the raw floor.

P1: N function workers through ``start_processes`` until ``wait()`` has
every return value, against N concurrent ``sys.executable -c pass`` (the
cost of N bare interpreters).  The function is defined in ``__main__``, as a
script's own functions are, so it travels by value (see ``main_function``);
P1m runs the same with ``_workers.ret_rank``, which a worker imports by name.
P2: N ``/bin/true`` binary workers against N raw
``asyncio.create_subprocess_exec("/bin/true")``.  Both baselines start all
processes, then await all of them.  ``close()`` runs after the clock stops.
"""

from __future__ import annotations

import asyncio
import functools
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable

import _workers
from _util import Config, Row, Target, interleaved, rows_from

import aioproc

TRUE = "/bin/true"

MAIN_SOURCE = """\
def p1_ret_rank(rank):
    return rank
"""


def main_function() -> Callable[[int], int]:
    """``p1_ret_rank``, defined in ``__main__`` like a function of the script being run.

    Whichever script runs the benchmark (``run_all``, a notebook, ``python -c``),
    the function is compiled into that ``__main__`` module's namespace, so it
    is a real ``__main__`` function: its ``__module__`` is ``"__main__"``, its
    globals are ``__main__``'s, and a worker cannot import it by name.
    """
    namespace = sys.modules["__main__"].__dict__
    if "p1_ret_rank" not in namespace:
        exec(compile(MAIN_SOURCE, "<p1 __main__ function>", "exec"), namespace)
    fn: Callable[[int], int] = namespace["p1_ret_rank"]
    return fn


async def raw_concurrent(argv: list[str], n: int) -> float:
    """Start ``n`` copies of ``argv``, then await them all: the floor."""
    t0 = time.perf_counter()
    procs = [await asyncio.create_subprocess_exec(*argv) for _ in range(n)]
    codes = await asyncio.gather(*(p.wait() for p in procs))
    dt = time.perf_counter() - t0
    if any(codes):
        raise RuntimeError(f"baseline {argv[0]} exit codes {set(codes)}")
    return dt


async def aioproc_functions(fn: Callable[[int], int], n: int) -> float:
    """Start ``n`` workers of ``fn`` and wait for all their return values."""
    t0 = time.perf_counter()
    pc = await aioproc.start_processes(
        "p1", fn, args={r: (r,) for r in range(n)}, envs={r: {} for r in range(n)}
    )
    try:
        result = await pc.wait()
        dt = time.perf_counter() - t0
    finally:
        await pc.close()
    assert result is not None
    if result.return_values != {r: r for r in range(n)}:
        raise AssertionError(f"P1: wrong return values / failures: {result}")
    return dt


_GIVEN_DIRS: list[str] = []
"""The log dirs of the ``"given"`` rounds, removed once P2 is over (not on the clock,
nor in the rounds' CPU figures)."""


async def aioproc_binaries(entrypoint: str, n: int, log_tree: str = "temp") -> float:
    """Start ``n`` binary workers and wait for all of them to succeed.

    ``log_tree``: ``"temp"``, the default spec (a private temp dir, where a
    rank that writes no file gets no dir); ``"devnull"``, ``log_dir=os.devnull``
    (no log tree at all); ``"given"``, a ``log_dir`` of the caller's, with
    torch's layout: a dir per rank, made during the launch.
    """
    specs: dict[str, aioproc.LogsSpecs] = {}
    if log_tree == "given":
        _GIVEN_DIRS.append(tempfile.mkdtemp(prefix="aioproc-p2-"))
        specs["logs_specs"] = aioproc.DefaultLogsSpecs(log_dir=_GIVEN_DIRS[-1])
    elif log_tree == "devnull":
        specs["logs_specs"] = aioproc.DefaultLogsSpecs(log_dir=os.devnull)
    t0 = time.perf_counter()
    pc = await aioproc.start_processes(
        "p2", entrypoint, args={r: () for r in range(n)}, envs={r: {} for r in range(n)}, **specs
    )
    try:
        result = await pc.wait()
        dt = time.perf_counter() - t0
    finally:
        await pc.close()
    assert result is not None
    if result.failures:
        raise AssertionError(f"P2: failures: {result.failures}")
    return dt


def p1(cfg: Config) -> list[Row]:
    """P1 (a ``__main__`` function, by value) and P1m (a module function, by name)."""
    n = cfg.p1_n
    rows = []
    for label, fn, what in (
        ("P1", main_function(), "a `__main__` function"),
        ("P1m", _workers.ret_rank, "a module function"),
    ):
        series = interleaved(
            cfg,
            lambda: raw_concurrent([sys.executable, "-c", "pass"], n),
            functools.partial(aioproc_functions, fn, n),
        )
        rows += rows_from(
            f"{label} {n} function workers, {what}: start -> all results",
            series,
            Target("ratio", 1.3),
            note=f"baseline: {n} x `python -c pass`",
            cpu_note=True,
        )
    return rows


def p2(cfg: Config) -> list[Row]:
    rows: list[Row] = []
    for n in cfg.p2_ns:
        series = interleaved(
            cfg, lambda n=n: raw_concurrent([TRUE], n), lambda n=n: aioproc_binaries(TRUE, n)
        )
        per_worker = {
            loop: f"{cand.median / n * 1e6:.0f} us/worker" for loop, (_, cand) in series.items()
        }
        rows += rows_from(
            f"P2 {n} binary workers {TRUE}: start -> all done",
            series,
            Target("ratio", 1.0),
            note=f"baseline: {n} x create_subprocess_exec; aioproc "
            + ", ".join(f"{loop} {v}" for loop, v in per_worker.items()),
            cpu_note=True,
        )
    # the largest N again with a log_dir given (torch's layout: a dir per
    # rank) and without any log tree: what the rank dirs cost
    n = max(cfg.p2_ns)
    try:
        series = interleaved(
            cfg,
            lambda: raw_concurrent([TRUE], n),
            lambda: aioproc_binaries(TRUE, n, log_tree="given"),
        )
    finally:
        while _GIVEN_DIRS:
            shutil.rmtree(_GIVEN_DIRS.pop(), ignore_errors=True)
    rows += rows_from(
        f"P2 {n} binary workers {TRUE}, log_dir given (a log dir per rank)",
        series,
        Target("ratio", 1.2),
        note=f"baseline: {n} x create_subprocess_exec",
        cpu_note=True,
    )
    series = interleaved(
        cfg,
        lambda: raw_concurrent([TRUE], n),
        lambda: aioproc_binaries(TRUE, n, log_tree="devnull"),
    )
    rows += rows_from(
        f"P2 {n} binary workers {TRUE}, log_dir=os.devnull (no log dir per rank)",
        series,
        None,
        note=f"baseline: {n} x create_subprocess_exec; info: P2 less the log tree",
        cpu_note=True,
    )
    return rows
