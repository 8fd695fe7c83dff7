"""Every input check that can run before a process, fd or directory exists.

Input that only exec rejects is found late: the earlier ranks already run,
and the OS says "embedded null byte" or "Argument list too long" without
naming the rank or the variable.  The factories (``start_processes``,
``run``, ``open_worker``, ``open_pool``), the agent's specs,
``DefaultLogsSpecs`` and the CLI call these checks first, so a mistake fails
at once, says which rank, which variable and which value, and leaves
nothing behind.

Stdlib only at import time: ``logs`` imports this module and the child side
may import ``logs``.  The checks that need other aioproc modules import them
when called.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import sys
from collections.abc import Mapping, Sequence
from typing import Any, Literal, overload

START_METHODS = ("spawn", "forkserver")

_NUL = "\0"
# exec's limits (Linux fs/exec.c): the strings of argv and envp, each with its
# NUL, plus one pointer per string, must fit in ARG_MAX; the kernel caps that
# at 3/4 of 8 MiB whatever RLIMIT_STACK says (glibc's sysconf does not).
_LINUX_ARG_MAX_CAP = 6 << 20
_POINTER = 8 if sys.maxsize > 2**32 else 4
# Room kept for what is added after the check: TORCHELASTIC_ERROR_FILE (a
# path, set by the logs spec when the group starts) and the executable's
# resolved path, which the kernel copies too.
EXEC_MARGIN = 8 << 10
# A directory entry holds 255 bytes on every filesystem aioproc runs on.
_NAME_MAX = 255
_MKDTEMP_SUFFIX = 9  # "_" and tempfile's 8 random characters


# --------------------------------------------------------------- durations


@overload
def check_duration(
    name: str,
    value: object,
    *,
    allow_none: Literal[False] = False,
    allow_negative: bool = False,
) -> float: ...


@overload
def check_duration(
    name: str, value: object, *, allow_none: bool, allow_negative: bool = False
) -> float | None: ...


def check_duration(
    name: str, value: object, *, allow_none: bool = False, allow_negative: bool = False
) -> float | None:
    """Check a number of seconds and return it as a float.

    NaN compares false with everything, so it slips through a ``< 0`` check
    and then makes a timeout fire never or at once; ``True`` is not "one
    second".  Both are refused, and so is infinity: ``None`` (where
    allowed) or a negative value (where allowed) already mean "no limit".

    Args:
        name: how the caller names the value in the message, e.g.
            ``"grace_period"`` or ``"close(timeout=...)"``.
        value: the value given.
        allow_none: ``None`` is accepted (and returned) as "no limit".
        allow_negative: a negative value is accepted (``wait()``: forever).

    Returns:
        ``float(value)``, or ``None`` for an allowed ``None``.

    Raises:
        TypeError: ``value`` is not an int or a float, or is a bool.
        ValueError: ``value`` is NaN, infinite, or negative where not allowed.
    """
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        alternative = " or None" if allow_none else ""
        raise TypeError(f"{name} must be a number of seconds{alternative}, got {value!r}")
    try:
        seconds = float(value)
    except OverflowError:  # an int too large for a float
        seconds = math.inf
    if not math.isfinite(seconds):
        if allow_negative:
            hint = " (a negative value means no limit)"
        elif allow_none:
            hint = " (None means no limit)"
        else:
            hint = ""
        raise ValueError(f"{name} must be a finite number of seconds{hint}, got {value!r}")
    if seconds < 0 and not allow_negative:
        raise ValueError(f"{name} must be a number >= 0, got {value!r}")
    return seconds


# ------------------------------------------------------- strings for exec


def _short(text: str, limit: int = 60) -> str:
    """``repr(text)``, cut in the middle when long (values may be megabytes)."""
    if len(text) <= limit:
        return repr(text)
    half = limit // 2
    return f"{text[:half]!r}...{text[-half:]!r} ({len(text)} characters)"


def _exec_problem(text: str) -> str | None:
    """What makes ``text`` unusable in an argv or environment, or None."""
    at = text.find(_NUL)
    if at >= 0:
        return f"contains a NUL byte (at index {at})"
    if text.isascii():
        return None  # ASCII always encodes (and is what nearly every argv holds)
    try:
        os.fsencode(text)
    except UnicodeEncodeError as e:
        return f"cannot be encoded for the OS ({e.reason} at index {e.start})"
    return None


def check_exec_text(what: str, text: str) -> None:
    """Raise ``ValueError`` naming ``what`` if exec cannot take ``text`` (a NUL byte...)."""
    problem = _exec_problem(text)
    if problem is not None:
        raise ValueError(f"{what} {problem}: {_short(text)}")


def check_env(what: str, env: object, rank: int | None = None) -> None:
    """Check that ``env`` maps variable names to values exec accepts.

    Args:
        what: how the caller names the mapping, e.g. ``"envs[3]"`` or ``"env"``.
        env: the mapping.
        rank: the local rank it belongs to, named in messages.

    Raises:
        TypeError: not a mapping of str to str.
        ValueError: an empty name, a name with ``=``, a NUL byte in a name or
            a value, or text that cannot be encoded for the OS.
    """
    whose = f" (local rank {rank})" if rank is not None else ""
    if not isinstance(env, Mapping):
        raise TypeError(f"{what}{whose} must be a dict of str to str, got {env!r}")
    for key, value in env.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(
                f"{what}{whose} must map str to str; got {key!r}: {value!r} "
                f"({type(value).__name__})"
            )
        if not key:
            raise ValueError(f"{what}{whose} has an empty variable name (value {_short(value)})")
        if "=" in key:
            raise ValueError(
                f"{what}{whose} has the variable name {_short(key)}: a name cannot contain '='"
            )
        problem = _exec_problem(key)
        if problem is not None:
            raise ValueError(f"{what}{whose} has the variable name {_short(key)}, which {problem}")
        if _exec_problem(value) is not None:  # the message only for a bad one
            check_exec_text(f"{what}[{key!r}]{whose}", value)


def _check_argv(rank: int, args: Sequence[object]) -> None:
    for i, arg in enumerate(args):
        try:
            text = str(arg)  # exactly what the launch does
        except Exception as e:
            raise TypeError(
                f"args[{rank}][{i}] (local rank {rank}) cannot be made a str for the "
                f"command line: {e!r}"
            ) from e
        if _exec_problem(text) is not None:  # the message only for a bad one
            check_exec_text(f"args[{rank}][{i}] (local rank {rank})", text)


def _check_prefixes(prefixes: object, expected: set[int]) -> None:
    if prefixes is None or isinstance(prefixes, str):
        return
    if not isinstance(prefixes, Mapping):
        raise TypeError(
            f"log_line_prefixes must be a str template or a {{local_rank: str}} dict, "
            f"got {prefixes!r}"
        )
    bad = set(prefixes) - expected
    if bad:
        raise ValueError(f"log_line_prefixes has unknown local ranks {sorted(bad, key=repr)}")
    for rank, prefix in prefixes.items():
        if not isinstance(prefix, str):
            raise TypeError(
                f"log_line_prefixes[{rank}] (local rank {rank}) must be a str, "
                f"got {prefix!r} ({type(prefix).__name__})"
            )


# ------------------------------------------------------------ the group


def check_start_method(start_method: object) -> str:
    """``"spawn"`` or ``"forkserver"``; ``"fork"`` is refused with the reason."""
    if start_method == "fork":
        raise ValueError(
            "start_method='fork' is refused: forking this process would copy its running "
            "event loop, its threads' held locks and its open fds into every worker; use "
            "'forkserver' (workers forked from a clean template that preloads modules) "
            "or 'spawn'"
        )
    if start_method not in START_METHODS:
        raise ValueError(
            f"unknown start_method {start_method!r}: expected 'spawn' (a fresh "
            "interpreter per worker) or 'forkserver' (forked from a preloaded template)"
        )
    if start_method == "forkserver" and not sys.platform.startswith("linux"):
        raise ValueError(f"start_method='forkserver' needs Linux, not {sys.platform}")
    return str(start_method)


def check_preload(start_method: str, preload: object) -> tuple[str, ...]:
    """The module names to preload in the forkserver template, as a tuple."""
    if isinstance(preload, (str, bytes)) or not isinstance(preload, Sequence):
        raise TypeError(f"preload must be a list of module names, got {preload!r}")
    for name in preload:
        if not isinstance(name, str) or not all(p.isidentifier() for p in name.split(".")):
            raise ValueError(f"preload: {name!r} is not a module name")
    if preload and start_method != "forkserver":
        raise ValueError(
            f"preload={list(preload)!r} needs start_method='forkserver' "
            f"(got {start_method!r}): only the forkserver template preloads modules"
        )
    return tuple(dict.fromkeys(preload))


def validate_group(
    name: object,
    entrypoint: object,
    args: object,
    envs: object,
    logs_specs: object,
    log_line_prefixes: object,
    start_method: object,
) -> None:
    """Check ``start_processes``' arguments; see its docstring for the errors."""
    from .logs import LogsSpecs

    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {name!r}")
    if not isinstance(entrypoint, str) and not callable(entrypoint):
        raise TypeError(
            f"entrypoint must be a callable (function workers) or a str "
            f"(binary workers), got {entrypoint!r}"
        )
    if isinstance(entrypoint, str):
        if not entrypoint:
            raise ValueError("entrypoint is an empty string")
        check_exec_text("entrypoint", entrypoint)
    check_start_method(start_method)
    if not isinstance(args, Mapping):
        raise TypeError(f"args must be a {{local_rank: tuple}} dict, got {args!r}")
    if not isinstance(envs, Mapping):
        raise TypeError(f"envs must be a {{local_rank: dict}} dict, got {envs!r}")
    nprocs = len(args)
    if nprocs == 0:
        raise ValueError("args is empty: at least one worker (local rank 0) is needed")
    expected = set(range(nprocs))
    for what, mapping in (("args", args), ("envs", envs)):
        if set(mapping) != expected:
            raise RuntimeError(
                f"{what} local rank keys mismatch: expected {sorted(expected)}, "
                f"got {sorted(mapping, key=repr)}"
            )
    for rank, a in args.items():
        if not isinstance(a, (tuple, list)):
            raise TypeError(f"args[{rank}] must be a tuple, got {a!r}")
        if isinstance(entrypoint, str):  # function workers' args are pickled, not exec'd
            _check_argv(rank, a)
    for rank, env in envs.items():
        if env or not isinstance(env, Mapping):  # an empty dict needs no check
            check_env(f"envs[{rank}]", env, rank)
    if not isinstance(logs_specs, LogsSpecs):
        raise TypeError(f"logs_specs must be a LogsSpecs, got {logs_specs!r}")
    _check_prefixes(log_line_prefixes, expected)


