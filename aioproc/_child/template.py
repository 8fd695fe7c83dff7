"""Child side of the forkserver template.  Standard library only.

The supervisor runs this file's source through the boot stub,
``sys.executable -c <stub> <fd> 'aioproc-template <pid>'``, in a session of
its own (see ``_func.template``); ``fd`` is the template's end of a
socketpair, on which the source comes first.  The template reads its INIT
message (the parent's ``sys.path``, the modules to preload, the code of the
function workers' boot modules, which it builds once), takes its title
("Title" in ``_child.boot``: ``ps`` shows ``aioproc-template <pid>``),
imports the modules, checks it is still single-threaded and has not
initialised CUDA, has a large memory backed by 2 MiB pages so that forks
copy few page-table entries (``_collapse``), answers READY (or why not) and
then serves fork requests until EOF.

A request carries, as SCM_RIGHTS fds, a worker's stdout, stderr, channel
socket and extra fds, and as data their fd numbers in the worker, its
environment and working directory, and for a worker that runs a Python
script, its command line.  The template clones itself with
``CLONE_PARENT``: the worker becomes a child of the *supervisor*, not of the
template, so the supervisor notices its exit with a pidfd, reads the true
status with ``waitid(WNOWAIT)`` and reaps it late exactly as it does for a
spawned worker, and a template that dies never hands workers to init.  The
raw ``clone`` is wrapped in ``PyOS_BeforeFork``/``PyOS_AfterFork_*``, which is
all ``os.fork()`` adds around ``fork()``.  The template never waits for or
signals the processes it forked (it reads each one's "set up" report on a
pipe): it forks every request it has received, answers them in order, and
exits when the supervisor closes the socket or dies.

The template takes a process name of its own (``comm``, what ``ps`` shows),
which every fork has until it passes its gate and then gives back: the
supervisor's sweep tells an abandoned fork by it even once the fork is dead.

The new worker leads a session of its own, gets its fds at their numbers and
nothing else, its environment and cwd, and then waits on its *gate*: the
read end of a pipe that came with the request, whose write end only the
supervisor holds.  The supervisor writes "go" there once it has the
worker's pid and the guardian knows it; EOF instead (the supervisor gave
the request up, or died) ends the worker before it runs anything of the
user's.  Past its gate it takes its title (``aioproc: trainer[3]``, sent with
the request).  Then a fresh ``__main__`` and the same boot code as a spawned
worker (the rest arrives over the channel), or the script, as ``python
[-u] script args`` would (``_child.script``).  A worker that failed to set
itself up also waits for its gate before it exits: until the supervisor
lets go of it, every process the template forked is alive or killed by the
supervisor, so an abandoned one is always found and reaped (see
``_func.template``).
"""

from __future__ import annotations

import marshal
import os
import socket
import stat
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any, NoReturn

CLONE_PARENT = 0x00008000
SIGCHLD = 17  # on every architecture below
# clone(2) syscall numbers; flags come first on all of these (s390 differs)
_SYS_CLONE = {
    "x86_64": 56,
    "aarch64": 220,
    "riscv64": 220,
    "ppc64le": 120,
    "ppc64": 120,
    "i686": 120,
    "i386": 120,
    "armv7l": 120,
}
MAX_FDS = 253  # the kernel passes at most 253 fds in one message (SCM_MAX_FD)
GO = b"g"  # what the supervisor writes on a worker's gate once it knows the worker
MADV_COLLAPSE = 25  # madvise(2), Linux 6.1+
HUGE_PAGE = 2 << 20  # a PMD-mapped transparent huge page on the architectures above
COLLAPSE_MIN = 32 << 20
"""Anonymous memory (bytes) below which the template leaves its pages as they are."""


def _send(sock: socket.socket, message: Any) -> None:
    body = marshal.dumps(message)
    sock.sendall(len(body).to_bytes(8, "big") + body)


def _recv_exact(sock: socket.socket, n: int, buf: bytearray) -> bool:
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return False
        buf += chunk
    return True


def _recv(sock: socket.socket) -> Any:
    """One length-prefixed message (INIT, which has no fds); None at EOF."""
    buf = bytearray()
    if _recv_exact(sock, 8, buf) and _recv_exact(sock, 8 + int.from_bytes(buf[:8], "big"), buf):
        return marshal.loads(bytes(buf[8:]))
    return None


