"""How a function worker's interpreter is started (parent side).

The child runs a stub of a few lines given with ``-c`` (``STUB``) that
reads the boot code from its channel and runs it (``BOOT_CODE``, sent first
on the channel, ``boot_head()``), which reads the compiled code of
``_child.channel``, ``_child.boot`` and ``_child.pickling`` from the channel
and executes it.  The command line stays short and says what the worker
is: ``sys.executable -c <stub> <fd> 'aioproc: trainer[3]'``, and once booted
the worker rewrites it to the title alone (``process_title``; "Title" in
``_child.boot``).  Shipping code objects
(compiled once per supervisor) instead of importing the package means a
worker never searches for, reads or compiles aioproc's sources: with
``PYTHONDONTWRITEBYTECODE`` set or a read-only install there are no cached
``.pyc`` files, and compiling them cost every worker several milliseconds.
The worker is the same ``sys.executable``, so the marshal format matches.
A forkserver template starts from the same stub (``_func.template``).
"""

from __future__ import annotations

import collections
import functools
import importlib.util
import marshal
import pickle
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import cloudpickle

from .._child import aio as _aio
from .._child import channel
from .._child import shm as _shm
from .._errors.failure import RemoteTraceback
from . import pickling
from .pickling import Cached, cached, dumps, function_ref, lookup

STUB = (
    "import os,sys\n"
    "def _r(n,b=b'',f=int(sys.argv[1])):\n"
    " while len(b)<n:b+=os.read(f,n-len(b))or sys.exit(1)\n"
    " return b\n"
    "exec(_r(int(_r(8))))"
)
"""The ``-c`` code of a function worker or a template: it reads code from the fd
in ``argv[1]`` (its length in 8 ASCII digits, then the source) and runs it in
``__main__``; a supervisor that closes the channel first ends it (exit 1)."""

BOOT_CODE = """\
import marshal, sys
fd = int(sys.argv[1])
title = sys.argv[2] if len(sys.argv) > 2 else ""
del sys.argv[1:]
try:
    channel_code, boot_code, load_code = marshal.loads(_r(int.from_bytes(_r(8), "big")))
except SystemExit:
    raise SystemExit("aioproc worker: supervisor closed the channel during startup") from None
channel = type(sys)("aioproc._child.channel")
exec(channel_code, channel.__dict__)
_boot = type(sys)("aioproc._child.boot")
_boot.channel = channel
exec(boot_code, _boot.__dict__)
if title:
    _boot.set_title(title)
_load = type(sys)("aioproc._child.pickling")
exec(load_code, _load.__dict__)
# registered so user code can reach aioproc.worker_state() in this process,
# and so functions pickled by value (``_func.pickling``) find their rebuilders
sys.modules["aioproc._child.channel"] = channel
sys.modules["aioproc._child.boot"] = _boot
sys.modules["aioproc._child.pickling"] = _load
del _r, title, channel_code, boot_code, load_code, channel, _load
_boot.main(fd)
"""
"""What the stub runs in a spawned function worker (sent first on its channel)."""

TITLE_LIMIT = 120
"""Characters of a process title kept (``process_title``); the rest is cut."""


def process_title(label: str) -> str:
    """``"trainer/3"`` -> ``"aioproc: trainer[3]"``: what ``ps`` shows for a worker.

    A label without a rank (a persistent worker's own name) is shown as it
    is: ``"aioproc: ckpt"``.  Cut to ``TITLE_LIMIT`` characters; a character
    that cannot be shown (a NUL, which no argument may hold, a control
    character, a lone surrogate) is shown as ``?``.
    """
    group, _, rank = label.rpartition("/")
    name = f"{group}[{rank}]" if group and rank.isdigit() else label
    title = f"aioproc: {name}"[:TITLE_LIMIT]
    return "".join(c if c.isprintable() else "?" for c in title)


def stub_argv(fd: int, title: str) -> list[str]:
    """The command line of a process started from ``STUB`` on channel ``fd``."""
    return [
        sys.executable,
        *subprocess._args_from_interpreter_flags(),  # type: ignore[attr-defined]
        "-c",
        STUB,
        str(fd),
        title,
    ]


def code_frame(source: str) -> bytes:
    """``source`` as ``STUB`` reads it: its length in 8 ASCII digits, then the source."""
    data = source.encode()
    return b"%08d" % len(data) + data


@functools.cache
def boot_blob() -> bytes:
    """Marshalled code of ``_child``'s ``channel``, ``boot`` and ``pickling``, length-prefixed."""
    here = Path(__file__).parent.parent / "_child"
    codes = tuple(
        compile((here / f"{name}.py").read_text(), str(here / f"{name}.py"), "exec")
        for name in ("channel", "boot", "pickling")
    )
    data = marshal.dumps(codes)
    return len(data).to_bytes(8, "big") + data