def check_kwargs(
    entrypoint: object, args: Mapping[int, object], kwargs: object
) -> dict[int, dict[str, Any]]:
    """Per-rank keyword arguments of function workers: ``{local_rank: {name: value}}``.

    Ranks left out get none.  Raises ``TypeError`` for binary workers (argv
    has no keywords) and for anything but a dict of str-keyed dicts,
    ``ValueError`` for a rank the group does not have.
    """
    if kwargs is None:
        return {}
    if isinstance(entrypoint, str):
        raise TypeError(
            f"kwargs are for function workers; binary worker {entrypoint!r} takes argv only"
        )
    if not isinstance(kwargs, Mapping):
        raise TypeError(f"kwargs must be a {{local_rank: dict}} dict, got {kwargs!r}")
    out: dict[int, dict[str, Any]] = {}
    for rank, kw in kwargs.items():
        if rank not in args:
            raise ValueError(
                f"kwargs for local rank {rank!r}, but the ranks are {sorted(args, key=repr)}"
            )
        if not isinstance(kw, Mapping) or not all(isinstance(k, str) for k in kw):
            raise TypeError(f"kwargs[{rank}] must be a dict with str keys, got {kw!r}")
        out[rank] = dict(kw)
    return out


def check_filters(what: str, filters: Sequence[str] | None) -> tuple[str, ...]:
    """``duplicate_*_filters``: a list of non-empty strings, as a tuple."""
    if filters is None:
        return ()
    if isinstance(filters, str) or not all(isinstance(f, str) and f for f in filters):
        raise TypeError(f"{what} must be a list of non-empty strings, got {filters!r}")
    return tuple(filters)


