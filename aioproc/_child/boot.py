"""Child side of a function worker.  Standard library (and the user's code) only.

The supervisor starts ``sys.executable -c <stub> <fd> <title>`` (see
``_func.boot``) where ``fd`` is this worker's end of a socketpair.  Over it
the child receives its boot code, this module and ``_child.channel`` as
compiled code, then INIT (the parent's ``sys.path``) and CALL (the function
and its arguments), runs the function in the main thread and answers with
RESULT or ERROR before exiting.
After a RESULT it waits for the supervisor's TERMINATE before it exits (see
"Holding" below).

Kept deliberately light: asyncio, anyio, uvloop and the parent-side
aioproc modules are never imported here (a test checks ``sys.modules``), and
``signal``/``threading`` are replaced by their C cores so a worker starts
almost as fast as a bare interpreter.  A function importable by name with
arguments and a result made of core types travels as ``marshal`` data, so
such a worker never even imports ``pickle``; everything else is pickled
(``_pickle``).  Functions that travel by value (lambdas, closures,
``__main__`` functions) are rebuilt by ``_child.pickling`` (shipped like this
module); cloudpickle is imported by the unpickler only for what
``_func.pickling`` leaves to it (classes defined in ``__main__``, for one).

A persistent worker also keeps functions the supervisor defines once
(DEFINE: a by-value function and its id, sent in the same write as the CALL
that first uses it); later CALLs name them by id, and ``_child.pickling``
puts such a function back as it was defined before each call, so a call
sees what a freshly unpickled copy would (see ``_func.pickling.cached``).

Lifeline: in a worker of a cluster run, whose supervisor may ask for its
stacks at any time, a daemon thread blocks on the channel; EOF means the
supervisor is gone, and the worker then SIGKILLs its own process group
(itself and every descendant).  Any other one-shot worker runs no thread of
its own: the supervisor sends it nothing but RELEASE and TERMINATE after
CALL, which ``barrier()`` and the hold (below) read in the thread that waits;
a dead supervisor's groups are killed by its guardian (``_proc.lifeline``),
as binary workers' are, and a channel the supervisor closes on a protocol
error comes with a SIGKILL to the group.  A second thread costs every exit:
64 workers exit 2.5-4.4 ms later with one blocked in ``read()``
(``benchmarks/RESULTS.md``).

Title: ``ps -o args`` (``/proc/<pid>/cmdline``) shows a process's command
line, for a function worker or a template an interpreter running a short
boot stub, alike for every worker.  ``set_title`` rewrites it to a title
(``aioproc: trainer[3]``) without a dependency (setproctitle) or C: the
command line lives in the process's own memory, between ``arg_start`` and
``arg_end`` of ``/proc/self/stat``, and ``/proc/self/mem`` lets the process
write there.  The title is written NUL-terminated and the span's last byte
made non-NUL: that is how the kernel tells a rewritten command line
(setproctitle(3)'s) from the original, and it then reads it up to the first
NUL, so the title alone is shown.  Python keeps its own copies of the
arguments (``sys.argv``, ``sys.orig_argv``): nothing reads the span after
start-up.  Best effort: where ``/proc`` cannot be written the command line
stays as it was, and a title longer than the span is cut to fit.  A
template's forks write over the span the template read (a fork has its
memory at the same addresses).

Holding: as torch's ``start_processes`` does, a worker whose function
returned stays alive until the supervisor has read every local worker's
result.  Exiting while the others still run would tear down what the
function left behind (a gloo process group never destroyed, whose peers are
still talking to it) under their feet, and they abort.  So after its RESULT
a worker waits for TERMINATE, which the supervisor sends once every rank of
the group has its outcome, or when it stops the group (before the stop's
signal); an interrupt (SIGINT, the default handler) or EOF end the wait
too.  Failures (ERROR, ``sys.exit`` in the function) exit at once: the
supervisor stops the group anyway.
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # signal's C core: no enum import
import _thread
import marshal
import os
import sys

if "channel" not in globals():
    # Imported normally.  When the supervisor ships this module as a code
    # object (see ``_func.boot``), it pre-binds ``_child.channel`` so no package import runs.
    from aioproc._child import channel

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any, NoReturn

# argv[1]: directory holding the aioproc package; argv[2]: channel fd
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"


def _lifeline(fd: int, started: Any) -> None:
    """The lifeline thread: serve the supervisor's requests until it goes away."""
    started.release()
    _serve_requests(fd, until_release=False)


def _serve_requests(fd: int, *, until_release: bool) -> str:
    """Read the supervisor's requests; kill this worker's group when it goes away.

    After CALL the supervisor sends only RELEASE (a barrier passed or broke),
    DUMP (print every thread's stack) and, after the RESULT, TERMINATE (the
    hold is over: see "Holding"); EOF means it is gone.  Returns
    RELEASE's text if ``until_release`` (a waiter at the barrier reading for
    itself); otherwise hands it to the waiter.
    """
    try:
        while True:
            kind, body = channel.read_frame(fd)
            if kind == channel.RELEASE:
                answer = bytes(body).decode("utf-8", "replace")
                if until_release:
                    return answer
                _BARRIER["answer"] = answer
                _BARRIER["lock"].release()
            elif kind == channel.DUMP:
                _dump_stacks(fd)
            elif kind == channel.TERMINATE and _HOLD is not None and _HOLD.locked():
                _HOLD.release()  # the group has every result: the main thread exits
    except (channel.ChannelClosed, OSError):
        pass
    _supervisor_gone()


