"""Fault soak: hurt the processes aioproc relies on at random moments; nothing may be left.

A sibling of ``soak_cancel.py``, which cancels the caller; here the
supervisor's helpers fail under it.  Each iteration runs one *mode*:

- ``kill``: start a 64-worker forkserver group and SIGKILL the template (the
  process alone, or its whole group) at a random moment of the fork: a
  random delay, or a few loop turns after the k-th worker started.
- ``nested``: a supervisor (a worker of this process) whose worker is a
  supervisor of two workers, SIGKILLed at a random moment of its life;
  every process below it must die, both guardians must exit, and their
  temp log dirs must be pruned.
- ``stop``: the same group, but the template is SIGSTOPped at a random
  moment (wedged, as when swapping) and the start is cancelled a random
  while later; the cancellation must return within ``STOP_CANCEL_LIMIT``
  seconds of the deadline (not after the 30 s fork timeout), and the
  template is continued afterwards (it must fork nothing then).

Every worker runs ``fork_fault_funcs.report_and_block``: it appends its pid
to a report file and blocks.  After each iteration the group and the
template's lease are closed and the soak counts what was left behind:

- processes: any process whose exec environment carries this process's
  lifeline token (every worker forked for it, and their descendants),
  still running ``SETTLE`` seconds later, and this process's children that
  were not there before (running, or zombies nobody reaped);
- fds and threads, against the counts before the first iteration;
- ``aioproc_*`` temp dirs of the groups;
- errors other than the expected ones (``TemplateLost`` for a killed
  template, the cancellation for a stopped one), and cancellations that
  took too long.

Usage::

    python benchmarks/soak_faults.py [--iterations 300] [--loop asyncio|uvloop|both]
                                     [--mode kill|stop|nested|all] [--seed N]

Prints "N iterations, K leftovers" per loop, the details of each leftover,
and exits 1 if anything was left over.  ``tests/test_template_faults.py``
runs the same faults with fewer iterations.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import random
import signal
import sys
import tempfile
import time
import warnings
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(HERE)
CHILDREN_DIR = os.path.join(REPO_ROOT, "tests", "children")
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)  # this checkout's aioproc, not an installed one
if CHILDREN_DIR not in sys.path:
    sys.path.insert(0, CHILDREN_DIR)  # fork_fault_funcs, importable by function workers

import fork_fault_funcs  # noqa: E402
import soak_cancel  # noqa: E402
from _util import child_pids, run_on  # noqa: E402
from soak_cancel import (  # noqa: E402
    Baseline,
    describe,
    kill_all,
    private_tempdir,
    running,
    wait_exited,
)

import aioproc  # noqa: E402
from aioproc._func import template as _template  # noqa: E402
from aioproc._proc import lifeline as _lifeline  # noqa: E402

NPROCS = 64
SETTLE = 5.0
"""Seconds leftover processes get to exit after an iteration (bounded pidfd wait)."""
STOP_CANCEL_LIMIT = 1.5
"""Seconds a start cancelled while its template is stopped may take to return."""
PRELOAD = ["json"]


# ------------------------------------------------------------ processes


def token_holders() -> set[int]:
    """Running processes whose exec environment carries this process's lifeline token."""
    token = _lifeline.token().encode()
    key = _lifeline.TOKEN_VAR.encode() + b"="
    found: set[int] = set()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue  # gone meanwhile, or not readable
        if any(e.startswith(key) and token in e[len(key) :].split(b":") for e in env):
            found.add(int(name))
    return found


async def survivors(known: set[int], timeout: float = SETTLE) -> set[int]:
    """Token holders (and ``known`` pids) still running after up to ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        alive = {p for p in known if running(p)} | token_holders()
        left = deadline - time.monotonic()
        if not alive or left <= 0:
            return alive
        alive = await wait_exited(alive, left)
        if alive:
            return alive


def reported_pids(report: str) -> set[int]:
    try:
        with open(report) as f:
            return {int(line.split()[0]) for line in f if line.strip()}
    except FileNotFoundError:
        return set()


# ------------------------------------------------------------ one iteration


@dataclass
class Leftovers(soak_cancel.Leftovers):
    """``soak_cancel``'s tally, plus the cancellations of a stopped template that took too long."""

    slow_cancels: int = 0
    max_cancel: float = 0.0

    def total(self) -> int:
        return super().total() + self.slow_cancels

    def summary(self) -> str:
        return (
            f"{self.iterations} iterations, {self.total()} leftovers "
            f"({self.processes} processes, {self.fds} fds, {self.threads} threads, "
            f"{self.temp_dirs} temp dirs, {self.errors} unexpected errors, "
            f"{self.slow_cancels} cancellations slower than {STOP_CANCEL_LIMIT:g} s; "
            f"slowest cancellation {self.max_cancel:.2f} s)"
        )