def check_signal(sig: int) -> int:
    """``death_sig``: a valid signal number."""
    try:
        valid = signal.Signals(sig)
    except (ValueError, TypeError):
        raise ValueError(f"death_sig must be a signal number, got {sig!r}") from None
    return int(valid)


def check_executable(entrypoint: str, envs: Mapping[int, Mapping[str, str]]) -> None:
    """Fail like exec would, but before any worker starts."""
    if os.sep in entrypoint:
        if not os.path.exists(entrypoint):
            raise FileNotFoundError(2, f"binary entrypoint not found: {entrypoint!r}", entrypoint)
        if os.path.isdir(entrypoint) or not os.access(entrypoint, os.X_OK):
            raise PermissionError(
                13, f"binary entrypoint is not an executable file: {entrypoint!r}", entrypoint
            )
        return
    checked: set[str] = set()  # ranks usually share one PATH: look it up once
    for rank, env in envs.items():
        path = env.get("PATH", os.environ.get("PATH", os.defpath))
        if path in checked:
            continue
        checked.add(path)
        if shutil.which(entrypoint, path=path) is None:
            raise FileNotFoundError(
                2, f"binary entrypoint {entrypoint!r} not found on PATH of local rank {rank}"
            )


# ------------------------------------------------------------ exec size


