"""Run a Python script in a forked worker as ``python [-u] script args`` would.

Standard library only.  Shipped to the forkserver template as compiled code
in its INIT message (see ``_func.template``) and built there once, like the
function workers' boot modules; ``run_script`` is called in a worker the
template forked for ``aioproc run --start-method forkserver`` (see
``_func.script`` for which command lines qualify).
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


def script_streams(unbuffered: bool) -> None:
    """Standard streams over the worker's fds 0-2, made as ``python [-u]`` makes them.

    The template's own were made for its /dev/null: line buffering follows
    the worker's stdout (a terminal or not), and ``-u`` (or
    ``PYTHONUNBUFFERED``) leaves stdout and stderr unbuffered.
    """
    import io

    for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        old = getattr(sys, name)
        raw = io.FileIO(fd, "r" if fd == 0 else "w", closefd=False)
        buffer: Any
        if fd == 0:
            buffer = io.BufferedReader(raw)
        elif unbuffered:
            buffer = raw
        else:
            buffer = io.BufferedWriter(raw)
        stream = io.TextIOWrapper(
            buffer,
            encoding=getattr(old, "encoding", None),
            errors=getattr(old, "errors", None),
            newline="\n",
            line_buffering=not unbuffered and (fd == 2 or raw.isatty()),
            write_through=unbuffered and fd != 0,
        )
        stream.mode = "r" if fd == 0 else "w"  # type: ignore[misc]
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def run_script(
    command: dict[str, Any],
    default_path: list[str],
    main: Any,
    codes: dict[str, tuple[tuple[int, ...], Any]] | None = None,
) -> None:
    """Run a Python script or module in ``main`` as ``python [-u] script args`` would.

    ``command``: ``argv`` (the script, or ``-m`` and the module, then the
    arguments), ``unbuffered`` (``-u``) and ``orig`` (the whole command
    line, for ``sys.orig_argv``).  ``sys.argv``, ``sys.path`` and
    ``__main__`` are what the interpreter gives a script: ``sys.path[0]`` is
    the script's directory (the working directory for ``-m``), followed by
    this interpreter's default path.  ``codes``: scripts compiled already,
    ``{abspath: (file_key(stat), code)}``, used while the file is unchanged.
    """
    argv: list[str] = command["argv"]
    script_streams(command["unbuffered"] or bool(os.environ.get("PYTHONUNBUFFERED")))
    sys.orig_argv = command["orig"]
    safe = getattr(sys.flags, "safe_path", False) or sys.flags.isolated
    rest = default_path if safe else default_path[1:]  # [0] is -c's "" otherwise
    if argv[0] == "-m":
        import runpy  # as the interpreter does for -m, and only then

        sys.argv[:] = ["-m", *argv[2:]]
        sys.path[:] = rest if safe else [os.getcwd(), *rest]
        runpy._run_module_as_main(argv[1], alter_argv=True)  # type: ignore[attr-defined]
        return
    path = argv[0]
    sys.argv[:] = argv
    if os.path.isdir(path) or _is_zip(path):  # a directory or zip with __main__.py
        import runpy

        sys.path[:] = rest if safe else [path, *rest]
        runpy._run_module_as_main("__main__", alter_argv=False)  # type: ignore[attr-defined]
        return
    sys.path[:] = rest if safe else [os.path.dirname(os.path.realpath(path)), *rest]
    filename = os.path.abspath(path)
    code = _compiled(filename, codes)
    if code is None:
        try:
            with open(path, "rb") as f:
                source = f.read()
        except OSError as e:
            print(
                f"{sys.executable}: can't open file {filename!r}: [Errno {e.errno}] {e.strerror}",
                file=sys.stderr,
            )
            raise SystemExit(2) from None
        code = compile(source, filename, "exec", dont_inherit=True)
    import _frozen_importlib_external

    main.__file__ = filename
    main.__cached__ = None
    main.__loader__ = _frozen_importlib_external.SourceFileLoader("__main__", filename)
    exec(code, main.__dict__)


def file_key(st: os.stat_result) -> tuple[int, ...]:
    """What tells a file's text changed since: size, times and inode.

    The inode catches a same-size file renamed into place, the change
    time a rewrite that kept the modification time (``rsync -t``, ``cp -p``).
    """
    return (st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_ino, st.st_dev)


def _compiled(filename: str, codes: dict[str, tuple[tuple[int, ...], Any]] | None) -> Any:
    """The code compiled for ``filename`` if the file is still as it was then."""
    known = None if codes is None else codes.get(filename)
    if known is None:
        return None
    try:
        st = os.stat(filename)
    except OSError:
        return None
    return known[1] if file_key(st) == known[0] else None


def _is_zip(path: str) -> bool:
    import zipimport

    try:
        zipimport.zipimporter(path)
    except (ImportError, OSError):
        return False
    return True