class _Requests:
    """Fork requests as they arrive: length-prefixed messages and their fds.

    The supervisor may send several requests before the first answer, so
    one ``recvmsg`` can hold the end of one request and the start of the
    next; the fds (SCM_RIGHTS, in order) queue apart and each request takes
    as many as it names targets.
    """

    def __init__(self, sock: socket.socket) -> None:
        import array
        import collections

        self._sock = sock
        self._buf = bytearray()
        self._fds: collections.deque[int] = collections.deque()
        self._array = array.array
        self._space = socket.CMSG_SPACE(MAX_FDS * 4)
        self.eof = False

    def _fill(self, block: bool) -> bool:
        flags = socket.MSG_CMSG_CLOEXEC | (0 if block else socket.MSG_DONTWAIT)
        try:
            data, ancdata, _, _ = self._sock.recvmsg(1 << 16, self._space, flags)
        except BlockingIOError:
            return False
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                arr = self._array("i")
                arr.frombytes(payload[: len(payload) - len(payload) % arr.itemsize])
                self._fds.extend(arr)
        if not data:
            self.eof = True
            return False
        self._buf += data
        return True

    def next(self, block: bool) -> tuple[Any, list[int]] | None:
        """The next request and its fds; None at EOF, or if none is there and not ``block``."""
        while True:
            buf = self._buf
            if len(buf) >= 8:
                end = 8 + int.from_bytes(buf[:8], "big")
                if len(buf) >= end:
                    message = marshal.loads(bytes(buf[8:end]))
                    del buf[:end]
                    n = min(len(message[0]) + 1, len(self._fds))  # the gate comes last
                    return message, [self._fds.popleft() for _ in range(n)]
            if self.eof or not self._fill(block):
                return None


def _unsafe() -> str:
    """Why this process may no longer fork safely ("" if it may)."""
    threading = sys.modules.get("threading")
    try:
        threads = len(os.listdir("/proc/self/task"))
    except OSError:
        threads = threading.active_count() if threading is not None else 1
    if threads > 1:
        names = ""
        if threading is not None:
            named = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
            names = f" ({', '.join(named)})" if named else ""
        native = (
            ""
            if names
            else (
                " (not Python threads: a native pool, e.g. numpy's OpenBLAS or OpenMP; "
                "the template sets OMP_NUM_THREADS, OPENBLAS_NUM_THREADS and the like to 1 "
                "unless they are set: leave them unset or 1 while preloading)"
            )
        )
        return (
            f"started {threads - 1} thread(s){names}{native}; the template must stay "
            "single-threaded (a forked worker would inherit locks those threads hold)"
        )
    events = sys.modules.get("asyncio.events")
    if events is not None and events._get_running_loop() is not None:
        return "left an event loop running; a forked worker cannot use its parent's loop"
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    is_initialized = getattr(cuda, "is_initialized", None)
    if is_initialized is not None and is_initialized():
        return "initialised CUDA; a forked worker cannot use CUDA initialised in its parent"
    return ""


def _forget_event_loop() -> None:
    """Close the event loop a preloaded module left set in asyncio, and forget it.

    ``asyncio.set_event_loop(...)`` or ``get_event_loop()`` at import leaves
    the policy holding a loop.  A fork would inherit that object without
    its fds (``_become_worker`` closes them): once a worker's own loop took
    its place (``asyncio.run``, a coroutine worker's loop), the inherited
    object's finalizer would close those fd numbers, by then the worker's
    own.  The template never runs a loop itself, so it closes the one it
    holds and resets the policy's per-thread state, as a fresh interpreter
    has it; the policy itself (uvloop's, say) stays.
    """
    events = sys.modules.get("asyncio.events")
    policy = getattr(events, "_event_loop_policy", None)
    local = getattr(policy, "_local", None)
    if local is None:
        return
    loop = getattr(local, "_loop", None)
    if loop is not None and not loop.is_running() and not loop.is_closed():
        loop.close()
    policy._local = type(local)()  # type: ignore[union-attr]


IMPORT_AHEAD = ("asyncio", "aioproc._child.aio")
"""What a coroutine worker imports first, imported by the template itself.

Every worker whose function is a coroutine function imports asyncio (some
30 modules, most of such a worker's start) and the runner; the supervisor
names them with such a worker's fork request, and the template imports them
once, the first time, so its forks find them imported.  Importing them
starts no thread and makes no event loop (nor an event loop policy); other
modules a worker names are only read here (``_Modules``), never run."""


