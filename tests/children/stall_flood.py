"""A worker for tests/test_output_stall.py; standard library only.

    stall_flood.py N    N numbered lines of 1000 bytes (newline included) on stdout

Written with ``os.write`` so nothing waits in a Python buffer: once its
reader stops reading, the worker blocks in ``write`` on its full pipe.
"""

from __future__ import annotations

import os
import sys

WIDTH = 1000


def line(i: int) -> bytes:
    """Line ``i``: its number, padded with dots to ``WIDTH`` bytes with the newline."""
    return f"{i:08d}".ljust(WIDTH - 1, ".").encode() + b"\n"


def main() -> None:
    for i in range(int(sys.argv[1])):
        view = memoryview(line(i))
        while view:
            view = view[os.write(1, view) :]


if __name__ == "__main__":
    main()
