"""The live view of ``aioproc run`` on a terminal (needs ``rich``).

A table with one row per local rank (pid, state, uptime, restarts, CPU and
memory, and the rank's last line or progress-bar state) stays at the bottom of the terminal
while the workers' prefixed lines scroll above it.  The view takes at most
half of the terminal's lines: with more ranks than fit, it shows one
compact row per state instead ("running  22 ranks 0-3,5-22 ..."), so the
workers' lines stay visible; the full table is drawn once, at the end.
A Ctrl-C must not leave a stale copy of the view in the scrollback.  Two
things would: the terminal discards output not yet displayed when it sends
SIGINT (half a redraw lost, so the next one starts from the wrong line),
which ``NOFLSH`` turns off while the view is live; and it echoes ``^C`` at
the cursor, so the view ends with an empty line where the cursor waits and
the echo is erased by the next redraw instead of wrapping below the view.

How it works: ``LiveView`` is both a sink (the agent's output readers hand
it whole lines and progress updates) and an agent event callback (starts,
exits, restarts).  Everything runs on the event loop thread.  The table is
drawn by ``rich.live.Live`` with ``auto_refresh=False``: no refresh thread;
the view itself is the renderable and builds the table each time it is
drawn.  Lines are queued and printed with one ``Console.print`` per flush,
which rich follows with the table redrawn below them; the lines themselves
skip rich's text layout (``_Lines``), so a chatty worker costs little more
than with plain output.  Flushes are coalesced to at most one per
``interval``; while a worker runs, a one-second timer redraws the uptimes.
``rich`` is imported by this module only, and only the CLI imports it.

CPU and memory figures are a periodic sample, the one thing here that is
not an event: at each tick of that one-second timer (and only while the
view is shown and a worker runs), the view reads each running rank's
``/proc`` figures (``_limits.usage.sample``: its user and system time and
resident set, as the ``"sampled"`` events carry them), and shows
``cpu 97% rss 212M``: the CPU used since the last sample over the time
between them (100% is one CPU), and the resident set
now.  Two small reads of the kernel's in-memory files per rank per second
cost the loop microseconds; ``sample_usage=False`` turns them off.  They
are figures to watch, never a state anything waits on.  A rank's final
figures come from its reap instead (``aioproc.Usage``): the final table
shows each rank's CPU time and largest resident set, and ``oom`` as the
state of a rank the kernel's OOM killer ended.
"""

from __future__ import annotations

import asyncio
import os
import sys
import termios
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, TextIO, TypeAlias

from rich.console import Console, ConsoleOptions, Group, RenderResult
from rich.live import Live
from rich.segment import Segment
from rich.style import Style
from rich.table import Table
from rich.text import Text

from .._limits.usage import sample
from ..agent import AgentEvent
from ..agent import events as ev
from ..logs import DefaultLogsSpecs, LogsDest
from ..results import Usage
from ..sinks import Sink

__all__ = ["LiveLogsSpecs", "LiveView"]

_PREFIX_STYLES = tuple(
    Style.parse(name)
    for name in ("cyan", "magenta", "green", "blue", "yellow", "bright_cyan", "bright_magenta")
)

# A queued line: a note of ours, or (prefix, prefix style, the worker's line).
_Pending: TypeAlias = "Text | tuple[str, Style, str]"


class LiveLogsSpecs(DefaultLogsSpecs):
    """``DefaultLogsSpecs`` that routes console streams through the sinks.

    A stream that torchrun would leave on the console (not redirected, not
    tee'd) is tee'd to ``os.devnull`` instead: its lines reach the live view,
    which prints them prefixed above the table, and no log file is made for
    it.  Redirected and tee'd streams, and ranks filtered out by
    ``local_ranks_filter``, are laid out exactly as by ``DefaultLogsSpecs``.
    """

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        dest = super().reify(envs)
        shown = self.local_ranks_filter
        for rank in range(len(envs)):
            if shown and rank not in shown:
                continue
            for paths, tees in (
                (dest.stdouts, dest.tee_stdouts),
                (dest.stderrs, dest.tee_stderrs),
            ):
                if paths.get(rank, "") == "":  # "" is the console
                    paths[rank] = os.devnull
                    tees[rank] = os.devnull
        return dest