def _supervisor_gone() -> NoReturn:
    """The supervisor is gone: this worker's process group goes with it."""
    os.killpg(os.getpgid(0), _signal.SIGKILL)
    os._exit(137)  # not reached: SIGKILL is not blocked


_WRITE_LOCK = _thread.allocate_lock()
"""Frames come from the main thread, the lifeline and any thread at a barrier."""

_ONE_SHOT_FD: int | None = None
"""The channel of a one-shot function worker once it runs its function."""

_BARRIER: dict[str, Any] = {"lock": None, "answer": ""}

_HOLD: Any = None
"""With a lifeline thread: the lock the main thread waits on after its RESULT,
released by the lifeline when TERMINATE comes (see "Holding")."""


def _hold(fd: int) -> None:
    """After the RESULT: wait for the supervisor's TERMINATE (see "Holding").

    The lifeline thread, if any, reads the channel and releases ``_HOLD``;
    otherwise this thread reads it.  EOF: the supervisor is done with this
    worker (or gone: its guardian ends the group), so the wait is over too.
    A SIGINT's ``KeyboardInterrupt`` ends the wait quietly, by that signal:
    the function had returned, there is no traceback to show.
    """
    try:
        if _HOLD is not None:
            _HOLD.acquire()
            return
        # in poll(), not read(): the parent reading a large RESULT would wake
        # a reader of this socket at each of its reads (see ``_serve``)
        import select

        poller = select.poll()
        poller.register(fd, select.POLLIN)
        while channel.read_frame(fd, poller)[0] != channel.TERMINATE:
            pass  # after a RESULT nothing else is sent: never reached
    except (channel.ChannelClosed, OSError):
        pass
    except KeyboardInterrupt:
        _flush_std()
        _signal.signal(_signal.SIGINT, _signal.SIG_DFL)
        os.kill(os.getpid(), _signal.SIGINT)
        os._exit(130)  # not reached unless SIGINT is blocked


def _write(fd: int, kind: int, *parts: bytes) -> None:
    with _WRITE_LOCK:
        channel.write_frame(fd, kind, *parts)


def _dump_stacks(fd: int) -> None:
    """faulthandler's dump of every thread: into stderr, and to the supervisor."""
    import faulthandler
    import tempfile

    with tempfile.TemporaryFile() as f:
        faulthandler.dump_traceback(f, all_threads=True)
        f.seek(0)
        text = f.read()
    try:
        os.write(2, b"aioproc: stacks of every thread (the supervisor asked)\n" + text)
    except OSError:
        pass  # no stderr: the supervisor still gets the text
    _write(fd, channel.STACKS, text)


def barrier() -> None:
    """Wait inside a worker until every worker of its group called ``barrier()``.

    The group is the cluster run (all the tasks of its cluster spec) or the
    ``run``/``start_processes`` group (all its ranks).  Reusable: the n-th
    call of every worker meets the n-th call of the others.  The worker's
    side: ARRIVE on its control channel, then a wait for RELEASE
    (``barrier_wait``); the supervisor's side is ``aioproc._func.barrier``.

    It blocks the calling thread: a coroutine awaits :func:`abarrier`
    instead, and ``barrier()`` called where an asyncio loop runs (the
    worker's own, when its function is ``async def``) is an error.

    Raises:
        ValueError: called outside a function worker started by aioproc
            (in the supervisor, or in a persistent/pool worker), as TF's
            ``multi_process_runner`` raises there, with TF's words.
        RuntimeError: called on a running event loop's thread.
        threading.BrokenBarrierError: a worker of the group ended without
            reaching the barrier; the message names it.
    """
    _check_barrier(ValueError)
    barrier_wait()


async def abarrier() -> None:
    """``barrier()`` for a coroutine: await every worker of the group at the barrier.

    The worker's loop keeps running meanwhile (its other tasks, and its
    stop: a stop signal cancels the wait with the rest of the main task).
    It is the same barrier as ``barrier()``: the n-th call of a worker,
    sync or async, meets the n-th call of the others.  A cancelled wait
    does not take the arrival back: the worker counts as arrived.

    Raises:
        ValueError: awaited outside a function worker started by aioproc.
        threading.BrokenBarrierError: a worker of the group ended without
            reaching the barrier; the message names it.
    """
    _check_barrier(ValueError)
    await abarrier_wait()


def _check_barrier(error: type[Exception]) -> None:
    """Raise ``error`` (TF's words) or RuntimeError outside a one-shot function worker."""
    if _ONE_SHOT_FD is not None:
        return
    if error is ValueError:
        raise ValueError(
            "barrier is not defined. It is likely because you are calling barrier() in the "
            "main process. barrier() can only be called in the subprocesses: the function "
            "workers aioproc starts (cluster.run, ClusterRunner, run or start_processes)."
        )
    raise RuntimeError(
        "barrier() works only inside a function worker started by aioproc "
        "(cluster.run, ClusterRunner, run or start_processes)"
    )


