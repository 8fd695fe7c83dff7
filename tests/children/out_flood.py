"""A worker that floods stdout: ``out_flood.py LINES WIDTH [READY_FIFO [READY_AFTER]]``.

Writes ``LINES`` numbered lines of ``WIDTH`` bytes (forever if LINES is 0) with
``os.write``.  With ``READY_FIFO``, writes one byte to that FIFO once
``READY_AFTER`` bytes (default 1 MiB) went out, so the test knows the
flood is under way.  Standard library only.
"""

from __future__ import annotations

import itertools
import os
import sys


def main() -> None:
    total = int(sys.argv[1])
    pad = b"." * (int(sys.argv[2]) - 9)
    fifo = sys.argv[3] if len(sys.argv) > 3 else ""
    ready_after = int(sys.argv[4]) if len(sys.argv) > 4 else 1 << 20
    written = 0
    batch = max(1, (64 << 10) // len(pad))
    numbers = itertools.count() if total == 0 else iter(range(total))
    while True:
        chunk = b"".join(b"%08d" % i + pad + b"\n" for i in itertools.islice(numbers, batch))
        if not chunk:
            return
        view = memoryview(chunk)
        while view:
            view = view[os.write(1, view) :]
        written += len(chunk)
        if fifo and written >= ready_after:
            fd = os.open(fifo, os.O_WRONLY)
            os.write(fd, b"r")
            os.close(fd)
            fifo = ""


if __name__ == "__main__":
    main()
