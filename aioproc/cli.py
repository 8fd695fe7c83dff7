"""``aioproc run``: torchrun's command line on the asyncio agent.

``aioproc run [options] script.py [args...]`` starts ``--nproc-per-node``
copies of ``sys.executable -u script.py args...`` with torchrun's
environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``, ``TORCHELASTIC_*``), restarts the group on failure up to
``--max-restarts`` times, and exits with torchrun's failure summary, so a
script written for ``torchrun`` runs unchanged.  ``main()`` is the console
script; ``python -m aioproc run ...`` is the same.  Every torchrun 2.13
flag is accepted with torchrun's meaning, and defaults to its ``PET_``
variable (docs/guides/torchrun.md, "Every flag and variable").

Design: the command parses its flags into a ``WorkerSpec`` and a
``LogsSpecs``, then runs ``LocalElasticAgent.run()`` in ``asyncio.run`` under
``translate_signals``.  A terminating signal stops the workers with that
signal (SIGKILL after ``--grace-period``) and the command exits 128 + the
signal number.  On a terminal, ``aioproc._cli.live`` draws a table of the
workers below their scrolling output; elsewhere output is plain text.

This module is the command's public face: ``main``, ``build_parser`` and
the two value parsers users reuse.  The parts live in ``aioproc._cli``:
the flags' values and the parser (``values``, ``args``), the run made from
them (``run``), running it (``supervise``), what it tells the user
(``report``) and the live view (``live``).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from ._base import public_module
from ._cli.args import _build_parsers
from ._cli.args import build_parser as build_parser
from ._cli.run import _make_run as _make_run  # imported from here by the tests
from ._cli.supervise import _run_command
from ._cli.values import parse_backoff as parse_backoff
from ._cli.values import parse_nproc as parse_nproc

__all__ = ["build_parser", "main", "parse_backoff", "parse_nproc"]

# Defined in the wing, named here: reprs and pickles show the path users import.
public_module(__name__, build_parser, parse_backoff, parse_nproc)


def main(argv: Sequence[str] | None = None) -> int:
    """The ``aioproc`` command; returns the exit status.

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).

    Returns:
        The exit status (see ``aioproc run --help``).  ``--help``,
        ``--version`` and usage errors exit through ``SystemExit``.
    """
    parser, run_parser = _build_parsers()
    ns = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    if ns.command is None:
        parser.print_help(sys.stderr)
        return 2
    return _run_command(ns, run_parser)
