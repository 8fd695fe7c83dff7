"""What a recorder's hook costs the launcher, enabled and disabled; what a scrape costs.

    python benchmarks/bench_metrics.py [--calls N] [--rounds N] [--groups]
    python benchmarks/bench_metrics.py --scrape [--rounds N] [--before REV]

Each case is one statement the launcher would run per event, timed over
``--calls`` executions by ``timeit``; the cost of the bare loop (``pass``)
is subtracted, so a figure is nanoseconds per statement.  Cases run
interleaved, round after round, and each figure is the median over rounds;
the ratio column divides it by the median cost of calling an empty function
with the same arguments, measured in the same rounds, so the figures carry
from one machine to another.

- ``empty function call``: the unit, ``empty(group, role, stream, 3, 120)``.
- ``disabled, guarded``: what the launcher pays while metrics are off:
  ``if rec.enabled: rec.output(...)`` on the default ``NullRecorder``.
- ``disabled, unguarded``: calling the no-op hook without the check.
- ``enabled ...``: the guarded hook on a ``Recorder``: ``output`` (two
  counters), ``worker_exited`` (a gauge and a counter), ``pool_call`` (a
  counter and a histogram), and ``output`` with a ``group_label`` mapping.

With ``--groups``, whole groups instead, metrics off against on, rounds
interleaved (ratios of medians; the target is under 1.05x):

- ``P2``: 256 ``/bin/true`` binary workers, start to all done;
- ``P6``: ``close()`` of 64 sleeping binary workers (SIGTERM, exits, reaps);
- ``tee``: 4 workers writing 50k lines each, tee'd to a sink.

With ``--scrape``, a page of 1,000 and of 10,000 running groups (running:
the expiry rule keeps all their series), scraped by a client in a process
of its own while a timer on the loop measures how late it fires (the
loop's longest hold, a 1 ms timer's worst lateness):

- ``idle``: no scrape; the machine's noise floor, the unit of the hold
  column's ratio;
- ``whole page, one callback``: what the server did before: the page
  rendered and encoded in the request's callback (this tree's text writer;
  with ``--before REV`` also REV's writer, loaded from git);
- ``served``: a real scrape of ``serve()``: rendered in slices, written as
  the socket takes it.

Render cost is the whole page rendered at once (``render()``), in ms; the
``served`` row gives the scrape's wall time instead.  Medians over rounds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import timeit

# run as a script: measure this checkout's aioproc, not an installed one
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from aioproc._metrics import hooks
from aioproc.metrics import Recorder


def empty(group: str, role: str, stream: str, lines: int, nbytes: int) -> None:
    """The unit every figure is divided by."""


OUTPUT = 'rec.output(g, r, "stdout", 3, 120)'
CASES = {
    "empty function call": ("empty(g, r, 'stdout', 3, 120)", None),
    "disabled, guarded": (f"if rec.enabled: {OUTPUT}", hooks.DEFAULT),
    "disabled, unguarded": (OUTPUT, hooks.DEFAULT),
    "enabled output": (f"if rec.enabled: {OUTPUT}", Recorder()),
    "enabled worker_exited": ('if rec.enabled: rec.worker_exited(g, r, "failed")', Recorder()),
    "enabled pool_call": ('if rec.enabled: rec.pool_call(g, "succeeded", 0.003)', Recorder()),
    "enabled output, group_label": (
        f"if rec.enabled: {OUTPUT}",
        Recorder(group_label=lambda name: name.rsplit("-", 1)[0]),
    ),
}


def measure(stmt: str, rec: hooks.NullRecorder | None, calls: int) -> float:
    """Nanoseconds per execution of ``stmt``, the bare loop's cost taken off."""
    names = {"empty": empty, "rec": rec, "g": "train-7", "r": "default"}
    loop = timeit.Timer("pass", globals=names).timeit(calls)
    total = timeit.Timer(stmt, globals=names).timeit(calls)
    return (total - loop) / calls * 1e9


TEE = (
    "import os\n"
    "chunk = b''.join(b'%08d ' % i + b'x' * 70 + b'\\n' for i in range(1000))\n"
    "for _ in range(50):\n"
    "    os.write(1, chunk)\n"
)


async def _p2() -> None:
    import aioproc

    result = await aioproc.run("/bin/true", 256, logs_specs=aioproc.DefaultLogsSpecs(os.devnull))
    assert not result.is_failed(), result.failures


