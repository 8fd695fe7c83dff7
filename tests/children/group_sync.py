"""Sync worker functions for test_coroutine_groups.py: the references coroutine
workers are compared with (standard library only, importing nothing else)."""

from __future__ import annotations

import os
import sys
import time

COROUTINE_MODULES = ("asyncio", "aioproc._child.aio", "uvloop", "inspect", "concurrent.futures")


def loaded_modules() -> list[str]:
    """Which of the modules a coroutine worker needs this sync worker has loaded."""
    return [name for name in COROUTINE_MODULES if name in sys.modules]


def sleep(fifo: str) -> None:
    """Say "ready <pid>" on ``fifo``, then sleep 60 s (stopped by a signal)."""
    with open(fifo, "w") as f:
        f.write(f"ready {os.getpid()}\n")
    time.sleep(60)
