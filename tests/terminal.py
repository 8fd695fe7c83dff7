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
import sys
import termios
import time
from collections.abc import Mapping, Sequence
from typing import TypeAlias


class Terminal:
    """A minimal terminal: text, CR, LF and CSI A/B/F (up/down), J and K (erase).

    Other escapes (colours, cursor visibility) are ignored.  Every line ever
    written is kept (scrollback included), so the final screen is the whole
    transcript as a user would scroll through it.

    With ``columns``, text wraps as on xterm: a character written in the
    last column leaves the cursor there, and the next one goes to the start
    of the next line.  With ``lines``, the screen is the last ``lines`` rows:
    lines scrolled off its top are in the scrollback, where cursor movements
    cannot reach them any more (so a redraw cannot erase them either).
    Without them the terminal is unbounded both ways.
    """

    TOKEN = re.compile(r"\x1b\[([0-9;?]*)([@-~])|\x1b[@-_]|\r|\n|[^\x1b\r\n]+")

    def __init__(self, columns: int | None = None, lines: int | None = None) -> None:
        self.columns = columns
        self.lines = lines
        self.rows: list[list[str]] = [[]]
        self.row = 0
        self.col = 0
        self.top = 0  # the screen's first row; those above are scrollback
        self._wrap_next = False  # xterm's pending wrap after the last column

    def feed(self, text: str) -> None:
        for m in self.TOKEN.finditer(text):
            tok = m.group(0)
            if m.group(2):
                self._wrap_next = False
                self._csi(m.group(1), m.group(2))
            elif tok.startswith("\x1b"):
                continue
            elif tok == "\r":
                self.col = 0
                self._wrap_next = False
            elif tok == "\n":
                self._down(1)
                self.col = 0  # the pty's onlcr sends CR LF anyway
                self._wrap_next = False
            else:
                self._put(tok)

    def _down(self, n: int) -> None:
        self.row += n
        while len(self.rows) <= self.row:
            self.rows.append([])
        if self.lines is not None and self.row >= self.top + self.lines:
            self.top = self.row - self.lines + 1

    def _up(self, n: int) -> None:
        self.row = max(self.top, self.row - n)

    def _csi(self, params: str, final: str) -> None:
        n = int(params) if params.isdigit() else 1
        line = self.rows[self.row]
        if params.startswith("?"):
            return  # ESC[?25l / ESC[?25h: cursor visibility
        if final == "A":
            self._up(n)
        elif final == "B":
            self._down(n)
        elif final == "F":
            self._up(n)
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
        if self.columns is None:
            self._write(text)
            return
        while text:
            if self._wrap_next:
                self._down(1)
                self.col = 0
                self._wrap_next = False
            room = self.columns - self.col
            chunk, text = text[:room], text[room:]
            self._write(chunk)
            if self.col >= self.columns:
                self.col = self.columns - 1
                self._wrap_next = True

    def _write(self, text: str) -> None:
        line = self.rows[self.row]
        if len(line) < self.col:
            line += [" "] * (self.col - len(line))
        line[self.col : self.col + len(text)] = list(text)
        self.col += len(text)

    def screen(self) -> list[str]:
        """Every line, scrollback first, without trailing blanks."""
        lines = ["".join(r).rstrip() for r in self.rows]
        while lines and not lines[-1]:
            lines.pop()
        return lines

    def visible(self) -> list[str]:
        """The lines on the screen now (the last ``lines`` rows), as a user sees them."""
        return self.screen()[self.top :] if self.lines is not None else self.screen()


# Makes the pty the command's controlling terminal (as a shell does), so
# that typing Ctrl-C sends SIGINT to its process group and echoes "^C".
_WITH_CONTROLLING_TTY = (
    "import fcntl, os, sys, termios; fcntl.ioctl(0, termios.TIOCSCTTY, 0); "
    "os.execv(sys.argv[1], sys.argv[1:])"
)

Action: TypeAlias = "signal.Signals | bytes | None"


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
    steps = [signal_when] if signal_when is not None else []
    code, drawn, _ = run_steps_on_pty(
        argv, columns=columns, lines=lines, timeout=timeout, env=env, steps=steps
    )
    return code, drawn


def run_steps_on_pty(
    argv: list[str],
    *,
    columns: int = 120,
    lines: int = 40,
    timeout: float = 30,
    env: Mapping[str, str] | None = None,
    steps: Sequence[tuple[bytes, int, Action]] = (),
) -> tuple[int, bytes, list[int]]:
    """Run ``argv`` on a pseudo-terminal, taking ``steps`` as it draws.

    Returns the exit code, all it drew, and for each step taken the length
    of what had been drawn then (``Terminal.feed`` of that much is what the
    user saw at that moment).

    ``steps`` are taken in order: ``(pattern, n, action)`` waits until
    ``pattern`` has appeared ``n`` times in what was drawn since the
    previous step, then sends the signal, or types the bytes (``b"\\x03"``
    is Ctrl-C: the pty is then the command's controlling terminal, so the
    terminal sends SIGINT and echoes "^C", as a real one does), or, for
    ``None``, only marks the point.
    """
    steps = list(steps)
    if any(isinstance(action, bytes) for _, _, action in steps):
        argv = [sys.executable, "-c", _WITH_CONTROLLING_TTY, *argv]
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
    drawn = bytearray()
    marks: list[int] = []
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
            drawn += data
            while steps:
                pattern, n, action = steps[0]
                since = marks[-1] if marks else 0
                if len(re.findall(pattern, bytes(drawn[since:]))) < n:
                    break
                steps.pop(0)
                marks.append(len(drawn))
                if isinstance(action, bytes):
                    os.write(master, action)
                elif action is not None:
                    proc.send_signal(action)
        return proc.wait(timeout), bytes(drawn), marks
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
