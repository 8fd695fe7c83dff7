"""P1t: workers whose function imports torch, aioproc against torch's own launcher.

Every worker runs ``_workers.import_torch`` (``import torch``, a one-element
tensor sum, return the rank).  Timed per group, start -> all results ->
closed, ``P1T_N`` workers, on four launchers measured in the same rounds:

* aioproc ``start_method="spawn"``: every worker imports torch itself;
* aioproc ``start_method="forkserver", preload=["torch"]`` with the template
  already up (``open_forkserver(["torch"])``, opened per round, its start-up
  timed as a row of its own against one ``python -c "import torch"``);
* torch ``start_processes(start_method="spawn")``;
* torch ``start_processes(start_method="forkserver")`` after
  ``torch.multiprocessing.set_forkserver_preload(["torch"])``.  The stdlib
  forkserver it uses stays up for the life of this process, so it is started
  by one unmeasured group before the rounds: every measured torch round is
  warm, as every aioproc round finds its template up.  torch starts these
  workers one after the other unless ``TORCH_MP_PARALLEL_START=1``; that
  opt-in variant is a row too.

``p1t_fork`` (``run_all.py --only p1t-fork``) runs the forkserver rows only,
``--rounds`` rounds of them: no spawn launcher, whose 16 torch imports take
about 30 s a round here (``p1t`` runs a third of ``--rounds``).

torch's blocking API runs in the main thread with no loop running, between
the aioproc rounds (see ``bench_torch``).  ``PYTHONWARNINGS=ignore`` is set
for the whole benchmark so that no launcher's workers print torch's NumPy
warning.  torch's forkserver workers are the forkserver's children, not this
process's, so no CPU figures are given for the forkserver rows.
"""

from __future__ import annotations

import contextlib
import multiprocessing.forkserver
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import _workers
from _util import (
    Config,
    Row,
    Sample,
    Series,
    Target,
    measure_async,
    measure_sync,
    rows_from,
    run_on,
)
from bench_core import raw_concurrent
from bench_torch import TORCH_POLL_PERIOD, torch_mp, torch_run

import aioproc

P1T_N = 16
PRELOAD = ["torch"]
_PARALLEL_START = "TORCH_MP_PARALLEL_START"


@contextlib.contextmanager
def _environ(name: str, value: str) -> Iterator[None]:
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


@contextlib.contextmanager
def torch_forkserver(tmp: Any, n: int) -> Iterator[None]:
    """The stdlib forkserver preloading torch, warmed by one group; stopped on exit.

    ``set_forkserver_preload`` only applies to a forkserver started after
    it, so a running one (someone else's preload) is refused.
    """
    import torch.multiprocessing

    server = multiprocessing.forkserver._forkserver  # type: ignore[attr-defined]
    if server._forkserver_pid is not None:
        raise RuntimeError("the stdlib forkserver is already running: preload would not apply")
    old = list(server._preload_modules)
    torch.multiprocessing.set_forkserver_preload(PRELOAD)
    try:
        torch_run(tmp, _workers.import_torch, n, "forkserver")  # starts it; not measured
        yield
    finally:
        server._stop()  # no public API; else it (and torch in it) lives until we exit
        torch.multiprocessing.set_forkserver_preload(old)


def torch_parallel(tmp: Any, n: int) -> float:
    with _environ(_PARALLEL_START, "1"):
        return torch_run(tmp, _workers.import_torch, n, "forkserver")


async def aioproc_group(n: int, start_method: str) -> float:
    """Start -> all results -> closed, as torch's ``wait()`` closes its group."""
    preload = PRELOAD if start_method == "forkserver" else []
    t0 = time.perf_counter()
    async with aioproc.start_processes(
        "p1t",
        _workers.import_torch,
        args={r: (r,) for r in range(n)},
        envs={r: {} for r in range(n)},
        start_method=start_method,
        preload=preload,
    ) as pc:
        result = await pc.wait()
    dt = time.perf_counter() - t0
    if result is None or result.return_values != {r: r for r in range(n)}:
        raise AssertionError(f"P1t aioproc {start_method}: wrong results: {result}")
    return dt


_ROWS = ("spawn", "template", "import", "forkserver")  # aioproc's samples per round, per loop