@dataclass
class Moment:
    """When to strike: after a random delay, or a few loop turns after the k-th start."""

    rng: random.Random
    kth: asyncio.Event = field(default_factory=asyncio.Event)
    started: list[int] = field(default_factory=list)
    k: int = 0

    def __post_init__(self) -> None:
        self.k = self.rng.randrange(NPROCS)

    def on_event(self, ev: Any) -> None:  # a WorkerEvent (not exported by aioproc)
        if ev.kind == "started":
            self.started.append(ev.pid)
            if len(self.started) > self.k:
                self.kth.set()

    async def wait(self, max_delay: float) -> None:
        if self.rng.random() < 0.5:
            await asyncio.sleep(self.rng.uniform(0, max_delay))
        else:
            await self.kth.wait()
            for _ in range(self.rng.randrange(4)):
                await asyncio.sleep(0)


def _group(report: str, moment: Moment) -> Any:
    return aioproc.start_processes(
        "soak-fault",
        fork_fault_funcs.report_and_block,
        {r: (report,) for r in range(NPROCS)},
        {r: {} for r in range(NPROCS)},
        start_method="forkserver",
        preload=PRELOAD,
        on_event=moment.on_event,
    )


async def _start_and_close(report: str, moment: Moment) -> str:
    """Start the group; close it if it started.  The outcome's name."""
    try:
        pc = await _group(report, moment)
    except _template.TemplateLost:
        return "template lost"
    await pc.close(signal.SIGKILL, 0)
    return "started"


async def mode_kill(rng: random.Random, report: str, out: Leftovers) -> str:
    """SIGKILL the template (alone, or with its group) at a random moment of the fork."""
    moment = Moment(rng)
    whole_group = rng.random() < 0.5
    async with aioproc.open_forkserver(PRELOAD) as server:

        async def kill() -> None:
            await moment.wait(0.4)
            if whole_group:
                os.killpg(server.pid, signal.SIGKILL)
            else:
                os.kill(server.pid, signal.SIGKILL)

        killer = asyncio.ensure_future(kill())
        try:
            outcome = await _start_and_close(report, moment)
        finally:
            await asyncio.wait({killer})
    return f"{'group' if whole_group else 'template'} killed, {outcome}"


async def mode_stop(rng: random.Random, report: str, out: Leftovers) -> str:
    """SIGSTOP the template at a random moment, cancel the start a random while later."""
    moment = Moment(rng)
    async with aioproc.open_forkserver(PRELOAD) as server:
        start = asyncio.ensure_future(_start_and_close(report, moment))
        stopped = False
        try:
            await moment.wait(0.4)
            if not start.done():
                os.kill(server.pid, signal.SIGSTOP)
                stopped = True
                await asyncio.wait({start}, timeout=rng.uniform(0.05, 0.5))
            t0 = time.monotonic()
            start.cancel()
            try:
                outcome = await asyncio.wait_for(asyncio.shield(start), 30)
            except asyncio.CancelledError:
                if not start.cancelled():
                    raise  # we ourselves were cancelled
                outcome = "cancelled"
            took = time.monotonic() - t0
        finally:
            if stopped:
                os.kill(server.pid, signal.SIGCONT)
        if stopped:
            out.max_cancel = max(out.max_cancel, took)
            if took > STOP_CANCEL_LIMIT:
                out.slow_cancels += 1
                out.details.append(f"a cancellation took {took:.2f} s")
    return f"{'stopped' if stopped else 'not stopped'}, {outcome}"


NESTED = os.path.join(CHILDREN_DIR, "nested_supervisor.py")
GRANDCHILD = os.path.join(CHILDREN_DIR, "grandchild.py")


def _guardians_marked(mark: str) -> set[int]:
    """Guardian shells whose PATH holds ``mark`` (all a guardian keeps of its environment)."""
    found: set[int] = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if not f.read().startswith(b"aioproc-guardian "):
                    continue
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if any(e.startswith(b"PATH=") and mark.encode() in e for e in env):
            found.add(int(name))
    return found


async def mode_nested(rng: random.Random, report: str, out: Leftovers) -> str:
    """SIGKILL a supervisor whose worker is a supervisor of two workers, at a random moment.

    Every process below it carries this process's lifeline token (so the
    count after the iteration finds any survivor), and both levels keep
    their logs in private temp dirs under the soak's ``TMPDIR``.  Their
    guardians keep only ``PATH`` of their environment: a marker there tells
    them from the guardians of other programs; they must all exit.
    """
    home = report + ".d"
    os.mkdir(home)
    fifo = report + ".fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)  # the workers' writes never block
    env = {
        "TMPDIR": tempfile.gettempdir(),
        "PATH": f"{os.environ.get('PATH', os.defpath)}:{home}",
        "AIOPROC_LOOP": "uvloop" if "uvloop" in type(asyncio.get_running_loop()).__module__ else "",
    }
    try:
        pc = await aioproc.start_processes(
            "nested",
            sys.executable,
            {0: (NESTED, "outer", GRANDCHILD, fifo)},
            {0: env},
            aioproc.DefaultLogsSpecs(log_dir=home),
        )
        try:
            # from before the inner supervisor exists to well after its workers run
            await asyncio.sleep(rng.uniform(0.0, 1.2))
            os.kill(pc.pids()[0], signal.SIGKILL)
            await pc.wait()
        finally:
            await pc.close(signal.SIGKILL, 0)
        try:
            reported = os.read(reader, 1 << 16).decode().split()
        except BlockingIOError:
            reported = []
        with open(report, "a") as f:
            f.writelines(f"{pid}\n" for pid in reported)
        deadline = time.monotonic() + 10
        while _guardians_marked(home) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # their sweeps and pruning take ~1.5 s
        left = _guardians_marked(home)
        if left:
            out.processes += len(left)
            out.details.append(f"guardians still running 10 s later: {sorted(left)}")
            kill_all(left)
    finally:
        os.close(reader)
    return f"{len(reported) // 2} inner worker(s) up when killed"