def barrier_wait() -> None:
    """Block until every worker of the group reached its barrier.

    Raises:
        RuntimeError: not inside a one-shot function worker started by
            aioproc, or called on a running event loop's thread (it would
            block that loop: ``abarrier_wait`` is the way there).
        threading.BrokenBarrierError: a worker of the group ended without
            reaching the barrier (or the supervisor broke it).
    """
    _check_barrier(RuntimeError)
    asyncio = sys.modules.get("asyncio")  # no loop can run where asyncio is not loaded
    if asyncio is not None and asyncio._get_running_loop() is not None:
        raise RuntimeError(
            "barrier() was called on a running event loop, which it would block (with the "
            "worker's stop signal and every other task) until every worker arrives: in a "
            "coroutine, use `await aioproc.cluster.abarrier()` (or "
            "`await aioproc.testing.abarrier()` in a test rank)"
        )
    fd = _ONE_SHOT_FD
    assert fd is not None
    with _BARRIER_CALL:  # one waiter per worker: the supervisor counts workers
        try:
            _write(fd, channel.ARRIVE)
        except (channel.ChannelClosed, OSError):
            _supervisor_gone()  # arriving after it went away: as a waiter would
        if _BARRIER["lock"] is None:
            answer = _serve_requests(fd, until_release=True)  # no lifeline thread reads
        else:
            _BARRIER["lock"].acquire()
            answer = _BARRIER["answer"]
    if answer:
        import threading

        raise threading.BrokenBarrierError(answer)


_BARRIER_CALL = _thread.allocate_lock()


async def abarrier_wait() -> None:
    """``barrier_wait`` awaited: it blocks a thread of its own, not the loop.

    The thread does what ``barrier_wait`` does (one waiter per worker, the
    channel read by it or by the lifeline) and hands the outcome to the
    loop; it ends with the wait, also when the awaiting task was cancelled
    (nobody takes the outcome then).

    Raises:
        RuntimeError: not inside a one-shot function worker started by aioproc.
        threading.BrokenBarrierError: see ``barrier_wait``.
    """
    _check_barrier(RuntimeError)
    import asyncio

    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def settle(error: BaseException | None) -> None:
        if done.done():
            return  # the wait was cancelled
        if error is None:
            done.set_result(None)
        else:
            done.set_exception(error)

    def wait() -> None:
        error: BaseException | None = None
        try:
            barrier_wait()
        except BaseException as e:
            error = e
        try:
            loop.call_soon_threadsafe(settle, error)
        except RuntimeError:
            pass  # the loop is closed: nobody waits any more

    _thread.start_new_thread(wait, ())
    await done


def error_report(exc: BaseException) -> dict[str, Any]:
    """Describe ``exc`` for the parent: type, message, traceback, and the object.

    The exception itself is pickled when possible so the parent can re-raise
    the real type; the formatted traceback always travels as text.
    """
    import traceback

    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        pickled: bytes | None = channel.dumps(exc)
    except Exception:
        pickled = None
    return {
        "type": f"{type(exc).__module__}.{type(exc).__qualname__}",
        "message": str(exc),
        "traceback": tb,
        "exception": pickled,
    }


_FROMLIST = ("__name__",)  # makes __import__ return the module itself, not its package

_FUNCS: dict[int, Any] = {}
"""Functions the supervisor defined in this persistent worker (DEFINE), by its id:
``(function, restore, its plan)``, or the exception that unpickling one raised."""


def _funcload() -> Any:
    """``_child.pickling``: registered by the boot code, imported when run in place."""
    module = sys.modules.get("aioproc._child.pickling")
    if module is None:
        module = __import__("aioproc._child.pickling", None, None, _FROMLIST)
    return module


def _define(body: bytes | bytearray) -> None:
    """DEFINE: unpickle a function once and keep it under the supervisor's id.

    The supervisor says which ids to forget (it bounds what a worker keeps);
    an unpickling error is kept too and raised by the call that uses the id.
    """
    fid, drops, data = marshal.loads(body)
    for old in drops:
        _FUNCS.pop(old, None)
    try:
        funcload = _funcload()
        fn, plan = funcload.define(data)
        _FUNCS[fid] = (fn, funcload.restore, plan)
    except Exception as e:
        _FUNCS[fid] = e


def _defined(fid: int) -> Any:
    """The function defined under ``fid``, put back as it was defined."""
    entry = _FUNCS.get(fid)
    if type(entry) is tuple:
        fn, restore, plan = entry
        restore(plan)
        return fn
    if entry is None:
        raise RuntimeError(f"aioproc worker: no function was defined under id {fid}")
    raise entry


def _load_call(body: bytes | bytearray | memoryview) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    view = memoryview(body)
    if body[0] == channel.MARSHAL_BYTE:
        call = marshal.loads(view[1:])
        if len(call) == 3:  # a function the supervisor defined (DEFINE)
            fid, args, kwargs = call
            entry = _FUNCS.get(fid)
            if type(entry) is tuple:  # _defined, inlined
                entry[1](entry[2])
                return entry[0], args, kwargs
            return _defined(fid), args, kwargs
        module, qualname, args, kwargs = call
        # a module already imported (and not half-way) is taken from
        # sys.modules: __import__ costs ~1.5 us, a fifth of a no-op call's turn
        fn: Any = sys.modules.get(module)
        if fn is None or getattr(getattr(fn, "__spec__", None), "_initializing", False):
            fn = __import__(module, None, None, _FROMLIST)
        if "." in qualname:
            for part in qualname.split("."):
                fn = getattr(fn, part)
        else:
            fn = getattr(fn, qualname)
        return fn, args, kwargs
    import _pickle

    codec = view[:1]
    fn_len = int.from_bytes(view[1:9], "big")
    if fn_len:
        fn = _pickle.loads(view[9 : 9 + fn_len])
        rest = view[9 + fn_len :]
    else:  # the id of a function the supervisor defined
        fn = _defined(int.from_bytes(view[9:17], "big"))
        rest = view[17:]
    if codec == channel.PICKLE:
        args, kwargs = _pickle.loads(rest)
    else:
        mapping = None
        if codec == channel.SHM:
            if _FD_SOCKET is None:
                raise RuntimeError("shared-memory arguments, but this worker has no fd socket")
            from aioproc._child import shm as _shm

            mapping = _shm.worker_map(rest, _FD_SOCKET)
        args, kwargs = channel.loads_oob(codec, rest, mapping)
    return fn, args, kwargs


