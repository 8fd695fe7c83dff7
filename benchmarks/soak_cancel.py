"""Cancellation soak: cancel start, wait and close at random points; nothing may be left.

Each iteration starts a small group, tee'd to a private ``aioproc_*`` temp
dir: binary workers (a ``/bin/sh`` that starts a ``sleep`` grandchild) or
function workers (which do the same).  Every worker and grandchild carries
the iteration's marker in its environment and appends its pids to a report
file.  The task driving the group is cancelled at a random moment of
``start()`` (both ``await start_processes(...)`` and ``async with``), of
``wait()`` or of ``close()``.  Then it counts what was left behind:

- processes: children of this process, reported pids still running, and any
  process on the machine whose environment holds the marker (that catches
  grandchildren and workers whose pid was never reported), waited for with
  pidfds up to ``SETTLE`` seconds;
- fds and threads, against the counts before the first iteration;
- ``aioproc_*`` temp dirs (the workers write nothing, so every log file is
  empty and ``prune`` removes the whole dir);
- warnings, such as the ``ResourceWarning`` of a pipe aioproc dropped unclosed.

Usage::

    python benchmarks/soak_cancel.py [--iterations 300] [--loop asyncio|uvloop|both]
                                     [--seed N]

Prints the counts and exits 1 if anything was left over.
``tests/test_faults.py`` runs the same soak with fewer iterations.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import random
import sys
import tempfile
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(HERE)
CHILDREN_DIR = os.path.join(REPO_ROOT, "tests", "children")
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)  # this checkout's aioproc, not an installed one
if CHILDREN_DIR not in sys.path:
    sys.path.insert(0, CHILDREN_DIR)  # fault_worker, importable by function workers

import fault_worker  # noqa: E402
from _util import child_pids, run_on  # noqa: E402

import aioproc  # noqa: E402
from aioproc import DefaultLogsSpecs, Std  # noqa: E402

MARK_VAR = fault_worker.MARK_VAR
SH_WORKER = fault_worker.SH_WORKER
SH_STUBBORN = fault_worker.SH_STUBBORN
SETTLE = 5.0
"""Seconds leftover processes get to exit after an iteration (bounded pidfd wait)."""
PHASES = ("start", "start-await", "wait", "close")
KINDS = ("binary", "function")


def discard(line: object) -> None:
    """A sink that drops every line (the soak wants pipes, not console noise)."""


# ------------------------------------------------------------ processes


def running(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie (a zombie has exited)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat[stat.rindex(b")") + 2 : stat.rindex(b")") + 3] != b"Z"


def marked_pids(mark: str) -> set[int]:
    """Running processes whose environment holds ``MARK_VAR=mark``, or whose
    command line holds ``mark``.

    ``/proc/<pid>/environ`` is the environment given at exec.  A process
    forked to become a worker but not yet exec'd still shows its parent's
    environment and command line; the fault tests pass the mark in the
    supervisor's argv, so such a process is found by its command line (and
    a supervisor killed mid-launch can leave exactly that).  Zombies have
    neither and are not counted.
    """
    env_needle = f"{MARK_VAR}={mark}".encode()
    found: set[int] = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue  # gone meanwhile, or not readable
        if env_needle in env.split(b"\0") or mark.encode() in argv:
            found.add(int(name))
    return found


def reported_pids(report: str) -> set[int]:
    """Every nonzero pid in a report file of "<pid> <pid>" lines."""
    try:
        with open(report) as f:
            text = f.read()
    except FileNotFoundError:
        return set()
    return {int(p) for p in text.split() if p.isdigit() and int(p) > 0}


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


async def wait_exited(pids: Iterable[int], timeout: float) -> set[int]:
    """Wait up to ``timeout`` for every pid to exit (via pidfds); return those still running."""
    loop = asyncio.get_running_loop()
    futs: dict[int, asyncio.Future[None]] = {}
    fds: list[int] = []
    try:
        for pid in set(pids):
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                continue
            fds.append(fd)
            fut: asyncio.Future[None] = loop.create_future()
            loop.add_reader(fd, _resolve, fut)
            futs[pid] = fut
        if futs:
            await asyncio.wait(futs.values(), timeout=timeout)
        return {pid for pid, fut in futs.items() if not fut.done()}
    finally:
        for fd in fds:
            loop.remove_reader(fd)
            os.close(fd)


async def survivors(mark: str, known: Iterable[int], timeout: float = SETTLE) -> set[int]:
    """Processes (marked, or in ``known``) still running after up to ``timeout`` s.

    Repeats the scan after each wait: a process found later (a grandchild
    forked meanwhile) is waited for too.  Bounded by ``timeout`` in total.
    """
    known = set(known)
    deadline = time.monotonic() + timeout
    while True:
        alive = {p for p in known if running(p)} | marked_pids(mark)
        left = deadline - time.monotonic()
        if not alive or left <= 0:
            return alive
        alive = await wait_exited(alive, left)
        if alive:
            return alive


async def clean_up(mark: str, known: Iterable[int], timeout: float = SETTLE) -> None:
    """SIGKILL what ``survivors`` found, and what they forked meanwhile, until none is left.

    A worker found still running may have started a grandchild (or exec'd)
    since it was found, so this kills, waits and scans again, bounded by
    ``timeout``.  Only processes of this test (marked, or in ``known``).
    """
    deadline = time.monotonic() + timeout
    while True:
        found = {p for p in known if running(p)} | marked_pids(mark)
        left = deadline - time.monotonic()
        if not found or left <= 0:
            return
        kill_all(found)
        await wait_exited(found, left)


def describe(pid: int) -> str:
    """``pid (cmdline, parent, group)`` for a report; ``pid (gone)`` if it exited meanwhile."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return f"{pid} (gone)"
    return f"{pid} ({cmd!r}, ppid {int(fields[1])}, pgid {int(fields[2])})"


def kill_all(pids: Iterable[int]) -> None:
    """SIGKILL processes this soak started (workers, grandchildren); reap our own children."""
    for pid in pids:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            continue
    for pid in child_pids():
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass


def open_fds() -> set[int]:
    return {int(fd) for fd in os.listdir("/proc/self/fd")}


def fd_target(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return "?"


def aioproc_temp_dirs(tmpdir: str) -> set[str]:
    """``aioproc_*`` entries in ``tmpdir`` (``DefaultLogsSpecs()``'s private log dirs)."""
    return {os.path.join(tmpdir, n) for n in os.listdir(tmpdir) if n.startswith("aioproc_")}


# ------------------------------------------------------------ one iteration


@contextlib.contextmanager
def private_tempdir(prefix: str) -> Iterator[tuple[str, str]]:
    """A work dir, and a ``tmp`` dir in it that ``tempfile`` uses meanwhile.

    Only the soak's own ``aioproc_*`` dirs are then counted as left behind.
    """
    saved = tempfile.tempdir
    with tempfile.TemporaryDirectory(prefix=prefix) as workdir:
        tmp = os.path.join(workdir, "tmp")
        os.mkdir(tmp)
        tempfile.tempdir = tmp
        try:
            yield workdir, tmp
        finally:
            tempfile.tempdir = saved


@dataclass
class Baseline:
    """What the soak process held before its first iteration: fds, threads, temp dirs.

    ``count`` adds what an iteration left on top of it to ``out`` and takes
    it into the baseline, so that one leak is counted once.
    """

    tmp: str
    fds: set[int] = field(default_factory=open_fds)
    threads: int = field(default_factory=threading.active_count)
    dirs: set[str] = field(default_factory=set)

    def count(self, out: Any, where: str) -> None:
        """Add this iteration's leftovers to ``out`` (``fds``, ``threads``,
        ``temp_dirs`` and ``details``, as both soaks' ``Leftovers`` have)."""
        fds = open_fds() - self.fds
        if fds:
            out.fds += len(fds)
            out.details.append(
                f"{where}: fds left open: "
                + ", ".join(f"{fd}->{fd_target(fd)}" for fd in sorted(fds))
            )
            self.fds |= fds
        threads = threading.active_count() - self.threads
        if threads > 0:
            # a retired helper thread leaves on its own, unwaited for: it gets a
            # second to do so; one still held by somebody stays and is counted
            for thread in threading.enumerate():
                if thread.name == "aioproc-helper":
                    thread.join(timeout=1.0)
            threads = threading.active_count() - self.threads
        if threads > 0:
            out.threads += threads
            names = [t.name for t in threading.enumerate()]
            out.details.append(f"{where}: {threads} extra thread(s): {names}")
            self.threads += threads
        dirs = aioproc_temp_dirs(self.tmp) - self.dirs
        if dirs:
            out.temp_dirs += len(dirs)
            out.details.append(f"{where}: temp dirs left: {sorted(dirs)}")
            self.dirs |= dirs


@dataclass
class Leftovers:
    """What the soak found left behind, per kind, with one line per finding."""

    iterations: int = 0
    processes: int = 0
    fds: int = 0
    threads: int = 0
    temp_dirs: int = 0
    errors: int = 0
    warnings: int = 0
    details: list[str] = field(default_factory=list)
    outcomes: dict[str, int] = field(default_factory=dict)

    def total(self) -> int:
        return (
            self.processes + self.fds + self.threads + self.temp_dirs + self.errors + self.warnings
        )

    def summary(self) -> str:
        return (
            f"{self.iterations} iterations: {self.processes} leftover processes, "
            f"{self.fds} fds, {self.threads} threads, {self.temp_dirs} temp dirs, "
            f"{self.errors} unexpected errors, {self.warnings} warnings (e.g. unclosed files)"
        )


async def _cancel_after(
    rng: random.Random, task: asyncio.Task[Any], max_delay: float, *, started: asyncio.Event
) -> None:
    """Cancel ``task`` at a random moment: a random delay, or a few loop turns after
    the k-th worker started (so the moments inside a launch are hit too)."""
    if rng.random() < 0.5:
        await asyncio.sleep(rng.uniform(0, max_delay))
    else:
        await started.wait()
        for _ in range(rng.randrange(4)):
            await asyncio.sleep(0)
    task.cancel()


async def one_iteration(
    rng: random.Random, workdir: str, phase: str, kind: str, nprocs: int | None = None
) -> tuple[str, str, set[int]]:
    """Run one group, cancel it at a random point of ``phase``; return the mark,
    the report file and the worker pids aioproc reported."""
    mark = uuid.uuid4().hex
    report = os.path.join(workdir, f"report-{mark}")
    n = nprocs or (4 if kind == "binary" else 2)
    envs = {r: {MARK_VAR: mark} for r in range(n)}
    entrypoint: Callable[..., Any] | str
    # in half the close iterations the binary workers ignore SIGTERM, so close()
    # is cancelled during its grace period or its SIGKILL escalation too
    stubborn = phase == "close" and kind == "binary" and rng.random() < 0.5
    if kind == "binary":
        entrypoint = "/bin/sh"
        script = SH_STUBBORN if stubborn else SH_WORKER
        args = {r: ("-c", script, "fault", report) for r in range(n)}
    else:
        entrypoint = fault_worker.fn_worker
        args = {r: (report,) for r in range(n)}
    pids: set[int] = set()
    kth = asyncio.Event()
    everyone = asyncio.Event()
    k = rng.randrange(n)
    count = 0

    def on_event(ev: Any) -> None:  # a WorkerEvent (not exported by aioproc)
        nonlocal count
        if ev.kind == "started":
            pids.add(ev.pid)
            count += 1
            if count > k:
                kth.set()
            if count == n:
                everyone.set()

    def ctx() -> Any:
        return aioproc.start_processes(
            f"soak-{kind}",
            entrypoint,
            args,
            envs,
            DefaultLogsSpecs(tee=Std.ALL),
            sinks=[discard],
            on_event=on_event,
            grace_period=5,
        )

    async def with_block() -> None:
        async with ctx() as pc:
            await pc.wait()

    async def awaited() -> None:
        pc = await ctx()
        try:
            await pc.wait()
        finally:
            await pc.close(timeout=5)

    start_time = 0.01 * n if kind == "binary" else 0.05 * n
    if phase in ("start", "start-await"):
        task = asyncio.create_task(with_block() if phase == "start" else awaited())
        await _cancel_after(rng, task, start_time, started=kth)
    elif phase == "wait":
        task = asyncio.create_task(with_block())
        await asyncio.wait_for(everyone.wait(), 30)
        await _cancel_after(rng, task, 0.05, started=everyone)
    else:
        pc = await ctx()
        if rng.random() < 0.5:
            await asyncio.sleep(rng.uniform(0, 0.05))
        task = asyncio.create_task(pc.close(timeout=0.2 if stubborn else 5))
        # one turn at least: a task cancelled before it ever ran would not close at all
        for _ in range(1 + rng.randrange(6)):
            await asyncio.sleep(0)
        if stubborn:
            await asyncio.sleep(rng.uniform(0, 0.3))  # into the grace period, or past it
        task.cancel()
    try:
        await asyncio.wait_for(asyncio.shield(task), 30)
    except asyncio.CancelledError:
        if not task.cancelled():
            raise  # we ourselves were cancelled
    return mark, report, pids


async def soak(
    iterations: int,
    seed: int,
    *,
    phases: tuple[str, ...] = PHASES,
    kinds: tuple[str, ...] = KINDS,
    nprocs: int | None = None,
    function_share: float = 0.25,
    log: Callable[[str], None] | None = None,
) -> Leftovers:
    """Run ``iterations`` cancelled groups and count what each one left behind.

    ``tempfile.tempdir`` is pointed at a private dir meanwhile, so only this
    soak's ``aioproc_*`` dirs are counted.  Leftovers of one iteration are
    killed (processes) or taken as the new baseline (fds, threads, dirs) so
    that one leak is counted once.
    """
    rng = random.Random(seed)
    out = Leftovers()
    with private_tempdir("soak_cancel_") as (workdir, tmp):
        await warm_up()
        base_children = child_pids()
        baseline = Baseline(tmp)
        for i in range(iterations):
            phase = rng.choice(phases)
            if len(kinds) == 1:
                kind = kinds[0]
            else:
                kind = "function" if rng.random() < function_share else "binary"
            where = f"iteration {i} ({phase}, {kind})"
            with warnings.catch_warnings(record=True) as caught:
                # an object aioproc dropped unclosed warns when collected
                warnings.simplefilter("always")
                try:
                    mark, report, pids = await one_iteration(rng, workdir, phase, kind, nprocs)
                    outcome = "ok"
                except Exception as e:
                    out.errors += 1
                    out.details.append(f"{where}: unexpected {e!r}")
                    outcome = type(e).__name__
                    mark, report, pids = "", "", set()
                gc.collect()
            for w in caught:
                if issubclass(w.category, aioproc.ForcedKillWarning):
                    continue  # expected: the stubborn workers ignore SIGTERM
                out.warnings += 1
                out.details.append(f"{where}: {w.category.__name__}: {w.message}")
            out.iterations += 1
            key = f"{phase}/{kind}: {outcome}"
            out.outcomes[key] = out.outcomes.get(key, 0) + 1
            await _count(out, where, mark, report, pids, base_children)
            baseline.count(out, where)
            if log is not None and (i + 1) % 50 == 0:
                log(f"  ... {i + 1} iterations, {out.total()} leftovers")
    return out


async def warm_up() -> None:
    """One uncancelled tee'd group first: the loop opens some fds lazily on first use
    (uvloop a /dev/null), and they are the loop's, not leaks."""
    pc = await aioproc.start_processes(
        "warm-up", "/bin/true", {0: ()}, {0: {}}, DefaultLogsSpecs(tee=Std.ALL), sinks=[discard]
    )
    await pc.wait()
    await pc.close()


async def _count(
    out: Leftovers, where: str, mark: str, report: str, pids: set[int], base_children: set[int]
) -> None:
    known = pids | (reported_pids(report) if report else set())
    alive = await survivors(mark, known) if mark else set()
    if alive:
        out.processes += len(alive)
        out.details.append(
            f"{where}: processes still running {SETTLE:g} s later: "
            + ", ".join(describe(p) for p in sorted(alive))
            + f"; aioproc reported pids {sorted(pids)}"
        )
        await clean_up(mark, alive)
    # a child of ours still here (running or an unreaped zombie) is a leak too
    extra = child_pids() - base_children - alive
    if extra:
        out.processes += len(extra)
        out.details.append(f"{where}: child processes left behind: {sorted(extra)}")
        kill_all(extra)


# ------------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--loop", choices=("asyncio", "uvloop", "both"), default="both")
    parser.add_argument("--seed", type=int, default=None)
    opts = parser.parse_args()
    if opts.iterations <= 0:
        parser.error(f"--iterations must be > 0, got {opts.iterations}")
    seed = opts.seed if opts.seed is not None else random.randrange(1 << 30)
    loops = ("asyncio", "uvloop") if opts.loop == "both" else (opts.loop,)
    failed = False
    for loop_kind in loops:
        print(f"{loop_kind}: {opts.iterations} iterations, seed {seed}", flush=True)
        t0 = time.monotonic()
        found = run_on(
            loop_kind, lambda: soak(opts.iterations, seed, log=lambda s: print(s, flush=True))
        )
        took = time.monotonic() - t0
        print(f"{loop_kind}: {found.summary()} ({took:.1f} s)")
        print(f"{loop_kind}: outcomes {found.outcomes}")
        for line in found.details:
            print(f"  {line}")
        failed = failed or found.total() > 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
