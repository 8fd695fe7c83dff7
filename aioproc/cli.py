"""``aioproc run``: torchrun's command line on the asyncio agent.

``aioproc run [options] script.py [args...]`` starts ``--nproc-per-node``
copies of ``sys.executable -u script.py args...`` with torchrun's
environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``, ``TORCHELASTIC_*``), restarts the group on failure up to
``--max-restarts`` times, and exits with torchrun's failure summary, so a
script written for ``torchrun`` runs unchanged.  ``main()`` is the console
script; ``python -m aioproc run ...`` is the same.

Design: the command parses its flags into a ``WorkerSpec`` and a
``LogsSpecs``, then runs ``LocalElasticAgent.run()`` in ``asyncio.run`` under
``translate_signals``.  A terminating signal stops the workers with that
signal (SIGKILL after ``--grace-period``) and the command exits 128 + the
signal number.  On a terminal, ``aioproc._cli.live`` draws a table of the
workers below their scrolling output; elsewhere output is plain text.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import re
import signal
import sys
import warnings
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from ._cli.live import LiveView
    from .agent import AgentEvent, LocalElasticAgent, RestartPolicy, WorkerSpec
    from .logs import LogsSpecs, Std

__all__ = ["build_parser", "main", "parse_backoff", "parse_nproc"]

logger = logging.getLogger("aioproc.cli")

PROG = "aioproc"
LOOP_ENV = "AIOPROC_LOOP"
LOG_LEVEL_ENV = "LOGLEVEL"  # torchrun's variable for its own log level
PREFIX_TEMPLATE_ENV = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"

_RUN_DESCRIPTION = """\
Run NPROC copies of a Python script (or a module, or a binary) on this host
with torchrun's environment, restart them as a group when one fails, and
report the failure with the worker's own traceback.

