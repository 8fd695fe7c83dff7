"""What a warm-start template process is made of, and how its forks are known (parent side).

The code a template runs (``_child.template``'s source, and ``_child.script``
compiled for it to build once), its exec environment (this process's, the
lifeline, its mark, the native thread-pool sizes while preloading), and the
search for what it forked among this process's children, by the name it
gives them (``fork_name``), its session or its mark (``MARK_VAR``): what
``Template._sweep`` kills after a failure (see ``_func.template``).
"""

from __future__ import annotations

import functools
import logging
import marshal
import os
from pathlib import Path

from .._proc import lifeline as _lifeline

logger = logging.getLogger("aioproc")

MARK_VAR = "AIOPROC_TEMPLATE"
"""Environment variable of a template's exec environment naming that template:
what tells its forks apart from this process's other children (``Template._sweep``)."""

NAME_PREFIX = "aioproc-"
"""How a template's process name starts (``fork_name``)."""


def fork_name(mark: str) -> bytes:
    """The process name (``comm``) of the template marked ``mark``, and of its forks
    until they pass their gate.

    Unlike its session and its environment, a process keeps its name once
    dead: a fork that a kill of the template's group caught just as it made
    its own session is a zombie whose name alone still tells whose fork it
    is.  15 bytes, the most the kernel keeps.
    """
    return (NAME_PREFIX + mark.rpartition("-")[2][:7]).encode()


THREAD_VARS = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "BLIS_NUM_THREADS",
    "NUMEXPR_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
)
"""Thread-pool sizes of the usual native libraries, set to 1 while preloading
unless the user set them: a pool started at import would make the template
unsafe to fork (torchrun sets ``OMP_NUM_THREADS=1`` for its workers alike)."""


@functools.cache
def _source() -> str:
    return (Path(__file__).parent.parent / "_child" / "template.py").read_text()


@functools.cache
def _script_runner() -> bytes:
    """``_child.script`` compiled and marshalled: the template builds it once."""
    path = Path(__file__).parent.parent / "_child" / "script.py"
    return marshal.dumps(compile(path.read_text(), str(path), "exec"))


def _template_env(
    preload: tuple[str, ...], mark: str, logged: set[tuple[str, ...]]
) -> dict[str, str]:
    """The template's exec environment: ours, the lifeline, its mark, the thread vars.

    ``logged``: the preload sets whose thread vars were logged already
    (``_func.template._thread_vars_logged``); ``preload`` is added to it.
    """
    env = {**os.environ, _lifeline.TOKEN_VAR: _lifeline.lineage(), MARK_VAR: mark}
    unset = [var for var in THREAD_VARS if var not in os.environ]
    if preload and unset:
        env.update(dict.fromkeys(unset, "1"))
        # once per preload set: a supervisor starts a template for every group
        # that has none kept warm, and the same line each time is noise
        log = logger.debug if preload in logged else logger.warning
        logged.add(preload)
        log(
            "forkserver template: %s set to 1 while preloading %s, as torchrun does for its "
            "workers (set them to choose): forked workers start with one thread per native "
            "thread pool",
            ", ".join(unset),
            list(preload),
        )
    return env


def _forked_by(pid: int, template: int, name: bytes, needle: bytes) -> bool:
    """Whether our child ``pid`` is a fork of ``template`` (see ``Template._sweep``).

    ``name``: the template's process name (``fork_name``); ``needle``: its
    mark as it appears in its exec environment.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        # "pid (comm) state ppid pgrp session ...": comm may hold spaces and parens
        comm_end = stat.rindex(b")")
        if stat[stat.index(b"(") + 1 : comm_end] == name:
            return True  # not past its gate yet, alive or dead
        _, _, pgrp, session = stat[comm_end + 2 :].split()[:4]
        if int(session) == template or int(pgrp) == template:
            return True
        with open(f"/proc/{pid}/environ", "rb") as f:
            return needle in f.read().split(b"\0")
    except (OSError, ValueError):
        return False
