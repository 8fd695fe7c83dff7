"""Kill every worker group when the supervisor dies abruptly (even by SIGKILL).

A worker killed with its supervisor is not enough: its own children live on,
reparented.  So each process group gets a guardian: a tiny ``/bin/sh`` in a
session of its own, holding the read end of a pipe whose write end only the
supervisor has.  The supervisor writes the id of every group it creates;
when the supervisor closes the group normally it writes ``done`` and the
guardian exits without touching anything.  If the supervisor dies first,
the kernel closes the pipe, the guardian reads EOF and SIGKILLs every group
it was told about.  A shell costs about a millisecond to start, far less
than a second Python interpreter.
"""

from __future__ import annotations

import asyncio
import os
import subprocess

from ._spawn import ExitWatcher

_SCRIPT = """\
trap '' HUP INT TERM QUIT PIPE
groups=
while IFS= read -r line; do
  case $line in
    done) exit 0 ;;
    *) groups="$groups $line" ;;
  esac
done
for g in $groups; do kill -s KILL -- "-$g" 2>/dev/null; done
"""

SHELL = "/bin/sh"


class Guardian:
    """The supervisor's side of one guardian process."""

    def __init__(self) -> None:
        read_fd, self._write_fd = os.pipe()
        try:
            self._popen = subprocess.Popen(
                [SHELL, "-c", _SCRIPT],
                stdin=read_fd,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
                close_fds=True,
            )
        except BaseException:
            os.close(self._write_fd)
            raise
        finally:
            os.close(read_fd)
        self._watcher = ExitWatcher(self._popen)

    @property
    def pid(self) -> int:
        return self._popen.pid

    def watch(self, pgid: int) -> None:
        """Tell the guardian about a new process group."""
        self._write(f"{pgid}\n")

    def _write(self, text: str) -> None:
        if self._write_fd < 0:
            return
        try:
            os.write(self._write_fd, text.encode())
        except OSError:
            pass  # guardian gone (killed from outside); the workers still get closed

    async def aclose(self) -> None:
        """Dismiss the guardian (the groups are already stopped) and reap it."""
        self._write("done\n")
        if self._write_fd >= 0:
            os.close(self._write_fd)
            self._write_fd = -1
        try:
            await asyncio.wait_for(asyncio.shield(self._watcher.future), 5)
        except asyncio.TimeoutError:
            self._popen.kill()
            await asyncio.shield(self._watcher.future)