def _exec_limits() -> tuple[int, int] | None:
    """``(ARG_MAX, MAX_ARG_STRLEN)`` of this system, or None if unknown."""
    try:
        arg_max = os.sysconf("SC_ARG_MAX")
    except (ValueError, OSError):
        return None
    if arg_max <= 0:
        return None
    if sys.platform.startswith("linux"):
        arg_max = min(arg_max, _LINUX_ARG_MAX_CAP)
        # one string, with its NUL, may take at most 32 pages
        max_strlen = 32 * os.sysconf("SC_PAGE_SIZE")
    else:
        max_strlen = arg_max
    return arg_max, max_strlen


def _size(n: int) -> str:
    if n >= 1 << 20:
        return f"{n / (1 << 20):.1f} MiB"
    if n >= 1 << 10:
        return f"{n / (1 << 10):.1f} KiB"
    return f"{n} bytes"


def _encoded_len(text: str) -> int:
    """Bytes of ``text`` as exec gets it (``os.fsencode``), ASCII without a copy."""
    return len(text) if text.isascii() else len(os.fsencode(text))


def _entry(key: str, value: str) -> int:
    """Bytes of ``KEY=VALUE`` in an environment block, without its NUL."""
    return _encoded_len(key) + 1 + _encoded_len(value)


def check_exec_size(
    entrypoint: object,
    args: Mapping[int, Sequence[object]],
    envs: Mapping[int, Mapping[str, str]],
) -> None:
    """Check that every rank's argv and environment fit exec's limits.

    A rank's environment is the parent's ``os.environ`` plus ``envs[rank]``,
    as at launch; ``EXEC_MARGIN`` bytes are kept for what the launch adds.
    Run it after ``validate_group`` (the strings are known to be encodable).
    Each rank costs a sum and a max of string lengths; the strings are
    named only for a rank over a limit (hundreds of ranks are checked on
    the caller's loop, before anything starts).

    Args:
        entrypoint: the executable (binary workers) or the callable.
        args: ``{local_rank: args}``.
        envs: ``{local_rank: {name: value}}``.

    Raises:
        ValueError: a rank's argv and environment exceed ARG_MAX, or one
            string exceeds MAX_ARG_STRLEN (Linux); the message names the rank
            and the biggest string.
    """
    limits = _exec_limits()
    if limits is None:
        return
    arg_max, max_strlen = limits
    inherited = {key: _entry(key, value) for key, value in os.environ.items()}
    inherited_total = sum(size + 1 + _POINTER for size in inherited.values())
    biggest_inherited = max(inherited.values(), default=0)
    binary = isinstance(entrypoint, str)
    fixed: list[int] = []  # the sizes every rank has: the entrypoint, or the boot command
    if binary:
        fixed.append(_encoded_len(str(entrypoint)))
    else:
        from ._func.boot import boot_argv

        fixed += [_encoded_len(s) for s in boot_argv(0)]
    fixed_total = sum(size + 1 + _POINTER for size in fixed)
    for rank in sorted(envs):
        own = envs[rank]
        sizes = [_encoded_len(str(a)) for a in args[rank]] if binary else []
        sizes += [_entry(key, value) for key, value in own.items()]
        total = inherited_total + fixed_total + sum(sizes) + len(sizes) * (1 + _POINTER)
        for key in own:
            if key in inherited:  # overridden: the rank's value replaces it
                total -= inherited[key] + 1 + _POINTER
        # an upper bound: the biggest inherited string may be overridden
        largest = max(max(sizes, default=0), max(fixed, default=0), biggest_inherited)
        if largest + 1 > max_strlen or total > arg_max - EXEC_MARGIN:
            _check_rank_closely(rank, entrypoint, args, own, inherited, total, arg_max, max_strlen)


