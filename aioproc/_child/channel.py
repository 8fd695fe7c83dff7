"""Frame format of the control channel, and the child's blocking half.

A frame is a 9-byte header (kind: 1 byte, body length: 8 bytes, big endian)
followed by the body.  The parent reads frames with an asyncio protocol
(``_proc.channel``); the child, which must not import asyncio, reads and writes
them here with plain ``os.read``/``os.write`` on the inherited socket fd.

Bodies that carry Python values start with a codec byte: MARSHAL for values
made only of core types (``marshal`` is built in, so a worker that needs
nothing else never imports ``pickle``), PICKLE for everything else.

Large values (see ``pickle_parts``): the pickler writes into a ``_Sink`` that
keeps big payloads (bytes, bytearrays) by reference, and contiguous buffers
of ``OOB_MIN`` bytes or more (numpy arrays, ``PickleBuffer``, memoryviews)
leave the stream as protocol-5 out-of-band buffers.  A value of ``SHM_MIN``
bytes or more is written once into a sealed memfd passed beside the frame
(SHM, see ``_child.shm``) and the receiver unpickles from a mapping of it, so its
arrays view that memory; a value with out-of-band buffers that is smaller,
or that cannot use a memfd, carries them after the stream in the frame
itself (BUFFERS), where the receiver's arrays view the frame's buffer.

Call ids: a persistent worker may have many calls in flight, so its CALL,
RESULT, ERROR, PING and PONG frames end with the id of the call they belong
to (``ID_SIZE`` bytes, big endian, chosen by the supervisor; the worker
echoes it back untouched), and CANCEL names one by its id.  A one-shot
worker's frames carry no id: it has one call.  The id is a suffix, not a
prefix, so a body still starts with its codec byte wherever it is read.
"""

from __future__ import annotations

import marshal
import os

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

HEADER_SIZE = 9

# parent -> child
INIT = 1  # marshal: {"sys_path": [...], "serve": bool}
CALL = 2  # codec byte + (MARSHAL: (module, qualname, args, kwargs) or (fid, args, kwargs)
#                       | PICKLE: see _child.boot._load_call)
PING = 3  # persistent workers: answered with PONG
TERMINATE = 4  # persistent workers: exit 0 now
FD_SOCKET = 5  # the fd number (ascii) of the worker's end of the fd-passing socket
RELEASE = 6  # barrier: empty body = passed, else utf-8 text saying why it broke
DUMP = 7  # dump every thread's stack (faulthandler); answered with STACKS
DEFINE = 8  # persistent workers: marshal (fid, drops, pickle): keep a function under an id
CANCEL = 9  # persistent workers: the call id of a coroutine call to cancel (nothing if it ended)
# child -> parent
PONG = 12
RESULT = 10  # codec byte + the return value
ERROR = 11  # pickled dict describing the exception (see main.error_report)
ARRIVE = 13  # barrier: this worker waits at the group's barrier (empty body)
STACKS = 14  # utf-8 faulthandler dump of every thread, answering DUMP

MARSHAL = b"M"
PICKLE = b"P"
BUFFERS = b"B"  # descriptor, then the stream and its out-of-band buffers, in the frame
SHM = b"S"  # descriptor; the stream and buffers lie in a memfd sent on the fd socket

OOB_MIN = 1 << 16
"""A contiguous buffer this large leaves the pickle stream (protocol-5
out-of-band), and bytes this large are pickled rather than marshalled, so
that the pickler can hand them over without copying."""

SHM_MIN = 1 << 20
"""A pickled value (stream plus buffers) this large travels in shared memory
when the channel can pass file descriptors."""

_ALIGN = 64  # out-of-band buffers start on a cache line (numpy needs <= 16)
MARSHAL_BYTE = MARSHAL[0]
PICKLE_BYTE = PICKLE[0]

KIND_NAMES = {
    INIT: "INIT",
    CALL: "CALL",
    PING: "PING",
    TERMINATE: "TERMINATE",
    FD_SOCKET: "FD_SOCKET",
    RELEASE: "RELEASE",
    DUMP: "DUMP",
    DEFINE: "DEFINE",
    CANCEL: "CANCEL",
    PONG: "PONG",
    RESULT: "RESULT",
    ERROR: "ERROR",
    ARRIVE: "ARRIVE",
    STACKS: "STACKS",
}
CHILD_KINDS = frozenset({PONG, RESULT, ERROR, ARRIVE, STACKS})
"""The kinds a worker may send; the parent rejects any other."""