def _import_ahead(names: set[str]) -> bool:
    """Import those of ``names`` in ``IMPORT_AHEAD`` not imported yet; whether any was.

    One that fails to import is left to the worker, which imports it itself
    and reports what goes wrong.
    """
    new = False
    for name in IMPORT_AHEAD:
        if name in names and name not in sys.modules:
            try:
                __import__(name)
            except Exception:
                continue
            new = True
    return new


def _preload(names: list[str]) -> tuple[Any, ...]:
    """Import ``names``; on the first failure, ``("error", kind, name, detail)``."""
    for name in names:
        try:
            __import__(name)
        except BaseException as e:
            import traceback

            tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
            return ("error", "import", name, f"{type(e).__name__}: {e}", tb)
        problem = _unsafe()
        if problem:
            return ("error", "unsafe", name, problem, "")
    return ("ready", os.getpid())


class _Loaded:
    """A loader that runs code the template read, then hands over to the real one."""

    __slots__ = ("code", "loader")

    def __init__(self, loader: Any, code: Any) -> None:
        self.loader = loader
        self.code = code

    def __getattr__(self, name: str) -> Any:
        if name in _Loaded.__slots__:
            raise AttributeError(name)  # not set yet (a copy being made)
        return getattr(self.loader, name)  # get_source, get_data, is_package...

    def create_module(self, spec: Any) -> None:
        return None  # the default module, as the file loaders make

    def exec_module(self, module: Any) -> None:
        # from here on the module looks imported by its own loader (inspect,
        # importlib.resources and a reload ask the loader, and read the file)
        module.__loader__ = self.loader
        spec = module.__spec__
        if spec is not None:
            spec.loader = self.loader
        exec(self.code, module.__dict__)


def _file_key(st: os.stat_result) -> tuple[int, ...]:
    # as _child.script.file_key, which this module cannot import (see serve)
    return (st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_ino, st.st_dev)


class _Modules:
    """The code of the modules a group's function lives in, read here once.

    A meta path finder, first on a worker's ``sys.meta_path``: a forked
    worker that imports the module its function lives in would find, read
    and unmarshal it again in pages of its own, about two thirds of what
    the import costs it.  The module's code still runs in each worker, as
    in a spawned one (its import-time output goes to the worker's log, its
    state is the worker's own); only the reading is shared.  A file that
    changed on disk since is read again by the usual finders.

    Only what a worker would find at the same place is served: plain
    source or bytecode files found through absolute ``sys.path`` entries
    (a relative one means the worker's cwd) that lead the worker's
    ``sys.path`` as they led the template's, and their packages.
    """

    LIMIT = 256
    """Modules read at most: the code stays in the template's memory."""

    def __init__(self) -> None:
        # name: (spec, the file's (mtime, size), the path it was found on, and
        # for a top-level module whether that path is a prefix of sys.path)
        self._specs: dict[str, tuple[Any, tuple[int, ...], list[str], bool]] = {}
        self._failed: set[str] = set()

    def learn(self, names: set[str]) -> bool:
        """Read the code of ``names`` and their packages; whether any was new."""
        new = False
        for name in sorted(names):
            parts = name.split(".")
            for i in range(1, len(parts) + 1):
                new = self._learn(".".join(parts[:i])) or new
        return new

    def _learn(self, name: str) -> bool:
        if name in sys.modules or name in self._failed:
            return False
        known = self._specs.get(name)
        if known is not None and self.current(known):
            return False
        if known is None and len(self._specs) + len(self._failed) >= self.LIMIT:
            return False
        from importlib.machinery import PathFinder, SourceFileLoader, SourcelessFileLoader

        parent = name.rpartition(".")[0]
        search: list[str]
        if parent:
            module = sys.modules.get(parent)
            if module is not None:
                search = list(getattr(module, "__path__", None) or ())
            elif parent in self._specs:
                search = self._specs[parent][0].submodule_search_locations
            else:
                return False
            if not search:
                return False
        else:
            search = []
            for entry in sys.path:
                if not isinstance(entry, str) or not os.path.isabs(entry):
                    break  # found past here, it may not be what the worker finds
                search.append(entry)
        code: Any = None
        spec: Any = None
        try:
            spec = PathFinder.find_spec(name, search)
            loader: Any = None if spec is None or not spec.origin else spec.loader
            if spec is not None and type(loader) in (SourceFileLoader, SourcelessFileLoader):
                st = os.stat(spec.origin)  # before the read: a change meanwhile reads it again
                code = loader.get_code(name)
        except Exception:
            code = None
        if code is None:
            self._failed.add(name)  # the worker's own import reports it
            return False
        spec.loader = _Loaded(loader, code)
        self._specs[name] = (spec, _file_key(st), search, not parent)
        return True

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        entry = self._specs.get(name)
        if entry is None:
            return None
        spec, _, search, top = entry
        if top:
            if path is not None or sys.path[: len(search)] != search:
                return None  # the worker's sys.path differs: it may find another file
        elif path is None or list(path) != search:
            return None  # its package came from somewhere else
        if not isinstance(spec.loader, _Loaded) or not self.current(entry):
            return None  # imported once already (a reload reads the file), or changed
        return spec

    @staticmethod
    def current(entry: tuple[Any, tuple[int, ...], list[str], bool]) -> bool:
        """Whether the file of a learned module is still as it was read."""
        try:
            st = os.stat(entry[0].origin)
        except OSError:
            return False
        return _file_key(st) == entry[1]

    def invalidate_caches(self) -> None:
        self._specs.clear()  # what importlib.invalidate_caches() asks of every finder


