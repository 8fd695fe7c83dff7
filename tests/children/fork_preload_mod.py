"""A module to preload in the forkserver template: records who imported it.

``IMPORT_PID`` is the pid of the process that ran this import; each import
also appends that pid to the file named by ``AIOPROC_TEST_IMPORT_LOG``.
"""

from __future__ import annotations

import os

IMPORT_PID = os.getpid()
_log = os.environ.get("AIOPROC_TEST_IMPORT_LOG")
if _log:
    fd = os.open(_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(fd, f"{IMPORT_PID}\n".encode())
    os.close(fd)
