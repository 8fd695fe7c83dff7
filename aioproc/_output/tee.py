"""Worker output: pipe -> raw bytes to the log file, whole lines to the sinks.

One ``TeeProtocol`` reads one piped stream of one worker.  Every chunk goes
to the log file unchanged; a ``LineSplitter`` turns the bytes into complete
lines and progress updates, which are handed to the sinks (``aioproc.sinks``:
console, file, callback, async iterator); a run of plain lines goes to a
sink that takes text (``Sink.text``) as one string, and is split into a
list once for all the others.  Since everything runs on the loop
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
from .flow import Flow, stall_of
from .sink import takes_text
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

READ_SIZE = 256 * 1024
"""Bytes of a read buffer (``get_buffer``): as much as asyncio's pipe transport
reads at once, a quarter of a grown tee pipe."""

SPARE_BUFFERS = 8
"""Read buffers a loop keeps for reuse once their bytes are out."""


def _decode(data: bytes | bytearray | memoryview) -> str:
    # str() decodes any buffer: a view of a read buffer is decoded without a copy first
    return str(data, "utf-8", "replace")


Buffer = bytes | bytearray
"""What a range of a stream's bytes lives in: a read's ``bytes`` or a read buffer."""


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

    def feed(self, data: bytes | bytearray | memoryview) -> tuple[list[str], str | None]:
        """Consume ``data``; return the lines it completes and the latest status.

        The status is the current state of a progress bar (text after the
        last ``\r`` of the unfinished line), or ``None`` if ``data`` did not
        update one.
        """
        if isinstance(data, memoryview):
            data = data.tobytes()
        return self.feed_range(data, 0, len(data))

    def feed_range(self, buf: Buffer, start: int, end: int) -> tuple[list[str], str | None]:
        """``feed(buf[start:end])``, without copying the range out of ``buf`` first."""
        if not self._cr and buf.find(b"\r", start, end) < 0:
            plain = self._feed_plain(buf, start, end)
            if plain is not None:
                return plain, None
        data = bytes(buf[start:end]) if start or end != len(buf) else bytes(buf)
        lines: list[str] = []
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

    def feed_text(self, buf: Buffer, start: int, end: int) -> str | None:
        """The lines ``buf[start:end]`` completes, as one text joined by ``\\n``.

        For sinks that take text (``Sink.text``): no object per line.  Returns
        ``None``, having consumed nothing, where the range needs the rules
        ``feed_range`` applies (a ``\\r``, a line that may exceed
        ``MAX_LINE``) or completes no line.
        """
        if self._cr or buf.find(b"\r", start, end) >= 0:
            return None
        nl = buf.rfind(b"\n", start, end)
        seg = self._seg
        # past MAX_LINE in all, one of its lines may be longer: feed_range cuts it
        if nl < 0 or len(seg) + nl - start > MAX_LINE or end - nl - 1 > MAX_LINE:
            return None
        view = memoryview(buf)
        # UTF-8 never uses the byte \n inside a character: decoding the block
        # at once gives the text of decoding it line by line
        text = _decode(seg + view[start:nl]) if seg else _decode(view[start:nl])
        seg[:] = view[nl + 1 : end]
        return text

    def _feed_plain(self, buf: Buffer, start: int, end: int) -> list[str] | None:
        """Fast path for ranges without ``\r``: decode and split whole blocks.

        UTF-8 never uses the byte ``\n`` inside a character, so decoding a
        block of lines at once gives the same text as line by line.  Only
        the held partial line and the first line of the range are joined
        (a character may straddle them); the rest is decoded straight from
        ``buf``.  Returns ``None`` (nothing consumed) when a line may exceed
        ``MAX_LINE``.
        """
        seg = self._seg
        nl = buf.rfind(b"\n", start, end)
        if nl < 0:
            if len(seg) + end - start > MAX_LINE:
                return None
            seg += memoryview(buf)[start:end]
            return []
        if end - nl - 1 > MAX_LINE:
            return None
        view = memoryview(buf)
        if seg:
            first = buf.find(b"\n", start, nl + 1)
            head = _decode(seg + view[start:first])
            lines = _decode(view[first + 1 : nl]).split("\n") if first < nl else []
            lines.insert(0, head)
            size = len(seg) + nl - start
        else:
            lines = _decode(view[start:nl]).split("\n")
            size = nl - start
        # a decoded character comes from 1 to 4 bytes, so this bound is safe
        if size > MAX_LINE and max(map(len, lines)) * 4 > MAX_LINE:
            return None
        seg[:] = view[nl + 1 : end]
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
        self._spare: list[bytearray] = []  # read buffers whose bytes are all out

    def take_buffer(self) -> bytearray:
        """A read buffer of ``READ_SIZE`` bytes, reused when one is free."""
        return self._spare.pop() if self._spare else bytearray(READ_SIZE)

    def give_back(self, buf: bytearray) -> None:
        """``buf``'s bytes are all out (nothing refers to them): reuse it."""
        if len(self._spare) < SPARE_BUFFERS:
            self._spare.append(buf)

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