class _Scripts:
    """Scripts compiled here once for the workers that run them (``_child.script``).

    A script has no bytecode file: each worker that runs ``python
    script.py`` would read and compile it again (about 9 ms for 1,000
    lines).  Keyed by the path the worker makes of it; a file that changed
    on disk since is compiled again by the worker.
    """

    LIMIT = 16
    """Scripts kept at most: their code stays in the template's memory."""

    def __init__(self) -> None:
        self.codes: dict[str, tuple[tuple[int, ...], Any]] = {}

    def learn(self, script: dict[str, Any], cwd: str) -> bool:
        """Compile the file ``script`` runs from ``cwd``; whether it was new."""
        path = script["argv"][0]
        if path == "-m":
            return False  # a module imports from its bytecode file already
        # the worker's os.path.abspath(path) after its chdir(cwd): getcwd()
        # gives the directory without symlinks
        filename = os.path.normpath(os.path.join(os.path.realpath(cwd), path))
        known = self.codes.get(filename)
        try:
            st = os.stat(filename)  # before the read: a change meanwhile compiles again
            key = _file_key(st)
            if (known is not None and known[0] == key) or not stat.S_ISREG(st.st_mode):
                return False
            if known is None and len(self.codes) >= self.LIMIT:
                return False
            with open(filename, "rb") as f:
                source = f.read()
            code = compile(source, filename, "exec", dont_inherit=True)
        except Exception:
            return False  # the worker reads and compiles it, and reports what fails
        self.codes[filename] = (key, code)
        return True


def _cloner() -> Callable[[], int]:
    """``fork()`` that makes the new process a child of our parent (``CLONE_PARENT``)."""
    import ctypes

    nr = _SYS_CLONE.get(os.uname().machine)
    if nr is None or not sys.platform.startswith("linux"):
        raise OSError(f"CLONE_PARENT is not supported on {sys.platform} {os.uname().machine}")
    libc = ctypes.PyDLL(None, use_errno=True)  # PyDLL: the GIL stays held across the call
    syscall = libc.syscall
    syscall.restype = ctypes.c_long
    api = ctypes.pythonapi
    args = (ctypes.c_long(nr), ctypes.c_ulong(CLONE_PARENT | SIGCHLD), *[ctypes.c_long(0)] * 4)

    def clone() -> int:
        api.PyOS_BeforeFork()
        pid = int(syscall(*args))
        err = ctypes.get_errno()
        if pid == 0:
            api.PyOS_AfterFork_Child()
            return 0
        api.PyOS_AfterFork_Parent()
        if pid < 0:
            raise OSError(err, os.strerror(err))
        return pid

    return clone


