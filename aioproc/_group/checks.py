"""The checks of a whole group, run before any of its workers starts.

Input that only exec rejects is found late: the earlier ranks already run,
and the OS says "embedded null byte" or "Argument list too long" without
naming the rank or the variable.  The factories (``start_processes``,
``run``, ``open_worker``, ``open_pool``), the agent's specs and the CLI call
these first, so a mistake says which rank, which variable and which value.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from .._base.checks import check_env, check_exec_text, check_start_method, exec_problem
from ..logs import LogsSpecs

# exec's limits (Linux fs/exec.c): the strings of argv and envp, each with its
# NUL, plus one pointer per string, must fit in ARG_MAX; the kernel caps that
# at 3/4 of 8 MiB whatever RLIMIT_STACK says (glibc's sysconf does not).
_LINUX_ARG_MAX_CAP = 6 << 20
_POINTER = 8 if sys.maxsize > 2**32 else 4
# Room kept for what is added after the check: TORCHELASTIC_ERROR_FILE (a
# path, set by the logs spec when the group starts) and the executable's
# resolved path, which the kernel copies too.
EXEC_MARGIN = 8 << 10


def _check_argv(rank: int, args: Sequence[object]) -> None:
    for i, arg in enumerate(args):
        try:
            text = str(arg)  # exactly what the launch does
        except Exception as e:
            raise TypeError(
                f"args[{rank}][{i}] (local rank {rank}) cannot be made a str for the "
                f"command line: {e!r}"
            ) from e
        if exec_problem(text) is not None:  # the message only for a bad one
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
        from .._func.boot import boot_argv

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
        from .._func.boot import boot_argv

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
    check_exec_size(entrypoint, args, envs)
    if isinstance(logs_specs, LogsSpecs):
        logs_specs.validate(envs)


def check_interval(value: float | None) -> float | None:
    """``sample_interval=`` checked: a positive number of seconds, or None."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"sample_interval must be a number of seconds or None, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"sample_interval must be a positive number of seconds, got {value!r}")
    return float(value)
