"""A module to preload in the forkserver template: starts a child process on import.

As a library that starts a helper server would.  The child (a ``sleep``)
stays in the template's process group; its pid is appended to the file
named by ``AIOPROC_TEST_SPAWN_LOG``.
"""

from __future__ import annotations

import os
import subprocess

HELPER = subprocess.Popen(["sleep", "1000"], stdin=subprocess.DEVNULL)
_log = os.environ.get("AIOPROC_TEST_SPAWN_LOG")
if _log:
    fd = os.open(_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(fd, f"{HELPER.pid}\n".encode())
    os.close(fd)