MAX_FRAME_SIZE = 1 << 30
"""Largest frame body the parent accepts from a worker: 1 GiB.

The parent allocates a frame's buffer from its header, so a header is
checked against this cap before anything is allocated: a corrupt or forged
header can cost neither memory nor a hang.  A return value (or error report)
that encodes to more than this fails in the worker with a clear error;
values that large belong in a file or shared memory.  Read when a channel
opens and sent to the worker in INIT, so both halves agree; ``Channel.open``
and ``_boot.init_frame`` also take another cap.
"""

ID_SIZE = 8
"""Bytes of the call id that ends a persistent worker's CALL, RESULT, ERROR, PING and
PONG bodies (and is CANCEL's whole body)."""

_CHUNK = 1 << 20


def header(kind: int, length: int) -> bytes:
    return kind.to_bytes(1, "big") + length.to_bytes(8, "big")


def parse_header(data: bytes | bytearray) -> tuple[int, int]:
    return data[0], int.from_bytes(data[1:HEADER_SIZE], "big")


def kind_name(kind: int) -> str:
    """``"RESULT (10)"`` for a known kind, ``"99"`` for an unknown one."""
    name = KIND_NAMES.get(kind)
    return f"{name} ({kind})" if name else str(kind)


def format_size(n: int) -> str:
    """``1 GiB``, ``512 MiB``, ``1.5 KiB``, ``12 bytes``: for messages."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            value = n / (1 << shift)
            return f"{value:.1f} {unit}".replace(".0 ", " ")
    return f"{n} bytes"


def dumps(obj: Any) -> bytes:
    import _pickle

    try:
        return _pickle.dumps(obj, protocol=5)
    except Exception:
        # values defined in __main__ or dynamically need pickling by value
        import cloudpickle

        return cloudpickle.dumps(obj, protocol=5)  # type: ignore[no-any-return]


def encode_value(value: Any, segments: list[Any] | None = None) -> list[bytes]:
    """Codec byte + body: marshal for core types, pickle otherwise.

    With ``segments`` (a list: the channel can pass file descriptors), a
    large value goes into a memfd appended to it as a ``_shm.Segment``,
    which the caller sends beside the frame and closes.
    """
    if _marshallable(value):
        try:
            return [MARSHAL, marshal.dumps(value)]
        except ValueError:
            pass
    import _pickle

    try:
        return pickle_parts(value, _pickler(_pickle.Pickler), segments)
    except Exception:
        # values defined in __main__ or dynamically need pickling by value
        import cloudpickle

        return pickle_parts(value, _pickler(cloudpickle.Pickler), segments)


class _Sink:
    """The pickler's output file: keeps what it is given, big payloads by reference.

    The C pickler hands a payload of 64 KiB or more (a bytes or bytearray
    object, an in-band ``PickleBuffer``) to ``write`` as the object itself
    rather than copying it into its buffer.
    """

    __slots__ = ("parts", "size")

    def __init__(self) -> None:
        self.parts: list[Any] = []
        self.size = 0

    def write(self, data: Any) -> int:
        n = _raw(data).nbytes
        self.parts.append(data)
        self.size += n
        return n


def _raw(buf: Any) -> memoryview:
    """A buffer's bytes as a flat view (``PickleBuffer.raw`` handles Fortran order)."""
    raw = getattr(buf, "raw", None)
    return raw() if raw is not None else memoryview(buf).cast("B")


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def pickle_parts(obj: Any, pickler: Any, segments: list[Any] | None) -> list[bytes]:
    """Pickle ``obj`` (protocol 5) with ``pickler``: ``[codec, body parts...]``.

    PICKLE (a plain stream, as ``dumps`` gives) unless the value carries
    out-of-band buffers or is ``SHM_MIN`` bytes or more; then SHM when
    ``segments`` is a list (the value is written once into a memfd appended
    to it; only reserved when the list is a ``_shm.Deferred``, whose owner
    fills it), else BUFFERS (descriptor, stream and buffers in the frame).
    """
    sink = _Sink()
    buffers: list[Any] = []

    def keep(buf: Any) -> bool:
        if _raw(buf).nbytes < OOB_MIN:
            return True  # in-band
        buffers.append(buf)
        return False

    pickler(sink, protocol=5, buffer_callback=keep).dump(obj)
    raws = [_raw(b) for b in buffers]
    size = sink.size + sum(r.nbytes for r in raws)
    if not raws and size < SHM_MIN:
        parts = sink.parts
        return [PICKLE, parts[0] if len(parts) == 1 else b"".join(parts)]
    offsets = []
    end = sink.size
    for r in raws:
        end = _align(end)
        offsets.append(end)
        end += r.nbytes
    entries = tuple((o, r.nbytes, r.readonly) for o, r in zip(offsets, raws, strict=True))
    desc = marshal.dumps((end, sink.size, entries))
    head = len(desc).to_bytes(4, "big") + desc
    if segments is not None and size >= SHM_MIN:
        from aioproc._child import shm as _shm

        if _shm.AVAILABLE:
            try:
                # a Deferred list's owner copies the value in later, off its loop
                make = (
                    _shm.Segment.reserve if type(segments) is _shm.Deferred else _shm.Segment.create
                )
                segments.append(make(end, sink.parts, zip(offsets, raws, strict=True)))
                return [SHM, head]
            except OSError:
                pass  # out of memfds or memory for one: the frame carries it instead
    # in the frame: joined once, so the caller's objects may change after this returns
    start = _align(len(head))
    data = bytearray(start + end)
    data[: len(head)] = head
    pos = start
    for part in sink.parts:
        view = _raw(part)
        data[pos : pos + view.nbytes] = view
        pos += view.nbytes
    for o, r in zip(offsets, raws, strict=True):
        data[start + o : start + o + r.nbytes] = r
    return [BUFFERS, data]  # type: ignore[list-item]