async def _p6() -> float:
    import asyncio
    import time

    import aioproc

    pc = await aioproc.start_processes(
        "p6", "sleep", {r: ("60",) for r in range(64)}, {r: {} for r in range(64)},
        aioproc.DefaultLogsSpecs(os.devnull),
    )  # fmt: skip
    await asyncio.sleep(0.05)  # every sleep has exec'd: the close is what is timed
    t0 = time.perf_counter()
    await pc.close()
    return time.perf_counter() - t0


async def _tee() -> None:
    import aioproc

    lines = 0

    def count(record: object) -> None:
        nonlocal lines
        lines += 1

    specs = aioproc.DefaultLogsSpecs(os.devnull, tee=aioproc.Std.OUT)
    args = {r: ("-c", TEE) for r in range(4)}
    result = await aioproc.run(sys.executable, 4, args, logs_specs=specs, sinks=[count])
    assert not result.is_failed(), result.failures
    assert lines == 4 * 50_000, lines


def groups(rounds: int) -> None:
    """Each group benchmark with metrics off, then on, ``rounds`` times; medians."""
    import asyncio
    import time

    import aioproc.metrics

    async def timed(case: str) -> float:
        if case == "P6":
            return await _p6()
        t0 = time.perf_counter()
        await (_p2() if case == "P2" else _tee())
        return time.perf_counter() - t0

    cases = ("P2", "P6", "tee")
    figures: dict[tuple[str, bool], list[float]] = {(c, on): [] for c in cases for on in (0, 1)}
    for i in range(rounds + 1):  # the first round warms up
        for case in cases:
            for on in (False, True):
                if on:
                    aioproc.metrics.enable(aioproc.metrics.Recorder())
                try:
                    seconds = asyncio.run(timed(case))
                finally:
                    aioproc.metrics.disable()
                if i:
                    figures[case, on].append(seconds)
    print(f"{rounds} rounds, medians; load average {os.getloadavg()[0]:.1f}")
    print(f"{'case':6} {'off ms':>8} {'on ms':>8} {'on/off':>7}")
    for case in cases:
        off = statistics.median(figures[case, False])
        on = statistics.median(figures[case, True])
        print(f"{case:6} {off * 1e3:8.1f} {on * 1e3:8.1f} {on / off:7.3f}")


SCRAPER = """
import socket, sys, time
sys.stdin.readline()  # started before the measure: its fork is not the server's cost
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
t0 = time.perf_counter()
s.sendall(b"GET /metrics HTTP/1.1\\r\\nConnection: close\\r\\n\\r\\n")
n = 0
while True:
    chunk = s.recv(1 << 20)
    if not chunk:
        break
    n += len(chunk)
print(n, time.perf_counter() - t0, flush=True)
"""


def _running_groups(n: int) -> Recorder:
    rec = Recorder()
    for i in range(n):
        group = f"job-{i}"
        rec.group_queued(group, "default", 0.0)
        rec.worker_started(group, "default")
        rec.worker_started(group, "default")
        rec.group_started(group, "default", 0.05)
        rec.output(group, "default", "stdout", 10, 400)
        rec.output(group, "default", "stderr", 1, 40)
    return rec