@functools.cache
def boot_head() -> bytes:
    """What a spawned function worker reads first: ``BOOT_CODE``, then ``boot_blob()``."""
    return code_frame(BOOT_CODE) + boot_blob()


def boot_argv(fd: int, title: str = "aioproc: worker") -> list[str]:
    """argv of a function worker whose channel is ``fd``, shown as ``title``."""
    return stub_argv(fd, title)


def check_worker_loop(value: object) -> str:
    """``worker_loop``, checked: a loop the workers can make, before anything starts.

    Raises:
        ValueError: not one of ``_child.aio.LOOPS``, or ``"uvloop"`` where it is
            not installed (the workers run this interpreter, with this
            process's import path).
    """
    if value not in _aio.LOOPS:
        raise ValueError(f"worker_loop must be 'asyncio' or 'uvloop', got {value!r}")
    if value == "uvloop" and importlib.util.find_spec("uvloop") is None:
        raise ValueError(
            "worker_loop='uvloop' but uvloop is not installed for this Python "
            f"({sys.executable}): pip install uvloop, or pass worker_loop='asyncio'"
        )
    return str(value)


def init_frame(
    *,
    serve: bool = False,
    has_init: bool = False,
    max_frame_size: int | None = None,
    lifeline: bool = True,
    hold: bool = True,
    loop: str = "asyncio",
) -> bytes:
    """Body of the INIT frame: what a worker needs before it runs user code.

    The parent's import path, the worker's mode, the largest frame the
    parent accepts (the worker checks its answers against it), and the
    parent's ``multiprocessing`` authkey, so that Manager proxies passed to
    the worker can authenticate as they do in ``multiprocessing`` children.
    The key travels only over the private channel, never in env or argv.
    ``lifeline``: whether a one-shot worker reads its channel with a thread
    of its own (needed where the supervisor may ask for its stacks at any
    time; see ``_child.boot``).  ``hold``: whether a one-shot worker whose
    function returned waits for TERMINATE before it exits, which its group
    sends once it has every rank's result (torch's ``start_processes``; see
    "Holding" in ``_child.boot``).  A persistent worker (``serve``) ignores it.
    ``loop``: the event loop a worker runs coroutines on, ``"asyncio"`` or
    ``"uvloop"`` (checked by the caller: ``check_worker_loop``).
    """
    # imported here, once per supervisor: ~7 ms that `import aioproc` need not pay
    from multiprocessing import process

    paths = [p for p in sys.path if isinstance(p, str)]
    return marshal.dumps(
        {
            "sys_path": paths,
            "serve": serve,
            "has_init": has_init,
            "lifeline": lifeline,
            "hold": hold,
            "loop": loop,
            "max_frame": channel.MAX_FRAME_SIZE if max_frame_size is None else max_frame_size,
            "authkey": bytes(process.current_process().authkey),
        }
    )


WORKER_FUNCTIONS = 128
"""By-value functions one persistent worker keeps (DEFINE) before it forgets the
least recently called."""

_UNKNOWN: Any = object()
_NO_ID = (0).to_bytes(8, "big")  # in a pickled CALL: no pickle, a function id follows


class Definitions:
    """The functions one persistent worker keeps, as its supervisor tracks them.

    The supervisor decides alone which ids a worker keeps and tells it which
    to forget, so the two never disagree; a worker that replaces another
    starts with a fresh ``Definitions`` and is sent every function again.
    """

    __slots__ = ("_drops", "_ids", "_limit")

    def __init__(self, limit: int = WORKER_FUNCTIONS) -> None:
        self._ids: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._drops: list[int] = []
        self._limit = limit

    def use(self, entry: Cached) -> bytes | None:
        """Body of the DEFINE frame to send just before a call of ``entry``, if needed."""
        ids = self._ids
        if entry.fid in ids:
            ids.move_to_end(entry.fid)
            return None
        return self._define(entry)

    def _define(self, entry: Cached) -> bytes:
        fid = entry.fid
        drops, self._drops = self._drops, []
        while len(self._ids) >= self._limit:
            drops.append(self._ids.popitem(last=False)[0])
        self._ids[fid] = None
        return marshal.dumps((fid, drops, entry.data))

    def forget(self, fid: int) -> None:
        """The call that defined ``fid`` failed: define it again at its next call.

        The failure may have been the unpickling, which another try can get
        past (a module installed since, say); the worker is told to drop
        what it kept with the next definition.
        """
        if self._ids.pop(fid, 0) is None:
            self._drops.append(fid)