def loads_oob(codec: bytes | memoryview, view: memoryview, mapping: Any = None) -> Any:
    """Unpickle the body of a BUFFERS or SHM value (``view``: after the codec byte).

    The out-of-band buffers are slices of the frame (BUFFERS) or of
    ``mapping``, the memfd's mapping (SHM): arrays in the value view them,
    read-only where the sender's buffer was.
    """
    n = int.from_bytes(view[:4], "big")
    size, stream_size, entries = marshal.loads(view[4 : 4 + n])
    if codec == SHM:
        if mapping is None:
            raise ValueError("shared-memory value arrived without its memory")
        data = memoryview(mapping)
    elif codec == BUFFERS:
        start = _align(4 + n)
        data = view[start : start + size]
    else:
        raise ValueError(f"unknown value codec {bytes(codec)!r}")
    if data.nbytes < size or stream_size > size or any(o + k > size for o, k, _ in entries):
        raise ValueError(f"malformed out-of-band value: {data.nbytes} bytes, layout {entries!r}")
    buffers = [data[o : o + k].toreadonly() if ro else data[o : o + k] for o, k, ro in entries]
    import pickle

    return pickle.loads(data[:stream_size], buffers=buffers)


_picklers: dict[Any, Any] = {}


def _pickler(base: Any) -> Any:
    """``base`` with memoryviews picklable (see ``_reduce_memoryview``)."""
    cls = _picklers.get(base)
    if cls is None:
        import copyreg

        base_table = getattr(base, "dispatch_table", None)
        if not hasattr(base_table, "keys"):
            base_table = None  # the C pickler's slot: copyreg's table applies

        class Pickler(base):  # type: ignore[misc]
            @property
            def dispatch_table(self) -> Any:
                # read once by the C pickler as it is created: copyreg now
                table = dict(base_table if base_table is not None else copyreg.dispatch_table)
                table[memoryview] = _reduce_memoryview
                return table

        cls = _picklers[base] = Pickler
    return cls


def _reduce_memoryview(view: Any) -> Any:
    import _pickle

    probe: Any = memoryview(bytes(view.itemsize))
    try:
        probe.cast(view.format)
    except (TypeError, ValueError):
        raise TypeError(f"cannot pickle a memoryview of format {view.format!r}") from None
    if not view.contiguous:
        view = memoryview(view.tobytes()).cast(view.format, view.shape)
    return _rebuild_memoryview, (_pickle.PickleBuffer(view), view.format, view.shape)


def _rebuild_memoryview(buf: Any, fmt: str, shape: tuple[int, ...]) -> memoryview:
    view: Any = memoryview(buf)
    if view.format != fmt or view.shape != shape:
        view = view.cast("B").cast(fmt, shape)
    return view  # type: ignore[no-any-return]


_MARSHAL_WALK_LIMIT = 10_000
_CORE = frozenset({type(None), bool, int, float, complex, str})  # bytes: by size, below
_SEQUENCES = frozenset({tuple, list, set, frozenset})


