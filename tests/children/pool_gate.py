"""A pool initializer that lets the first worker start and holds back every later one.

Standard library only; imported by reference in pool workers (the tests put
``tests/children`` on ``sys.path``).
"""

from __future__ import annotations

import os


def hold_replacements(marker: str, announce: str, release: str) -> None:
    """Pass on the first start; on any later one, announce this pid and wait.

    The first worker creates ``marker`` and returns.  A replacement writes
    ``"<pid>\\n"`` to the FIFO ``announce`` (the test holds it open, so the
    ``open`` never blocks) and then blocks reading one byte from the FIFO
    ``release``: the test knows a replacement is mid-start, and decides when
    (or whether) it finishes.
    """
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return
    except FileExistsError:
        pass
    fd = os.open(announce, os.O_WRONLY)
    try:
        os.write(fd, f"{os.getpid()}\n".encode())  # one small write: atomic on a pipe
    finally:
        os.close(fd)
    fd = os.open(release, os.O_RDONLY)
    try:
        os.read(fd, 1)
    finally:
        os.close(fd)
