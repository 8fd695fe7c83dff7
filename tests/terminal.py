"""Test infrastructure for what a user sees on a terminal.

``Terminal`` is a minimal emulator (enough for prefixed lines, progress bars
redrawn in place and rich's live view); ``run_on_pty`` runs a command whose
stdin/stdout/stderr is a pseudo-terminal and returns all it drew.
"""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import signal
import struct
import subprocess
import termios
import time
from collections.abc import Mapping


class Terminal:
    """A minimal terminal: text, CR, LF and CSI A/B/F (up/down), J and K (erase).

    Other escapes (colours, cursor visibility) are ignored.  Every line ever
    written is kept (scrollback included), so the final screen is the whole
    transcript as a user would scroll through it.
    """

    TOKEN = re.compile(r"\x1b\[([0-9;?]*)([@-~])|\x1b[@-_]|\r|\n|[^\x1b\r\n]+")

    def __init__(self) -> None:
        self.rows: list[list[str]] = [[]]
        self.row = 0
        self.col = 0

    def feed(self, text: str) -> None:
        for m in self.TOKEN.finditer(text):
            tok = m.group(0)
            if m.group(2):
                self._csi(m.group(1), m.group(2))
            elif tok.startswith("\x1b"):
                continue
            elif tok == "\r":
                self.col = 0
            elif tok == "\n":
                self._down(1)
                self.col = 0  # the pty's onlcr sends CR LF anyway
            else:
                self._put(tok)

    def _down(self, n: int) -> None:
        self.row += n
        while len(self.rows) <= self.row:
            self.rows.append([])

    def _csi(self, params: str, final: str) -> None:
        n = int(params) if params.isdigit() else 1
        line = self.rows[self.row]
        if params.startswith("?"):
            return  # ESC[?25l / ESC[?25h: cursor visibility
        if final == "A":
            self.row = max(0, self.row - n)
        elif final == "B":
            self._down(n)
        elif final == "F":
            self.row = max(0, self.row - n)
            self.col = 0
        elif final == "J" and params in ("", "0"):
            del line[self.col :]
            del self.rows[self.row + 1 :]
        elif final == "K" and params in ("", "0"):
            del line[self.col :]
        elif final == "K" and params == "1":
            line[: self.col] = [" "] * min(self.col, len(line))
        elif final == "K" and params == "2":
            line.clear()

    def _put(self, text: str) -> None:
        line = self.rows[self.row]
        if len(line) < self.col:
            line += [" "] * (self.col - len(line))
        line[self.col : self.col + len(text)] = list(text)
        self.col += len(text)

    def screen(self) -> list[str]:
        lines = ["".join(r).rstrip() for r in self.rows]
        while lines and not lines[-1]:
            lines.pop()
        return lines


def run_on_pty(
    argv: list[str],
    *,
    columns: int = 120,
    lines: int = 40,
    timeout: float = 30,
    env: Mapping[str, str] | None = None,
    signal_when: tuple[bytes, int, signal.Signals] | None = None,
) -> tuple[int, bytes]:
    """Run ``argv`` on a pseudo-terminal of ``columns`` x ``lines``: exit code, all it drew.

    ``signal_when=(pattern, n, sig)`` sends ``sig`` to the command once
    ``pattern`` has appeared ``n`` times in what it drew.
    """
    master, slave = pty.openpty()
    try:
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", lines, columns, 0, 0))
        full_env = dict(os.environ if env is None else env)
        full_env.update(COLUMNS=str(columns), LINES=str(lines))
        full_env.setdefault("TERM", "xterm")
        proc = subprocess.Popen(
            argv, stdin=slave, stdout=slave, stderr=slave, env=full_env, start_new_session=True
        )
    except BaseException:
        os.close(master)
        raise
    finally:
        os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([master], [], [], left)[0]:
                raise TimeoutError(f"{argv} still drawing after {timeout} s")
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every slave fd is closed
                break
            if not data:
                break
            chunks.append(data)
            if signal_when is not None:
                pattern, n, sig = signal_when
                if len(re.findall(pattern, b"".join(chunks))) >= n:
                    proc.send_signal(sig)
                    signal_when = None
        return proc.wait(timeout), b"".join(chunks)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
