"""Generic input checks that run before a process, fd or directory exists.

A mistake found here fails at once, names the value, and leaves nothing
behind.  Durations, environments and strings bound for exec, start methods,
signal numbers and path names are checked here for every public entry
point; the checks of a whole group (ranks, argv, exec's size limits) are in
``_group.checks``.  Standard library only.
"""

from __future__ import annotations

import math
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from typing import Literal, overload

START_METHODS = ("spawn", "forkserver")

_NUL = "\0"
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


def exec_problem(text: str) -> str | None:
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
    problem = exec_problem(text)
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
        problem = exec_problem(key)
        if problem is not None:
            raise ValueError(f"{what}{whose} has the variable name {_short(key)}, which {problem}")
        if exec_problem(value) is not None:  # the message only for a bad one
            check_exec_text(f"{what}[{key!r}]{whose}", value)


# ------------------------------------------------------ start and options


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
