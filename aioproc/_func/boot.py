"""How a function worker's interpreter is started (parent side).

The child runs a few lines given with ``-c`` that read the compiled code of
``_child.channel`` and ``_child.boot`` from the channel and execute it.  Shipping code
objects (compiled once per supervisor) instead of importing the package
means a worker never searches for, reads or compiles aioproc's sources:
with ``PYTHONDONTWRITEBYTECODE`` set or a read-only install there are no
cached ``.pyc`` files, and compiling them cost every worker several
milliseconds.  The worker is the same ``sys.executable``, so the marshal
format matches.
"""

from __future__ import annotations

import functools
import marshal
import pickle
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import cloudpickle

from .._child import channel as _wire
from .._child import shm as _shm
from .._errors.failure import RemoteTraceback
from .pickling import dumps, function_ref

BOOT_CODE = """\
import marshal, os, sys
fd = int(sys.argv[1])
del sys.argv[1]
def _read(n):
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            raise SystemExit("aioproc worker: supervisor closed the channel during startup")
        buf += chunk
    return buf
wire_code, boot_code, load_code = marshal.loads(_read(int.from_bytes(_read(8), "big")))
_wire = type(sys)("aioproc._child.channel")
exec(wire_code, _wire.__dict__)
_boot = type(sys)("aioproc._child.boot")
_boot._wire = _wire
exec(boot_code, _boot.__dict__)
_load = type(sys)("aioproc._child.pickling")
exec(load_code, _load.__dict__)
# registered so user code can reach aioproc.worker_state() in this process,
# and so functions pickled by value (_funcpickle) find their rebuilders
sys.modules["aioproc._child.channel"] = _wire
sys.modules["aioproc._child.boot"] = _boot
sys.modules["aioproc._child.pickling"] = _load
del _read, wire_code, boot_code, load_code, _wire, _load
_boot.main(fd)
"""


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


def boot_argv(fd: int) -> list[str]:
    """argv of a function worker whose channel is ``fd``."""
    return [
        sys.executable,
        *subprocess._args_from_interpreter_flags(),  # type: ignore[attr-defined]
        "-c",
        BOOT_CODE,
        str(fd),
    ]


def init_frame(
    *,
    serve: bool = False,
    has_init: bool = False,
    max_frame_size: int | None = None,
    lifeline: bool = True,
    hold: bool = True,
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
            "max_frame": _wire.MAX_FRAME_SIZE if max_frame_size is None else max_frame_size,
            "authkey": bytes(process.current_process().authkey),
        }
    )


class CallEncoder:
    """Encodes CALL frame bodies for one function, pickling it at most once.

    A function importable by name whose arguments are core types travels as
    marshal data (the worker then never imports pickle); otherwise the
    function is pickled once and each call's arguments separately, by value
    where needed (``_func.pickling``: cloudpickle only for what needs it).
    """

    __slots__ = ("_fn", "_pickled", "_ref")

    def __init__(self, fn: Any) -> None:
        self._fn = fn
        self._ref = function_ref(fn)
        self._pickled: bytes | None = None

    def encode(
        self,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        segments: list[_shm.Segment] | None = None,
    ) -> list[bytes]:
        """CALL body parts; with ``segments``, large arguments go to shared memory.

        A memfd made for large arguments is appended to ``segments`` (see
        ``_wire.pickle_parts``): the caller passes it with the frame or
        closes it.
        """
        if self._ref is not None:
            call: Any = None
            if type(args) is tuple and not args and type(kwargs) is dict and not kwargs:
                call = (*self._ref, (), {})
            elif _wire._marshallable(args) and _wire._marshallable(kwargs):
                # exact tuple/list and dict: what the worker unpacks into the call
                call = (*self._ref, args, kwargs)
            if call is not None:
                return [_wire.MARSHAL, marshal.dumps(call)]
        args, kwargs = tuple(args), dict(kwargs)
        if self._pickled is None:
            try:
                self._pickled = dumps(self._fn)
            except Exception as e:
                raise TypeError(f"function {self._fn!r} cannot be pickled: {e}") from e
        try:
            # data: plain pickle opcodes (the worker imports no cloudpickle for
            # them); a function or class among them travels by value
            codec, *pickled_args = _wire.pickle_parts(
                (args, kwargs), _wire._pickler(cloudpickle.Pickler), segments
            )
        except Exception as e:
            raise TypeError(f"arguments for {self._fn!r} cannot be pickled: {e}") from e
        fn = self._pickled
        return [codec, len(fn).to_bytes(8, "big"), fn, *pickled_args]


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