_FD_SOCKET: int | None = None
"""This worker's end of its fd socket (see ``aioproc._child.shm``), from FD_SOCKET."""


def _encode(value: Any) -> tuple[list[bytes], list[Any] | None]:
    """``channel.encode_value`` and the memfds it made (sent by ``_send_result``)."""
    segments: list[Any] | None = [] if _FD_SOCKET is not None else None
    return channel.encode_value(value, segments), segments


def _send_result(fd: int, parts: list[bytes], segments: list[Any] | None) -> None:
    """Write a RESULT frame, its memfds (if any) first on the fd socket."""
    if segments:
        from aioproc._child import shm as _shm

        assert _FD_SOCKET is not None
        _shm.send(_shm.worker_socket(_FD_SOCKET), segments)
    _write(fd, channel.RESULT, *parts)


_MAX_FRAME = channel.MAX_FRAME_SIZE  # the parent's cap, from INIT


def _check_size(parts: list[bytes], what: str, value: Any) -> None:
    """Refuse to send an answer the parent would reject as oversized.

    ``what`` (formatted with ``value``'s type) names it in the error.
    """
    size = sum(map(len, parts))
    if size > _MAX_FRAME:
        what = what.format(type(value).__qualname__)
        raise ValueError(
            f"{what} encodes to {size} bytes ({channel.format_size(size)}), over the "
            f"{channel.format_size(_MAX_FRAME)} limit of aioproc's control channel; "
            "pass data that large through a file or shared memory"
        )


