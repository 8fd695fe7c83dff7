"""Worker functions for tests/test_template_faults.py (standard library only).

Imported by name in the workers: the test puts this directory on ``sys.path``.
"""

from __future__ import annotations

import os
import time


def report_and_block(report: str) -> None:
    """Append "<my pid> 0" to ``report`` (user code ran), then block until killed."""
    fd = os.open(report, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{os.getpid()} 0\n".encode())
    finally:
        os.close(fd)
    time.sleep(1000)


def ident(x: object) -> tuple[object, int, int]:
    """``(x, my pid, my parent's pid)``."""
    return x, os.getpid(), os.getppid()


def thread_vars(module: str) -> tuple[dict[str, str | None], dict[str, str | None]]:
    """``(the thread variables the template saw while importing module, this worker's own)``."""
    mod = __import__(module)
    return mod.SEEN, {var: os.environ.get(var) for var in mod.SEEN}
