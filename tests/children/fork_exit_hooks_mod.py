"""A preload module with exit hooks, to check whose hooks a forked worker runs.

At import (in the template) it registers an atexit handler and a
``weakref.finalize`` callback that would each append a line naming the
process to ``AIOPROC_TEST_EXIT_LOG`` when they run.
"""

from __future__ import annotations

import atexit
import os
import weakref

_LOG = os.environ.get("AIOPROC_TEST_EXIT_LOG", "")


def note(what: str) -> None:
    if _LOG:
        fd = os.open(_LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.write(fd, f"{what} {os.getpid()}\n".encode())
        os.close(fd)


class _Held:
    pass


HELD = _Held()
atexit.register(note, "template-atexit")
weakref.finalize(HELD, note, "template-finalize")