def _old_writer(rev: str) -> object:
    """``aioproc/_metrics/text.py`` of ``rev``, loaded beside this tree's families."""
    import subprocess
    import types

    import aioproc._metrics.families  # noqa: F401  (the old writer imports it relatively)

    source = subprocess.run(
        ["git", "show", f"{rev}:aioproc/_metrics/text.py"],
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    module = types.ModuleType("aioproc._metrics._text_before")
    module.__package__ = "aioproc._metrics"
    exec(compile(source, f"{rev}:aioproc/_metrics/text.py", "exec"), module.__dict__)
    return module


async def _hold_during(action: object) -> tuple[float, float]:
    """(the loop's longest hold, the action's wall time) while ``action()`` is awaited."""
    import asyncio
    import time

    worst = 0.0
    done = False

    async def beat() -> None:
        nonlocal worst
        loop = asyncio.get_running_loop()
        while not done:
            due = loop.time() + 0.001
            await asyncio.sleep(0.001)
            worst = max(worst, loop.time() - due)

    beating = asyncio.ensure_future(beat())
    await asyncio.sleep(0.01)
    t0 = time.perf_counter()
    await action()  # type: ignore[operator]
    took = time.perf_counter() - t0
    done = True
    await beating
    return worst, took


def scrape(rounds: int, before: str | None) -> None:
    """The page's render cost and the loop's longest hold during a scrape; medians."""
    import asyncio
    import time

    import aioproc.metrics as metrics

    old = _old_writer(before) if before else None
    rows: dict[tuple[int, str], list[tuple[float, float]]] = {}

    async def one_round(rec: Recorder, n: int) -> None:
        loop = asyncio.get_running_loop()

        async def idle() -> None:
            await asyncio.sleep(0.3)

        async def whole(writer: object) -> None:
            def callback() -> None:
                writer.render(rec.registry.collect()).encode()  # type: ignore[attr-defined]

            loop.call_soon(callback)
            await asyncio.sleep(0)

        async def served() -> None:
            assert scraper.stdin is not None
            assert scraper.stdout is not None
            scraper.stdin.write(b"go\n")
            out = await scraper.stdout.readline()
            assert int(out.split()[0]) > 0

        from aioproc._metrics import text

        cases = {"idle": idle, "whole page, one callback": lambda: whole(text)}
        if old is not None:
            cases[f"whole page, one callback ({before}'s writer)"] = lambda: whole(old)
        async with metrics.serve(recorder=rec) as server:
            scraper = await asyncio.create_subprocess_exec(
                sys.executable, "-c", SCRAPER, str(server.port),
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            )  # fmt: skip
            cases["served (sliced)"] = served
            for name, action in cases.items():
                rows.setdefault((n, name), []).append(await _hold_during(action))
            await scraper.wait()

    for n in (1_000, 10_000):
        rec = _running_groups(n)
        size = len(metrics.render(rec))
        renders: dict[str, list[float]] = {"this tree": []}
        if old is not None:
            renders[f"{before}"] = []
        for i in range(rounds + 1):
            asyncio.run(one_round(rec, n))
            if i == 0:  # the first round warms up
                for key in [k for k in rows if k[0] == n]:
                    del rows[key]
            t0 = time.perf_counter()
            metrics.render(rec)
            renders["this tree"].append(time.perf_counter() - t0)
            if old is not None:
                t0 = time.perf_counter()
                old.render(rec.registry.collect())  # type: ignore[attr-defined]
                renders[f"{before}"].append(time.perf_counter() - t0)
        print(f"\n{n:,} running groups, page {size / 1e6:.1f} MB, {rounds} rounds, medians")
        for writer, values in renders.items():
            ms = statistics.median(values) * 1e3
            print(f"  render() whole page, {writer}'s writer: {ms:.0f} ms")
        idle_hold = statistics.median(h for h, _ in rows[n, "idle"])
        print(f"  {'case':44} {'hold ms':>8} {'x idle':>7} {'wall ms':>8}")
        for (size_n, name), values in rows.items():
            if size_n != n:
                continue
            hold = statistics.median(h for h, _ in values)
            wall = statistics.median(w for _, w in values)
            print(f"  {name:44} {hold * 1e3:8.1f} {hold / idle_hold:7.1f} {wall * 1e3:8.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--calls", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--groups", action="store_true", help="whole groups, metrics off vs on")
    parser.add_argument("--scrape", action="store_true", help="render cost and loop hold")
    parser.add_argument("--before", help="with --scrape: also time this git revision's writer")
    args = parser.parse_args()
    if args.groups:
        groups(args.rounds)
        return
    if args.scrape:
        scrape(args.rounds, args.before)
        return

    for stmt, rec in CASES.values():  # warm up: caches, the series' first insert
        measure(stmt, rec, 1000)
    figures: dict[str, list[float]] = {name: [] for name in CASES}
    for _ in range(args.rounds):
        for name, (stmt, rec) in CASES.items():
            figures[name].append(measure(stmt, rec, args.calls))

    unit = statistics.median(figures["empty function call"])
    python = f"{sys.implementation.name} {sys.version.split()[0]}"
    print(f"{python}, {args.calls} calls x {args.rounds} rounds, medians")
    print(f"{'case':32} {'ns/call':>8} {'x empty call':>13}")
    for name, values in figures.items():
        ns = statistics.median(values)
        print(f"{name:32} {ns:8.1f} {ns / unit:13.2f}")


if __name__ == "__main__":
    main()
