"""Worker output: pipe -> raw bytes to the log file, whole lines to the sinks.

One ``TeeProtocol`` reads one piped stream of one worker.  Every chunk goes
to the log file unchanged; a ``LineSplitter`` turns the bytes into complete
lines and progress updates, which are handed to the sinks (``aioproc.sinks``:
console, file, callback, async iterator).  Since everything runs on the loop
thread and each sink writes a line in one call, a line of one rank can never
be cut by a line of another.

Framing rules:

* a partial line is held until its newline or EOF, then emitted once, whole;
* ``\\r`` inside a line marks a progress update (tqdm and friends): the
  segment after the last ``\\r`` is the bar's current state, reported as a
  *status*; when the line ends, only its final state is emitted as a line;
* a line longer than ``MAX_LINE`` bytes is emitted in pieces of
  ``MAX_LINE`` bytes, each a line of its own, so memory stays bounded;
* bytes are decoded as UTF-8 with replacement characters for the sinks; the
  log file gets the bytes unchanged.
"""

from __future__ import annotations

import asyncio
import collections
import errno
import logging
import time
import weakref
from typing import TYPE_CHECKING, BinaryIO

from .drain import ReadProgress
from .flow import Flow
from .sinkops import report_sink_error

if TYPE_CHECKING:
    from .._metrics.hooks import NullRecorder
    from .sink import Sink

logger = logging.getLogger("aioproc")

FAIR_CHUNK = 32 * 1024
"""Bytes of one slice: a read bigger than this (asyncio reads up to 256 KiB,
uvloop about as much) reaches the sinks a slice at a time, the pipe's
reading paused until its last slice is out.  What bounds an iteration is
``SLICE_BUDGET``; a slice only adds its own time beyond it (~0.1 ms of
splitting and writing on a slow host).  Each slice also pays a fixed cost
per sink call: 8 KiB slices took 1.6x the parent CPU of 32 KiB ones
through a 64 MB tee, for no smaller stall."""

SLICE_BUDGET = 0.0005
"""Seconds of slices run per loop iteration, every stream of every group
together (at least one slice runs each iteration).  Without it, a dozen
flooded pipes readable at once would each hand a slice to the sinks in
the same iteration, and the loop would answer nothing else meanwhile."""

READ_BUDGET = 0.001
"""Seconds of pipe reads per loop iteration, every stream of the loop
together.  A read of a flooded pipe takes up to 256 KiB and writes it to
the log file (0.1-0.5 ms); a stream that reads once the budget is spent
pauses until the slicer lets it resume."""

RESUMES_PER_ITERATION = 2
"""Paused streams let resume reading per loop iteration.  Each may read a
full pipe in the next iteration: when a full console releases its sinks,
a dozen flooded streams would otherwise all read in one iteration."""

MAX_LINE = 64 * 1024
"""Longest line held back, in bytes; longer lines reach the sinks in pieces."""


def _decode(data: bytes | bytearray) -> str:
    return data.decode("utf-8", "replace")