Mode = Callable[[random.Random, str, Leftovers], Awaitable[str]]
MODES: dict[str, Mode] = {"kill": mode_kill, "stop": mode_stop, "nested": mode_nested}
"""Each mode does one faulty iteration and names its outcome (new modes go here)."""


async def soak(
    iterations: int,
    seed: int,
    modes: tuple[str, ...] = tuple(MODES),
    log: Callable[[str], None] | None = None,
) -> Leftovers:
    """Run ``iterations`` faulty iterations and count what each one left behind.

    ``tempfile.tempdir`` points at a private dir meanwhile, so only this
    soak's ``aioproc_*`` dirs are counted.  Leftovers of one iteration are
    killed (processes) or taken as the new baseline (fds, threads, dirs),
    so that one leak is counted once.
    """
    rng = random.Random(seed)
    out = Leftovers()
    with private_tempdir("soak_faults_") as (workdir, tmp):
        await warm_up()
        base_children = child_pids()
        baseline = Baseline(tmp)
        for i in range(iterations):
            mode = rng.choice(modes)
            report = os.path.join(workdir, f"report-{i}")
            where = f"iteration {i} ({mode})"
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    outcome = await MODES[mode](rng, report, out)
                except Exception as e:
                    out.errors += 1
                    out.details.append(f"{where}: unexpected {e!r}")
                    outcome = type(e).__name__
                gc.collect()
            for w in caught:
                if issubclass(w.category, aioproc.ForcedKillWarning):
                    continue
                out.errors += 1
                out.details.append(f"{where}: {w.category.__name__}: {w.message}")
            out.iterations += 1
            key = f"{mode}: {outcome}"
            out.outcomes[key] = out.outcomes.get(key, 0) + 1
            await _count(out, where, report, base_children)
            baseline.count(out, where)
            if log is not None and (i + 1) % 50 == 0:
                log(f"  ... {i + 1} iterations, {out.total()} leftovers")
    return out


async def warm_up() -> None:
    """One forkserver group first: the loop opens some fds lazily on first use."""
    await aioproc.run(fork_fault_funcs.ident, 1, (0,), start_method="forkserver", preload=PRELOAD)


async def _count(out: Leftovers, where: str, report: str, base_children: set[int]) -> None:
    ran = reported_pids(report)
    alive = await survivors(ran)
    if alive:
        out.processes += len(alive)
        out.details.append(
            f"{where}: processes still running {SETTLE:g} s later: "
            + ", ".join(describe(p) for p in sorted(alive))
        )
        kill_all(alive)
        await wait_exited(alive, SETTLE)
    # a child of ours still here (running or an unreaped zombie) is a leak too
    extra = child_pids() - base_children - alive
    if extra:
        out.processes += len(extra)
        out.details.append(
            f"{where}: child processes left behind: "
            + ", ".join(describe(p) for p in sorted(extra))
        )
        kill_all(extra)


# ------------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--loop", choices=("asyncio", "uvloop", "both"), default="both")
    parser.add_argument("--mode", choices=(*MODES, "all"), default="all")
    parser.add_argument("--seed", type=int, default=None)
    opts = parser.parse_args()
    if opts.iterations <= 0:
        parser.error(f"--iterations must be > 0, got {opts.iterations}")
    seed = opts.seed if opts.seed is not None else random.randrange(1 << 30)
    loops = ("asyncio", "uvloop") if opts.loop == "both" else (opts.loop,)
    modes = tuple(MODES) if opts.mode == "all" else (opts.mode,)
    failed = False
    for loop_kind in loops:
        print(f"{loop_kind}: {opts.iterations} iterations of {modes}, seed {seed}", flush=True)
        t0 = time.monotonic()
        found = run_on(
            loop_kind,
            lambda: soak(opts.iterations, seed, modes, log=lambda s: print(s, flush=True)),
        )
        took = time.monotonic() - t0
        print(f"{loop_kind}: {found.summary()} in {took:.1f} s")
        print(f"{loop_kind}: outcomes {dict(sorted(found.outcomes.items()))}")
        for line in found.details:
            print(f"  {line}")
        failed = failed or found.total() > 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
