"""Frame format of the control channel, and the child's blocking half.

A frame is a 9-byte header (kind: 1 byte, body length: 8 bytes, big endian)
followed by the body.  The parent reads frames with an asyncio protocol
(``_channel``); the child, which must not import asyncio, reads and writes
them here with plain ``os.read``/``os.write`` on the inherited socket fd.

Bodies that carry Python values start with a codec byte: MARSHAL for values
made only of core types (``marshal`` is built in, so a worker that needs
nothing else never imports ``pickle``), PICKLE for everything else.
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
CALL = 2  # codec byte + (MARSHAL: (module, qualname, args, kwargs) | PICKLE: see bootstrap)
PING = 3  # persistent workers: answered with PONG
TERMINATE = 4  # persistent workers: exit 0 now
# child -> parent
PONG = 12
RESULT = 10  # codec byte + the return value
ERROR = 11  # pickled dict describing the exception (see _bootstrap.error_report)

MARSHAL = b"M"
PICKLE = b"P"
MARSHAL_BYTE = MARSHAL[0]

KIND_NAMES = {
    INIT: "INIT",
    CALL: "CALL",
    PING: "PING",
    TERMINATE: "TERMINATE",
    PONG: "PONG",
    RESULT: "RESULT",
    ERROR: "ERROR",
}
CHILD_KINDS = frozenset({PONG, RESULT, ERROR})
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


def encode_value(value: Any) -> list[bytes]:
    """Codec byte + body: marshal for core types, pickle otherwise."""
    if _marshallable(value):
        try:
            return [MARSHAL, marshal.dumps(value)]
        except ValueError:
            pass
    return [PICKLE, dumps(value)]


_MARSHAL_WALK_LIMIT = 10_000
_CORE = frozenset({type(None), bool, int, float, complex, str, bytes})
_SEQUENCES = frozenset({tuple, list, set, frozenset})


def _marshallable(value: Any, depth: int = 0) -> bool:
    """True if marshal round-trips ``value`` exactly (exact core types only)."""
    t = type(value)
    if t in _CORE:
        return True
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


def decode_value(body: bytes | bytearray | memoryview) -> Any:
    """Inverse of ``encode_value`` (pickle is imported only when needed)."""
    view = memoryview(body)[1:]
    if body[0] == MARSHAL_BYTE:
        return marshal.loads(view)
    import pickle

    return pickle.loads(view)


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


def read_frame(fd: int) -> tuple[int, bytes | bytearray]:
    """Block until one whole frame arrives on ``fd``; return (kind, body)."""
    global _pending
    buf = _pending or os.read(fd, READ_SIZE)
    while len(buf) < HEADER_SIZE:
        chunk = os.read(fd, READ_SIZE)
        if not chunk:
            raise ChannelClosed(f"channel closed after {len(buf)} of {HEADER_SIZE} header bytes")
        buf += chunk
    kind, length = parse_header(buf)
    end = HEADER_SIZE + length
    if len(buf) >= end:
        _pending = buf[end:]
        return kind, buf[HEADER_SIZE:end]
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
    return kind, body


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
