"""Python scripts that the forkserver template runs itself (``aioproc run``'s workers).

A binary worker whose command line is this interpreter running a script or
a module, ``sys.executable [-u] script.py args`` or ``sys.executable [-u]
-m module args`` (what ``aioproc run`` starts), can be forked from the
template with ``start_method="forkserver"``: exec'ing would discard the
template, so the forked worker runs the script itself, as that command line
would (``_child.script.run_script``).  Any other command line is spawned.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

_OPTIONS = frozenset({"-u"})
"""Interpreter options a forked script honours (the template's flags are fixed)."""


@dataclass(frozen=True)
class ScriptCommand:
    """``sys.executable [-u] (script | -m module) args...``, taken apart."""

    argv: tuple[str, ...]  # the script (or "-m" and the module), then its arguments
    unbuffered: bool
    orig: tuple[str, ...]  # the whole command line

    @property
    def is_module(self) -> bool:
        return self.argv[0] == "-m"

    def import_dir(self) -> str:
        """What ``sys.path[0]`` is for this command: where its own modules are found."""
        if self.is_module:
            return os.getcwd()
        path = self.argv[0]
        if os.path.isdir(path):
            return os.path.abspath(path)
        return os.path.dirname(os.path.realpath(path))

    def request(self) -> dict[str, Any]:
        """What the template's forked worker gets (marshal-able)."""
        return {"argv": list(self.argv), "unbuffered": self.unbuffered, "orig": list(self.orig)}


def script_commands(
    entrypoint: object, args: Mapping[int, Sequence[object]]
) -> dict[int, ScriptCommand]:
    """The script each rank's ``entrypoint args`` runs, if it is this
    interpreter running one: ``{rank: command}`` for those ranks.

    The entrypoint is compared with this interpreter once for all ranks
    (two ``abspath``, each a ``getcwd``: most of the cost per rank).
    """
    if not isinstance(entrypoint, str) or not _is_this_interpreter(entrypoint):
        return {}
    commands = {}
    for rank, rank_args in args.items():
        command = _script_of(entrypoint, rank_args)
        if command is not None:
            commands[rank] = command
    return commands


def _script_of(entrypoint: str, args: Sequence[object]) -> ScriptCommand | None:
    """The script ``entrypoint args`` runs (``entrypoint`` is this interpreter)."""
    argv = [str(a) for a in args]
    i = 0
    while i < len(argv) and argv[i] in _OPTIONS:
        i += 1
    rest = argv[i:]
    if not rest:
        return None
    if rest[0] == "-m":
        if len(rest) < 2 or not all(p.isidentifier() for p in rest[1].split(".")):
            return None
    elif rest[0].startswith("-") or not rest[0]:
        return None  # -c, -X..., "-" (stdin): spawned
    return ScriptCommand(tuple(rest), "-u" in argv[:i], (entrypoint, *argv))


def _is_this_interpreter(path: str) -> bool:
    # by name, not by inode: a virtualenv's python links to the base one,
    # yet it is another interpreter (its own prefix and site-packages)
    return bool(sys.executable) and os.path.abspath(path) == os.path.abspath(sys.executable)


def script_dirs(entrypoint: object, args: Mapping[int, Sequence[object]]) -> tuple[str, ...]:
    """The ``import_dir`` of every rank's script, once each; () if none runs one.

    A forkserver template for these workers searches them first, so a
    module next to the script can be preloaded.
    """
    dirs = {command.import_dir(): None for command in script_commands(entrypoint, args).values()}
    return tuple(dirs)