async def _aioproc_round(n: int, spawn: bool) -> dict[str, Sample]:
    """aioproc's part of one round: spawn (if ``spawn``), `python -c "import torch"`,
    the template's start-up, then the forked group."""
    out = {}
    if spawn:
        out["spawn"] = await measure_async(lambda: aioproc_group(n, "spawn"))
    out["import"] = await measure_async(
        lambda: raw_concurrent([sys.executable, "-c", "import torch"], 1)
    )
    server: aioproc.Forkserver | None = None

    async def open_template() -> float:
        nonlocal server
        t0 = time.perf_counter()
        server = await aioproc.open_forkserver(PRELOAD)
        return time.perf_counter() - t0

    out["template"] = await measure_async(open_template)
    assert server is not None
    try:
        out["forkserver"] = await measure_async(lambda: aioproc_group(n, "forkserver"))
    finally:
        await server.aclose()
    return out


def p1t_fork(cfg: Config) -> list[Row] | str:
    """The forkserver rows of P1t only (and the template's start-up)."""
    return p1t(cfg, spawn=False)


def p1t(cfg: Config, spawn: bool = True) -> list[Row] | str:
    """The P1t rows (without the spawn launchers unless ``spawn``), or why they were skipped."""
    tmp = torch_mp()
    if tmp is None:
        return "torch not installed: P1t skipped"
    import torch

    n = 2 if cfg.quick else P1T_N
    # without the spawn launchers a round takes seconds: every round is measured
    rounds = cfg.torch_rounds if spawn else cfg.rounds
    warmup = 0 if cfg.quick else cfg.warmup
    baselines: dict[str, Callable[[], float]] = {
        "spawn": lambda: torch_run(tmp, _workers.import_torch, n, "spawn"),
        "forkserver": lambda: torch_run(tmp, _workers.import_torch, n, "forkserver"),
        "parallel": lambda: torch_parallel(tmp, n),
    }
    if not spawn:
        del baselines["spawn"]
    torch_s = {k: Series() for k in baselines}
    ours = {loop: {k: Series() for k in _ROWS if spawn or k != "spawn"} for loop in cfg.loops}
    # one thread per process on both sides: with numpy installed, importing
    # torch starts an OpenBLAS pool, which aioproc's template refuses (a
    # worker cloned from it would inherit the pool's locks)
    with (
        _environ("PYTHONWARNINGS", "ignore"),
        _environ("OMP_NUM_THREADS", "1"),
        _environ("OPENBLAS_NUM_THREADS", "1"),
        torch_forkserver(tmp, n),
    ):
        for i in range(warmup + rounds):
            for key, fn in baselines.items():
                s = measure_sync(fn)
                if i >= warmup:
                    torch_s[key].samples.append(s)
            for loop in cfg.loops:
                got = run_on(loop, lambda: _aioproc_round(n, spawn))
                if i >= warmup:
                    for key, s in got.items():
                        ours[loop][key].samples.append(s)

    def pair(base: Callable[[str], Series], cand: str) -> dict[str, tuple[Series, Series]]:
        return {loop: (base(loop), ours[loop][cand]) for loop in cfg.loops}

    how = f"{rounds} rounds (+{warmup} warm-up), torch {torch.__version__}"
    per = f"P1t {n} workers importing torch, start -> results -> closed"
    rows = rows_from(
        f"{per}, forkserver preload=[torch] (aioproc vs torch)",
        pair(lambda _: torch_s["forkserver"], "forkserver"),
        Target("ratio", 0.3),
        note=f"both servers up and warm; torch starts workers one by one; {how}",
    )
    for row, loop in zip(rows, cfg.loops, strict=True):
        # torch's workers are its forkserver's children: only aioproc's CPU is known
        mine = ours[loop]["forkserver"]
        row.note += (
            f"; aioproc CPU/round: parent {mine.parent_cpu * 1e3:.0f} ms, "
            f"workers {mine.child_cpu * 1e3:.0f} ms"
        )
    rows += rows_from(
        f"{per}, forkserver (aioproc vs torch {_PARALLEL_START}=1)",
        pair(lambda _: torch_s["parallel"], "forkserver"),
        None,
        note=f"torch's opt-in parallel start from its warm forkserver; {how}",
    )
    template = rows_from(
        "P1t template start-up, preload=[torch]",
        pair(lambda loop: ours[loop]["import"], "template"),
        None,
        note=f'baseline: 1 x `python -c "import torch"`; {how}',
    )
    if not spawn:
        return rows + template
    rows += rows_from(
        f"{per}, spawn (aioproc vs torch)",
        pair(lambda _: torch_s["spawn"], "spawn"),
        None,
        note=f"every worker imports torch; wait(period={TORCH_POLL_PERIOD}); {how}",
        cpu_note=True,
    )
    rows += rows_from(
        f"{per}: aioproc forkserver vs aioproc spawn",
        pair(lambda loop: ours[loop]["spawn"], "forkserver"),
        None,
        note=how,
    )
    return rows + template
