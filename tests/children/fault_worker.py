"""Workers for the fault-injection and core-edge tests; standard library only.

As a function-worker module (imported by name from ``tests/children``):
``fn_worker(report, gate)`` starts a ``sleep 1000`` grandchild in its own
process group, appends "<worker pid> <grandchild pid>" to ``report`` and
then blocks; given a ``gate`` (a FIFO), it instead waits for one byte on it
and then writes lines to stdout as fast as it can.  ``answer()`` returns 42.

The ``SH_*`` scripts are binary workers run by ``/bin/sh -c``.

As a binary worker, ``python fault_worker.py <mode> ...``:

- ``flush-leader <fifo> <done>``: starts a ``flusher`` grandchild in its own
  group, waits for it to be ready, writes "<pid> <grandchild pid>" to
  ``<fifo>`` and blocks; SIGTERM ends it at once (default action).
- ``flusher <done>``: traps SIGTERM, prints "ready"; on SIGTERM it takes
  ``FLUSH_SECONDS`` to "flush" (simulated work), then writes ``<done>``.
- ``slow-exit <fifo>``: reports "<pid> 0" on ``<fifo>``; on SIGTERM it takes
  ``SLOW_EXIT_SECONDS`` before exiting 0.

A report is one ``write`` of one short line in append mode, so lines from
many workers never interleave.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

MARK_VAR = "AIOPROC_FAULT_MARK"
"""Environment variable every worker of a fault test carries (found in /proc/*/environ)."""
SH_WORKER = 'sleep 1000 & echo "$$ $!" >> "$1"; wait'
"""A binary worker: ``/bin/sh -c SH_WORKER fault <report>`` starts a grandchild,
reports both pids and waits (SIGTERM ends the shell and, via the group, the sleep)."""
SH_STUBBORN = 'trap "" TERM; sleep 1000 & echo "$$ $!" >> "$1"; wait'
"""Like ``SH_WORKER``, but the shell and its sleep ignore SIGTERM: only SIGKILL ends them."""
SH_CHATTY = (
    'sleep 1000 & echo "$$ $!" >> "$1"; '
    'dd bs=1 count=1 if="$2" of=/dev/null 2>/dev/null; '  # wait for the test's go
    'exec yes "fault-injection chatter $$"'
)
"""Like ``SH_WORKER``, then it waits for a byte on the FIFO ``$2`` and floods stdout."""
FLUSH_SECONDS = 1.0
SLOW_EXIT_SECONDS = 0.5
CHATTY_LINE = "fault-injection chatter " + "x" * 100 + "\n"


def report_line(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def read_byte(path: str) -> None:
    """Block until one byte can be read from the FIFO ``path`` (a gate the test opens)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.read(fd, 1)
    finally:
        os.close(fd)


def fn_worker(report: str, gate: str = "") -> None:
    """Function worker: start a grandchild, report both pids, then block or chatter."""
    sleeper = subprocess.Popen(["sleep", "1000"])
    report_line(report, f"{os.getpid()} {sleeper.pid}\n")
    if gate:
        read_byte(gate)
        block = CHATTY_LINE * 64
        while True:
            sys.stdout.write(block)
    while True:
        signal.pause()


def answer() -> int:
    """Function worker that returns at once."""
    return 42


def _block_sigterm() -> None:
    """Block SIGTERM, to be taken with ``sigwait``: a second SIGTERM (two close()
    calls) then stays pending instead of interrupting the work the first one started."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})


def flush_leader(fifo: str, done: str) -> None:
    child = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "flusher", done], stdout=subprocess.PIPE
    )
    assert child.stdout is not None
    if child.stdout.readline() != b"ready\n":
        sys.exit("flusher did not get ready")
    child.stdout.close()
    report_line(fifo, f"{os.getpid()} {child.pid}\n")
    while True:
        signal.pause()


def flusher(done: str) -> None:
    _block_sigterm()
    print("ready", flush=True)
    signal.sigwait({signal.SIGTERM})
    time.sleep(FLUSH_SECONDS)  # the work a real helper would flush before exiting
    report_line(done, "flushed\n")


def slow_exit(fifo: str) -> None:
    _block_sigterm()
    report_line(fifo, f"{os.getpid()} 0\n")
    signal.sigwait({signal.SIGTERM})
    time.sleep(SLOW_EXIT_SECONDS)  # a worker that needs a moment to shut down


if __name__ == "__main__":
    mode, rest = sys.argv[1], sys.argv[2:]
    if mode == "flush-leader":
        flush_leader(*rest)
    elif mode == "flusher":
        flusher(*rest)
    elif mode == "slow-exit":
        slow_exit(*rest)
    else:
        sys.exit(f"unknown mode {mode!r}")
