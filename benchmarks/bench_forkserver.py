"""P1b and the forkserver's memory: function workers forked from a warm template.

P1b: ``cfg.p1_n`` function workers (``_workers.ret_rank``) started with
``start_method="forkserver"`` while ``open_forkserver()`` keeps the template
up, start -> all results; baseline: the same group spawned (P1's candidate).
The template's own start-up (an interpreter plus an empty preload) is its
own row, against one ``python -c pass``.  Scripts: 16 workers running a
600-line script (``aioproc run --start-method forkserver``'s workers), the
template up, against the same 16 ``python script.py`` spawned.

Memory: ``cfg.p1_n`` idle workers (each waits in ``time.sleep`` after saying
ready on a FIFO), spawn vs forkserver: the supervisor's RSS and the mean
PSS per worker (``/proc/<pid>/smaps_rollup``; forked workers share the
template's pages copy-on-write).  Reported once per loop, from one round.
"""

from __future__ import annotations

import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import _workers
from _util import Config, ReadyFifo, Row, Target, interleaved, rows_from, run_on
from bench_core import aioproc_functions, raw_concurrent

import aioproc


async def forked_functions(n: int) -> float:
    """P1b: ``n`` forked function workers, the template already up (not timed)."""
    async with aioproc.open_forkserver():
        t0 = time.perf_counter()
        pc = await aioproc.start_processes(
            "p1b",
            _workers.ret_rank,
            args={r: (r,) for r in range(n)},
            envs={r: {} for r in range(n)},
            start_method="forkserver",
        )
        try:
            result = await pc.wait()
            dt = time.perf_counter() - t0
        finally:
            await pc.close()
    assert result is not None
    if result.return_values != {r: r for r in range(n)}:
        raise AssertionError(f"P1b: wrong return values / failures: {result}")
    return dt


# The least a warm template can do for P1b: a Python process holding what
# aioproc's template holds (its module, its frozen heap), that forks ``n``
# children on one request; each writes its rank to a shared pipe and exits.
# No process group, payload, channel or function call per child.
_BARE_TEMPLATE = """\
import gc, os, signal, socket, sys
import aioproc._child.template
signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the children
gc.freeze()
ctl = socket.socket(fileno=int(sys.argv[1]))
out = int(sys.argv[2])
while request := ctl.recv(16):
    pids = []
    for rank in range(int(request)):
        pid = os.fork()
        if pid == 0:
            os.write(out, b"%d\\n" % rank)
            os._exit(0)
        pids.append(pid)
    ctl.sendall(" ".join(map(str, pids)).encode() + b"\\n")
"""


async def bare_forks(n: int) -> float:
    """P1b's floor: ``n`` bare forks from a warm template (up, not timed), start ->
    every rank's line read and every child gone (pidfds)."""
    loop = asyncio.get_running_loop()
    ours, theirs = socket.socketpair()
    read_fd, write_fd = os.pipe()
    template = subprocess.Popen(
        [sys.executable, "-c", _BARE_TEMPLATE, str(theirs.fileno()), str(write_fd)],
        pass_fds=(theirs.fileno(), write_fd),
        # this checkout's aioproc, as in the benchmarks' own processes (_util)
        env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(__file__))},
    )
    theirs.close()
    os.close(write_fd)
    ours.setblocking(False)
    os.set_blocking(read_fd, False)
    pidfds: list[int] = []
    try:
        await loop.sock_sendall(ours, b"0")  # up and serving: its answer is an empty line
        assert await loop.sock_recv(ours, 64) == b"\n"
        t0 = time.perf_counter()
        await loop.sock_sendall(ours, str(n).encode())
        answer = b""
        while not answer.endswith(b"\n"):
            answer += await loop.sock_recv(ours, 1 << 16)
        exits = []
        for pid in map(int, answer.split()):
            try:
                pidfds.append(os.pidfd_open(pid))
            except ProcessLookupError:
                continue  # gone already
            exited: asyncio.Future[None] = loop.create_future()
            loop.add_reader(pidfds[-1], _settle, exited)
            exits.append(exited)
        lines = b""
        while lines.count(b"\n") < n:
            readable: asyncio.Future[None] = loop.create_future()
            loop.add_reader(read_fd, _settle, readable)
            try:
                await readable
            finally:
                loop.remove_reader(read_fd)
            lines += os.read(read_fd, 1 << 16)
        await asyncio.gather(*exits)
        dt = time.perf_counter() - t0
    finally:
        for fd in pidfds:
            loop.remove_reader(fd)
            os.close(fd)
        os.close(read_fd)
        ours.close()
        template.wait()
    if sorted(map(int, lines.split())) != list(range(n)):
        raise AssertionError(f"P1b floor: wrong ranks {lines!r}")
    return dt