def _error_frame(exc: BaseException) -> bytes:
    """ERROR frame body for ``exc``, cut down to fit under the parent's cap."""
    body = channel.dumps(error_report(exc))
    if len(body) <= _MAX_FRAME:
        return body
    report = error_report(exc)
    keep = min(1 << 16, _MAX_FRAME // 4)
    for key in ("message", "traceback"):
        text = report[key]
        if len(text) > keep:
            cut = f"\n[... {len(text) - keep} characters cut ...]\n"
            report[key] = text[: keep // 2] + cut + text[-keep // 2 :]
    report["exception"] = None  # too big to carry: the parent rebuilds it from the text
    return channel.dumps(report)


class _AuthkeyHook:
    """Gives ``multiprocessing`` the supervisor's authkey when it is first imported.

    Manager proxies authenticate with ``current_process().authkey``, which
    ``multiprocessing`` children inherit from their parent; a function worker
    must have the supervisor's key too.  Importing ``multiprocessing`` costs
    ~7 ms, more than a whole worker start, so instead of importing it here a
    one-shot meta path finder sets the key the moment user code (or the
    unpickling of a proxy argument) imports ``multiprocessing.process``.
    """

    def __init__(self, key: bytes) -> None:
        self.key = key

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != "multiprocessing.process":
            return None
        sys.meta_path.remove(self)
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        exec_module = getattr(loader, "exec_module", None)
        if exec_module is None:
            return spec
        key = self.key

        def exec_then_set_key(module: Any) -> None:
            exec_module(module)
            module.current_process().authkey = key

        loader.exec_module = exec_then_set_key  # this loader instance serves this import only
        return spec


def _set_authkey(key: bytes | None) -> None:
    if not key:
        return
    process = sys.modules.get("multiprocessing.process")
    if process is not None:
        process.current_process().authkey = key
    else:
        sys.meta_path.insert(0, _AuthkeyHook(key))


def _flush_std() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except Exception:
            pass


def _fail(fd: int, exc: BaseException, *, record: bool = True) -> NoReturn:
    """Report ``exc`` (error.json + ERROR frame), print it, exit with code 1."""
    import traceback

    if record and os.environ.get(ERROR_FILE_ENV):
        from aioproc._child.errorfile import write_error_file

        write_error_file(os.environ[ERROR_FILE_ENV], exc)
    try:
        traceback.print_exception(type(exc), exc, exc.__traceback__)
    except (OSError, ValueError):
        pass  # stderr on a full disk (ENOSPC) or closed: the ERROR frame still goes
    try:
        _write(fd, channel.ERROR, _error_frame(exc))
    except OSError:
        pass  # supervisor gone: its guardian (or our lifeline) is ending us
    # exit like a script with an uncaught exception: atexit handlers run
    raise SystemExit(1)


STATE: Any = None
"""What the persistent worker's ``init`` returned (read via ``aioproc.worker_state``)."""


def worker_state() -> Any:
    """Inside a persistent worker: the value its ``init`` returned.

    This is how functions sent with ``WorkerProcess.call()`` reach state
    created once per worker (an open file, a model, a connection)::

        def write(step):
            writer = aioproc.worker_state()
            writer.write(step)

    Coroutine functions reach it the same way, on the worker's loop; an
    ``async def`` init's value is the state once it returned.

    Raises:
        RuntimeError: outside a persistent worker.
    """
    if not _SERVING:
        raise RuntimeError("worker_state() is only available inside a persistent worker")
    return STATE


# imported by users from the package itself; set here, where it is defined
# (``_child`` imports the standard library only, not ``_base``'s helper), so
# its name never depends on the path that reached it
worker_state.__module__ = "aioproc"


_SERVING = False

_LOOP = "asyncio"
"""The event loop a persistent worker runs coroutine calls on (INIT's ``loop``)."""

_ID_SIZE = channel.ID_SIZE


async def _probe() -> None:
    pass


_COROUTINE = type(_probe_coroutine := _probe())
"""The type of what calling an ``async def`` function returns (without importing ``types``)."""
_probe_coroutine.close()
del _probe_coroutine
_FUNCTION = type(_probe)
_CO_COROUTINE = 0x80  # inspect.CO_COROUTINE
_MARKED = sys.version_info >= (3, 12)  # inspect.markcoroutinefunction can mark any function
_NEVER_COROUTINES = frozenset({type, type(len), type(str.join), type(str.__add__)})
"""Classes, builtins and slot methods: never coroutine functions, unless marked so."""


def _serve(fd: int, has_init: bool) -> None:
    """Persistent worker: answer the supervisor's requests until TERMINATE or EOF.

    The first CALL is ``init`` when ``has_init``: its return value becomes
    the worker state, and a failed ``init`` ends the worker.  An exception
    in a later call is reported and the worker stays usable.  EOF on the
    channel means the supervisor is gone: exit (the guardian also kills the
    group).

    Calls run in this thread one after the other (``_serve_calls``) until one
    returns a coroutine; from then on the worker serves its channel on an
    event loop (``_LoopServer``), where coroutine calls run concurrently.
    asyncio is imported only then, so a worker that never runs a coroutine
    never pays for it.
    """
    global _SERVING
    _SERVING = True
    first = has_init
    while True:
        cid, coro, first = _serve_calls(fd, first)
        try:
            loop = _new_loop(_LOOP)
        except Exception as e:
            coro.close()
            channel.write_frame(fd, channel.ERROR, _error_frame(e), cid)
            if first:
                _flush_std()
                raise SystemExit(1) from None
            first = False
            continue
        _LoopServer(fd, loop).run(cid, coro, first)


def _serve_calls(fd: int, first: bool) -> tuple[bytes, Any, bool]:
    """Answer requests in this thread until a call returns a coroutine.

    Returns:
        That call's id, its coroutine (not started), and whether it is ``init``.
    """
    global STATE
    # Wait for requests in poll(), not in read(): a task blocked in read() on
    # a Unix stream socket is also woken each time the parent consumes one
    # of its replies (the socket's "writable again" wakeup reaches every
    # sleeper), so every call cost a spurious wakeup of this process, which
    # preempted the parent or crossed to another CPU.  poll() wakes for
    # input (or hangup) only.
    import select

    poller = select.poll()
    poller.register(fd, select.POLLIN)
    read_frame = channel.read_frame
    header_size = channel.HEADER_SIZE
    while True:
        try:
            if channel._pending:
                kind, body = read_frame(fd, poller)
            else:
                # read_frame's usual case, inlined: one read brings one whole frame
                poller.poll()
                data = os.read(fd, channel.READ_SIZE)
                if len(data) >= header_size and len(data) == header_size + int.from_bytes(
                    data[1:header_size], "big"
                ):
                    kind, body = data[0], data[header_size:]
                else:
                    channel._pending = data
                    kind, body = read_frame(fd)
                del data
        except (channel.ChannelClosed, OSError):
            os._exit(0)
        if kind != channel.CALL:
            if kind == channel.DEFINE:
                _define(body)  # its CALL follows, usually in the same read
            elif kind == channel.PING:
                channel.write_frame(fd, channel.PONG, bytes(body))  # the ping's id
            elif kind == channel.CANCEL:
                pass  # its call has returned: the answer is on its way
            elif kind == channel.TERMINATE:
                _flush_std()
                sys.exit(0)
            else:
                raise RuntimeError(f"aioproc worker: unexpected frame kind {kind}")
            continue
        cid: Any = body[-_ID_SIZE:]  # bytes here: the usual read brings a bytes object
        try:
            # the id after the call is left to the decoders, which ignore what
            # follows a value (marshal's and pickle's loads say so; the
            # out-of-band layouts give their own sizes)
            fn, args, kwargs = _load_call(body)
            del body
            value = fn(*args, **kwargs)
            if type(value) is _COROUTINE:
                return bytes(cid), value, first  # evaluated before the finally below
            if first:
                STATE, value = value, None
            if type(value) in _SCALARS:
                # the common answer, framed here: one marshal call and one write
                data = marshal.dumps(value)
                size = len(data) + 1 + _ID_SIZE
                if size <= _MAX_FRAME:
                    frame = b"".join(
                        (_RESULT_KIND, size.to_bytes(8, "big"), channel.MARSHAL, data, cid)
                    )
                    sent = os.write(fd, frame)
                    if sent < len(frame):
                        channel._write_all(fd, memoryview(frame)[sent:])
                    continue
            parts, segments = _encode(value)
            _check_size(parts, "return value of type {}", value)
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as e:
            e = e.with_traceback(e.__traceback__.tb_next if e.__traceback__ else None)
            channel.write_frame(fd, channel.ERROR, _error_frame(e), cid)
            if first:
                _flush_std()
                raise SystemExit(1) from None  # a failed init ends the worker
            continue
        finally:
            first = False
        del value
        parts.append(cid)
        if segments:
            _send_result(fd, parts, segments)
        else:  # only this thread writes to a persistent worker's channel
            channel.write_frame(fd, channel.RESULT, *parts)


def _call(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], loop: Any) -> Any:
    """Call the one-shot worker's function; a coroutine function runs on a loop of its own.

    ``loop``: the loop a coroutine runs on (``_child.aio.run``'s ``loop``).
    A plain function that is no coroutine function costs one flag test:
    ``_child.aio`` (and asyncio) is imported only for a coroutine function,
    or for a callable whose kind it takes more to tell (a partial, a
    method), or when a function returns a coroutine (``lambda: main(x)``),
    which then runs the same way.
    """
    if type(fn) is not _FUNCTION or fn.__code__.co_flags & _CO_COROUTINE:
        aio = _aio()
        if aio.is_coroutine_function(fn):
            return aio.run(fn(*args, **kwargs), loop=loop)
    value = fn(*args, **kwargs)
    if type(value).__name__ == "coroutine":
        aio = _aio()
        if aio.is_coroutine(value):
            return aio.run(value, loop=loop)
    return value


def _aio() -> Any:
    """``_child.aio``, imported on first use (only coroutine workers pay for it)."""
    module = sys.modules.get("aioproc._child.aio")
    if module is None:
        module = __import__("aioproc._child.aio", None, None, _FROMLIST)
    return module


def _stopped(aio: Any, stopped: Any) -> NoReturn:
    """The worker's coroutine was cancelled by a stop signal: die of that signal.

    As a sync worker dies of it: no error file, no traceback, and the
    supervisor reports the worker stopped.  An exception the coroutine
    raised while it unwound is printed first (it is not the worker's
    failure: the stop is).
    """
    cause = stopped.__cause__
    if cause is not None:
        import traceback

        try:
            print(
                f"aioproc: the worker's coroutine raised while it was stopped by signal "
                f"{stopped.signum}:",
                file=sys.stderr,
            )
            cause = cause.with_traceback(aio.user_traceback(cause.__traceback__))
            traceback.print_exception(type(cause), cause, cause.__traceback__)
        except (OSError, ValueError):
            pass  # no stderr: the stop is still what the worker reports
    die_by: Callable[[int], NoReturn] = aio.die_by
    die_by(stopped.signum)


def _user_traceback(tb: Any) -> Any:
    """``tb`` without the frames of this module (and of a coroutine runner) at its head."""
    aio = sys.modules.get("aioproc._child.aio")
    if aio is not None:
        return aio.user_traceback(tb)
    while tb is not None and tb.tb_frame.f_globals is _GLOBALS:
        tb = tb.tb_next
    return tb


_GLOBALS = globals()


_SCALARS = frozenset({type(None), bool, int, float})
"""Return types a persistent worker frames itself (marshal, a few bytes)."""
_RESULT_KIND = channel.RESULT.to_bytes(1, "big")


def _answer(fd: int, cid: bytes, value: Any) -> None:
    """Send a call's RESULT, or the ERROR saying why its value cannot travel."""
    if type(value) in _SCALARS:  # the common answer, framed here (as in _serve_calls)
        data = marshal.dumps(value)
        size = len(data) + 1 + _ID_SIZE
        frame = b"".join((_RESULT_KIND, size.to_bytes(8, "big"), channel.MARSHAL, data, cid))
        channel._write_all(fd, memoryview(frame))
        return
    try:
        parts, segments = _encode(value)
        _check_size(parts, "return value of type {}", value)
    except Exception as e:
        channel.write_frame(fd, channel.ERROR, _error_frame(e), cid)
        return
    parts.append(cid)
    if segments:
        _send_result(fd, parts, segments)
    else:
        channel.write_frame(fd, channel.RESULT, *parts)


def _new_loop(kind: str) -> Any:
    """A new event loop of ``kind`` (``"asyncio"`` or ``"uvloop"``), set as the current one."""
    import asyncio

    from aioproc._child import aio

    loop = aio.new_event_loop(kind)
    asyncio.set_event_loop(loop)
    return loop


class _LoopServer:
    """A persistent worker's channel, served on an event loop from its first coroutine call.

    Frames are read when the loop sees the channel readable and handled in
    that callback: a sync call runs there, between two iterations of the
    loop, so it holds the loop (and the I/O of every coroutine call) only
    while it runs; a coroutine function's call becomes a task of its own,
    whose end answers it, so any number run at once.  The task's first step
    runs at once, in that callback, as Python 3.12's eager tasks do
    (``aio.eager_starter``; before 3.12 on asyncio's loop, not on uvloop's):
    a coroutine that returns without waiting is answered there, without a
    loop iteration in between.
    CANCEL cancels a call's task (its ``finally`` blocks run; the ERROR that
    answers it says it was cancelled).
    TERMINATE cancels every call still running, waits for them, then closes
    the loop as ``asyncio.run`` does: what the calls left running is
    cancelled too.  EOF (the supervisor is gone) exits at once, as before
    the loop.  Replies are written with blocking writes, in this thread: the
    supervisor reads its channel as it comes.
    """

    def __init__(self, fd: int, loop: Any) -> None:
        import asyncio

        from aioproc._child import aio

        self.fd = fd
        self.loop = loop
        self.asyncio = asyncio
        self.aio = aio
        self.calls: dict[bytes, Any] = {}  # call id -> the task running it
        self.start_task = aio.eager_starter(loop)
        self.terminated = loop.create_future()
        self.exiting = False  # leaving by an exception: nothing is answered any more

    def run(self, cid: bytes, coro: Any, first: bool) -> NoReturn:
        """Serve until TERMINATE, starting with ``coro`` (the call ``cid``), then exit 0.

        The loop runs until a future resolves, not a task: the calls' tasks
        (and the ones they start) are the only tasks on it.
        """
        loop = self.loop
        try:
            loop.add_reader(self.fd, self.readable)
            # the loop is not running yet: the task starts in its first iteration
            self.track(cid, loop.create_task(coro), first)
            if channel._pending:  # read along with the call that started the loop
                loop.call_soon(self.readable)
            try:
                loop.run_until_complete(self.terminated)
            finally:
                loop.remove_reader(self.fd)
            for cid in list(self.calls):
                self.cancel(cid)
            calls = list(self.calls.values())
            if calls:  # each answers as it ends
                loop.run_until_complete(self.asyncio.wait(calls))
        except BaseException:
            self.exiting = True  # sys.exit() in a call, a failed init: the calls end unanswered
            raise
        finally:
            self.aio.close_loop(loop)
        _flush_std()
        sys.exit(0)

    def readable(self) -> None:
        """Handle every whole frame the channel holds (the loop saw it readable)."""
        while not self.terminated.done():
            try:
                kind, body = channel.read_frame(self.fd)
            except (channel.ChannelClosed, OSError):
                os._exit(0)
            if kind == channel.CALL:
                self.call(body)
            elif kind == channel.CANCEL:
                self.cancel(bytes(body))
            elif kind == channel.PING:
                channel.write_frame(self.fd, channel.PONG, bytes(body))
            elif kind == channel.DEFINE:
                _define(body)
            elif kind == channel.TERMINATE:
                self.terminated.set_result(None)
            else:
                error = RuntimeError(f"aioproc worker: unexpected frame kind {kind}")
                self.terminated.set_exception(error)
            if not channel._pending:
                return

    def call(self, body: bytes | bytearray) -> None:
        cid = bytes(body[-_ID_SIZE:])
        try:
            fn, args, kwargs = _load_call(body)  # the id is ignored (see _serve_calls)
            del body
            fn_type = type(fn)
            if fn_type is _FUNCTION and fn.__code__.co_flags & _CO_COROUTINE:
                # calling an ``async def`` function runs none of its body: that
                # starts in the task, which sees itself as the current task
                coro = fn(*args, **kwargs)
            elif (
                _MARKED or (fn_type is not _FUNCTION and fn_type not in _NEVER_COROUTINES)
            ) and self.aio.is_coroutine_function(fn):
                # a partial, a method, a marked function: called in the task,
                # which runs whatever the call runs before its first await
                coro = _awaited(fn, args, kwargs)
            else:
                coro = fn(*args, **kwargs)
            task = self.start_task(coro) if type(coro) is _COROUTINE else None
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as e:
            e = e.with_traceback(e.__traceback__.tb_next if e.__traceback__ else None)
            channel.write_frame(self.fd, channel.ERROR, _error_frame(e), cid)
            return
        if task is None:
            _answer(self.fd, cid, coro)  # a sync function's value (its coroutine runs too)
        elif task.done():  # it returned without waiting: answered now, not by a callback
            self.answer(cid, task, False)
        else:
            self.track(cid, task, False)

    def cancel(self, cid: bytes) -> None:
        """Cancel call ``cid``'s task, if it still runs (else its answer is on its way).

        The task's end answers the call, also when it is cancelled before
        its first step: its coroutine is then closed unstarted.
        """
        task = self.calls.get(cid)
        if task is not None:
            task.cancel()

    def track(self, cid: bytes, task: Any, first: bool) -> None:
        """Answer call ``cid`` when ``task``, which runs its coroutine, ends."""
        self.calls[cid] = task
        task.add_done_callback(lambda task: self.done(cid, task, first))

    def done(self, cid: bytes, task: Any, first: bool) -> None:
        del self.calls[cid]
        self.answer(cid, task, first)

    def answer(self, cid: bytes, task: Any, first: bool) -> None:
        """Answer call ``cid`` with the end of ``task``, which ran its coroutine."""
        global STATE
        if self.exiting:
            return
        try:
            value = task.result()
        except BaseException as error:
            if isinstance(error, (SystemExit, KeyboardInterrupt)):
                return  # it leaves the loop through run_until_complete
            if task.cancelled():
                error = self.asyncio.CancelledError()
            error = error.with_traceback(self.aio.user_traceback(error.__traceback__))
            channel.write_frame(self.fd, channel.ERROR, _error_frame(error), cid)
            if first:
                self.terminated.set_exception(SystemExit(1))  # a failed init ends the worker
            return
        if first:
            STATE, value = value, None
        _answer(self.fd, cid, value)


async def _awaited(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """What calling ``fn`` returns, awaited if it is awaitable (a coroutine call's task)."""
    value = fn(*args, **kwargs)
    if type(value) is _COROUTINE or hasattr(type(value), "__await__"):
        value = await value
    return value


def main(fd: int) -> None:
    global _FD_SOCKET, _HOLD
    os.set_inheritable(fd, False)  # descendants must not hold the lifeline open
    kind, body = channel.read_frame(fd)
    if kind == channel.FD_SOCKET:
        _FD_SOCKET = int(body)
        os.set_inheritable(_FD_SOCKET, False)
        kind, body = channel.read_frame(fd)
    if kind != channel.INIT:
        raise RuntimeError(f"aioproc worker: expected INIT frame, got kind {kind}")
    init = marshal.loads(body)
    global _MAX_FRAME, _LOOP
    _MAX_FRAME = init.get("max_frame", _MAX_FRAME)
    _set_authkey(init.get("authkey"))
    # the parent's import path: functions pickled by reference import from it
    sys.path[:] = init["sys_path"]
    del sys.argv[1:]
    if init.get("serve"):
        _LOOP = init.get("loop", _LOOP)
        _serve(fd, has_init=init.get("has_init", False))
        return
    kind, body = channel.read_frame(fd)
    if kind != channel.CALL:
        raise RuntimeError(f"aioproc worker: expected CALL frame, got kind {kind}")
    hold = init.get("hold", False)
    if init.get("lifeline", True):
        # Wait until the thread runs: a thread still starting up when a quick
        # function returns and the interpreter finalizes crashes Python 3.10
        # (SIGSEGV in the new thread); one blocked in read() is safe.
        started = _thread.allocate_lock()
        started.acquire()
        _BARRIER["lock"] = _thread.allocate_lock()
        _BARRIER["lock"].acquire()  # released by the lifeline on RELEASE
        if hold:
            _HOLD = _thread.allocate_lock()
            _HOLD.acquire()  # released by the lifeline on TERMINATE
        _thread.start_new_thread(_lifeline, (fd, started))
        started.acquire()
    global _ONE_SHOT_FD
    _ONE_SHOT_FD = fd
    try:
        fn, args, kwargs = _load_call(body)
        del body
    except BaseException as e:
        _fail(fd, RuntimeError(f"could not unpickle the worker function or its arguments: {e!r}"))

    try:
        value = _call(fn, args, kwargs, init.get("loop", "asyncio"))
    except SystemExit:
        raise  # the interpreter turns SystemExit.code into the exit status
    except KeyboardInterrupt:
        # Like the interpreter: report, then die by SIGINT so the exit code says so.
        import traceback

        traceback.print_exc()
        _flush_std()
        _signal.signal(_signal.SIGINT, _signal.SIG_DFL)
        os.kill(os.getpid(), _signal.SIGINT)
        os._exit(130)  # not reached unless SIGINT is blocked
    except BaseException as e:
        aio = sys.modules.get("aioproc._child.aio")
        if aio is not None and isinstance(e, aio.Stopped):
            _stopped(aio, e)
        # the traceback starts in the user's function: this module's frames
        # (and a coroutine runner's) are dropped
        _fail(fd, e.with_traceback(_user_traceback(e.__traceback__)))

    try:
        payload, segments = _encode(value)
    except BaseException as e:
        _fail(
            fd,
            TypeError(
                f"worker return value of type {type(value).__qualname__} cannot be pickled: {e}"
            ),
        )
    try:
        _check_size(payload, "worker return value of type {}", value)
    except ValueError as e:
        _fail(fd, e)
    del value
    try:
        _send_result(fd, payload, segments)
    except OSError:
        raise SystemExit(1) from None  # supervisor gone mid-answer
    del payload, segments
    if hold:
        _hold(fd)  # until the supervisor has every local worker's result
    # Exit the normal way so atexit handlers and non-daemon threads behave as in a script.
    sys.exit(0)


# ---------------------------------------------------------------- the title
# What ``ps`` shows for the process: set by the boot code (``_func.boot``)
# and by a template for itself and its forks, before any function runs, and
# kept apart from the code that runs one.  See "Title" in the docstring.


def arg_span() -> tuple[int, int] | None:
    """Where this process's command line lives in its memory: ``(start, end)``, or None."""
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
        # the fields after the command name's last ')' start with proc(5)'s
        # field 3; arg_start and arg_end are fields 48 and 49
        fields = stat[stat.rindex(b")") + 2 :].split()
        start, end = int(fields[45]), int(fields[46])
    except (OSError, ValueError, IndexError):
        return None
    return (start, end) if end - start >= 2 else None


def set_title(title: str, span: tuple[int, int] | None = None) -> bool:
    """Make this process's command line read ``title``; whether it could.

    Args:
        title: what ``ps -o args`` is to show.
        span: ``arg_span()`` as read before (by a template, for its forks).
    """
    if span is None:
        span = arg_span()
    if span is None:
        return False
    start, end = span
    size = end - start
    text = title.encode(errors="replace")[: size - 2]
    # the title, NULs, and a last byte that is not one (see the module docstring)
    data = text + bytes(size - len(text) - 1) + b" "
    try:
        fd = os.open("/proc/self/mem", os.O_WRONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        return os.pwrite(fd, data, start) == size
    except OSError:
        return False
    finally:
        os.close(fd)