@dataclass
class _Row:
    pid: int | None = None
    state: str = "starting"
    style: str = "dim"
    started: float | None = None  # time.monotonic()
    ended: float | None = None
    restarts: int = 0
    last: str = ""
    status: str | None = None
    updated: float = 0.0  # time.monotonic() of the last line or status
    usage: str = ""  # "cpu 97% rss 212M" while it runs; its final figures once reaped
    cpu_time: float = 0.0  # the last sample's user + system time, in seconds
    sampled: float | None = None  # time.monotonic() of the last sample

    @property
    def running(self) -> bool:
        return self.started is not None and self.ended is None


class LiveView(Sink):
    """Worker table at the bottom of the terminal, worker lines above it.

    Args:
        role: the workers' role (shown in the header).
        nprocs: the number of local ranks (one row each).
        max_restarts: shown beside the restart count.
        title: the entrypoint's name (header).
        console: where to draw (default: a rich ``Console`` on stdout).
        stderr: where the workers' stderr lines go when stderr is not a
            terminal (default: ``sys.stderr``); on a terminal they are shown
            above the table with the stdout lines.
        interval: the shortest time between two redraws, in seconds.
        sample_usage: sample each running rank's CPU and resident memory
            from ``/proc`` at the view's one-second redraw (see the module
            docstring); False: the usage column stays empty until the end.

    Call ``start()`` on the event loop before the workers start and
    ``stop()`` when the run is over: it leaves the final table on screen.
    """

    def __init__(
        self,
        role: str,
        nprocs: int,
        max_restarts: int = 0,
        *,
        title: str = "",
        console: Console | None = None,
        stderr: TextIO | None = None,
        interval: float = 0.05,
        sample_usage: bool = True,
    ) -> None:
        self._role = role
        self._max_restarts = max_restarts
        self._title = title
        self._console = console or Console(markup=False, emoji=False, highlight=False)
        self._stderr = stderr if stderr is not None else sys.stderr
        self._stderr_shown = _isatty(self._stderr)
        self._interval = interval
        self._sample_usage = sample_usage and os.path.isdir("/proc/self")
        self._rows = [_Row() for _ in range(nprocs)]
        self._attempt = 0
        self._phase = "starting"
        self._pending: list[_Pending] = []
        self._live: Live | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._flush_handle: asyncio.TimerHandle | None = None
        self._tick: asyncio.TimerHandle | None = None
        self._last_flush = 0.0
        self._broken = False
        self._final = False  # the last redraw: the whole table, no cursor line
        self._restore_tty: Callable[[], None] | None = None

    def __repr__(self) -> str:
        state = "live" if self._live is not None else "stopped"
        return f"<LiveView {self._role} x{len(self._rows)} {state}>"

    # ---------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Draw the table; call on the event loop thread."""
        if self._live is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._restore_tty = _keep_output_on_interrupt(self._console.file)
        self._live = Live(
            self,
            console=self._console,
            auto_refresh=False,
            redirect_stdout=True,
            redirect_stderr=self._stderr_shown,
        )
        try:
            self._live.start(refresh=True)
        except OSError:
            self._broken = True

    def stop(self) -> None:
        """Print what is queued, draw the final table and leave it on screen."""
        live, self._live = self._live, None
        if live is None:
            return
        for handle in (self._flush_handle, self._tick):
            if handle is not None:
                handle.cancel()
        self._flush_handle = self._tick = None
        self._print_pending()
        self._final = True
        try:
            live.stop()
        except OSError:
            self._broken = True
        finally:
            restore, self._restore_tty = self._restore_tty, None
            if restore is not None:
                restore()

    # --------------------------------------------------------------- sink

    def lines(self, rank: int, stream: str, prefix: str, lines: list[str]) -> None:
        row = self._row(rank)
        if row is not None and lines:
            row.last = lines[-1]
            row.status = None
            row.updated = time.monotonic()
        if stream == "stderr" and not self._stderr_shown:
            text = "".join(f"{prefix}{line}\n" for line in lines)
            try:
                self._stderr.write(text)
                self._stderr.flush()
            except (OSError, ValueError):
                pass  # the log file, if any, still has it
        else:
            style = _PREFIX_STYLES[rank % len(_PREFIX_STYLES)]
            self._pending.extend((prefix, style, line) for line in lines)
        self._schedule()

    def status(self, rank: int, stream: str, prefix: str, text: str | None) -> None:
        row = self._row(rank)
        if row is not None:
            row.status = text
            row.updated = time.monotonic()
            self._schedule()

    async def aclose(self) -> None:
        # Called when each attempt's group closes: show its last lines now.
        # The view itself lives until stop().
        if self._live is not None and self._pending:
            self._flush()

    # ------------------------------------------------------------- events

    def on_event(self, event: AgentEvent) -> None:
        """Update the rows from an agent event (the agent's ``on_event``)."""
        now = time.monotonic()
        row = self._row(event.local_rank) if event.local_rank is not None else None
        kind = event.kind
        if kind == ev.ATTEMPT_STARTED:
            self._attempt = event.attempt
            self._phase = "running"
            for r in self._rows:
                r.restarts = event.attempt
        elif kind == ev.WORKER_STARTED and row is not None:
            row.pid = event.pid
            row.state, row.style = "running", "green"
            row.started, row.ended = now, None
            row.restarts = event.attempt
            row.status = None
            row.usage, row.cpu_time, row.sampled = "", 0.0, None
        elif kind == ev.WORKER_EXITED and row is not None:
            row.ended = now
            row.status = None
            # a live sample means nothing once the rank is gone; its reap's figures do
            row.usage = _final_usage(event.usage) if event.usage is not None else ""
            code = event.exitcode
            if event.oom:
                row.state, row.style = "oom", "bold red"
            elif row.state == "watchdog expired":
                row.state = f"watchdog: killed by {event.signal}"
            elif code is not None and code < 0:
                row.state, row.style = f"killed by {event.signal}", "red"
            else:
                row.state = f"exited {code}"
                row.style = "bold green" if code == 0 else "bold red"
        elif kind == ev.RESTART_SCHEDULED:
            self._phase = "restarting"
            for r in self._rows:
                r.state, r.style = "restarting", "yellow"
                r.restarts = event.attempt
        elif kind == ev.WATCHDOG_FIRED and row is not None:
            row.state, row.style = "watchdog expired", "bold red"
        elif kind == ev.SIGNAL_RECEIVED:
            self._phase = f"stopping ({event.signal})"
        elif kind == ev.GROUP_SUCCEEDED:
            self._phase = "succeeded"
        elif kind == ev.GROUP_FAILED:
            self._phase = "failed"
        elif kind == ev.GROUP_STOPPED:
            # stop() ended the run; during a backoff no worker was left to exit
            self._phase = "stopped"
            for r in self._rows:
                if r.state in ("starting", "restarting"):
                    r.state, r.style = "stopped", "yellow"
        self._schedule()

    def show_usage(self, usage: dict[int, Usage]) -> None:
        """Show each rank's final figures (``{local_rank: Usage}``, e.g. a result's usage)."""
        for rank, figures in usage.items():
            row = self._row(rank)
            if row is not None:
                row.usage = _final_usage(figures)
        self._schedule()

    def sample(self, now: float | None = None) -> None:
        """Read each running rank's CPU time and resident memory from ``/proc`` now.

        Called at each tick of the one-second redraw while a worker runs;
        a rank whose files cannot be read (it just exited) keeps its last
        figures.
        """
        now = time.monotonic() if now is None else now
        for row in self._rows:
            if not row.running or row.pid is None:
                continue
            read = sample(row.pid)
            if read is None or read.rss is None:
                continue
            since = row.sampled if row.sampled is not None else row.started
            assert since is not None  # a running row has started
            elapsed = now - since
            # the first sample measures from the start, when the rank had used nothing
            used = read.cpu_time - row.cpu_time if row.sampled is not None else read.cpu_time
            cpu = f"cpu {round(100 * used / elapsed)}% " if elapsed > 0 else ""
            row.usage = f"{cpu}rss {_size(read.rss)}"
            row.cpu_time, row.sampled = read.cpu_time, now

    def note(self, text: str, style: str = "yellow") -> None:
        """Print a line of our own above the table now, after the workers' lines so far."""
        self._pending.append(Text(text, style=style, no_wrap=False))
        if self._live is None:
            self._print_pending()
        else:
            self._flush()  # at once: what the command says next must come after it

    # ---------------------------------------------------------- rendering

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        now = time.monotonic()
        if self._final:
            yield Group(self._header(), self._table(now))
            return
        # half of the terminal, less the cursor's line; the workers' lines keep the rest
        room = max(2, options.size.height // 2) - 1
        fits = len(self._rows) + 2 <= room  # the header, the column names, the ranks
        body = self._table(now) if fits else self._compact(room - 1)
        yield Group(self._header(), body, Text(""))

    def _header(self) -> Text:
        n = len(self._rows)
        text = Text(no_wrap=True, overflow="ellipsis")
        text.append(f"{self._title} ", style="bold")
        text.append(f"[{self._role} x{n}] {self._phase}")
        text.append(f"  restarts {self._attempt}/{self._max_restarts}", style="dim")
        return text

    def _table(self, now: float) -> Table:
        table = Table(
            box=None,
            expand=True,
            pad_edge=False,
            show_edge=False,
            header_style="bold",
            padding=(0, 1),
        )
        table.add_column("rank", justify="right", no_wrap=True)
        table.add_column("pid", justify="right", no_wrap=True)
        table.add_column("state", no_wrap=True)
        table.add_column("uptime", justify="right", no_wrap=True)
        table.add_column("restarts", justify="right", no_wrap=True)
        table.add_column("usage", no_wrap=True)
        table.add_column("output", no_wrap=True, overflow="ellipsis", ratio=1)
        for rank, row in enumerate(self._rows):
            if row.started is None:
                uptime = ""
            else:
                uptime = _duration((row.ended if row.ended is not None else now) - row.started)
            shown = row.status if row.status is not None else row.last
            table.add_row(
                str(rank),
                "" if row.pid is None else str(row.pid),
                Text(row.state, style=row.style),
                uptime,
                str(row.restarts),
                row.usage,
                _plain(shown),
            )
        return table

    def _compact(self, room: int) -> Table:
        """One row per state: its ranks and the latest line among them, in ``room`` rows."""
        groups: dict[str, list[int]] = {}
        for rank, row in enumerate(self._rows):
            groups.setdefault(row.state, []).append(rank)
        shown = list(groups.items())
        if len(shown) > max(1, room):
            keep = max(0, room - 1)
            rest = sorted(rank for _, ranks in shown[keep:] for rank in ranks)
            shown = [*shown[:keep], (f"{len(shown) - keep} other states", rest)]
        table = Table(
            box=None,
            expand=True,
            pad_edge=False,
            show_edge=False,
            show_header=False,
            padding=(0, 1),
        )
        table.add_column("state", no_wrap=True)
        table.add_column("ranks", no_wrap=True, overflow="ellipsis", max_width=40)
        table.add_column("output", no_wrap=True, overflow="ellipsis", ratio=1)
        for state, ranks in shown:
            style = self._rows[ranks[0]].style if state in groups else "yellow"
            latest = max(ranks, key=lambda r: self._rows[r].updated)
            row = self._rows[latest]
            shown_line = row.status if row.status is not None else row.last
            output = Text(f"[{latest}] ", style="dim") if shown_line else Text()
            output.append_text(_plain(shown_line))
            count = f"{len(ranks)} rank{'s' if len(ranks) != 1 else ''}"
            table.add_row(Text(state, style=style), f"{count} {_ranges(ranks)}", output)
        return table

    # ------------------------------------------------------------ drawing

    def _row(self, rank: int) -> _Row | None:
        return self._rows[rank] if 0 <= rank < len(self._rows) else None

    def _schedule(self) -> None:
        """Redraw soon: at once if the last redraw is ``interval`` old, else then."""
        if self._live is None:
            self._print_pending()  # before start() or after stop(): plain printing
            return
        if self._flush_handle is not None or self._loop is None:
            return
        delay = max(0.0, self._last_flush + self._interval - time.monotonic())
        self._flush_handle = self._loop.call_later(delay, self._flush)

    def _flush(self) -> None:
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        self._last_flush = time.monotonic()
        live = self._live
        if live is None:
            return
        if self._pending:
            self._print_pending()  # rich redraws the table below the lines
        elif not self._broken:
            try:
                live.refresh()
            except OSError:
                self._broken = True
        if self._tick is None and self._loop is not None and any(r.running for r in self._rows):
            self._tick = self._loop.call_later(1.0, self._on_tick)

    def _on_tick(self) -> None:
        self._tick = None
        if self._sample_usage:
            self.sample()
        self._schedule()

    def _print_pending(self) -> None:
        pending, self._pending = self._pending, []
        if not pending or self._broken:
            return
        try:
            self._console.print(_Lines(pending), soft_wrap=True)
        except OSError:
            self._broken = True  # the terminal is gone (hang-up): stop drawing


class _Lines:
    """Queued lines as one renderable, laid out by us, not by rich.

    A worker's line goes out as it is (the terminal wraps it), so printing
    costs about as much as writing the bytes; only a line holding escape or
    control characters goes through ``rich.text.Text``, which keeps its
    colours and drops cursor movements that would break the table.
    """

    def __init__(self, items: list[_Pending]) -> None:
        self._items = items

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        newline = Segment.line()
        for item in self._items:
            if isinstance(item, Text):
                yield from item.render(console)
            else:
                prefix, style, line = item
                yield Segment(prefix, style)
                if line.isprintable():
                    yield Segment(line)
                else:
                    yield from _plain(line).render(console)
            yield newline


def _plain(line: str) -> Text:
    """The line as rich text: colours kept, cursor movements and control codes dropped."""
    if "\x1b" in line:
        return Text.from_ansi(line, no_wrap=True)
    return Text(line, no_wrap=True)


def _ranges(ranks: list[int]) -> str:
    """Sorted ranks as ranges: ``0-3,5,7-9``."""
    parts: list[str] = []
    start = prev = ranks[0]
    for rank in [*ranks[1:], -1]:
        if rank == prev + 1:
            prev = rank
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = rank
    return ",".join(parts)


def _final_usage(usage: Usage) -> str:
    """A reaped rank's figures: its CPU time and its largest resident set."""
    return f"cpu {_cpu_time(usage.cpu_time)} max rss {_size(usage.max_rss)}"


def _cpu_time(seconds: float) -> str:
    return f"{seconds:.1f}s" if seconds < 60 else _duration(seconds)


def _size(nbytes: int) -> str:
    """``222298112`` -> ``212M``: binary units, three figures at most."""
    size = float(nbytes)
    for unit in ("B", "K", "M", "G"):
        if size < 1024 or unit == "G":
            break
        size /= 1024
    if unit == "B":
        return f"{int(size)}B"
    return f"{size:.1f}{unit}" if size < 10 else f"{size:.0f}{unit}"


def _duration(seconds: float) -> str:
    s = int(max(0.0, seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _keep_output_on_interrupt(stream: IO[str]) -> Callable[[], None] | None:
    """Set ``NOFLSH`` on ``stream``'s terminal; return what clears it again.

    Without it, the terminal drops the output it has not displayed yet when
    Ctrl-C (or Ctrl-\\, Ctrl-Z) sends its signal.  ``None``: not a terminal,
    or ``NOFLSH`` was set already.
    """
    try:
        fd = stream.fileno()
        attrs = termios.tcgetattr(fd)
        if attrs[3] & termios.NOFLSH:
            return None
        attrs[3] |= termios.NOFLSH
        termios.tcsetattr(fd, termios.TCSANOW, attrs)
    except (AttributeError, ValueError, OSError, termios.error):
        return None

    def restore() -> None:
        try:  # the settings as they are now, less ours
            now = termios.tcgetattr(fd)
            now[3] &= ~termios.NOFLSH
            termios.tcsetattr(fd, termios.TCSANOW, now)
        except (OSError, termios.error):
            pass  # the terminal is gone

    return restore


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
