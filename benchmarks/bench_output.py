"""P4: the price of tee: 4 workers x 200k lines of 80 bytes through the parent.

Candidate: 4 binary workers (``python -c``, writing 80-byte lines in large
writes) with ``tee=Std.ALL``: every byte crosses a pipe into the parent,
which writes it to ``stdout.log`` and hands whole, prefixed lines to a
``ConsoleSink`` writing to ``/dev/null`` (and to a counting sink).
Baseline: the same workers with ``redirects=Std.ALL`` and no tee: the
children write straight to the log files and the parent sees nothing.

Both are timed from ``start_processes`` to the end of ``close()``, interleaved
(baseline, candidate, baseline, ...) in one event loop; figures are medians.
Every round checks that every line arrived: each ``stdout.log`` holds
exactly 200k lines, and (candidate) the sinks got 800k lines.

Parent CPU is ``RUSAGE_SELF`` user+sys over the round; parent threads are
the OS thread count (``/proc/self/status``) sampled at start, every 100k
lines the sinks receive (no polling), and at the end: its maximum.

Targets: wall <= 1.15x redirect-only; parent CPU <= 0.5 s; threads no more
than redirect-only.  ``--floor`` first measures the floors of the wall ratio
on this machine: the same writers teed by a bare hand-written protocol that
only copies each read to the log file (``copy``), and one that also writes
its lines to the console, prefixed as bytes in one pass (``prefixed``);
redirect-only, both floors and aioproc's tee run in the same rounds.

    python benchmarks/bench_output.py [--rounds N] [--loop asyncio|uvloop|both] [--floor]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, BinaryIO

from _util import LOOPS, Config, Row, Target, os_thread_count, run_on, uvloop_available

import aioproc
from aioproc import ConsoleSink, DefaultLogsSpecs, Sink, Std

N_WORKERS = 4
N_LINES = 200_000
LINE = b"x" * 79 + b"\n"  # 80 bytes with its newline
WAIT_TIMEOUT = 120.0

# A worker: N_LINES lines of 80 bytes to stdout in writes of 8192 lines (640 kB).
WRITER = (
    "import os, sys\n"
    "n = int(sys.argv[1]); block = 8192\n"
    f"line = {LINE!r}\n"
    "def put(data):\n"
    "    view = memoryview(data)\n"
    "    while view:\n"
    "        view = view[os.write(1, view):]\n"
    "chunk = line * block\n"
    "for _ in range(n // block):\n"
    "    put(chunk)\n"
    "put(line * (n % block))\n"
)


class CountingSink(Sink):
    """Counts lines and samples the parent's thread count every 100k lines.

    It takes text (``Sink.text``), as the console does, so it does not make
    the tee split lines the console does not need split.
    """

    SAMPLE_EVERY = 100_000

    def __init__(self) -> None:
        self.count = 0
        self.max_threads = os_thread_count()
        self._next_sample = self.SAMPLE_EVERY

    def lines(self, rank: int, stream: str, prefix: str, lines: list[str]) -> None:
        self._counted(len(lines))

    def text(self, rank: int, stream: str, prefix: str, text: str) -> None:
        # a run of lines of one width: counted from its length, so the count
        # costs the tee nothing (a scan for newlines would cost a fifth of it)
        lines, rest = divmod(len(text) + 1, len(LINE))
        if rest:
            raise AssertionError(f"P4: a run of {len(text)} characters is not whole lines")
        self._counted(lines)

    def _counted(self, n: int) -> None:
        self.count += n
        if self.count >= self._next_sample:
            self._next_sample += self.SAMPLE_EVERY
            self.max_threads = max(self.max_threads, os_thread_count())


def _cpu_self() -> float:
    me = resource.getrusage(resource.RUSAGE_SELF)
    return me.ru_utime + me.ru_stime


def _count_lines(path: str) -> int:
    count = 0
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            count += block.count(b"\n")
    return count


async def _one_round(tee: bool) -> dict[str, float]:
    """Run the 4 writers once; return wall, parent CPU and max threads of the round."""
    log_dir = tempfile.mkdtemp(prefix="aioproc-p4-")
    counter = CountingSink()
    try:
        with open(os.devnull, "w") as devnull:
            if tee:
                spec = DefaultLogsSpecs(log_dir=log_dir, tee=Std.ALL)
                sinks: list[Any] = [ConsoleSink(stream=devnull), counter]
            else:
                spec = DefaultLogsSpecs(log_dir=log_dir, redirects=Std.ALL)
                sinks = [ConsoleSink(stream=devnull)]
            threads = os_thread_count()
            cpu0 = _cpu_self()
            t0 = time.perf_counter()
            pc = await aioproc.start_processes(
                "p4",
                sys.executable,
                args={r: ("-c", WRITER, str(N_LINES)) for r in range(N_WORKERS)},
                envs={r: {} for r in range(N_WORKERS)},
                logs_specs=spec,
                sinks=sinks,
            )
            try:
                threads = max(threads, os_thread_count())
                result = await pc.wait(WAIT_TIMEOUT)
            finally:
                await pc.close()
            wall = time.perf_counter() - t0
            cpu = _cpu_self() - cpu0
            threads = max(threads, os_thread_count(), counter.max_threads)
        if result is None or result.is_failed():
            raise AssertionError(f"P4: writers failed or timed out: {result}")
        counts = {r: _count_lines(pc.stdouts[r]) for r in range(N_WORKERS)}
        if any(c != N_LINES for c in counts.values()):
            raise AssertionError(f"P4: stdout.log line counts {counts}, expected {N_LINES} each")
        if tee and counter.count != N_WORKERS * N_LINES:
            raise AssertionError(
                f"P4: the sinks got {counter.count} lines, expected {N_WORKERS * N_LINES}"
            )
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)
    return {"wall": wall, "cpu": cpu, "threads": float(threads)}


class _FloorTee(asyncio.Protocol):
    """The least a tee does: each read to the log file (``copy``), and (``prefixed``)
    its lines prefixed as bytes in one pass and written to the console in one
    call.  No decoding, no slicing, no budgets, no sink API."""

    def __init__(
        self, mode: str, log: BinaryIO, console: BinaryIO, done: asyncio.Future[None]
    ) -> None:
        self.mode, self.log, self.console, self.done = mode, log, console, done
        self.held = b""
        self.size = 0

    def data_received(self, data: bytes) -> None:
        self.log.write(data)
        self.size += len(data)  # fixed-width lines: bytes count them, at no cost
        if self.mode == "copy":
            return
        nl = data.rfind(b"\n")
        if nl < 0:
            self.held += data
            return
        block = self.held + data[:nl]
        self.held = data[nl + 1 :]
        self.console.write(b"[0]:" + block.replace(b"\n", b"\n[0]:") + b"\n")

    def connection_lost(self, exc: Exception | None) -> None:
        self.log.close()
        self.done.set_result(None)


FLOORS = ("copy", "prefixed")


async def _floor_round(mode: str) -> float:
    """The same 4 writers teed by ``_FloorTee`` (pipes grown to 1 MiB, as aioproc's): wall."""
    import fcntl
    import subprocess

    log_dir = tempfile.mkdtemp(prefix="aioproc-p4-floor-")
    loop = asyncio.get_running_loop()
    try:
        with open(os.devnull, "wb", buffering=0) as devnull:
            t0 = time.perf_counter()
            procs, tees = [], []
            for r in range(N_WORKERS):
                rd, wr = os.pipe()
                with contextlib.suppress(OSError):
                    fcntl.fcntl(rd, 1031, 1 << 20)  # F_SETPIPE_SZ
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-c", WRITER, str(N_LINES)], stdout=wr, close_fds=True
                    )
                )
                os.close(wr)
                done: asyncio.Future[None] = loop.create_future()
                log = open(os.path.join(log_dir, f"{r}.log"), "wb", buffering=0)  # noqa: SIM115
                tee = _FloorTee(mode, log, devnull, done)
                await loop.connect_read_pipe(lambda t=tee: t, open(rd, "rb", buffering=0))  # noqa: SIM115
                tees.append(tee)
            await asyncio.gather(*(t.done for t in tees))
            for p in procs:
                await asyncio.to_thread(p.wait)
            wall = time.perf_counter() - t0
        if any(t.size != N_LINES * len(LINE) for t in tees):
            raise AssertionError(f"P4 floor: {[t.size for t in tees]} bytes")
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)
    return wall


