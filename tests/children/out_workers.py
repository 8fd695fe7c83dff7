"""Workers for the output tests (test_output_*.py, test_sinks.py, test_console.py); stdlib only.

Each function runs as a function worker (the test puts this directory on
``sys.path``, so a worker imports this module by name) and as a binary
worker: ``python out_workers.py <function> [args...]`` calls the function
with the arguments converted by its annotations (``int`` or ``str``).

Output goes through ``os.write`` on fds 1 and 2 (``_write``), so nothing
sits in a Python buffer when a worker exits abruptly.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time


def _write(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _announce(fifo: str) -> None:
    """One byte to ``fifo`` (the test holds it open, so ``open`` never blocks)."""
    fd = os.open(fifo, os.O_WRONLY)
    try:
        os.write(fd, b"r")
    finally:
        os.close(fd)


def _wait_fifo(fifo: str) -> None:
    """Block until the test writes a byte to ``fifo``."""
    fd = os.open(fifo, os.O_RDONLY)
    try:
        os.read(fd, 1)
    finally:
        os.close(fd)


def numbered(n: int, width: int = 20) -> bytes:
    """``n`` distinct lines ``line-<i>`` padded with dots to ``width`` bytes plus newline."""
    return b"".join(f"line-{i}".ljust(width, ".").encode() + b"\n" for i in range(n))


def echo(rank: int) -> None:
    """``out-<rank>`` on stdout, ``err-<rank>`` on stderr."""
    _write(1, f"out-{rank}\n".encode())
    _write(2, f"err-{rank}\n".encode())


def hexbytes(out_hex: str, err_hex: str = "") -> None:
    """Write exactly these bytes (hex-encoded) to stdout and stderr."""
    _write(1, bytes.fromhex(out_hex))
    if err_hex:
        _write(2, bytes.fromhex(err_hex))


def lines(n: int, tail: str = "") -> None:
    """``numbered(n)`` on stdout in one write, then ``tail`` without a newline."""
    _write(1, numbered(n) + tail.encode())


def lines_then_sigkill(n: int, tail: str = "") -> None:
    """``numbered(n)`` and ``tail`` (no newline) on stdout, then SIGKILL itself."""
    _write(1, numbered(n) + tail.encode())
    os.kill(os.getpid(), signal.SIGKILL)


def lines_then_block(n: int, fifo: str, tail: str = "") -> None:
    """Write ``numbered(n)`` and ``tail``, announce on ``fifo``, then wait to be stopped."""
    _write(1, numbered(n) + tail.encode())
    _announce(fifo)
    time.sleep(60)


def two_lines(go: str) -> None:
    """``first`` on stdout; once released on ``go``, ``second``."""
    _write(1, b"first\n")
    _wait_fifo(go)
    _write(1, b"second\n")


def fail_when_released(fifo: str) -> None:
    """Exit 3 once the test writes a byte to ``fifo``."""
    _wait_fifo(fifo)
    sys.exit(3)


def block_or_fail(rank: int, n: int, ready: str, go: str) -> None:
    """Rank 0 runs ``lines_then_block(n, ready, "tail")``; rank 1 exits 3 once released."""
    if rank == 0:
        lines_then_block(n, ready, "tail")
    else:
        fail_when_released(go)


def chunked(rank: int, n: int, block: int) -> None:
    """``n`` lines of varying length on stdout, written in ``block``-byte pieces."""
    data = rank_lines(rank, n)
    for i in range(0, len(data), block):
        _write(1, data[i : i + block])


def rank_lines(rank: int, n: int) -> bytes:
    """``r<rank>-<i>-`` followed by 0-299 filler bytes, for i < n, one per line."""
    return b"".join(f"r{rank}-{i}-".encode() + b"x" * (i * 7 % 300) + b"\n" for i in range(n))


def big_line(size: int) -> None:
    """One line of ``size`` bytes (a repeating pattern) and its newline."""
    pattern = b"0123456789abcdef"
    _write(1, (pattern * (size // len(pattern) + 1))[:size] + b"\n")


def progress(n: int, trailer: str = "", go: str = "") -> None:
    """``n`` updates ``\\rstep <i>`` of one stderr line, then its newline and ``trailer``.

    With ``go``, the newline waits for the test's go-ahead on that FIFO.
    """
    for i in range(n):
        _write(2, f"\rstep {i}".encode())
    if go:
        _wait_fifo(go)
    _write(2, b"\n" + trailer.encode())


def late_grandchild(go: str, done: str, detach: int) -> None:
    """Leave a grandchild holding stdout that writes ``late`` once released, then exit.

    The grandchild waits for a byte on ``go``, writes ``late`` to the
    inherited stdout, then announces on ``done``.  With ``detach`` it runs in
    a session of its own (out of the worker's process group).
    """
    script = f"head -c 1 '{go}' > /dev/null; echo late; echo d > '{done}'"
    subprocess.Popen(["sh", "-c", script], start_new_session=bool(detach), close_fds=True)
    _write(1, b"early\n")


def main() -> None:
    name, *args = sys.argv[1:]
    fn = globals()[name]
    hints = fn.__annotations__
    params = list(hints)[: len(args)]
    conv = [int if hints[p] == "int" else str for p in params]
    fn(*(c(a) for c, a in zip(conv, args, strict=True)))


if __name__ == "__main__":
    main()
