"""The values of ``aioproc run``'s flags: one parser per flag, and the names they share.

Each parser is an argparse ``type=``: it turns one flag's string into its
value, or raises ``argparse.ArgumentTypeError`` with a message saying what
was expected, so a bad flag is a usage error (exit 2) before anything
starts.  ``PROG``, ``SIGNALS_ENV`` and ``MULTI_NODE_BACKENDS`` live here, at
the bottom of ``_cli``, because the parser, the run and the messages all
name them.  The parsers that need the agent or the checks import them when
called, so ``aioproc --help`` stays fast.
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
MULTI_NODE_BACKENDS = ("etcd", "etcd-v3", "static")

_UNCATCHABLE = (signal.SIGKILL, signal.SIGSTOP)


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
    from .._base.checks import check_start_method

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
