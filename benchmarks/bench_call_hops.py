"""Where a persistent worker's ``w.call(noop)`` round trip spends its time.

    python benchmarks/bench_call_hops.py [--calls N] [--rounds N] [--loop asyncio|uvloop|both]

A diagnosis, not a target check.  For each loop it measures, interleaved
round by round, a bare floor and aioproc:

- ``bare``: a 16-byte ping-pong over a socketpair between an event loop
  (a ``BufferedProtocol`` resolving one future per reply) and a forked child
  that waits in ``poll`` and answers with ``os.read``/``os.write``: two
  process wakeups and two loop iterations, no framing, no encoding.
- ``framed``: ``bare`` plus the least any framed call must do in Python on
  both sides: a 9-byte header built and parsed, the request
  ``("builtins", "int", (), {})`` marshalled and unmarshalled, the function
  looked up and called, its value marshalled back and unmarshalled.  The
  floor under ``aioproc`` for this design (Python at both ends).
- ``aioproc``: ``await w.call(int)`` on a persistent worker.
- ``script fn``: ``await w.call(f)`` of a no-op defined as in a script's
  ``__main__``: sent by value once, then called by id (the function cache).

Each runs three times: where the kernel puts the two processes (``free``),
both pinned to CPU 0 (``one CPU``) and pinned to CPUs 0 and 1
(``two CPUs``).  The pinning only tells the placements apart; aioproc never
pins anything.  Per placement: the median round trip, the caller's CPU time
per call (median of ``time.thread_time`` around each call: encoding, the
loop, the syscalls) and the worker's CPU time per call (from
``/proc/<pid>/schedstat``, over all calls).  Figures are medians over
rounds.  What aioproc adds is its row minus the bare row of the same
placement; what the placement adds is the ``two CPUs`` row minus the
``one CPU`` row (on a VM: waking an idle vCPU, once in each direction).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import marshal
import os
import select
import socket
import statistics
import struct
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

# run as a script: measure this checkout's aioproc, not an installed one
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _util

import aioproc

PLACEMENTS = ("free", "one CPU", "two CPUs")
WARMUP_CALLS = 100


def _cpu_ns(pid: int) -> int:
    """CPU time ``pid`` has run, in ns (first field of ``/proc/<pid>/schedstat``)."""
    with open(f"/proc/{pid}/schedstat") as f:
        return int(f.read().split()[0])


_ALLOWED = os.sched_getaffinity(0)


def _place(placement: str, child: int) -> None:
    if placement == "free":
        return
    first, second = sorted(_ALLOWED)[:2]
    os.sched_setaffinity(0, {first})
    os.sched_setaffinity(child, {first} if placement == "one CPU" else {second})


def _unpin() -> None:
    os.sched_setaffinity(0, _ALLOWED)


async def _timed(one: Callable[[], Awaitable[Any]], child: int, n: int) -> tuple[float, ...]:
    """(median wall us, median caller CPU us, worker CPU us per call)."""
    for _ in range(WARMUP_CALLS):
        await one()
    wall, cpu = [], []
    worker0 = _cpu_ns(child)
    for _ in range(n):
        c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
        await one()
        wall.append(time.perf_counter_ns() - t0)
        cpu.append(time.thread_time_ns() - c0)
    worker = (_cpu_ns(child) - worker0) / n
    return statistics.median(wall) / 1e3, statistics.median(cpu) / 1e3, worker / 1e3


class _Echo(asyncio.BufferedProtocol):
    def __init__(self) -> None:
        self.buf = bytearray(1 << 16)
        self.reply: asyncio.Future[int] | None = None

    def get_buffer(self, sizehint: int) -> bytearray:
        return self.buf

    def buffer_updated(self, nbytes: int) -> None:
        assert self.reply is not None
        self.reply.set_result(nbytes)


def _echo_child(fd: int) -> None:
    # waits in poll() like aioproc's worker (see _child.boot._serve)
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    while poller.poll() and (data := os.read(fd, 1 << 16)):
        os.write(fd, data)
    os._exit(0)


async def bare(placement: str, n: int) -> tuple[float, ...]:
    parent, child_end = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        parent.close()
        _echo_child(child_end.fileno())
    child_end.close()
    loop = asyncio.get_running_loop()
    transport, proto = await loop.connect_accepted_socket(_Echo, parent)

    async def one() -> None:
        proto.reply = loop.create_future()
        transport.write(b"x" * 16)
        await proto.reply

    try:
        _place(placement, pid)
        return await _timed(one, pid, n)
    finally:
        _unpin()
        transport.close()  # the child sees EOF and exits
        await loop.run_in_executor(None, os.waitpid, pid, 0)


def _script_noop() -> Callable[[], None]:
    """A no-op defined as a script defines its functions (``__module__`` is ``__main__``)."""
    namespace: dict[str, Any] = {"__name__": "__main__"}
    exec("def noop():\n    pass\n", namespace)
    fn: Callable[[], None] = namespace["noop"]
    return fn


SCRIPT_NOOP = _script_noop()


class _Framed(asyncio.BufferedProtocol):
    def __init__(self) -> None:
        self.buf = bytearray(1 << 16)
        self.reply: asyncio.Future[Any] | None = None

    def get_buffer(self, sizehint: int) -> bytearray:
        return self.buf

    def buffer_updated(self, nbytes: int) -> None:
        assert self.reply is not None
        kind, length = _HEADER.unpack_from(self.buf)
        assert kind == 10
        assert length == nbytes - _HEADER.size
        self.reply.set_result(marshal.loads(memoryview(self.buf)[_HEADER.size : nbytes]))


_HEADER = struct.Struct(">BQ")


def _framed_child(fd: int) -> None:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    while poller.poll() and (data := os.read(fd, 1 << 16)):
        module, qualname, args, kwargs = marshal.loads(memoryview(data)[9:])
        value = getattr(sys.modules[module], qualname)(*args, **kwargs)
        out = marshal.dumps(value)
        os.write(fd, b"".join((b"\n", len(out).to_bytes(8, "big"), out)))
    os._exit(0)


async def framed(placement: str, n: int) -> tuple[float, ...]:
    parent, child_end = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        parent.close()
        _framed_child(child_end.fileno())
    child_end.close()
    loop = asyncio.get_running_loop()
    transport, proto = await loop.connect_accepted_socket(_Framed, parent)

    async def one() -> None:
        proto.reply = loop.create_future()
        body = marshal.dumps(("builtins", "int", (), {}))
        transport.write(_HEADER.pack(2, len(body)) + body)
        await proto.reply

    try:
        _place(placement, pid)
        return await _timed(one, pid, n)
    finally:
        _unpin()
        transport.close()  # the child sees EOF and exits
        await loop.run_in_executor(None, os.waitpid, pid, 0)


async def worker(placement: str, n: int, fn: Callable[[], Any] = int) -> tuple[float, ...]:
    async with aioproc.open_worker(name="hops") as w:

        async def one() -> None:
            await w.call(fn)

        try:
            _place(placement, w.pid)
            return await _timed(one, w.pid, n)
        finally:
            _unpin()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=2000, help="calls per measurement")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--loop", choices=("asyncio", "uvloop", "both"), default="both")
    args = p.parse_args(argv[1:])
    if args.calls < 1 or args.rounds < 1:
        p.error("--calls and --rounds must be >= 1")
    loops = _util.LOOPS if args.loop == "both" else (args.loop,)
    loops = tuple(x for x in loops if x != "uvloop" or _util.uvloop_available())
    placements = PLACEMENTS if len(_ALLOWED) >= 2 else PLACEMENTS[:1]
    got: dict[tuple[str, str, str], list[tuple[float, ...]]] = {}
    for _ in range(args.rounds):
        for loop in loops:
            for placement in placements:
                for name, fn in (
                    ("bare", bare),
                    ("framed", framed),
                    ("aioproc", worker),
                    ("script fn", functools.partial(worker, fn=SCRIPT_NOOP)),
                ):
                    key = (loop, placement, name)
                    sample = _util.run_on(loop, lambda f=fn, pl=placement: f(pl, args.calls))
                    got.setdefault(key, []).append(sample)
    print(f"- {args.calls} calls x {args.rounds} rounds; medians over rounds; times in us")
    print()
    print("| loop | placement | what | round trip | caller CPU/call | worker CPU/call |")
    print("|---|---|---|---|---|---|")
    for (loop, placement, name), samples in got.items():
        wall, caller, child = (statistics.median(s[i] for s in samples) for i in range(3))
        print(f"| {loop} | {placement} | {name} | {wall:.1f} | {caller:.1f} | {child:.1f} |")
    print()
    load = os.getloadavg()[0]
    print(f"- python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load average {load:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
