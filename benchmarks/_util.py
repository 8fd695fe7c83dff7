"""Shared plumbing of the benchmarks: loops, interleaved rounds, medians, the table.

Every figure is a median over rounds, and every candidate is measured next to
its baseline in the same process, interleaved (baseline, candidate, baseline,
candidate, ...), so the noise of a shared 2-core machine hits both alike.
The ratio column is the median of the per-round ratios (candidate over the
baseline measured just before it), which follows load drifts better than
the ratio of the two medians; targets given as ratios are checked on it.
Each (baseline, candidate) pair runs in a fresh event loop of the loop kind
under test.
"""

from __future__ import annotations

import asyncio
import math
import os
import resource
import selectors
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

# This checkout's aioproc, not an installed one: a benchmark's child process
# runs as a script (sys.path[0] is benchmarks/), and its first aioproc import
# is the one below, which would otherwise find whatever aioproc is installed
# (e.g. another checkout's editable install) and measure that code instead.
_CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _CHECKOUT not in sys.path:
    sys.path.insert(1, _CHECKOUT)

from aioproc._plugin.leakcheck import child_pids as child_pids  # noqa: E402

T = TypeVar("T")

LOOPS = ("asyncio", "uvloop")


# --------------------------------------------------------------- configuration


@dataclass(frozen=True)
class Config:
    """Sizes and round counts; ``quick()`` is the CI smoke test (< 60 s)."""

    loops: tuple[str, ...]
    rounds: int = 9
    torch_rounds: int = 3
    warmup: int = 1
    p1_n: int = 64
    p2_ns: tuple[int, ...] = (64, 256, 1024)  # P2 is reported at each size: linear in N?
    p3_n: int = 8
    p3_delay: float = 0.5
    p5_ns: tuple[int, ...] = (64, 256)
    p6_n: int = 64
    leak_cycles: int = 1000
    # torch's spawn workers each import torch (~1.5 CPU-s on this machine):
    # 64 of them take over a minute per round, so function workloads are
    # compared with torch at this size (aioproc runs the same size there).
    torch_fn_n: int = 8
    quick: bool = False

    @classmethod
    def full(cls, loops: tuple[str, ...], rounds: int | None) -> Config:
        r = rounds or cls.rounds
        return cls(loops=loops, rounds=r, torch_rounds=max(1, r // 3))

    @classmethod
    def quick_mode(cls, loops: tuple[str, ...], rounds: int | None) -> Config:
        r = rounds or 3
        return cls(
            loops=loops,
            rounds=r,
            torch_rounds=1,
            p1_n=16,
            p2_ns=(16, 64),
            p3_n=4,
            p3_delay=0.3,
            p5_ns=(16, 64),
            p6_n=16,
            leak_cycles=100,
            torch_fn_n=2,
            quick=True,
        )


# ----------------------------------------------------------------------- loops


def uvloop_available() -> bool:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


def loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop]:
    if name == "asyncio":
        return asyncio.new_event_loop
    if name == "uvloop":
        import uvloop

        return uvloop.new_event_loop  # type: ignore[no-any-return]
    raise ValueError(f"unknown loop {name!r}")


def run_on(loop: str, main: Callable[[], Awaitable[T]]) -> T:
    """Run ``main()`` to completion in a fresh event loop of kind ``loop``."""

    async def _main() -> T:
        return await main()

    if sys.version_info >= (3, 11):
        with asyncio.Runner(loop_factory=loop_factory(loop)) as runner:
            return runner.run(_main())
    # Python 3.10: no Runner; swap the policy for the duration of the call.
    old = asyncio.get_event_loop_policy()
    if loop == "uvloop":
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    else:
        asyncio.set_event_loop_policy(asyncio.DefaultEventLoopPolicy())
    try:
        return asyncio.run(_main())
    finally:
        asyncio.set_event_loop_policy(old)


# -------------------------------------------------------------------- sampling


@dataclass
class Sample:
    """One measurement: the benchmark's figure plus the CPU it cost."""

    value: float
    parent_cpu: float = 0.0  # RUSAGE_SELF user+sys seconds over the whole call
    child_cpu: float = 0.0  # RUSAGE_CHILDREN user+sys seconds (reaped children)


@dataclass
class Series:
    """Samples of one side (baseline or candidate) on one loop."""

    samples: list[Sample] = field(default_factory=list)

    @property
    def median(self) -> float:
        """Median of the figures (the ratio column is the median of paired ratios)."""
        return statistics.median(s.value for s in self.samples)

    @property
    def parent_cpu(self) -> float:
        return statistics.median(s.parent_cpu for s in self.samples)

    @property
    def child_cpu(self) -> float:
        return statistics.median(s.child_cpu for s in self.samples)


def _cpu() -> tuple[float, float]:
    me = resource.getrusage(resource.RUSAGE_SELF)
    ch = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime, ch.ru_utime + ch.ru_stime


async def measure_async(fn: Callable[[], Awaitable[float]]) -> Sample:
    p0, c0 = _cpu()
    value = await fn()
    p1, c1 = _cpu()
    return Sample(value, p1 - p0, c1 - c0)


def measure_sync(fn: Callable[[], float]) -> Sample:
    p0, c0 = _cpu()
    value = fn()
    p1, c1 = _cpu()
    return Sample(value, p1 - p0, c1 - c0)


Measure = Callable[[], Awaitable[float]]


def interleaved(
    cfg: Config, baseline: Measure, candidate: Measure, rounds: int | None = None
) -> dict[str, tuple[Series, Series]]:
    """``{loop: (baseline series, candidate series)}``, rounds interleaved.

    See ``interleaved_all``.
    """
    return {
        loop: (series[0], series[1])
        for loop, series in interleaved_all(cfg, [baseline, candidate], rounds).items()
    }


def interleaved_all(
    cfg: Config, measures: Sequence[Measure], rounds: int | None = None
) -> dict[str, list[Series]]:
    """``{loop: [one series per measure]}``, rounds interleaved.

    Each round runs, for every loop in turn, every measure in order in one
    fresh loop, so that ratios between any two of them compare the same
    rounds.  ``cfg.warmup`` rounds come first and are dropped (imports,
    page cache, aioproc's one-time compile of its worker boot code).
    """
    out = {loop: [Series() for _ in measures] for loop in cfg.loops}
    total = cfg.warmup + (rounds or cfg.rounds)
    for i in range(total):
        for loop in cfg.loops:

            async def each() -> list[Sample]:
                return [await measure_async(m) for m in measures]

            samples = run_on(loop, each)
            if i >= cfg.warmup:
                for series, sample in zip(out[loop], samples, strict=True):
                    series.samples.append(sample)
    return out


def interleaved_sync_baseline(
    cfg: Config, baseline: Callable[[], float], candidate: Measure, rounds: int, warmup: int = 0
) -> dict[str, tuple[Series, Series]]:
    """Like :func:`interleaved`, for a blocking baseline (torch) that needs no loop.

    Per round: the baseline once in the main thread with no event loop
    running, then the candidate on every loop; every loop's row shares the
    baseline series.  No warm-up by default: by the time this runs, earlier
    benchmarks have warmed aioproc up, and a torch round is expensive.
    """
    base = Series()
    out = {loop: (base, Series()) for loop in cfg.loops}
    for i in range(warmup + rounds):
        b = measure_sync(baseline)
        if i >= warmup:
            base.samples.append(b)
        for loop in cfg.loops:

            async def one() -> Sample:
                return await measure_async(candidate)

            c = run_on(loop, one)
            if i >= warmup:
                out[loop][1].samples.append(c)
    return out


# ------------------------------------------------------------------ targets


@dataclass(frozen=True)
class Target:
    """A pass condition: ``ratio``, ``max`` (absolute) or ``equal``."""

    kind: str
    limit: float = 0.0
    unit: str = ""

    def describe(self) -> str:
        if self.kind == "ratio":
            return f"<= {self.limit:g}x"
        if self.kind == "max" and self.unit == "ms":
            return f"<= {self.limit * 1e3:g} ms"  # limits are in seconds, like the values
        if self.kind == "max":
            return f"<= {self.limit:g} {self.unit}".rstrip()
        return "== baseline"

    def check(self, candidate: float, baseline: float, ratio: float) -> bool:
        if self.kind == "ratio":
            return ratio <= self.limit
        if self.kind == "max":
            return candidate <= self.limit
        return candidate == baseline


# ----------------------------------------------------------------------- rows


@dataclass
class Row:
    bench: str
    loop: str
    candidate: float
    baseline: float
    unit: str  # "ms" (values in seconds, shown in ms) or a count unit
    target: Target | None
    note: str = ""
    timed: bool = True  # a time, used for the loop comparison
    error: str = ""
    paired_ratio: float | None = None  # median of per-round candidate/baseline

    @property
    def ratio(self) -> float:
        if self.paired_ratio is not None:
            return self.paired_ratio
        if self.baseline == 0:
            return math.inf if self.candidate else 1.0
        return self.candidate / self.baseline

    @property
    def passed(self) -> bool | None:
        if self.error:
            return False
        if self.target is None:
            return None
        return self.target.check(self.candidate, self.baseline, self.ratio)

    def _fmt(self, v: float) -> str:
        if self.unit == "ms":
            return f"{v * 1e3:.1f} ms"
        return f"{v:g} {self.unit}".rstrip()


def rows_from(
    bench: str,
    series: dict[str, tuple[Series, Series]],
    target: Target | None,
    *,
    unit: str = "ms",
    note: str = "",
    cpu_note: bool = False,
    timed: bool = True,
) -> list[Row]:
    rows = []
    for loop, (base, cand) in series.items():
        extra = note
        if cpu_note:
            cpu = (
                f"CPU/round: parent {cand.parent_cpu * 1e3:.0f} vs {base.parent_cpu * 1e3:.0f} ms,"
                f" children {cand.child_cpu * 1e3:.0f} vs {base.child_cpu * 1e3:.0f} ms"
            )
            extra = f"{note}; {cpu}" if note else cpu
        paired = None
        if len(base.samples) == len(cand.samples) and all(b.value > 0 for b in base.samples):
            paired = statistics.median(
                c.value / b.value for b, c in zip(base.samples, cand.samples, strict=True)
            )
        rows.append(
            Row(bench, loop, cand.median, base.median, unit, target, extra, timed, "", paired)
        )
    return rows


def error_row(bench: str, exc: BaseException) -> Row:
    return Row(bench, "-", math.nan, math.nan, "", None, error=f"{type(exc).__name__}: {exc}")


def standalone_main(
    doc: str, bench: Callable[[Config], list[Row]], child: Callable[[list[str]], None]
) -> None:
    """``main()`` of a benchmark script run on its own: ``--child ...`` runs its
    measured child process, anything else parses ``--quick/--rounds/--loop``
    and prints the table."""
    import argparse

    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2:])
        return
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--loop", choices=("asyncio", "uvloop", "both"), default="both")
    a = p.parse_args()
    loops = LOOPS if a.loop == "both" else (a.loop,)
    loops = tuple(x for x in loops if x != "uvloop" or uvloop_available())
    cfg = Config.quick_mode(loops, a.rounds) if a.quick else Config.full(loops, a.rounds)
    print(format_table(bench(cfg)))