def _become_worker(
    fds: list[int],
    targets: list[int],
    env: tuple[list[str], list[tuple[str, str]]],
    cwd: str,
    report: int,
    gate: int,
    title: str,
) -> None:
    """In the new process: own session, fds at their numbers, env, cwd; then the gate.

    Says "ok" (or why not) on ``report`` once it leads its session and has
    its fds and cwd: the template answers the supervisor after that, so
    every signal the supervisor sends to the worker's group reaches it.
    The rest (environment, closing what else the template had open) happens
    meanwhile.  Returns once the supervisor says "go" on ``gate``; exits
    on EOF there, and after a failure, once the supervisor has let go (see
    the module docstring).  Every write here copies a page of the
    template's (the process is forked): what can stay untouched does.
    """
    import fcntl  # imported by the template already (see serve)

    try:
        os.setsid()
        top = max([2, report, gate, *targets, *fds]) + 1
        report, given = fcntl.fcntl(report, fcntl.F_DUPFD_CLOEXEC, top), report
        os.close(given)  # the template reads to EOF: one write end left
        gate, given = fcntl.fcntl(gate, fcntl.F_DUPFD_CLOEXEC, top), gate
        os.close(given)
        moved = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, top) for fd in fds]
        null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
        for std in (0, 1, 2):
            if std not in targets:
                os.dup2(null, std)  # stdin, and a stream the supervisor has closed
        for src, dst in zip(moved, targets, strict=True):
            os.dup2(src, dst)  # inheritable, as Popen's pass_fds leaves them
        os.chdir(cwd)
    except OSError as e:
        _say(report, f"{type(e).__name__}: {e}".encode())
        _pass_gate(gate)  # the supervisor has read the failure: it reaps us next
        os._exit(127)
    _say(report, b"ok")
    # every other fd the template had, by ranges (close_range(2)): listing
    # /proc/self/fd would build objects in pages this process must copy
    low = 0
    for fd in sorted({0, 1, 2, gate, *targets}):
        if fd > low:
            os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, 0x7FFFFFFF)
    # the worker's environment: what differs from the template's (see serve)
    unset, changed = env
    environ = os.environ
    for key in unset:
        del environ[key]
    for key, value in changed:
        environ[key] = value
    if not _pass_gate(gate):
        os._exit(127)  # given up, or the supervisor died: nothing of the user's runs
    if _own_name is not None:
        _set_name(_own_name)  # adopted now: the name a spawned worker has
    if _retitle is not None and title:
        _retitle(title)  # one page of the template's copied: the command line's


def _say(report: int, what: bytes) -> None:
    """Report to the template and close the pipe (its EOF ends the template's read)."""
    try:
        os.write(report, what)
    except OSError:
        pass  # the template died: the supervisor finds this process by its environment
    os.close(report)


_own_name: bytes | None = None
"""The template's process name before it took the one it gives its forks."""

_retitle: Callable[[str], object] | None = None
"""Sets a fork's title over the template's command line ("Title" in ``_child.boot``)."""


def _set_name(name: bytes) -> None:
    """Name this process (``comm``); best effort: nothing to do where it cannot."""
    try:
        fd = os.open("/proc/self/comm", os.O_WRONLY)
    except OSError:
        return
    try:
        os.write(fd, name)
    except OSError:
        pass
    finally:
        os.close(fd)


def _pass_gate(gate: int) -> bool:
    """Block until the supervisor says "go" on ``gate`` (True) or closes it (False)."""
    try:
        go = os.read(gate, 1)
    except OSError:
        go = b""
    os.close(gate)
    return go == GO


def _load_boot(blob: bytes) -> tuple[Callable[[int], None], Any]:
    """The function workers' boot modules, built here once; their ``main``, and
    ``_child.boot`` (whose ``set_title`` the template and its forks use too).

    What ``_boot.BOOT_CODE`` does in a spawned worker with the code the
    supervisor sends, done before forking: a forked worker only calls
    ``main(channel)``.  Registered before the preload, as a spawned worker
    has them before it runs user code.
    """
    channel_code, boot_code, load_code = marshal.loads(blob)
    child_channel = type(sys)("aioproc._child.channel")
    exec(channel_code, child_channel.__dict__)
    boot = type(sys)("aioproc._child.boot")
    boot.channel = child_channel  # type: ignore[attr-defined]
    exec(boot_code, boot.__dict__)
    load = type(sys)("aioproc._child.pickling")
    exec(load_code, load.__dict__)
    sys.modules["aioproc._child.channel"] = child_channel
    sys.modules["aioproc._child.boot"] = boot
    sys.modules["aioproc._child.pickling"] = load
    main: Callable[[int], None] = boot.main
    return main, boot


