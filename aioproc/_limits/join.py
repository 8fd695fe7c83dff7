"""What a child runs on itself to enter its placement before user code: standard library only.

A worker forked by a template is not the launcher's child until the
template says so, and a binary may run user code before the launcher's
``join(pid)`` lands; a child that enters its cgroups and sets its rlimits
itself, first thing, closes both gaps.  The launcher passes the placement in
two environment variables (``Placement.child_env()``); ``enter()`` reads
them.  ``_child`` cannot import this wing, so its boot code carries a copy
of ``enter``: this module is the reference the copy follows, and the tests
run it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, MutableMapping

if sys.platform != "win32":
    import resource

PROCS_ENV = "AIOPROC_CGROUP_PROCS"
"""``cgroup.procs`` files to write the child's pid into, joined with ``os.pathsep``."""

RLIMITS_ENV = "AIOPROC_RLIMITS"
"""Rlimits to set, ``NAME=value`` joined with commas (``DATA=67108864,NPROC=16``)."""


def encode_rlimits(settings: Mapping[str, int]) -> str:
    """``{"DATA": 64}`` -> ``"DATA=64"``: the value of ``AIOPROC_RLIMITS``."""
    return ",".join(f"{name}={value}" for name, value in settings.items())


def decode_rlimits(text: str) -> dict[str, int]:
    """The inverse of ``encode_rlimits``; an empty string is no rlimits.

    Raises:
        ValueError: an item is not ``NAME=int`` or names no ``RLIMIT_`` constant.
    """
    settings = {}
    for item in filter(None, text.split(",")):
        name, _, value = item.partition("=")
        if not hasattr(resource, f"RLIMIT_{name}") or not value.isdigit():
            raise ValueError(f"{RLIMITS_ENV}: {item!r} is not NAME=bytes with a known RLIMIT_NAME")
        settings[name] = int(value)
    return settings


def set_rlimits(settings: Mapping[str, int], pid: int | None = None) -> None:
    """Lower the soft and hard limits of this process (or of ``pid``, Linux only).

    A hard limit lower than asked is kept: lowering it is all an
    unprivileged process may do, and the lower one is the stricter.
    """
    for name, value in settings.items():
        which = getattr(resource, f"RLIMIT_{name}")
        _, hard = resource.getrlimit(which) if pid is None else resource.prlimit(pid, which)
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        if pid is None:
            resource.setrlimit(which, (value, value))
        else:
            resource.prlimit(pid, which, (value, value))


ENTER_SH = (
    'IFS=:; for f in $AIOPROC_CGROUP_PROCS; do echo $$ > "$f" || exit 126; done; '
    'unset AIOPROC_CGROUP_PROCS IFS; exec "$@"'
)
"""``enter``'s cgroup half for a binary: ``/bin/sh -c ENTER_SH NAME ARGV...``.

The shell writes its pid into the cgroups named in ``AIOPROC_CGROUP_PROCS``,
then execs ``ARGV`` as that same pid: the program runs nothing, and forks
nothing, outside them.  A cgroup that refuses the pid ends the shell with
status 126 and the program never runs."""


def enter(environ: MutableMapping[str, str] | None = None) -> None:
    """Enter the placement named in ``environ``: cgroups first, then rlimits.

    The two variables are removed from ``environ`` (``os.environ`` by
    default), so the user's own subprocesses do not read a placement meant
    for this process; they stay in its cgroups anyway, by inheritance.

    Raises:
        OSError: a cgroup refused the process: the child should fail to
            start rather than run without the limits it was given.
    """
    environ = os.environ if environ is None else environ
    procs = environ.pop(PROCS_ENV, "")
    rlimits = environ.pop(RLIMITS_ENV, "")
    pid = str(os.getpid()).encode()
    for path in filter(None, procs.split(os.pathsep)):
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.write(fd, pid)
        finally:
            os.close(fd)
    if rlimits:
        set_rlimits(decode_rlimits(rlimits))
