"""The values of ``aioproc run``'s flags: one parser per flag, and the names they share.

Each parser is an argparse ``type=``: it turns one flag's string into its
value, or raises ``argparse.ArgumentTypeError`` with a message saying what
was expected, so a bad flag is a usage error (exit 2) before anything
starts.  ``PROG`` and ``SIGNALS_ENV`` live here, at
the bottom of ``_cli``, because the parser, the run and the messages all
name them.  The parsers that need the agent or the checks import them when
called, so ``aioproc --help`` stays fast.

``EnvDefault`` and ``EnvSwitch`` are torchrun's ``env`` and ``check_env``
actions: a flag not given takes its ``PET_<NAME>`` variable, parsed as the
flag would be, and a bad value is a usage error naming the variable.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..agent import RestartPolicy
    from ..logs import Std

PROG = "aioproc"
SIGNALS_ENV = "TORCHELASTIC_SIGNALS_TO_HANDLE"
SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
LOGS_SPECS_GROUP = "torchrun.logs_specs"

_UNCATCHABLE = (signal.SIGKILL, signal.SIGSTOP)


def parse_nproc(value: str) -> int:
    """``--nproc-per-node``: a positive int, or cpu, gpu, xpu or auto, counted as torchrun counts.

    ``cpu`` is the number of CPUs this process may run on, ``gpu``/``xpu``
    the accelerators (an error where there are none), ``auto`` the
    accelerators if any, else the CPUs.  Accelerators are counted by torch
    when it can be imported, else by the NVIDIA driver (see
    ``aioproc._cli.devices``).

    Raises:
        argparse.ArgumentTypeError: not a positive number, an accelerator
            kind this host has none of, or an unknown word.
    """
    text = value.strip()
    try:
        n = int(text)
    except ValueError:
        n = None
    if n is not None:
        if n <= 0:
            raise argparse.ArgumentTypeError(
                f"expected a positive number of workers, got {value!r}"
            )
        return n
    from .devices import count_workers

    try:
        return count_workers(text.lower())
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_backoff(value: str) -> RestartPolicy:
    """``--backoff initial,factor,max[,jitter]`` (seconds) as a ``RestartPolicy``.

    The delay before the n-th restart (0-based) is
    ``min(max, initial * factor**n)``, spread randomly by ``jitter`` (0-1).

    Raises:
        argparse.ArgumentTypeError: not 3 or 4 numbers, or values the policy
            rejects.
    """
    from ..agent import RestartPolicy

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
    from ..logs import Std

    try:
        return Std.from_str(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


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
    """``--start-method``: spawn, forkserver, or torchrun's fork (which ``_make_run`` maps)."""
    from .._base.checks import check_start_method

    if value == "fork":
        return value  # torchrun's: its scripts are exec'd whatever the method (see run.py)
    try:
        return check_start_method(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _parse_filters(value: str) -> list[str]:
    """``--duplicate-std*-filters``: comma-separated strings, ``,,`` for a comma (torchrun's).

    Empty items are dropped, so an empty value duplicates nothing (as
    torchrun's help promises; its parser would keep ``""``, which every
    line contains).
    """
    placeholder = "\0"  # cannot be in an argument
    items = value.replace(",,", placeholder).split(",")
    return [item.replace(placeholder, ",") for item in items if item]


def _parse_numa(value: str) -> str:
    """``--numa-binding``: one of torch's affinity modes."""
    from .devices import NUMA_MODES

    if value not in NUMA_MODES:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(NUMA_MODES)}, got {value!r}")
    return value


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
    from .._base.checks import check_log_dir

    try:
        return check_log_dir(value)
    except (OSError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _run_id(value: str) -> str:
    """``--run-id``: one directory name under the log dir, never a path."""
    from .._base.checks import check_path_name

    try:
        return check_path_name("run id", value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _port(value: str) -> int:
    port: int = _number(int, 1)(value)
    if port > 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port (1-65535), got {value!r}")
    return port


def _listen_port(value: str) -> int:
    """``--metrics-port``: a TCP port, or 0 for one the system picks."""
    port: int = _number(int, 0)(value)
    if port > 65535:
        raise argparse.ArgumentTypeError(
            f"expected a TCP port (1-65535), or 0 for any free one, got {value!r}"
        )
    return port


def _parse_memory_limit(value: str) -> int:
    """``--memory-limit``: a size with a binary unit (``512M``, ``2G``), in bytes."""
    from .._limits.spec import parse_memory

    try:
        return parse_memory(value)
    except (TypeError, ValueError) as e:
        # the message names ``memory=``, the library's argument: say the flag's words
        raise argparse.ArgumentTypeError(
            str(e).replace(f"memory={value!r} is not", f"{value!r} is not")
        ) from None


def _parse_cpu_limit(value: str) -> float:
    """``--cpu-limit``: a CPU quota such as ``1.5``, at least ``MIN_CPUS``."""
    from .._limits.spec import MIN_CPUS

    cpus: float = _number(float, MIN_CPUS)(value)
    return cpus


def _parse_cpu_affinity(value: str) -> list[int] | str:
    """``--cpu-affinity``: a CPU list (``0-3,8``), ``round-robin`` or ``numa:N``.

    Checked against the CPUs this process may run on, so a CPU or node
    that could never be used is a usage error before anything starts.
    """
    from .._limits.affinity import ROUND_ROBIN, allowed_cpus, numa_cpus, parse_cpulist
    from .devices import ranges

    text = value.strip()
    expected = f"expected a CPU list such as '0-3,8', {ROUND_ROBIN!r} or 'numa:<node>'"
    node = text.partition(":")[2] if text.startswith("numa:") else None
    try:
        allowed = allowed_cpus()
        if node is not None and not node.isdigit():
            raise ValueError(f"{expected}, got {value!r}")
        cpus = () if text == ROUND_ROBIN else numa_cpus(int(node)) if node else parse_cpulist(text)
    except ValueError as e:
        # the library's messages name its own argument (``cpus=...``): the flag names it here
        reason = str(e).partition(": ")[2] if str(e).startswith("cpus=") else str(e)
        if reason.startswith(f"{text!r} is not a CPU list"):
            reason = f"{expected}, got {value!r}"
        elif node is not None and node.isdigit():
            reason = f"{value!r}: {reason}"
        raise argparse.ArgumentTypeError(reason) from None
    if text == ROUND_ROBIN:
        return text
    usable = [cpu for cpu in cpus if cpu in allowed]
    if node is not None and not usable:
        raise argparse.ArgumentTypeError(
            f"{value!r}: none of the node's CPUs ({ranges(cpus)}) is one this command may use "
            f"({ranges(allowed)})"
        )
    if node is not None:
        return text
    if not cpus:
        raise argparse.ArgumentTypeError(f"{expected}, got {value!r}")
    outside = sorted(set(cpus) - set(allowed))
    if outside:
        raise argparse.ArgumentTypeError(
            f"{value!r}: CPU {ranges(outside)} is not among the CPUs this command may use "
            f"({ranges(allowed)})"
        )
    return list(cpus)


# ------------------------------------------------- torchrun's PET_ defaults


class _FromEnv(str):
    """A flag's default taken from its ``PET_`` variable; a bad one is named in the error."""

    env_name: str

    def __new__(cls, value: str, env_name: str) -> _FromEnv:
        text = super().__new__(cls, value)
        text.env_name = env_name
        return text


def _naming_env(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse``, whose error for a value from a ``PET_`` variable names that variable."""

    def parse_value(value: str) -> Any:
        try:
            return parse(value)
        except (argparse.ArgumentTypeError, TypeError, ValueError) as e:
            if not isinstance(value, _FromEnv):
                raise
            raise argparse.ArgumentTypeError(
                f"{value.env_name}={str(value)!r} (the default of this flag): {e}"
            ) from None

    # argparse names the type in its own messages
    parse_value.__name__ = getattr(parse, "__name__", "value")
    return parse_value


def _env_switch(value: str) -> bool:
    """A switch's ``PET_`` value as torchrun reads it: an integer, 0 for off."""
    try:
        return bool(int(value))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected an integer (0: off, 1: on), got {value!r}"
        ) from None


class EnvDefault(argparse.Action):
    """torchrun's ``env`` action: the flag's default is the variable ``env`` when it is set.

    As ``torch.distributed.argparse_util.env``: ``PET_NPROC_PER_NODE=4``
    means ``--nproc-per-node 4`` unless the flag is given, and the value is
    parsed as the flag's would be (a bad one is a usage error naming the
    variable).
    """

    def __init__(
        self,
        option_strings: list[str],
        dest: str,
        env: str,
        default: Any = None,
        type: Callable[[str], Any] | None = None,
        **kwargs: Any,
    ) -> None:
        self.env = env
        value = os.environ.get(env)
        if value is not None:
            default = _FromEnv(value, env)  # argparse parses a str default with ``type``
        super().__init__(
            option_strings, dest, default=default, type=_naming_env(type or str), **kwargs
        )

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, values)


class EnvSwitch(argparse.Action):
    """torchrun's ``check_env`` action: a switch the variable ``env`` can turn on.

    As ``torch.distributed.argparse_util.check_env``: ``PET_STANDALONE=1``
    means ``--standalone``; ``0`` leaves it off; anything but an integer is
    a usage error naming the variable.
    """

    def __init__(
        self, option_strings: list[str], dest: str, env: str, help: str | None = None
    ) -> None:
        self.env = env
        value = os.environ.get(env)
        super().__init__(
            option_strings,
            dest,
            nargs=0,
            const=True,
            default=False if value is None else _FromEnv(value, env),
            type=_naming_env(_env_switch),
            help=help,
        )

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, True)