def _take_title(titles: Any, title: str) -> None:
    """Show ``title`` in ``ps``; keep how a fork shows its own (``_retitle``).

    The span of the command line is read once, here: a fork has the
    template's memory at the same addresses, and writes its title there.
    """
    global _retitle
    span = titles.arg_span()
    if span is None or not title or not titles.set_title(title, span):
        return
    set_title = titles.set_title

    def retitle(text: str) -> object:
        return set_title(text, span)

    _retitle = retitle


def serve(fd: int) -> NoReturn:
    """Preload, then fork on request; each new worker runs its work (``_work``).

    Neither the template nor a worker returns: both leave through
    ``os._exit``.
    """
    default_path = list(sys.path)  # before INIT replaces it with the supervisor's
    sock = socket.socket(fileno=fd)
    init = _recv(sock)
    if init is None:
        os._exit(0)
    sys.path[:] = init["sys_path"]
    boot_main, titles = _load_boot(init["boot"])
    _take_title(titles, sys.argv[2] if len(sys.argv) > 2 else "")
    del sys.argv[1:]
    runner = type(sys)("aioproc._child.script")
    exec(marshal.loads(init["script"]), runner.__dict__)
    _OURS.append(runner.__dict__)  # its frames are cut from a script's traceback
    answer = _preload(init["preload"])
    _forget_event_loop()
    sys.stdout.flush()  # what a preloaded module printed must not reach a worker
    sys.stderr.flush()
    if answer[0] == "ready":
        try:
            clone = _cloner()
        except OSError as e:
            answer = ("error", "clone", "", str(e), "")
    if answer[0] != "ready":
        _send(sock, answer)
        os._exit(1)  # at once: a thread a preloaded module started must not delay it
    # what every worker uses, imported once here (a module imported in a
    # worker is built in pages of its own: far more than it copies here)
    import atexit  # noqa: F401
    import fcntl  # noqa: F401

    # once here rather than in every worker: the template itself always
    # leaves through os._exit, and a worker that has nothing to undo copies
    # no page for it
    _forget_template_exit_hooks()
    # what the template holds now is shared with every worker: out of the
    # collector's reach, a worker's collections never touch (and copy) it
    import gc
    import weakref  # noqa: F401

    gc.freeze()
    _collapse()  # before READY: every fork finds the memory in large pages
    # named last, so that a preloaded module that names the process
    # (setproctitle) cannot take the name the sweep knows the forks by
    global _own_name
    try:
        with open("/proc/self/comm", "rb") as f:
            _own_name = f.read().rstrip(b"\n")
    except OSError:
        pass  # no name to give back: none is taken either
    else:
        _set_name(init["name"])
    modules = _Modules()
    sys.meta_path.insert(0, modules)
    scripts = _Scripts()
    _send(sock, answer)
    # pipelined (see the module docstring): new workers set themselves up side by side
    requests = _Requests(sock)
    pending: list[tuple[Any, int]] = []  # (an answer, or the pid whose report to await; its pipe)
    batch: list[tuple[Any, list[int]]] = []
    while True:
        if not batch:
            got = requests.next(block=not pending)
            if got is None:
                if requests.eof:
                    os._exit(0)  # the supervisor closed us, or died
                answer, read_end = pending[0]
                if read_end >= 0 and not _report_first(sock, read_end):
                    continue  # a request came first: fork it while the worker sets up
                pending.pop(0)
                if read_end >= 0:
                    answer = _await_report(answer, read_end)
                _send(sock, answer)
                continue
            # Every request already here is parsed before the first fork:
            # what the template writes between two forks (a page each) is
            # copied on write, as every fork shares its pages anew.
            batch.append(got)
            while (got := requests.next(block=False)) is not None:
                batch.append(got)
            batch.reverse()
            # the modules the workers' functions live in, and the scripts
            # they run, read and compiled before they fork
            named = {name for (*_, named, _), _ in batch for name in named}
            learned = _import_ahead(named)
            learned = modules.learn(named) or learned
            for (_, _, _, cwd, script, _, _), _ in batch:
                if script is not None and scripts.learn(script, cwd):
                    learned = True
            if learned:
                gc.freeze()  # the new code too is shared, out of the collector's reach
            # Each worker's environment as changes to this one: a worker that
            # compared the two itself would touch (and copy) the pages of every
            # variable's strings, and so would the template between forks.
            environ = dict(os.environ)
            for i, ((targets, channel, env, cwd, script, _, title), fds) in enumerate(batch):
                changes = (
                    [key for key in environ if key not in env],
                    [(key, value) for key, value in env.items() if environ.get(key) != value],
                )
                batch[i] = ((targets, channel, changes, cwd, script, None, title), fds)
            del environ
        (targets, channel, changes, cwd, script, _, title), fds = batch.pop()
        read_end, write_end = os.pipe()
        try:
            if len(fds) != len(targets) + 1:
                raise OSError(f"got {len(fds)} fds for {len(targets)} targets and a gate")
            pid = clone()
        except OSError as e:
            for fd in (*fds, read_end, write_end):
                os.close(fd)
            pending.append((("error", e.errno or 0, str(e)), -1))
            continue
        if pid == 0:
            # The other workers' report pipes go with every other fd of the
            # template's in _become_worker, by ranges: a loop over ``pending``
            # here would write (and copy) the page of every entry it reads.
            sock.close()
            gate = fds.pop()
            _become_worker(fds, targets, changes, cwd, write_end, gate, title)
            # From the fork itself, never returning through this frame: that
            # would free what the template's loop holds, touching its pages.
            if script is not None:
                _work(("script", runner.run_script, script, default_path, scripts.codes))
            sys.argv[:] = ["-c"]  # as a spawned function worker's
            _work(("boot", boot_main, channel))
        for fd in (*fds, write_end):
            os.close(fd)
        pending.append((pid, read_end))