def format_table(rows: Sequence[Row]) -> str:
    head = ["benchmark", "loop", "candidate", "baseline", "ratio", "target", "result", "notes"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if r.error:
            cells = [r.bench, r.loop, "-", "-", "-", "-", "ERROR", r.error]
        else:
            verdict = {True: "PASS", False: "FAIL", None: "info"}[r.passed]
            cells = [
                r.bench,
                r.loop,
                r._fmt(r.candidate),
                r._fmt(r.baseline),
                f"{r.ratio:.2f}x",
                r.target.describe() if r.target else "-",
                verdict,
                r.note,
            ]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(lines)


def loop_verdict(rows: Sequence[Row]) -> str:
    """Which loop runs aioproc faster: geometric mean of uvloop/asyncio candidates."""
    by: dict[str, dict[str, Row]] = {}
    for r in rows:
        if r.timed and not r.error and r.unit == "ms":
            by.setdefault(r.bench, {})[r.loop] = r
    pairs = [(d["asyncio"], d["uvloop"]) for d in by.values() if {"asyncio", "uvloop"} <= set(d)]
    if not pairs:
        return "Overall: only one loop measured; no loop comparison."

    def gmean(xs: list[float]) -> float:
        return math.exp(statistics.fmean(math.log(x) for x in xs))

    cand = gmean([u.candidate / a.candidate for a, u in pairs])
    base = gmean(
        [u.baseline / a.baseline for a, u in pairs if "torch" not in a.bench and a.baseline > 0]
        or [1.0]
    )
    if abs(cand - 1) < 0.05:
        verdict = "neither loop is meaningfully faster for aioproc (within 5%)"
    else:
        verdict = f"{'uvloop' if cand < 1 else 'asyncio'} is faster for aioproc"
    return (
        f"Overall: {verdict}: aioproc's median times on uvloop are "
        f"{cand:.2f}x those on asyncio (geometric mean over {len(pairs)} timed benchmarks; "
        f"the raw baselines on uvloop are {base:.2f}x those on asyncio)."
    )


# --------------------------------------------------------- process inspection


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def os_thread_count() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    return threading.active_count()  # pragma: no cover - not Linux


def gone(pid: int) -> bool:
    """True when ``pid`` no longer exists (exited AND reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def assert_gone(pids: Sequence[int], what: str) -> None:
    alive = [p for p in pids if not gone(p)]
    if alive:
        raise AssertionError(f"{what}: {len(alive)} pid(s) still exist: {alive[:8]}")


# ---------------------------------------------------------------- readiness


class ReadyFifo:
    """Count "ready" bytes that workers write to a named pipe, without polling.

    Why a FIFO: aioproc's function workers inherit no file descriptor but
    their control channel (``close_fds`` + ``pass_fds``), torch's spawn workers
    neither, while a path can be passed as an argument to all three variants
    (aioproc, torch, raw subprocesses) alike.  The parent opens the read end
    before any worker starts and keeps a writer of its own open, so the
    reader never sees EOF between two workers and a worker's ``open`` for
    writing never blocks.  The event loop wakes the reader (``add_reader``)
    or, for torch's blocking API, ``selectors`` blocks on it: nothing polls.
    """

    def __init__(self, n: int) -> None:
        self.n = n
        self._dir = tempfile.mkdtemp(prefix="aioproc-bench-")
        self.path = os.path.join(self._dir, "ready")
        os.mkfifo(self.path)
        self._rfd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        self._wfd = os.open(self.path, os.O_WRONLY)
        self.count = 0
        self._fut: asyncio.Future[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _drain(self) -> None:
        try:
            self.count += len(os.read(self._rfd, 65536))
        except BlockingIOError:
            return
        if self.count >= self.n and self._fut is not None and not self._fut.done():
            self._fut.set_result(None)

    async def wait(self, timeout: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._fut = self._loop.create_future()
        self._loop.add_reader(self._rfd, self._drain)
        try:
            self._drain()
            await asyncio.wait_for(self._fut, timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"only {self.count}/{self.n} workers ready") from None
        finally:
            self._loop.remove_reader(self._rfd)

    def wait_blocking(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(self._rfd, selectors.EVENT_READ)
            while self.count < self.n:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    raise TimeoutError(f"only {self.count}/{self.n} workers ready")
                self._drain()

    def close(self) -> None:
        os.close(self._rfd)
        os.close(self._wfd)
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> ReadyFifo:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