def _marshallable(value: Any, depth: int = 0) -> bool:
    """True if marshal round-trips ``value`` exactly (exact core types only).

    Big bytes are left to the pickler, which passes them on without a copy.
    """
    t = type(value)
    if t in _CORE:
        return True
    if t is bytes:
        return len(value) < OOB_MIN
    if depth > 8:
        return False
    if t in _SEQUENCES:
        if len(value) > _MARSHAL_WALK_LIMIT:
            return False  # walking a huge container costs more than pickling it
        # a loop, not all(<genexpr>): this runs on every call's arguments
        for v in value:  # noqa: SIM110
            if type(v) not in _CORE and not _marshallable(v, depth + 1):
                return False
        return True
    if t is dict:
        if len(value) > _MARSHAL_WALK_LIMIT:
            return False
        for k, v in value.items():
            if type(k) not in _CORE and not _marshallable(k, depth + 1):
                return False
            if type(v) not in _CORE and not _marshallable(v, depth + 1):
                return False
        return True
    return False


def decode_value(body: bytes | bytearray | memoryview, trailer: int = 0) -> Any:
    """Inverse of ``encode_value`` (pickle is imported only when needed).

    An SHM body carries its mapping as ``body.mapping`` (see ``_shm.attach``).
    ``trailer``: bytes at the end of ``body`` that are not the value's (a call id).
    """
    view = memoryview(body)
    if trailer:
        view = view[: len(view) - trailer]
    codec = body[0]
    if codec == MARSHAL_BYTE:
        return marshal.loads(view[1:])
    if codec == PICKLE_BYTE:
        import pickle

        return pickle.loads(view[1:])
    return loads_oob(view[:1], view[1:], getattr(body, "mapping", None))


class ChannelClosed(EOFError):
    """The other side closed the channel (for the child: the supervisor is gone)."""


READ_SIZE = 1 << 16
"""Bytes asked for per read while looking for a frame: one read brings a whole
small frame (header and body), often several; a bigger body is then read
straight into its own buffer."""

JOIN_LIMIT = 1 << 16
"""Frames up to this size are joined and sent with one write: copying them is
cheaper than a syscall per part, and the reader wakes once."""

_pending = b""
"""Bytes the child read past the last frame it returned (it has one channel)."""


def read_frame(fd: int, poller: Any = None) -> tuple[int, bytes | bytearray]:
    """Block until one whole frame arrives on ``fd``; return (kind, body).

    ``poller``: a ``select.poll`` object watching ``fd`` for input; when no
    bytes are buffered here, the wait for the frame happens in it rather
    than in ``read`` (see ``main._serve`` for why).
    """
    global _pending
    buf = _pending
    if not buf:
        if poller is not None:
            poller.poll()
        buf = os.read(fd, READ_SIZE)
    while len(buf) < HEADER_SIZE:
        chunk = os.read(fd, READ_SIZE)
        if not chunk:
            raise ChannelClosed(f"channel closed after {len(buf)} of {HEADER_SIZE} header bytes")
        buf += chunk
    # parse_header, inlined: this runs once per request of a persistent worker
    length = int.from_bytes(buf[1:HEADER_SIZE], "big")
    end = HEADER_SIZE + length
    if len(buf) >= end:
        _pending = buf[end:]
        return buf[0], buf[HEADER_SIZE:end]
    body = bytearray(length)
    got = len(buf) - HEADER_SIZE
    body[:got] = memoryview(buf)[HEADER_SIZE:]
    _pending = b""
    view = memoryview(body)
    while got < length:
        # the rest lands in its final buffer: no intermediate copies for big bodies
        n = os.readv(fd, [view[got : got + _CHUNK]])
        if n == 0:
            raise ChannelClosed(f"channel closed after {got} of {length} body bytes")
        got += n
    return buf[0], body


def write_frame(fd: int, kind: int, *parts: bytes) -> None:
    """Write one frame (body = ``parts`` concatenated), blocking until sent.

    A small frame is joined and written with one ``write``, a big one with
    ``writev`` (nothing copied): either way the parent wakes once for it.
    """
    size = sum(map(len, parts))
    if size <= JOIN_LIMIT:
        data = b"".join((header(kind, size), *parts))
        sent = os.write(fd, data)
        if sent < len(data):
            _write_all(fd, memoryview(data)[sent:])
        return
    views = [memoryview(header(kind, size))]
    views += [memoryview(p) for p in parts if len(p)]
    while views:
        sent = os.writev(fd, views)
        while views and sent >= views[0].nbytes:
            sent -= views.pop(0).nbytes
        if sent:
            views[0] = views[0][sent:]


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        view = view[os.write(fd, view) :]