def _collapse() -> int:
    """Back the template's anonymous memory with 2 MiB pages, once; bytes collapsed.

    ``fork()`` copies one page-table entry for every 4 KiB page the
    template has written, and each worker's exit walks them all again:
    with torch preloaded (~140 MB of heap and anonymous mappings, ~36,000
    entries) that was ~5 ms of the template's CPU per fork and as much in
    every worker.  Collapsed into transparent huge pages
    (``MADV_COLLAPSE``) the same memory is ~70 entries; a worker that
    writes to one splits only its own mapping of it and copies 4 KiB, as
    before.  Only private anonymous mappings at least half resident are
    collapsed (a huge page fills the holes of its 2 MiB), and only in a
    template that holds ``COLLAPSE_MIN`` of them: for a small one the fork
    is cheap already and the collapse (~2 ms per MB, once) is not.  Best
    effort: kernels before 6.1, THP set to "never" and a lack of free huge
    pages leave the memory as it was.
    """
    try:
        spans = _collapsible()
    except OSError:
        return 0  # no /proc: leave the memory as it is
    if sum(hi - lo for lo, hi in spans) < COLLAPSE_MIN:
        return 0
    import ctypes

    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    done = 0
    for lo, hi in spans:
        if madvise(lo, hi - lo, MADV_COLLAPSE) == 0:
            done += hi - lo
    return done


