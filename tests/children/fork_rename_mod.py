"""A module to preload in the forkserver template: it names the process on import,
as ``setproctitle`` does."""

from __future__ import annotations

import os

NAME = "renamed-by-mod"

_fd = os.open("/proc/self/comm", os.O_WRONLY)
os.write(_fd, NAME.encode())
os.close(_fd)