Workers get torchrun's variables: RANK, LOCAL_RANK, GROUP_RANK, ROLE_RANK,
ROLE_NAME, WORLD_SIZE, LOCAL_WORLD_SIZE, ROLE_WORLD_SIZE, GROUP_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_MAX_RESTARTS,
TORCHELASTIC_RUN_ID and TORCHELASTIC_ERROR_FILE ("${local_rank}" in an argument
becomes the worker's local rank).  torchrun's underscore spellings of the flags
(--nproc_per_node, --max_restarts, ...) are accepted too.
"""

_RUN_EPILOG = """\
output:
  As with torchrun, without --tee/--redirects the workers write straight to
  this command's stdout/stderr (unprefixed).  --tee copies lines to the
  console prefixed with "[<role><rank>]:"; --redirects sends streams to files
  under --log-dir only.  When stdout is a terminal (and rich is installed), a
  live table of the workers (pid, state, uptime, restarts, last line or
  progress bar) is drawn below their output; to show lines above the table,
  every stream that is not redirected is then passed through aioproc and
  printed prefixed (without creating log files for it).  --no-live, or a
  non-terminal stdout, gives plain output.

signals:
  SIGTERM, SIGINT and SIGQUIT stop the workers with that signal (SIGKILL after
  --grace-period) and the command exits 128 + the signal number.  SIGHUP is
  ignored by this command (its workers run in sessions of their own), so a
  job survives a terminal hang-up; torchrun instead stops its workers on
  SIGHUP.  With --forward-sighup, SIGHUP stops the workers like SIGTERM and
  the command exits 129.  --signals-to-handle (or torchrun's
  TORCHELASTIC_SIGNALS_TO_HANDLE) replaces the list, e.g. SIGTERM,SIGUSR1 for
  SLURM; SIGHUP is still ignored unless it is in the list.

exit status:
  0 when the workers succeed, 1 when they fail (after the restarts; torchrun's
  failure summary is printed to stderr), 2 for usage errors, 128+N after
  signal N.  With --rdzv-backend etcd, also 1 when the rendezvous fails:
  etcd not reached within join_timeout, a round not completed in time, a
  lost lease (fenced), or a job found closed on arrival, even one that
  finished (a reused --rdzv-id: nothing ran here; torchrun exits 1 on its
  RendezvousClosedError too).  A host that joined and waited for a place
  while the job finished exits 0.

environment:
  AIOPROC_LOOP=uvloop runs the agent on uvloop (default: asyncio's loop).
  LOGLEVEL sets this command's log level (default: WARNING), as in torchrun.
  OMP_NUM_THREADS is set to 1 in the workers when there are several and it is
  not set already (torchrun's behaviour).
  TORCHELASTIC_SIGNALS_TO_HANDLE: the default of --signals-to-handle.
  TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE: the default of
  --log-line-prefix-template (as torchrun reads it).
"""


# ------------------------------------------------------------------ parsing


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Shows every default, and hides torchrun's underscore aliases."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "(default" in text or not action.option_strings or action.default is argparse.SUPPRESS:
            return text
        if action.nargs == 0:  # a switch
            return text + (" (default: off)" if action.default is False else "")
        return text + " (default: %(default)s)"

    def _format_action_invocation(self, action: argparse.Action) -> str:
        shown = [s for s in action.option_strings if "_" not in s]
        if shown and len(shown) != len(action.option_strings):
            action = argparse.Action(shown, action.dest, nargs=action.nargs, metavar=action.metavar)
        return super()._format_action_invocation(action)


def parse_nproc(value: str) -> int:
    """``--nproc-per-node``: a positive int, or ``cpu``/``auto`` for ``os.cpu_count()``.

    Raises:
        argparse.ArgumentTypeError: ``gpu`` (aioproc does not count GPUs) or
            anything else that is not a positive number.
    """
    text = value.strip().lower()
    if text in ("cpu", "auto"):
        return os.cpu_count() or 1
    if text == "gpu":
        raise argparse.ArgumentTypeError(
            "'gpu' is not supported: aioproc does not count GPUs; give the number of "
            "workers (e.g. --nproc-per-node 8), or 'cpu'/'auto' for one per CPU"
        )
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a positive number of workers, 'cpu' or 'auto', got {value!r}"
        ) from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of workers, got {value!r}")
    return n


def parse_backoff(value: str) -> RestartPolicy:
    """``--backoff initial,factor,max[,jitter]`` (seconds) as a ``RestartPolicy``.

    The delay before the n-th restart (0-based) is
    ``min(max, initial * factor**n)``, spread randomly by ``jitter`` (0-1).

    Raises:
        argparse.ArgumentTypeError: not 3 or 4 numbers, or values the policy
            rejects.
    """
    from .agent import RestartPolicy

    parts = [p.strip() for p in value.split(",")]
    try:
        numbers = [float(p) for p in parts]
    except ValueError:
        numbers = []
    if len(numbers) not in (3, 4):
        raise argparse.ArgumentTypeError(
            f"expected 'initial,factor,max[,jitter]' in seconds (e.g. '1,2,60,0.1'), got {value!r}"
        )
    try:
        return RestartPolicy(
            initial_delay=numbers[0],
            factor=numbers[1],
            max_delay=numbers[2],
            jitter=numbers[3] if len(numbers) == 4 else 0.0,
        )
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{value!r}: {e}") from None


def _parse_std(value: str) -> Std | dict[int, Std]:
    from .logs import Std

    try:
        return Std.from_str(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


SIGNALS_ENV = "TORCHELASTIC_SIGNALS_TO_HANDLE"

_UNCATCHABLE = (signal.SIGKILL, signal.SIGSTOP)


def _parse_signals(value: str) -> tuple[signal.Signals, ...]:
    """torchrun's ``--signals-to-handle``: comma-separated names, e.g. ``SIGTERM,SIGUSR1``."""
    sigs: list[signal.Signals] = []
    for item in value.split(","):
        name = item.strip()
        sig = getattr(signal.Signals, name, None) if name.startswith("SIG") else None
        if sig is None or sig in _UNCATCHABLE:
            what = "cannot be caught" if sig is not None else "is not a signal name"
            raise argparse.ArgumentTypeError(
                f"{name!r} {what}: expected comma-separated signal names "
                f"(e.g. 'SIGTERM,SIGINT,SIGUSR1'), got {value!r}"
            )
        if sig not in sigs:
            sigs.append(sig)
    return tuple(sigs)


def _parse_start_method(value: str) -> str:
    from ._base.checks import check_start_method

    try:
        return check_start_method(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _parse_preload(value: str) -> list[str]:
    """``--preload``: comma-separated module names."""
    names = [name.strip() for name in value.split(",")]
    for name in names:
        if not name or not all(part.isidentifier() for part in name.split(".")):
            raise argparse.ArgumentTypeError(
                f"expected comma-separated module names (e.g. 'torch,numpy'), got {value!r}"
            )
    return names


def _parse_ranks(value: str) -> set[int] | None:
    if not value.strip():
        return None
    ranks: set[int] = set()
    for item in value.split(","):
        try:
            rank = int(item)
        except ValueError:
            rank = -1
        if rank < 0:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated local ranks (e.g. '0,2'), got {value!r}"
            )
        ranks.add(rank)
    return ranks


MULTI_NODE_BACKENDS = ("etcd", "etcd-v3", "static")


def _parse_nnodes(value: str) -> tuple[int, int]:
    """``--nnodes``: ``N`` or ``MIN:MAX``, as ``(min, max)``."""
    low, colon, high = value.partition(":")
    try:
        bounds = (int(low), int(high) if colon else int(low))
    except ValueError:
        bounds = (0, 0)
    if not 0 < bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(
            f"expected a number of nodes, N or MIN:MAX such as 1:4, got {value!r}"
        )
    return bounds


def _parse_node_rank(value: str) -> int:
    """``--node-rank``: a rank >= 0 (the static rendezvous's)."""
    try:
        rank = int(value)
    except ValueError:
        rank = -1
    if rank < 0:
        raise argparse.ArgumentTypeError(f"expected a node rank >= 0, got {value!r}")
    return rank


def _parse_backend(value: str) -> str:
    if not value.strip():
        raise argparse.ArgumentTypeError("expected a rendezvous backend name such as c10d, got ''")
    return value


def _parse_endpoint(value: str) -> str:
    """``--rdzv-endpoint``: ``HOST[:PORT]`` (port 0: any), the store's address."""
    if not value.strip():
        return ""  # torchrun's default
    host, colon, port = value.strip().rpartition(":")
    if not colon or host.endswith(":"):  # no port, or a bare IPv6 address
        host, port = value.strip(), ""
    ok = bool(host.strip("[]"))
    if port:
        ok = ok and port.isdigit() and int(port) <= 65535
    if not ok:
        raise argparse.ArgumentTypeError(
            f"expected HOST[:PORT] such as localhost:29400, got {value!r}"
        )
    return value


def _parse_rdzv_conf(value: str) -> dict[str, str]:
    """``--rdzv-conf``: ``KEY=VALUE`` pairs, comma-separated: the backend's options."""
    conf: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in value.split(","))):
        key, eq, val = item.partition("=")
        if not eq or not key.strip():
            raise argparse.ArgumentTypeError(
                f"expected KEY=VALUE pairs separated by commas (e.g. 'join_timeout=900'), "
                f"got {value!r}"
            )
        conf[key.strip()] = val.strip()
    return conf


def _number(kind: type[int] | type[float], minimum: float) -> Callable[[str], Any]:
    def parse(value: str) -> Any:
        try:
            number = kind(value)
        except ValueError:
            number = None
        # float() accepts "nan" and "inf": NaN passes every comparison, so test it first
        if number is None or not math.isfinite(number) or number < minimum:
            what = "an integer" if kind is int else "a finite number"
            raise argparse.ArgumentTypeError(f"expected {what} >= {minimum:g}, got {value!r}")
        return number

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


def _log_dir(value: str) -> str | None:
    """``--log-dir``: refused at once if it is, or would be created in, a file."""
    from ._base.checks import check_log_dir

    try:
        return check_log_dir(value)
    except (OSError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _run_id(value: str) -> str:
    """``--run-id``: one directory name under the log dir, never a path."""
    from ._base.checks import check_path_name

    try:
        return check_path_name("run id", value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _port(value: str) -> int:
    port: int = _number(int, 1)(value)
    if port > 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port (1-65535), got {value!r}")
    return port


def build_parser() -> argparse.ArgumentParser:
    """The ``aioproc`` argument parser, with its ``run`` subcommand."""
    return _build_parsers()[0]


def _build_parsers() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    from . import __version__

    parser = argparse.ArgumentParser(
        prog=PROG,
        description="aioproc: an asyncio-native process orchestrator.",
        formatter_class=_HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    run = commands.add_parser(
        "run",
        help="run a script on NPROC workers, torchrun-style",
        description=_RUN_DESCRIPTION,
        epilog=_RUN_EPILOG,
        formatter_class=_HelpFormatter,
        usage="%(prog)s [options] script [args ...]",
    )
    add = run.add_argument
    add(
        "--nproc-per-node",
        "--nproc_per_node",
        dest="nproc_per_node",
        type=parse_nproc,
        default=1,
        metavar="NPROC",
        help="number of workers: a number, or 'cpu'/'auto' for one per CPU "
        "('gpu' is not supported)",
    )
    add(
        "--nnodes",
        type=_parse_nnodes,
        default=(1, 1),
        metavar="N|MIN:MAX",
        help="number of nodes (hosts), each running 'aioproc run': N, or MIN:MAX for an "
        "elastic job (--rdzv-backend etcd) (default: 1, this host alone)",
    )
    add(
        "--node-rank",
        "--node_rank",
        dest="node_rank",
        type=_parse_node_rank,
        default=0,
        metavar="RANK",
        help="this node's rank with --rdzv-backend static (default: 0)",
    )
    add(
        "--standalone",
        action="store_true",
        help="this host alone, whatever --nnodes and --rdzv-* say (the default with --nnodes 1)",
    )
    add(
        "--rdzv-backend",
        "--rdzv_backend",
        dest="rdzv_backend",
        type=_parse_backend,
        default="static",
        metavar="BACKEND",
        help="how several nodes meet: etcd (elastic: hosts may join, leave or be lost; "
        "needs pip install 'aioproc[etcd]') or static (fixed --node-rank and "
        "--master-addr/--master-port) (default: static); ignored with one node",
    )
    add(
        "--rdzv-endpoint",
        "--rdzv_endpoint",
        dest="rdzv_endpoint",
        type=_parse_endpoint,
        default="",
        metavar="HOST[:PORT]",
        help="the etcd server's client address (etcd: HOST:2379 by default)",
    )
    add(
        "--rdzv-conf",
        "--rdzv_conf",
        dest="rdzv_conf",
        type=_parse_rdzv_conf,
        default="",
        metavar="KEY=VALUE,...",
        help="rendezvous options: join_timeout (600), last_call_timeout (30), "
        "lease_ttl (3: seconds before a lost host is noticed), close_timeout (30)",
    )
    add(
        "--local-addr",
        "--local_addr",
        dest="local_addr",
        default=None,
        metavar="ADDR",
        help="the address this host is known by, MASTER_ADDR when it is group rank 0 "
        "(default: its fully qualified name)",
    )
    add(
        "--max-restarts",
        "--max_restarts",
        dest="max_restarts",
        type=_number(int, 0),
        default=0,
        metavar="N",
        help="restarts of the whole group allowed after failures",
    )
    add(
        "--backoff",
        type=parse_backoff,
        default=None,
        metavar="INITIAL,FACTOR,MAX[,JITTER]",
        help="wait before restart n (0-based) min(MAX, INITIAL*FACTOR**n) seconds, "
        "scaled by a random factor in [1-JITTER, 1+JITTER] (default: restart at once)",
    )
    add(
        "--monitor-interval",
        "--monitor_interval",
        dest="monitor_interval",
        type=_number(float, 0),
        default=0.1,
        metavar="SECONDS",
        help="accepted for torchrun compatibility: exits are noticed when they happen",
    )
    add(
        "--grace-period",
        dest="grace_period",
        type=_number(float, 0),
        default=30.0,
        metavar="SECONDS",
        help="seconds between SIGTERM (or the signal received) and SIGKILL when stopping workers",
    )
    add(
        "-r",
        "--redirects",
        type=_parse_std,
        default="0",
        metavar="STD",
        help="streams to write to log files instead of the console: 0 none, 1 stdout, "
        "2 stderr, 3 both, for every rank or per rank as '0:3,1:0'",
    )
    add(
        "-t",
        "--tee",
        type=_parse_std,
        default="0",
        metavar="STD",
        help="streams to write to log files and also to the console, prefixed; "
        "same values as --redirects",
    )
    add(
        "--log-dir",
        "--log_dir",
        dest="log_dir",
        type=_log_dir,
        default=None,
        metavar="DIR",
        help="base directory of the logs (<DIR>/<run_id>_<random>/attempt_<n>/<rank>/...) "
        "(default: a new temporary directory)",
    )
    add(
        "--local-ranks-filter",
        "--local_ranks_filter",
        dest="local_ranks_filter",
        type=_parse_ranks,
        default="",
        metavar="RANKS",
        help="comma-separated local ranks whose output reaches the console, e.g. '0' "
        "(default: all ranks)",
    )
    add(
        "--log-line-prefix-template",
        "--log_line_prefix_template",
        dest="log_line_prefix_template",
        default=None,
        metavar="TEMPLATE",
        help="prefix of console lines, with ${role_name}, ${rank}, ${local_rank} "
        "(default: '[${role_name}${local_rank}]:')",
    )
    add("--role", default="default", help="the workers' role name (ROLE_NAME, line prefixes)")
    add(
        "--run-id",
        "--rdzv-id",
        "--rdzv_id",
        dest="run_id",
        type=_run_id,
        default=None,
        metavar="ID",
        help="job id (TORCHELASTIC_RUN_ID, log directory prefix) (default: a random id)",
    )
    add(
        "--master-addr",
        "--master_addr",
        dest="master_addr",
        default="127.0.0.1",
        metavar="ADDR",
        help="MASTER_ADDR given to the workers",
    )
    add(
        "--master-port",
        "--master_port",
        dest="master_port",
        type=_port,
        default=None,
        metavar="PORT",
        help="MASTER_PORT given to the workers (default: a free port)",
    )
    add(
        "--start-method",
        "--start_method",
        dest="start_method",
        type=_parse_start_method,
        default="spawn",
        metavar="{spawn,forkserver}",
        help="how workers are started: spawn (a fresh interpreter each) or forkserver "
        "(forked from a template interpreter that imported --preload once; the script "
        "then runs in the forked worker; --no-python programs are always spawned; "
        "fork is refused)",
    )
    add(
        "--preload",
        type=_parse_preload,
        action="append",
        default=[],
        metavar="MODULES",
        help="comma-separated modules the forkserver template imports before forking "
        "the workers, e.g. 'torch,numpy' (repeatable; needs --start-method forkserver; "
        "searched in the script's directory first) (default: none)",
    )
    add(
        "--no-python",
        "--no_python",
        dest="no_python",
        action="store_true",
        help="run the script as a binary, without prepending 'python -u'",
    )
    add(
        "-m",
        "--module",
        action="store_true",
        help="run the script as a Python module (python -u -m script)",
    )
    add(
        "--watchdog",
        action="store_true",
        help="serve aioproc.timer watchdog timers to the workers; a worker whose timer "
        "expires is killed and counts as failed",
    )
    add(
        "--no-live",
        dest="no_live",
        action="store_true",
        help="plain output even when stdout is a terminal",
    )
    add(
        "--forward-sighup",
        dest="forward_sighup",
        action="store_true",
        help="stop the workers on SIGHUP and exit 129 (default: SIGHUP is ignored, "
        "so the job survives a terminal hang-up)",
    )
    add(
        "--signals-to-handle",
        "--signals_to_handle",
        dest="signals_to_handle",
        type=_parse_signals,
        default=None,
        metavar="SIGNALS",
        help=f"comma-separated signals that stop the workers with that signal, e.g. "
        f"'SIGTERM,SIGINT,SIGUSR1' (default: ${SIGNALS_ENV}, else SIGTERM,SIGINT,SIGQUIT; "
        "SIGHUP is ignored unless listed or --forward-sighup)",
    )
    add("script", help="the Python script (module with -m, program with --no-python)")
    add("script_args", nargs=argparse.REMAINDER, metavar="args", help="the script's arguments")
    return parser, run


# ---------------------------------------------------------------- the run


@dataclass
class _Run:
    """What one ``aioproc run`` does, from its parsed flags."""

    name: str  # the entrypoint's name, the failure summary's title (as torchrun)
    spec: WorkerSpec
    logs_specs: LogsSpecs
    run_id: str | None
    grace_period: float
    start_method: str
    live: bool
    signals: tuple[signal.Signals, ...]
    log_line_prefix_template: str | None
    show_log_dir: bool  # --log-dir was given: say where this run's logs are


def _handled_signals(ns: argparse.Namespace) -> tuple[signal.Signals, ...]:
    """The flag, else torchrun's environment variable, else aioproc's default."""
    if ns.signals_to_handle is not None:
        return tuple(ns.signals_to_handle)
    from_env = os.environ.get(SIGNALS_ENV, "").strip()
    if from_env:
        try:
            return _parse_signals(from_env)
        except argparse.ArgumentTypeError as e:
            raise ValueError(f"{SIGNALS_ENV}: {e}") from None
    return (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT)


def _make_run(ns: argparse.Namespace) -> _Run:
    from .agent import RestartPolicy, WorkerSpec
    from .logs import DefaultLogsSpecs

    if ns.no_python and ns.module:
        raise ValueError("--no-python and -m/--module cannot be used together")
    preload = [name for names in ns.preload for name in names]
    if preload and ns.start_method != "forkserver":
        raise ValueError(
            f"--preload {','.join(preload)} needs --start-method forkserver "
            "(only the forkserver template preloads modules)"
        )
    if preload and ns.no_python:
        raise ValueError(
            "--preload needs a Python script or module: --no-python programs are spawned"
        )
    if ns.no_python:
        entrypoint: str = ns.script
        args: list[str] = list(ns.script_args)
    else:
        entrypoint = sys.executable
        args = ["-u", *(["-m"] if ns.module else []), ns.script, *ns.script_args]
    redirects, tee = ns.redirects, ns.tee  # argparse parses string defaults too
    live = not ns.no_live and _live_possible()
    logs_specs: LogsSpecs
    if live:
        from ._cli.live import LiveLogsSpecs

        logs_specs = LiveLogsSpecs(ns.log_dir, redirects, tee, ns.local_ranks_filter)
    else:
        logs_specs = DefaultLogsSpecs(ns.log_dir, redirects, tee, ns.local_ranks_filter)
    sigs = list(_handled_signals(ns))
    if ns.forward_sighup and signal.SIGHUP not in sigs:
        sigs.append(signal.SIGHUP)
    rdzv_handler = _make_rdzv_handler(ns)
    spec = WorkerSpec(
        role=ns.role,
        local_world_size=ns.nproc_per_node,
        entrypoint=entrypoint,
        args=tuple(args),
        max_restarts=ns.max_restarts,
        monitor_interval=ns.monitor_interval,
        redirects=redirects,
        tee=tee,
        local_ranks_filter=ns.local_ranks_filter,
        master_addr=ns.master_addr,
        master_port=ns.master_port,
        restart_policy=ns.backoff or RestartPolicy(),
        watchdog=ns.watchdog,
        preload=preload,
        # torchrun exports the list it handles; workers see the same variable
        env={SIGNALS_ENV: ",".join(sig.name for sig in sigs)},
        rdzv_handler=rdzv_handler,
    )
    template = ns.log_line_prefix_template
    if template is None:
        template = os.environ.get(PREFIX_TEMPLATE_ENV)  # as torchrun reads it
    return _Run(
        name=ns.script,
        spec=spec,
        logs_specs=logs_specs,
        run_id=ns.run_id,
        grace_period=ns.grace_period,
        start_method=ns.start_method,
        live=live,
        signals=tuple(sigs),
        log_line_prefix_template=template,
        show_log_dir=ns.log_dir is not None and ns.log_dir != os.devnull,
    )


def _make_rdzv_handler(ns: argparse.Namespace) -> Any:
    """The rendezvous handler for a run over several nodes; None for this host alone.

    Raises:
        ValueError: flags that do not make a multi-node run (the message says which).
    """
    min_nodes, max_nodes = ns.nnodes
    if ns.standalone or max_nodes == 1:
        if ns.node_rank != 0:
            raise ValueError(f"--node-rank {ns.node_rank} needs --nnodes > 1")
        return None
    from .rendezvous import RendezvousParameters, create_handler

    backend = ns.rdzv_backend
    if backend not in MULTI_NODE_BACKENDS:
        raise ValueError(
            f"--rdzv-backend {backend!r} cannot join several nodes in aioproc; "
            f"use {' or '.join(MULTI_NODE_BACKENDS[::2])}"
        )
    conf: dict[str, Any] = dict(ns.rdzv_conf)
    if backend == "static":
        if min_nodes != max_nodes:
            raise ValueError(
                f"--nnodes {min_nodes}:{max_nodes} is elastic: use --rdzv-backend etcd, "
                f"or a fixed --nnodes N with --rdzv-backend static"
            )
        if ns.node_rank >= max_nodes:
            raise ValueError(f"--node-rank {ns.node_rank} must be < --nnodes {max_nodes}")
        conf["node_rank"] = ns.node_rank
        conf["master_addr"] = ns.master_addr
        conf.setdefault("master_port", ns.master_port or 29500)
        endpoint = ns.rdzv_endpoint
    else:
        if not ns.rdzv_endpoint:
            raise ValueError(
                f"--rdzv-backend {backend} needs --rdzv-endpoint HOST:PORT (the etcd server)"
            )
        if ns.run_id is None:
            raise ValueError(f"--rdzv-backend {backend} needs --rdzv-id (the job's id)")
        endpoint = ns.rdzv_endpoint
    params = RendezvousParameters(
        backend,
        endpoint,
        ns.run_id or "none",
        min_nodes,
        max_nodes,
        local_addr=ns.local_addr,
        **conf,
    )
    try:
        return create_handler(params)
    except ImportError as e:
        raise ValueError(str(e)) from None


def _live_possible() -> bool:
    """Whether stdout is a terminal the live view can draw on (rich installed)."""
    try:
        if not sys.stdout.isatty():
            return False
    except (AttributeError, ValueError):
        return False
    try:
        from rich.console import Console
    except ImportError:
        return False
    return Console().is_interactive


async def _supervise(run: _Run) -> int:
    """Run the agent; return the exit status.

    Cancellation: the agent stops the workers (shielded, bounded) before the
    cancellation propagates.
    """
    from ._func.template import TemplateError
    from ._proc.jobcontrol import follow_job_control
    from .agent import LocalElasticAgent
    from .agent import events as ev
    from .errors import ChildFailedError, RemoteTraceback
    from .signals import SignalException, translate_signals

    view: LiveView | None = None
    if run.live:
        from ._cli.live import LiveView

        view = LiveView(
            run.spec.role, run.spec.local_world_size, run.spec.max_restarts, title=run.name
        )
        say: Callable[[str], None] = view.note
        show_event: Callable[[AgentEvent], None] = _show_on(view)
    else:
        say = _print_stderr
        show_event = _log_event
    attempt = 0

    def on_event(event: AgentEvent) -> None:
        nonlocal attempt
        if event.kind == ev.ATTEMPT_STARTED:
            attempt = event.attempt
            stopper.started = True
        show_event(event)
        if run.show_log_dir and event.kind == ev.WORKER_STARTED and event.local_rank == 0:
            run_dir = _run_log_dir(run.logs_specs)
            if run_dir is not None and event.attempt == 0:
                say(f"{PROG} run: logs in {run_dir}")

    agent = LocalElasticAgent(
        run.spec,
        run.logs_specs,
        run.start_method,
        log_line_prefix_template=run.log_line_prefix_template,
        grace_period=run.grace_period,
        run_id=run.run_id,
        sinks=[view] if view is not None else None,
        on_event=on_event,
    )
    stopper = _Stopper(agent, run.grace_period, say)
    try:
        try:
            if view is not None:
                view.start()
            with follow_job_control():
                async with translate_signals(run.signals, on_signal=stopper.on_signal):
                    result = await agent.run()
        finally:
            await stopper.aclose()
            if view is not None:
                view.stop()  # before anything else is printed
    except SignalException as e:
        sig = signal.Signals(e.sigval)
        if stopper.started:
            _error(f"got {sig.name}: the workers were stopped")
        else:  # still connecting to the rendezvous, or joining it
            _error(f"got {sig.name}: stopped before any worker started")
        return 128 + int(sig)
    except OSError as e:  # a --no-python binary that cannot be run, an unusable --log-dir
        _error(str(e))
        return 1
    except (ImportError, TemplateError) as e:  # --preload failed in the template
        if isinstance(e.__cause__, RemoteTraceback):
            _print_stderr(e.__cause__.tb.rstrip())  # the template's traceback
        _error(str(e))
        return 1
    if not result.is_failed():
        if result.message and run.spec.rdzv_handler is not None:
            _error(result.message)  # e.g. a late joiner: the job already finished
        if result.log_dir and not run.show_log_dir:
            # a private temp dir that holds output: say where, or it is litter
            _error(f"logs of this run kept in {result.log_dir}")
        return 0
    if result.message:
        _error(result.message)
    if result.failures:
        failure = ChildFailedError(
            run.name, result.failures, result.log_dir, host=result.host or None
        )
        summary = failure.format_msg()
        _print_stderr(summary)
        rank, root = failure.get_first_failure()
        for line in _where_the_logs_are(run.logs_specs, attempt, rank, root.local_rank, summary):
            _error(line)
    return 1


class _Stopper:
    """What the command does on each terminating signal.

    The first one stops the workers gracefully (``translate_signals``
    cancels the agent's run, which stops them with that signal); this says
    so.  A second one kills them now, skipping the rest of the grace period.
    """

    def __init__(
        self, agent: LocalElasticAgent, grace_period: float, say: Callable[[str], None]
    ) -> None:
        self._agent = agent
        self._grace_period = grace_period
        self._say = say
        self._received = 0
        self._kill: asyncio.Task[None] | None = None
        self.started = False  # whether a worker group was started: what a signal stops

    def on_signal(self, sig: signal.Signals) -> None:
        self._received += 1
        if self._received == 1 and not self.started:
            self._say(f"{PROG} run: got {sig.name}: stopping (no worker was started)")
        elif self._received == 1:
            again = "Ctrl-C again" if sig == signal.SIGINT else "a second signal"
            self._say(
                f"{PROG} run: got {sig.name}: stopping the workers (SIGKILL in "
                f"{self._grace_period:g} s; {again} kills them now)"
            )
        elif self._kill is None and self.started:  # with no worker, the first one ends it all
            self._say(
                f"{PROG} run: got {sig.name} again: killing the workers now with SIGKILL, "
                f"without waiting out the {self._grace_period:g} s grace period"
            )
            self._kill = asyncio.get_running_loop().create_task(
                self._agent.stop(signal.SIGKILL, 0.0), name="aioproc-run-kill-now"
            )

    async def aclose(self) -> None:
        """Wait for the kill, if one was asked (it ends with the agent's run)."""
        if self._kill is not None:
            await self._kill


def _run_log_dir(logs_specs: LogsSpecs) -> str | None:
    return logs_specs.run_log_dir or None


def _where_the_logs_are(
    logs_specs: LogsSpecs, attempt: int, rank: int, local_rank: int, summary: str
) -> list[str]:
    """Lines naming the root cause's log files and the run's log dir, if not in ``summary``."""
    run_dir = _run_log_dir(logs_specs)
    if run_dir is None or not os.path.isdir(run_dir):
        return []
    rank_dir = os.path.join(run_dir, f"attempt_{attempt}", str(local_rank))
    files = []
    for name in ("stderr.log", "stdout.log"):
        path = os.path.join(rank_dir, name)
        if not _named(path, summary) and os.path.isfile(path):
            files.append(path)
    lines = []
    if files:
        lines.append(f"output of rank {rank}: {', '.join(files)}")
    if not _named(run_dir, summary):
        lines.append(f"logs of this run: {run_dir}")
    return lines


def _named(path: str, text: str) -> bool:
    """Whether ``text`` names ``path`` itself (not a file under it)."""
    return re.search(re.escape(path) + r"/?(?:[\s,;)]|$)", text, re.MULTILINE) is not None


def _describe_event(event: AgentEvent) -> tuple[int, str] | None:
    """A log level and line for the agent events a user should hear about."""
    from .agent import events as ev

    role = f"[{event.role}]"
    if event.kind == ev.ATTEMPT_FAILED:
        if event.exitcode is not None and event.exitcode < 0:
            how = f"was killed by {event.signal}"
        else:
            how = f"exited with code {event.exitcode}"
        return (
            logging.WARNING,
            f"{role} worker group failed (attempt {event.attempt}): local_rank "
            f"{event.local_rank} (pid {event.pid}) {how}",
        )
    if event.kind == ev.RESTART_SCHEDULED:
        return logging.WARNING, f"{role} restarting the worker group: {event.message}"
    if event.kind == ev.WORLD_CHANGED:
        return logging.WARNING, f"{role} re-forming the world: {event.message}"
    if event.kind == ev.RENDEZVOUS_COMPLETED:
        return logging.INFO, f"{role} rendezvous completed: {event.message}"
    if event.kind == ev.GROUP_SUCCEEDED and event.message:
        return logging.INFO, f"{role} worker group succeeded: {event.message}"
    return None


def _show_on(view: LiveView) -> Callable[[AgentEvent], None]:
    def show(event: AgentEvent) -> None:
        view.on_event(event)
        said = _describe_event(event)
        if said is not None and said[0] >= logger.getEffectiveLevel():
            view.note(f"{PROG}: {said[1]}")

    return show


def _log_event(event: AgentEvent) -> None:
    said = _describe_event(event)
    if said is not None:
        logger.log(*said)


def _error(message: str) -> None:
    _print_stderr(f"{PROG} run: {message}")


def _one_line(text: str) -> str:
    return " ".join(text.split("\n"))


def _print_stderr(text: str) -> None:
    try:
        print(text, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass  # stderr is gone; the exit status still tells


class _StderrHandler(logging.Handler):
    """Writes to whatever ``sys.stderr`` is now (the live view redirects it)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:
            self.handleError(record)


def _show_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: TextIO | None = None,
    line: str | None = None,
) -> None:
    """Warnings (such as ``ForcedKillWarning``) as one line, without our source line."""
    _print_stderr(f"{PROG}: {category.__name__}: {message}")


def _configure_logging() -> Callable[[], None]:
    """Log to stderr at ``LOGLEVEL``; return a function undoing it."""
    previous_showwarning = warnings.showwarning
    warnings.showwarning = _show_warning
    root = logging.getLogger()
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s:%(name)s:%(message)s"))
    level = os.environ.get(LOG_LEVEL_ENV, "WARNING").upper()
    previous = root.level
    root.addHandler(handler)
    try:
        root.setLevel(level)
    except ValueError:
        root.setLevel(logging.WARNING)

    def restore() -> None:
        warnings.showwarning = previous_showwarning
        root.removeHandler(handler)
        root.setLevel(previous)

    return restore


def _ignore_signal(signum: int, frame: FrameType | None) -> None:
    """A handler that does nothing.

    Unlike SIG_IGN, a caught signal is reset to its default across exec, so
    the workers keep the default disposition.
    """


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event loop ``AIOPROC_LOOP`` names (``None``: asyncio's default).

    Raises:
        ValueError: an unknown name, or uvloop is not installed.
    """
    choice = os.environ.get(LOOP_ENV, "").strip().lower()
    if choice in ("", "asyncio"):
        return None
    if choice != "uvloop":
        raise ValueError(f"{LOOP_ENV} must be 'asyncio' or 'uvloop', got {choice!r}")
    try:
        import uvloop
    except ImportError:
        raise ValueError(
            f"{LOOP_ENV}=uvloop but uvloop is not installed (pip install 'aioproc[uvloop]')"
        ) from None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def _run_loop(
    coro: Coroutine[Any, Any, int], factory: Callable[[], asyncio.AbstractEventLoop] | None
) -> int:
    """``asyncio.run(coro)``, on a loop from ``factory`` if given."""
    if factory is None:
        return asyncio.run(coro)
    if sys.version_info >= (3, 11):
        with asyncio.Runner(loop_factory=factory) as runner:
            return runner.run(coro)
    loop = factory()  # pragma: no cover - Python 3.10 has no asyncio.Runner
    try:  # pragma: no cover
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(coro)
    finally:  # pragma: no cover
        asyncio.set_event_loop(None)
        loop.close()


def _run_command(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        run = _make_run(ns)
        factory = _loop_factory()
    except (TypeError, ValueError, OSError) as e:
        parser.error(str(e))
    restore_logging = _configure_logging()
    previous_hup: Any = None
    if signal.SIGHUP not in run.signals:
        previous_hup = signal.signal(signal.SIGHUP, _ignore_signal)
    try:
        return _run_loop(_supervise(run), factory)
    except (TypeError, ValueError) as e:
        # Bad input found only as the workers are about to start (an argv and
        # environment too big for exec, say): a usage error, told in one line.
        # Nothing was started.  LOGLEVEL=DEBUG shows the traceback.
        logger.debug("aioproc run stopped by an error", exc_info=True)
        _print_stderr(f"{PROG} run: error: {_one_line(str(e))}")
        return 2
    finally:
        if previous_hup is not None:
            signal.signal(signal.SIGHUP, previous_hup)
        restore_logging()


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