async def bench_floor(rounds: int) -> dict[str, float]:
    """P4's floors and aioproc's tee in the same rounds: median walls, keyed
    ``redirect``, each of ``FLOORS``, and ``aioproc``."""
    walls: dict[str, list[float]] = {k: [] for k in ("redirect", *FLOORS, "aioproc")}
    for i in range(1 + rounds):  # the first round warms up
        round_walls = {"redirect": (await _one_round(tee=False))["wall"]}
        for mode in FLOORS:
            round_walls[mode] = await _floor_round(mode)
        round_walls["aioproc"] = (await _one_round(tee=True))["wall"]
        if i:
            for k, v in round_walls.items():
                walls[k].append(v)
    return {k: statistics.median(v) for k, v in walls.items()}


async def bench_p4(rounds: int) -> list[dict[str, Any]]:
    """P4 on the running event loop: ``rounds`` interleaved rounds after one warm-up.

    Returns one dict per figure (wall, parent CPU, parent threads) with the
    keys ``bench, candidate, baseline, unit, ratio, target, passed, note``;
    times are in seconds (``unit == "s"``).  Raises ``AssertionError`` when a
    round loses a line.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds!r}")
    base: list[dict[str, float]] = []
    cand: list[dict[str, float]] = []
    for i in range(1 + rounds):
        b = await _one_round(tee=False)
        c = await _one_round(tee=True)
        if i:  # the first pair warms up (page cache, imports)
            base.append(b)
            cand.append(c)

    def med(samples: list[dict[str, float]], key: str) -> float:
        return statistics.median(s[key] for s in samples)

    size = f"{N_WORKERS} binary workers x {N_LINES // 1000}k lines x {len(LINE)} B"
    wall_b, wall_c = med(base, "wall"), med(cand, "wall")
    cpu_b, cpu_c = med(base, "cpu"), med(cand, "cpu")
    thr_b = max(s["threads"] for s in base)
    thr_c = max(s["threads"] for s in cand)
    return [
        {
            "bench": f"P4 tee=ALL wall, {size}",
            "candidate": wall_c,
            "baseline": wall_b,
            "unit": "s",
            "ratio": wall_c / wall_b,
            "target": "<= 1.15x",
            "passed": wall_c <= 1.15 * wall_b,
            "note": f"baseline: redirects=ALL, no tee; median of {rounds} rounds",
        },
        {
            "bench": "P4 tee=ALL parent CPU",
            "candidate": cpu_c,
            "baseline": cpu_b,
            "unit": "s",
            "ratio": cpu_c / cpu_b if cpu_b else float("inf"),
            "target": "<= 0.5 s",
            "passed": cpu_c <= 0.5,
            "note": "RUSAGE_SELF user+sys per round, start to close",
        },
        {
            "bench": "P4 tee=ALL parent OS threads (max)",
            "candidate": float(thr_c),
            "baseline": float(thr_b),
            "unit": "threads",
            "ratio": thr_c / thr_b,
            "target": "== baseline",
            "passed": thr_c <= thr_b,
            "note": "sampled at start, every 100k lines, at the end",
        },
    ]


_TARGETS = {
    "<= 1.15x": Target("ratio", 1.15),
    "<= 0.5 s": Target("max", 0.5, "ms"),
    "== baseline": Target("equal"),
}


def to_rows(loop: str, figures: list[dict[str, Any]]) -> list[Row]:
    """``bench_p4``'s dicts as ``_util.Row``s (times shown in ms) for the table."""
    rows = []
    for f in figures:
        unit = "ms" if f["unit"] == "s" else f["unit"]
        timed = f["bench"].startswith("P4 tee=ALL wall")
        rows.append(
            Row(
                f["bench"],
                loop,
                f["candidate"],
                f["baseline"],
                unit,
                _TARGETS.get(f["target"]),
                f["note"],
                timed=timed,
            )
        )
    return rows