def _settle(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


SCRIPT_N = 16


def write_script(directory: str) -> str:
    """A 600-line script that defines functions and a class, then exits: what
    a worker pays to read and compile a training script before it runs."""
    lines = []
    for i in range(120):
        lines += [
            f"def f{i}(x, y=3, *args, **kw):",
            f"    # step {i}",
            "    z = [a * y for a in range(x) if a % 2]",
            f"    return {{'k{i}': z, 'n': len(args)}} | kw",
            "",
        ]
    lines += ["class Step:", "    def run(self):", "        return f1(3)", ""]
    path = os.path.join(directory, "script_600.py")
    with open(path, "w") as f:
        f.write("\n".join(lines))
    return path


async def forked_scripts(path: str, n: int) -> float:
    """``n`` workers running ``python path``, forked from a template already up."""
    async with aioproc.open_forkserver():
        t0 = time.perf_counter()
        result = await aioproc.run(sys.executable, n, (path,), start_method="forkserver")
        dt = time.perf_counter() - t0
    if result.return_values != dict.fromkeys(range(n)):
        raise AssertionError(f"P1b scripts: wrong results / failures: {result}")
    return dt


async def template_start() -> float:
    t0 = time.perf_counter()
    server = await aioproc.open_forkserver()
    dt = time.perf_counter() - t0
    await server.aclose()
    return dt


def p1b(cfg: Config) -> list[Row]:
    n = cfg.p1_n
    rows = rows_from(
        f"P1b {n} function workers, forkserver (template up): start -> all results",
        interleaved(
            cfg, lambda: aioproc_functions(_workers.ret_rank, n), lambda: forked_functions(n)
        ),
        Target("max", 0.15, "ms"),
        note=f"baseline: the same {n} workers spawned",
        cpu_note=True,
    )
    rows += rows_from(
        f"P1b {n} function workers against the floor: {n} bare forks from a warm template",
        interleaved(cfg, lambda: bare_forks(n), lambda: forked_functions(n)),
        None,
        note=f"baseline: a Python process holding the template's module forks {n} children "
        "that each write a line and exit; start -> lines read, children gone",
        cpu_note=True,
    )
    with tempfile.TemporaryDirectory(prefix="p1b-script-") as directory:
        script = write_script(directory)
        rows += rows_from(
            f"P1b {SCRIPT_N} workers running a 600-line script, forkserver (template up)",
            interleaved(
                cfg,
                lambda: raw_concurrent([sys.executable, script], SCRIPT_N),
                lambda: forked_scripts(script, SCRIPT_N),
            ),
            None,
            note=f"baseline: {SCRIPT_N} x `python script.py` spawned",
            cpu_note=True,
        )
    rows += rows_from(
        "P1b template start-up (no preload)",
        interleaved(cfg, lambda: raw_concurrent([sys.executable, "-c", "pass"], 1), template_start),
        None,
        note="baseline: 1 x `python -c pass`",
    )
    return rows


def _pss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1])
    raise RuntimeError(f"no Pss in /proc/{pid}/smaps_rollup")


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


async def _idle_memory(n: int, method: str) -> tuple[float, float]:
    """(supervisor RSS MiB, mean worker PSS MiB) with ``n`` idle workers."""
    ready = ReadyFifo(n)
    try:
        async with aioproc.start_processes(
            "mem",
            _workers.ready_then_sleep,
            args={r: (ready.path,) for r in range(n)},
            envs={r: {} for r in range(n)},
            start_method=method,
        ) as pc:
            await ready.wait(60)
            pss = [_pss_kib(pid) for pid in pc.pids().values()]
            rss = _rss_kib()
            await pc.close(timeout=5)
    finally:
        ready.close()
    return rss / 1024, statistics.mean(pss) / 1024


def memory(cfg: Config) -> list[Row]:
    n = cfg.p1_n
    rows = []
    for loop in cfg.loops:
        spawn = run_on(loop, lambda: _idle_memory(n, "spawn"))
        fork = run_on(loop, lambda: _idle_memory(n, "forkserver"))
        rows.append(
            Row(
                f"memory: supervisor RSS, {n} idle workers, forkserver vs spawn",
                loop,
                fork[0],
                spawn[0],
                "MiB",
                None,
                "one round",
                False,
            )
        )
        rows.append(
            Row(
                "memory: mean PSS per idle worker, forkserver vs spawn",
                loop,
                fork[1],
                spawn[1],
                "MiB",
                None,
                "one round",
                False,
            )
        )
    return rows