class TeeProtocol(asyncio.BufferedProtocol):
    """Reads one worker stream from a pipe into its log file and the sinks.

    Reads: where the transport supports it (uvloop's pipes), the pipe is
    read straight into a buffer of the loop's (``get_buffer``), which goes
    back to the loop once its lines are out; elsewhere (asyncio's pipes
    call ``data_received``) each read is a ``bytes`` of at most
    ``READ_SIZE``.  Either way the log file, the line splitter and the
    slices waiting for the sinks use ranges of that one buffer: the bytes
    are not copied again before they are decoded.

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
        # per sink, whether it takes text; empty when none does (no text is made)
        self._texts = [takes_text(s) for s in sinks] if any(map(takes_text, sinks)) else []
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
        self._held = False  # its worker's start is not announced yet (see hold)
        self._connected = False  # a pipe was connected: it closes the log file
        self._early: list[bytes] = []  # read while held: goes out on release
        # slices whose lines the sinks have not had yet (reading is paused
        # until they have), as (buffer, start, end); the loop's slicer hands
        # them over, and a read buffer goes back to it with its last slice
        self._backlog: collections.deque[tuple[Buffer, int, int]] = collections.deque()
        self._lent: bytearray | None = None  # the buffer get_buffer gave the transport
        self._slicer = _slicer()
        # a sink's ``flow`` attribute that is no Flow (a sink of its own making
        # that predates the contract) takes no part in backpressure
        self._flows = [f for f in (getattr(s, "flow", None) for s in sinks) if isinstance(f, Flow)]
        for flow in self._flows:
            flow.watch(self._on_flow)

    def __repr__(self) -> str:
        return f"<TeeProtocol rank={self._rank} {self._stream}>"

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        pipe = transport.get_extra_info("pipe")
        self._fd = pipe.fileno() if pipe is not None else -1
        self._connected = True
        # uvloop's pipe transports do not subclass asyncio.ReadTransport
        self._transport = transport  # type: ignore[assignment]
        # no pause here: uvloop starts reading after connection_made returns,
        # and Python 3.10's pipes add their reader regardless, so a pause now
        # would be lost; the first read pauses instead (see _received)
        self._track_stalls()

    def close_unconnected(self) -> None:
        """Close the log file of a tee no pipe was connected to (a start that failed).

        A connected tee closes it itself once its pipe is closed, after
        writing what it read.
        """
        if not self._connected and self.log_file is not None:
            self.log_file.close()

    def hold(self) -> None:
        """Keep what is read from the sinks until ``release()`` (or the worker's exit).

        Whoever announces the worker's start does so before the sinks see
        any of its output: a worker that prints at once would otherwise be
        read while its launch is still being wired up.  The first read
        while held pauses the pipe.
        """
        self._held = True

    def release(self) -> None:
        """Start reading, after ``hold()``: what was read meanwhile goes out first."""
        if self._held:
            self._held = False
            early, self._early = self._early, []
            for data in early:
                self._received(data, len(data))
            self._update_reading()

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
        stall = stall_of(flow)
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
            ((bool(self._blocked) or self._held) and not self._draining)
            or bool(self._backlog)
            or self._turn
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
        self.release()  # the worker exited: its output is due whatever the caller does
        if not self._draining:
            self._draining = True
            self._update_reading()
            self._track_stalls()
        if self.progress.at_eof:
            return self.closed
        waiting = sum(end - start for _, start, end in self._backlog)
        # a closing transport's fd may be closed already (uvloop closes it at
        # once, before connection_lost) and its number given to another file
        open_fd = self._transport is not None and not self._transport.is_closing()
        return self.progress.reached(self._fd if open_fd else -1, waiting)

    def get_buffer(self, sizehint: int) -> memoryview:
        """Where the transport reads next: a buffer of the loop's (uvloop)."""
        if self._lent is None:
            self._lent = self._slicer.take_buffer()
        return memoryview(self._lent)

    def buffer_updated(self, nbytes: int) -> None:
        buf, self._lent = self._lent, None
        assert buf is not None
        # a short read that has to wait would hold a whole buffer: its
        # bytes wait in a copy of their own, and the buffer is reused
        if nbytes <= FAIR_CHUNK and not self._short_read_goes_out_now():
            self._received(bytes(memoryview(buf)[:nbytes]), nbytes)
            self._slicer.give_back(buf)
            return
        if not self._received(buf, nbytes):
            self._slicer.give_back(buf)

    def _short_read_goes_out_now(self) -> bool:
        # what _received will decide for a short read (should the budget end
        # in between, the buffer is kept all the same: nothing is lost)
        return self._splitter is None or (not self._backlog and self._slicer.admits())

    def data_received(self, data: bytes) -> None:
        self._received(data, len(data))

    def _received(self, buf: Buffer, n: int) -> bool:
        """``buf[:n]`` was read: to the log file and the sinks; whether ``buf`` is kept."""
        if self._held:
            self._early.append(bytes(memoryview(buf)[:n]))
            self._update_reading()  # pauses: the transport reads now
            return False
        self._slicer.read_done(self)
        if self.log_file is not None and self.write_error is None:
            self._write_log(buf if n == len(buf) else memoryview(buf)[:n])
        if self._splitter is None:
            self.progress.advance(n)  # no sink: nothing to slice
            return False
        if not self._backlog and n <= FAIR_CHUNK and self._slicer.admits():
            self._consume(buf, 0, n)
            if self._blocked and not self._paused:
                self._update_reading()  # held back since it connected (see connection_made)
            return False
        # its lines go out a slice at a time, in order, with the other
        # flooded streams' (see _Slicer); reading waits until they are out
        was_idle = not self._backlog
        self._backlog.extend((buf, i, min(i + FAIR_CHUNK, n)) for i in range(0, n, FAIR_CHUNK))
        self._update_reading()
        if was_idle:
            self._slicer.enqueue(self)
        return True

    def _consume(self, buf: Buffer, start: int, end: int) -> None:
        """Lines (and progress) of ``buf[start:end]`` to the sinks; then count it as read."""
        if self._splitter is not None:
            try:
                text = self._splitter.feed_text(buf, start, end) if self._texts else None
                if text is None:
                    lines, status = self._splitter.feed_range(buf, start, end)
            except Exception:  # a bug here must not close the pipe (uvloop) and kill the worker
                report_sink_error(self, "line splitting")
            else:
                if text is not None:
                    self._emit_text(text)
                else:
                    self._emit(lines)
                    if status is not None:
                        self._status(status)
                if self._metrics is not None:
                    count = len(lines) if text is None else text.count("\n") + 1
                    recorder, group, role = self._metrics
                    recorder.output(group, role, self._stream, count, end - start)
        # counted once the sinks have the lines: settled() means they have them
        self.progress.advance(end - start)

    def _consume_next(self) -> None:
        """The oldest waiting slice to the sinks; its read buffer back once it is done."""
        buf, start, end = self._backlog.popleft()  # taken first: a failing slice is not retried
        try:
            self._consume(buf, start, end)
        finally:
            if isinstance(buf, bytearray) and not (self._backlog and self._backlog[0][0] is buf):
                self._slicer.give_back(buf)  # its last slice: nothing refers to it any more

    def _next_slice(self) -> bool:
        """Hand the next slice to the sinks; whether more are left."""
        if self._backlog:
            self._consume_next()
        if self._backlog:
            return True
        self._update_reading()
        return False

    def _write_log(self, data: bytes | bytearray | memoryview) -> None:
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

    def _emit_text(self, text: str) -> None:
        """``text``'s lines to the sinks, as text to those that take it."""
        lines: list[str] | None = None
        for sink, takes in zip(self._sinks, self._texts, strict=True):
            try:
                if takes:
                    sink.text(self._rank, self._stream, self._prefix, text)
                else:
                    if lines is None:
                        lines = text.split("\n")
                    sink.lines(self._rank, self._stream, self._prefix, lines)
            except Exception:
                report_sink_error(sink, "text()" if takes else "lines()")

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
        self._lent = None  # lent for a read that never came
        if self._held:
            # cut before its start was announced (the start was abandoned):
            # what it wrote reaches its log file, never the sinks
            self._held = False
            early, self._early = self._early, []
            for data in early:
                if self.log_file is not None and self.write_error is None:
                    self._write_log(data)
        while self._backlog:  # the pipe was cut: what was read still goes out
            self._consume_next()
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