def _collapsible() -> list[tuple[int, int]]:
    """2 MiB-aligned spans of private anonymous mappings at least half resident."""
    spans: list[tuple[int, int]] = []
    with open("/proc/self/smaps") as f:
        span: tuple[int, int] | None = None
        for line in f:
            head, _, rest = line.partition(" ")
            if "-" in head and not head.endswith(":"):
                span = None
                fields = rest.split()
                # private, writable, no file: the heap and anonymous mmaps (not the stack)
                if fields[0] == "rw-p" and (len(fields) < 5 or fields[4] == "[heap]"):
                    start, end = (int(x, 16) for x in head.split("-"))
                    lo = -(-start // HUGE_PAGE) * HUGE_PAGE
                    hi = end // HUGE_PAGE * HUGE_PAGE
                    span = (lo, hi) if hi > lo else None
            elif head == "Rss:" and span is not None:
                if int(rest.split()[0]) * 1024 * 2 >= span[1] - span[0]:
                    spans.append(span)
                span = None
    return spans


def _report_first(sock: socket.socket, read_end: int) -> bool:
    """Wait for the oldest worker's report or a new request; whether the report came.

    The supervisor sends requests while earlier ones are answered: one
    that arrives while a worker sets itself up is forked at once rather
    than after that worker's report.
    """
    import select

    ready = select.select([read_end, sock.fileno()], [], [])[0]
    return read_end in ready


def _await_report(pid: int, read_end: int) -> tuple[Any, ...]:
    """The answer for ``pid`` once it has set itself up (or died trying)."""
    status = b""
    while chunk := os.read(read_end, 4096):  # EOF once the worker is set up (or died)
        status += chunk
    os.close(read_end)
    if status == b"ok":
        return ("pid", pid)
    # exited: the supervisor, its parent, reaps it
    return ("failed", pid, status.decode(errors="replace") or "died")


def _forget_template_exit_hooks() -> None:
    """Before forking: the exit hooks the template registered are not a worker's.

    A spawned worker runs the atexit handlers and ``weakref.finalize``
    callbacks of what *it* imported; a forked one inherits the template's
    (``import torch`` alone registers over a hundred finalizers, 30 ms of
    CPU per worker at exit).  They are dropped, as multiprocessing's forked
    children skip them all; what the worker itself registers still runs.
    The stdlib hooks a worker relies on for its own objects (logging's
    flush, multiprocessing's cleanup) are registered again.
    """
    import atexit
    import weakref

    atexit._clear()
    registry = getattr(weakref.finalize, "_registry", {})
    for fin in list(registry):
        fin.atexit = False
    # so the worker's own finalizers register the exit hook again
    weakref.finalize._registered_with_atexit = False  # type: ignore[attr-defined]
    for module, hook in (("logging", "shutdown"), ("multiprocessing.util", "_exit_function")):
        mod = sys.modules.get(module)
        if mod is not None and callable(getattr(mod, hook, None)):
            atexit.register(getattr(mod, hook))


def _exit_code(e: SystemExit) -> int:
    """The exit status the interpreter gives an uncaught ``SystemExit``."""
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code & 0xFF
    try:
        print(e.code, file=sys.stderr)
    except Exception:
        pass
    return 1


def _finish(code: int, die_by: int = 0) -> NoReturn:
    """End a forked worker as a script ends, without tearing the interpreter down.

    Non-daemon threads are joined, atexit handlers run (logging's flush,
    ``weakref.finalize``, multiprocessing's cleanup) and the standard streams
    are flushed, as at any interpreter exit; then ``os._exit``, as
    multiprocessing's forked children do.  Tearing down every module the
    template preloaded would touch, and so copy, most of its memory: more
    CPU than the whole worker's run.  ``die_by``: a signal to die by instead
    (SIGINT after an uncaught ``KeyboardInterrupt``, as the interpreter does).
    """
    threading = sys.modules.get("threading")
    if threading is not None:
        try:
            threading._shutdown()
        except BaseException:
            pass
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except BaseException:
            if code == 0:
                code = 120  # what the interpreter reports when the final flush fails
    if die_by:
        import _signal  # type: ignore[import-not-found]

        _signal.signal(die_by, _signal.SIG_DFL)
        os.kill(os.getpid(), die_by)
    os._exit(code)


def _script_traceback(e: BaseException) -> Any:
    """``e``'s traceback from the script's first frame on (ours dropped)."""
    tb = e.__traceback__
    while tb is not None and any(tb.tb_frame.f_globals is g for g in _OURS):
        tb = tb.tb_next
    return tb


_OURS: list[dict[str, Any]] = [globals()]
"""Globals of the code a worker runs before the user's (this module's, the runner's)."""


def _work(run: tuple[Any, ...]) -> NoReturn:
    """In a new worker: what it runs, in a fresh ``__main__``, then ``_finish``.

    ``("boot", main, channel)`` for a function worker, or ``("script",
    run_script, command, path, codes)`` for a Python script or module (see
    ``_child.script``; ``path`` is this interpreter's own default
    ``sys.path``, which a script's is made from; ``codes``, the scripts
    compiled here).
    """
    # a fresh __main__ for the worker, as in a spawned interpreter
    main = type(sys)("__main__")
    main.__builtins__ = __builtins__  # type: ignore[attr-defined]
    sys.modules["__main__"] = main
    try:
        if run[0] == "script":
            run[1](run[2], run[3], main, run[4])  # _child.script.run_script
        else:
            run[1](run[2])  # the function worker's main.main(channel)
    except SystemExit as e:
        _finish(_exit_code(e))
    except BaseException as e:
        # as the interpreter reports an uncaught exception: through sys.excepthook
        # (the hook prints the exception's own traceback: ours is cut off it)
        e = e.with_traceback(_script_traceback(e))
        try:
            sys.excepthook(type(e), e, e.__traceback__)
        except BaseException:
            import traceback

            traceback.print_exc()
        _finish(1, die_by=2 if isinstance(e, KeyboardInterrupt) else 0)
    _finish(0)


if __name__ == "__main__":
    serve(int(sys.argv[1]))