class LineSplitter:
    """Splits a byte stream into lines and progress updates, whatever the chunking.

    State: ``_seg`` is the unfinished line's current segment (the text after
    its last ``\r``), ``_prev`` the last non-empty segment a ``\r`` ended
    (a bar's state when the line ends right after a ``\r``), ``_cr`` whether
    the unfinished line is a progress line.  Every rule depends only on the
    bytes, never on where chunks end.
    """

    __slots__ = ("_cr", "_prev", "_seg")

    def __init__(self) -> None:
        self._seg = bytearray()
        self._prev = b""
        self._cr = False

    def feed(self, data: bytes) -> tuple[list[str], str | None]:
        """Consume ``data``; return the lines it completes and the latest status.

        The status is the current state of a progress bar (text after the
        last ``\r`` of the unfinished line), or ``None`` if ``data`` did not
        update one.
        """
        if not self._cr and b"\r" not in data:
            lines = self._feed_plain(data)
            if lines is not None:
                return lines, None
        lines = []
        status_changed = False
        parts = data.split(b"\n")
        for i, part in enumerate(parts):
            if b"\r" in part:
                pieces = part.split(b"\r")
                for piece in pieces[:-1]:
                    self._extend(piece, lines)
                    if self._seg:
                        self._prev = bytes(self._seg)
                        self._seg.clear()
                    self._cr = status_changed = True
                self._extend(pieces[-1], lines)
            else:
                self._extend(part, lines)
            if i < len(parts) - 1:
                lines.append(self._end_line())
                status_changed = False
        status = None
        if status_changed and self._cr:
            shown = self._seg or self._prev
            status = _decode(shown) if shown else None
        return lines, status

    def _feed_plain(self, data: bytes) -> list[str] | None:
        """Fast path for chunks without ``\r``: decode and split whole blocks.

        UTF-8 never uses the byte ``\n`` inside a character, so decoding a
        block of lines at once gives the same text as line by line.  Returns
        ``None`` (nothing consumed) when a line may exceed ``MAX_LINE``.
        """
        nl = data.rfind(b"\n")
        if nl < 0:
            if len(self._seg) + len(data) > MAX_LINE:
                return None
            self._seg += data
            return []
        block = bytes(self._seg) + data[:nl] if self._seg else data[:nl]
        lines = _decode(block).split("\n")
        # a decoded character comes from 1 to 4 bytes, so this bound is safe
        if len(block) > MAX_LINE and max(map(len, lines)) * 4 > MAX_LINE:
            return None
        rest = data[nl + 1 :]
        if len(rest) > MAX_LINE:
            return None
        self._seg[:] = rest
        return lines

    def _extend(self, piece: bytes, lines: list[str]) -> None:
        """Add text to the current segment, emitting ``MAX_LINE`` pieces as it grows."""
        seg = self._seg
        seg += piece
        while len(seg) > MAX_LINE:
            cut = _char_boundary(seg, MAX_LINE)
            lines.append(_decode(seg[:cut]))
            del seg[:cut]

    def _end_line(self) -> str:
        """The text a terminal would leave for the finished line: its last segment."""
        final = self._seg if self._seg or not self._cr else self._prev
        text = _decode(final)
        self._seg = bytearray()
        self._prev = b""
        self._cr = False
        return text

    def flush(self) -> list[str]:
        """At EOF: the held partial line (or final progress state), if any."""
        if not self._seg and not self._cr:
            return []
        return [self._end_line()]


def _char_boundary(data: bytes | bytearray, limit: int) -> int:
    """The largest cut <= ``limit`` that does not split a UTF-8 character."""
    # a character starts at a byte that is not a continuation byte (0b10xxxxxx)
    for cut in range(limit, max(limit - 4, 0), -1):
        if cut >= len(data) or data[cut] & 0xC0 != 0x80:
            return cut
    return limit  # not UTF-8 there: any cut will do


class LineFramer:
    """Turns a byte stream into prefixed console text (``prefix + line + "\\n"``).

    A convenience over ``LineSplitter`` for readers that only need text,
    such as ``TailLog``; progress updates are reduced to their final state.
    """

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix
        self._splitter = LineSplitter()

    def feed(self, data: bytes) -> str:
        lines, _ = self._splitter.feed(data)
        return self._render(lines)

    def flush(self) -> str:
        return self._render(self._splitter.flush())

    def _render(self, lines: list[str]) -> str:
        p = self._prefix
        return "".join(f"{p}{line}\n" for line in lines)