class CallEncoder:
    """Encodes CALL frame bodies for one function, pickling it at most once.

    A function importable by name whose arguments are core types travels as
    marshal data (the worker then never imports pickle); otherwise the
    function is pickled once and each call's arguments separately, by value
    where needed (``_func.pickling``: cloudpickle only for what needs it).
    For a persistent worker (``encode_call``) a by-value function is sent
    once per worker and then named by its id (see ``_func.pickling.cached``).
    """

    __slots__ = ("_fn", "_pickled", "_ref")

    def __init__(self, fn: Any, ref: tuple[str, str] | None = _UNKNOWN) -> None:
        """``ref``: ``function_ref(fn)`` when the caller has it already."""
        self._fn = fn
        self._ref = function_ref(fn) if ref is _UNKNOWN else ref
        self._pickled: bytes | None = None

    def encode(
        self,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        segments: list[_shm.Segment] | None = None,
    ) -> list[bytes]:
        """CALL body parts; with ``segments``, large arguments go to shared memory.

        A memfd made for large arguments is appended to ``segments`` (see
        ``channel.pickle_parts``): the caller passes it with the frame or
        closes it.
        """
        if self._ref is not None:
            call: Any = None
            if type(args) is tuple and not args and type(kwargs) is dict and not kwargs:
                call = (*self._ref, (), {})
            elif channel._marshallable(args) and channel._marshallable(kwargs):
                # exact tuple/list and dict: what the worker unpacks into the call
                call = (*self._ref, args, kwargs)
            if call is not None:
                return [channel.MARSHAL, marshal.dumps(call)]
        args, kwargs = tuple(args), dict(kwargs)
        if self._pickled is None:
            try:
                self._pickled = dumps(self._fn)
            except Exception as e:
                raise TypeError(f"function {self._fn!r} cannot be pickled: {e}") from e
        fn = self._pickled
        return self._args(args, kwargs, segments, len(fn).to_bytes(8, "big"), fn)

    def _args(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        segments: list[_shm.Segment] | None,
        *fn_parts: bytes,
    ) -> list[bytes]:
        """A pickled CALL body: codec, ``fn_parts``, then the arguments."""
        try:
            # data: plain pickle opcodes (the worker imports no cloudpickle for
            # them); a function or class among them travels by value
            codec, *pickled_args = channel.pickle_parts(
                (args, kwargs), channel._pickler(cloudpickle.Pickler), segments
            )
        except Exception as e:
            raise TypeError(f"arguments for {self._fn!r} cannot be pickled: {e}") from e
        return [codec, *fn_parts, *pickled_args]


def encode_call(
    fn: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    segments: list[_shm.Segment] | None,
) -> tuple[list[bytes], Cached | None]:
    """CALL body parts for a persistent worker, and the by-value function it names.

    With a ``Cached`` entry the body names the function by its id: the
    caller must precede the frame with the DEFINE that ``Definitions.use``
    gives (decided when the frame is written, not now: a call that waits
    for its turn may be cancelled before it is sent).  A
    ``functools.partial`` is unwrapped into its function and arguments,
    which is what calling it does, so that function is cached (or named by
    reference) too.

    Raises:
        TypeError: ``fn`` or the arguments cannot be pickled.
    """
    while type(fn) is functools.partial:
        args = (*fn.args, *args)
        kwargs = {**fn.keywords, **kwargs} if fn.keywords else kwargs
        fn = fn.func
    marshallable = (not args and not kwargs) or (
        channel._marshallable(args) and channel._marshallable(kwargs)
    )
    # first: a cached function needs no function_ref (the rest: one dict lookup)
    entry = lookup(fn) if id(fn) in pickling._cache else None
    if entry is None:
        ref = function_ref(fn)
        if ref is not None and marshallable:
            return [channel.MARSHAL, marshal.dumps((*ref, args, kwargs))], None  # CallEncoder's
        entry = cached(fn) if ref is None and type(fn) is _FunctionType else None
        if entry is None:
            return CallEncoder(fn, ref).encode(args, kwargs, segments), None
    if marshallable:
        return [channel.MARSHAL, marshal.dumps((entry.fid, args, kwargs))], entry
    fid = entry.fid.to_bytes(8, "big")
    return CallEncoder(fn)._args(args, kwargs, segments, _NO_ID, fid), entry


_FunctionType = type(encode_call)


def rebuild_exception(body: bytes | bytearray) -> BaseException | None:
    """The exception a worker reported in an ERROR frame, with its traceback.

    The worker's own exception object when it unpickles, else a
    ``RemoteTraceback`` with its type and message; either way its
    ``__cause__`` is a ``RemoteTraceback`` holding the worker's traceback.
    """
    try:
        report = pickle.loads(body)
    except Exception:
        return None
    exc: BaseException | None = None
    if report.get("exception") is not None:
        try:
            exc = pickle.loads(report["exception"])
        except Exception:
            exc = None
    if not isinstance(exc, BaseException):
        exc = RemoteTraceback(f"{report['type']}: {report['message']}")
    exc.__cause__ = RemoteTraceback(report["traceback"])
    return exc