def p4(cfg: Config) -> list[Row]:
    """``run_all`` entry: P4 on every configured loop (3 rounds in quick mode)."""
    rounds = min(cfg.rounds, 3) if cfg.quick else cfg.rounds
    rows: list[Row] = []
    for loop in cfg.loops:
        rows += to_rows(loop, run_on(loop, lambda: bench_p4(rounds)))
    return rows


def main(argv: list[str]) -> int:
    from _util import format_table

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--loop", choices=("asyncio", "uvloop", "both"), default="both")
    p.add_argument(
        "--floor", action="store_true", help="also the floors: bare hand-written tees (_FloorTee)"
    )
    args = p.parse_args(argv)
    loops = LOOPS if args.loop == "both" else (args.loop,)
    loops = tuple(x for x in loops if x != "uvloop" or uvloop_available())
    if args.floor:
        for loop in loops:
            w = run_on(loop, lambda: bench_floor(args.rounds))
            print(
                f"- {loop}, of redirect-only ({w['redirect'] * 1e3:.1f} ms), same rounds: "
                + ", ".join(f"{k} {w[k] / w['redirect']:.2f}x" for k in (*FLOORS, "aioproc"))
            )
    rows: list[Row] = []
    for loop in loops:
        rows += to_rows(loop, run_on(loop, lambda: bench_p4(args.rounds)))
    print(format_table(rows))
    return 0  # like run_all: a missed target is reported, not an error


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