def _check_rank_closely(
    rank: int,
    entrypoint: object,
    args: Mapping[int, Sequence[object]],
    own: Mapping[str, str],
    inherited: Mapping[str, int],
    total: int,
    arg_max: int,
    max_strlen: int,
) -> None:
    """Raise the ValueError for a rank over a limit, naming its biggest string.

    Returns if the rank fits after all (its biggest string was an inherited
    variable that it overrides).
    """
    strings: list[tuple[str, int]] = []  # (what, bytes without the NUL)
    if isinstance(entrypoint, str):
        strings.append(("the entrypoint", _encoded_len(entrypoint)))
        strings += [(f"args[{rank}][{i}]", _encoded_len(str(a))) for i, a in enumerate(args[rank])]
    else:
        from ._func.boot import boot_argv

        strings += [("the function worker's command line", _encoded_len(s)) for s in boot_argv(0)]
    strings += [(f"envs[{rank}][{key!r}]", _entry(key, value)) for key, value in own.items()]
    what, size = max(strings, key=lambda s: s[1])
    # the biggest inherited variable this rank does not override
    kept = [(key, entry) for key, entry in inherited.items() if key not in own]
    key, entry = max(kept, key=lambda item: item[1], default=("", 0))
    if entry > size:
        what, size = f"os.environ[{key!r}] (inherited)", entry
    if size + 1 > max_strlen:
        raise ValueError(
            f"local rank {rank}: {what} takes {_size(size)}, over the system limit "
            f"MAX_ARG_STRLEN of {_size(max_strlen - 1)} for one argument or variable"
        )
    if total > arg_max - EXEC_MARGIN:
        raise ValueError(
            f"local rank {rank}: argv and environment take {_size(total)} ({total} bytes), "
            f"over the system limit ARG_MAX of {_size(arg_max)} less {_size(EXEC_MARGIN)} "
            f"kept for the launch (largest: {what}, {_size(size)})"
        )


# ---------------------------------------------------------------- paths


def check_path_name(what: str, value: object) -> str:
    """Check a value that becomes one directory name inside the log dir.

    A run id builds ``<log_dir>/<run_id>_<random>``: a separator, ``.`` or
    ``..`` would put the logs somewhere else.

    Raises:
        TypeError: ``value`` is not a str.
        ValueError: it contains a path separator or a NUL byte, is ``.`` or
            ``..``, or is too long for a directory name.
    """
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str, got {value!r}")
    check_exec_text(what, value)
    separators = {os.sep, "/", *([os.altsep] if os.altsep else [])}
    if any(sep in value for sep in separators):
        raise ValueError(
            f"{what} {_short(value)} contains a path separator; it names a directory "
            "inside the log dir, so it must be a plain name"
        )
    if value in (".", ".."):
        raise ValueError(f"{what} {value!r} is not a usable directory name")
    length = len(os.fsencode(value))
    if length + _MKDTEMP_SUFFIX > _NAME_MAX:
        raise ValueError(
            f"{what} {_short(value)} is {length} bytes long; a directory name allows "
            f"{_NAME_MAX - _MKDTEMP_SUFFIX} bytes before the {_MKDTEMP_SUFFIX} aioproc appends"
        )
    return value


def check_log_dir(log_dir: object) -> str | None:
    """Check a ``log_dir`` argument; return it as a str, or None for none given.

    Nothing is created.  A ``log_dir`` that does not exist yet is fine when
    its nearest existing ancestor is a directory (it is made at start).

    Raises:
        TypeError: not a str, a path or None.
        ValueError: it contains a NUL byte.
        NotADirectoryError: it, or the ancestor it would be created in, exists
            and is not a directory.
    """
    if log_dir is None:
        return None
    if not isinstance(log_dir, (str, os.PathLike)):
        raise TypeError(f"log_dir must be a str, a path or None, got {log_dir!r}")
    path = os.fspath(log_dir)
    if not isinstance(path, str):
        raise TypeError(f"log_dir must be a str, a path or None, got {log_dir!r}")
    if not path:
        return None  # torch treats "" like None
    if path == os.devnull:
        return path
    check_exec_text("log_dir", path)
    probe = os.path.abspath(path)
    # lexists: a dangling symlink is in the way too (makedirs would fail on it)
    while not os.path.lexists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            return path
        probe = parent
    if not os.path.isdir(probe):
        if probe == os.path.abspath(path):
            raise NotADirectoryError(f"log_dir {path!r} exists and is not a directory")
        raise NotADirectoryError(
            f"log_dir {path!r} cannot be created: {probe!r} exists and is not a directory"
        )
    return path


# ---------------------------------------------------------------- start


def check_start(
    entrypoint: object,
    args: Mapping[int, Sequence[object]],
    envs: Mapping[int, Mapping[str, str]],
    logs_specs: object,
) -> None:
    """What ``PContext.start()`` checks against the present (environment, files).

    Runs after ``validate_group`` and before anything is created: exec's size
    limits for every rank, then the logs spec's own ``validate``.

    Raises:
        ValueError: a rank's argv and environment are too big for exec.
        Exception: whatever ``logs_specs.validate(envs)`` raises.
    """
    from .logs import LogsSpecs

    check_exec_size(entrypoint, args, envs)
    if isinstance(logs_specs, LogsSpecs):
        logs_specs.validate(envs)