class _Slicer:
    """Hands the slices of every flooded stream of one loop to the sinks.

    Round robin, a slice per stream in turn, until ``SLICE_BUDGET`` is
    spent; the rest waits for the next loop iteration.  A small read is
    handed over at once while this iteration's budget lasts and no stream
    waits, so a chatty worker's lines are not delayed.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._waiting: collections.deque[TeeProtocol] = collections.deque()
        self._scheduled = False
        self._budget_end = 0.0  # this iteration's: set by its first slice or direct read
        # reads: this iteration's budget and resumes, and who waits to resume
        self._reads_end: float | None = None
        self._resumed = 0
        self._resuming: collections.deque[TeeProtocol] = collections.deque()
        self._granting: TeeProtocol | None = None  # the one _next_reads resumes now

    def admits(self) -> bool:
        """Whether a small read may go to the sinks now, in this iteration."""
        if self._waiting:
            return False
        now = time.perf_counter()
        self._open_budget(now)
        return now < self._budget_end

    def enqueue(self, tee: TeeProtocol) -> None:
        self._waiting.append(tee)
        self._open_budget(time.perf_counter())

    def _open_budget(self, now: float) -> None:
        # the first work of an iteration opens its budget; the next
        # iteration (the call below) opens a fresh one
        if not self._scheduled:
            self._scheduled = True
            self._budget_end = now + SLICE_BUDGET
            self._loop.call_soon(self._run)

    def _run(self) -> None:
        self._budget_end = time.perf_counter() + SLICE_BUDGET
        waiting = self._waiting
        try:
            while waiting:
                tee = waiting.popleft()
                try:
                    more = tee._next_slice()
                except Exception:  # a bug here must not stop every stream's output
                    logger.exception("handing a slice of %r to its sinks failed", tee)
                    more = bool(tee._backlog)
                if more:
                    waiting.append(tee)  # its next slice after the others'
                if time.perf_counter() >= self._budget_end:
                    break
        finally:
            if waiting:
                self._loop.call_soon(self._run)
            else:
                self._scheduled = False

    def read_done(self, tee: TeeProtocol) -> None:
        """Count a read against this iteration's ``READ_BUDGET``; past it,
        ``tee`` pauses until its turn to resume."""
        now = time.perf_counter()
        if self._reads_end is None:
            self._open_reads(now)
        elif now >= self._reads_end:
            tee._turn = True
            self._queue(tee)
            tee._update_reading()

    def may_resume(self, tee: TeeProtocol) -> bool:
        """Whether ``tee`` may resume reading now; if not, it is resumed in a
        later iteration, ``RESUMES_PER_ITERATION`` at a time, in order."""
        if tee is self._granting:
            return True
        self._open_reads(time.perf_counter())
        if self._resumed < RESUMES_PER_ITERATION and not self._resuming:
            self._resumed += 1
            return True
        self._queue(tee)
        return False

    def _queue(self, tee: TeeProtocol) -> None:
        if not tee._queued:
            tee._queued = True
            self._resuming.append(tee)

    def _open_reads(self, now: float) -> None:
        # the first read or resume of an iteration opens its budget; the
        # next iteration (the call below) opens a fresh one before its reads
        if self._reads_end is None:
            self._reads_end = now + READ_BUDGET
            self._loop.call_soon(self._next_reads)

    def _next_reads(self) -> None:
        self._reads_end = None
        self._resumed = 0
        waiting = self._resuming
        while waiting and self._resumed < RESUMES_PER_ITERATION:
            tee = waiting.popleft()
            tee._queued = False
            tee._turn = False
            self._granting = tee
            try:
                tee._update_reading()  # resumes it, if nothing else holds it
            except Exception:  # a bug here must not stop the others' reading
                logger.exception("resuming %r failed", tee)
            finally:
                self._granting = None
            if not tee._paused:
                self._resumed += 1
        if waiting:
            self._open_reads(time.perf_counter())


_slicers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Slicer] = (
    weakref.WeakKeyDictionary()
)


def _slicer() -> _Slicer:
    loop = asyncio.get_running_loop()
    slicer = _slicers.get(loop)
    if slicer is None:
        slicer = _slicers[loop] = _Slicer(loop)
    return slicer


class TeeProtocol(asyncio.Protocol):
    """Reads one worker stream from a pipe into its log file and the sinks.

    Backpressure: while any sink's flow is held (its buffer is full) the
    transport stops reading, so the worker blocks on its pipe; once the
    worker has exited (``settled()`` was asked) the pipe is read to the end
    whatever the sinks' state, so the log file gets every byte and the
    verdict never waits on a slow sink.

    Isolation: nothing a sink does escapes ``data_received`` (on uvloop an
    escaping exception would close the pipe and kill the worker with
    SIGPIPE).  A failed log-file write (a full disk) is logged once as a
    warning naming the rank, stream and path, kept in ``write_error``, and
    the sinks still get every line.

    Stalls: while a sink's flow pauses this reader (and its worker still
    runs), the reader is reported to that flow's ``StallWatch`` as
    ``worker`` (e.g. ``trainer/1``; ``rank N`` if not given), so a sink
    that holds the workers too long is named in a warning.

    Metrics: given ``metrics`` (the recorder, the group and the role, only
    while metrics are on), each chunk's lines and bytes are counted
    (``output``), and so is the time reading stayed paused because a sink
    fell behind (``backpressure``).  Without it the count costs one check.
    """

    def __init__(
        self,
        log_file: BinaryIO | None,
        rank: int,
        stream: str,
        prefix: str,
        sinks: list[Sink],
        *,
        worker: str | None = None,
        metrics: tuple[NullRecorder, str, str] | None = None,
    ) -> None:
        self.log_file = log_file
        self._metrics = metrics
        self._held_at = 0.0  # when a sink's flow paused reading (metrics only)
        self._rank = rank
        self._stream = stream
        self._label = f"{worker or f'rank {rank}'} ({stream})"
        self._prefix = prefix
        self._sinks = sinks
        self._splitter = LineSplitter() if sinks else None
        self.progress = ReadProgress()
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.write_error: OSError | None = None
        """The error that stopped writes to the log file (e.g. ENOSPC), if any."""
        self._fd = -1
        self._transport: asyncio.ReadTransport | None = None
        self._blocked: set[Flow] = set()  # the sinks' flows that are held
        self._paused = False
        self._turn = False  # read past the loop's budget: paused until its turn
        self._queued = False  # waits in the slicer's queue to resume
        self._draining = False  # the worker exited: read to EOF, ignore backpressure
        # slices whose lines the sinks have not had yet (reading is paused
        # until they have); the loop's slicer hands them over
        self._backlog: collections.deque[bytes] = collections.deque()
        self._slicer = _slicer()
        self._flows = [f for f in (s._backpressure for s in sinks) if f is not None]
        for flow in self._flows:
            flow.watch(self._on_flow)

    def __repr__(self) -> str:
        return f"<TeeProtocol rank={self._rank} {self._stream}>"

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        pipe = transport.get_extra_info("pipe")
        self._fd = pipe.fileno() if pipe is not None else -1
        # uvloop's pipe transports do not subclass asyncio.ReadTransport
        self._transport = transport  # type: ignore[assignment]
        self._update_reading()
        self._track_stalls()

    def _on_flow(self, flow: Flow, blocked: bool) -> None:
        if blocked:
            self._blocked.add(flow)
        else:
            self._blocked.discard(flow)
        self._update_reading()
        self._track_stall(flow)

    def _track_stalls(self) -> None:
        for flow in self._flows:
            self._track_stall(flow)

    def _track_stall(self, flow: Flow) -> None:
        """Tell ``flow``'s stall watch whether it holds this reader's worker now."""
        stall = flow.stall
        if stall is None:
            return
        # a reader not connected yet, closed, or draining an exited worker
        # holds nobody back, whatever its sinks' state
        if flow in self._blocked and not self._draining and self._transport is not None:
            stall.paused(self, self._label)
        else:
            stall.resumed(self)

    def _update_reading(self) -> None:
        tr = self._transport
        if tr is None or tr.is_closing():
            return
        want_paused = (
            (bool(self._blocked) and not self._draining) or bool(self._backlog) or self._turn
        )
        if want_paused and not self._paused:
            tr.pause_reading()
            self._paused = True
            if self._metrics is not None and self._blocked and not self._draining:
                self._held_at = time.monotonic()
        elif not want_paused and self._paused and self._slicer.may_resume(self):
            tr.resume_reading()
            self._paused = False
            if self._held_at:
                self._count_backpressure()

    def _count_backpressure(self) -> None:
        assert self._metrics is not None
        recorder, group, role = self._metrics
        recorder.backpressure(group, role, self._stream, time.monotonic() - self._held_at)
        self._held_at = 0.0

    def settled(self) -> asyncio.Future[None]:
        """Resolves once the bytes waiting in the pipe now have been consumed.

        Asked when the worker has exited: from then on the pipe is read
        without backpressure (the worker cannot be slowed down any more,
        and the log file must get everything).
        """
        if not self._draining:
            self._draining = True
            self._update_reading()
            self._track_stalls()
        if self.progress.at_eof:
            return self.closed
        return self.progress.reached(self._fd, sum(map(len, self._backlog)))

    def data_received(self, data: bytes) -> None:
        self._slicer.read_done(self)
        if self.log_file is not None and self.write_error is None:
            self._write_log(data)
        if self._splitter is None:
            self.progress.advance(len(data))  # no sink: nothing to slice
            return
        if not self._backlog and len(data) <= FAIR_CHUNK and self._slicer.admits():
            self._consume(data)
            return
        # its lines go out a slice at a time, in order, with the other
        # flooded streams' (see _Slicer); reading waits until they are out
        was_idle = not self._backlog
        self._backlog.extend(data[i : i + FAIR_CHUNK] for i in range(0, len(data), FAIR_CHUNK))
        self._update_reading()
        if was_idle:
            self._slicer.enqueue(self)

    def _consume(self, data: bytes) -> None:
        """Lines (and progress) of ``data`` to the sinks; then count it as read."""
        if self._splitter is not None:
            try:
                lines, status = self._splitter.feed(data)
            except Exception:  # a bug here must not close the pipe (uvloop) and kill the worker
                report_sink_error(self, "line splitting")
            else:
                self._emit(lines)
                if status is not None:
                    self._status(status)
                if self._metrics is not None:
                    recorder, group, role = self._metrics
                    recorder.output(group, role, self._stream, len(lines), len(data))
        # counted once the sinks have the lines: settled() means they have them
        self.progress.advance(len(data))

    def _next_slice(self) -> bool:
        """Hand the next slice to the sinks; whether more are left."""
        if self._backlog:
            self._consume(self._backlog.popleft())  # taken first: a failing slice is not retried
        if self._backlog:
            return True
        self._update_reading()
        return False

    def _write_log(self, data: bytes) -> None:
        assert self.log_file is not None
        view = memoryview(data)
        try:
            while view:
                n = self.log_file.write(view)
                if not n:
                    raise OSError(errno.EIO, "the log file accepted no bytes")
                view = view[n:]
        except OSError as e:
            self.write_error = e
            path = getattr(self.log_file, "name", "?")
            logger.warning(
                "could not write the %s log of rank %d to %s: %s; the rest of this stream "
                "is missing from that file (the sinks still get every line)",
                self._stream,
                self._rank,
                path,
                e,
            )

    def _emit(self, lines: list[str]) -> None:
        if not lines:
            return
        for sink in self._sinks:
            try:
                sink.lines(self._rank, self._stream, self._prefix, lines)
            except Exception:
                report_sink_error(sink, "lines()")

    def _status(self, text: str | None) -> None:
        for sink in self._sinks:
            try:
                sink.status(self._rank, self._stream, self._prefix, text)
            except Exception:
                report_sink_error(sink, "status()")

    def eof_received(self) -> bool | None:
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        for flow in self._flows:
            flow.unwatch(self._on_flow)
        self._transport = None
        self._track_stalls()
        while self._backlog:  # the pipe was cut: what was read still goes out
            self._consume(self._backlog.popleft())
        if self._splitter is not None:
            last = self._splitter.flush()
            self._emit(last)
            self._status(None)
            if self._metrics is not None and last:
                recorder, group, role = self._metrics
                recorder.output(group, role, self._stream, len(last), 0)
        if self._held_at:
            self._count_backpressure()  # closed while a sink held it paused
        if self.log_file is not None:
            try:
                self.log_file.close()
            except OSError as e:
                if self.write_error is None:
                    self.write_error = e
                    logger.warning(
                        "could not close the %s log of rank %d: %s",
                        self._stream,
                        self._rank,
                        e,
                    )
        self.progress.finish()
        if not self.closed.done():
            self.closed.set_result(None)
