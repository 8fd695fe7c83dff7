"""``Limits``: memory, CPU quota and process count for a group or a rank, checked at once.

Sizes are binary: ``"512M"`` is 512 MiB, ``"1.5G"`` and ``"1.5GiB"`` are
both 1.5 GiB.  ``"512MB"`` is refused rather than guessed, because the
decimal reading (512 000 000 bytes) and the binary one differ by five per
cent, which is the difference between a job that fits and one the kernel
kills.  Standard library only.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from decimal import Decimal

from .._base import public_module

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([KMGT]?)(iB)?\s*", re.IGNORECASE)

# The kernel's CFS bandwidth control refuses a quota under 1 ms per period,
# and every mechanism here uses a 100 ms period: 1 ms of it is 0.01 CPU.
MIN_CPUS = 0.01


def parse_memory(value: object) -> int:
    """Turn a memory size into bytes.

    Args:
        value: an int number of bytes, or a string: a number with an
            optional binary unit ``K``, ``M``, ``G`` or ``T`` (KiB, MiB, GiB,
            TiB), with or without ``iB`` (``"512M"``, ``"2G"``, ``"1.5GiB"``,
            ``"4096"``).

    Returns:
        The size in bytes, rounded down to a whole byte.

    Raises:
        TypeError: ``value`` is neither an int nor a string (a bool is refused).
        ValueError: the string is not a size, or the size is not positive.
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(
            f"memory must be a number of bytes or a size such as '512M' or '2GiB', got {value!r}"
        )
    if isinstance(value, int):
        size = value
    else:
        match = _SIZE.fullmatch(value)
        if match is None:
            hint = ""
            if re.fullmatch(r"\s*[\d.]+\s*[KMGT]B\s*", value, re.IGNORECASE):
                hint = " (units are binary: write 'M' or 'MiB', not 'MB')"
            raise ValueError(
                f"memory={value!r} is not a size such as '512M', '2G' or '1.5GiB'{hint}"
            )
        number, unit, _ = match.groups()
        # Decimal, not float: "1099511627777" stays exact past 2**53.
        size = int(Decimal(number) * _UNITS[unit.upper()])
    if size <= 0:
        raise ValueError(f"memory must be a positive size, got {value!r}")
    return size


def format_bytes(size: int) -> str:
    """``67108864`` -> ``"64 MiB"``; ``1610612736`` -> ``"1.5 GiB"``: for messages."""
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        scale = _UNITS[unit[0]]
        if size >= scale:
            return f"{size / scale:.4g} {unit}"
    return f"{size} bytes"


@dataclass(frozen=True, init=False)
class Limits:
    """Resource limits for a group of workers or for one rank.

    Every value is checked when the object is made, so a mistake fails
    before any process exists.  ``None`` means "no limit".

    Args:
        memory: the most memory the processes may use together, RAM and
            swap: an int number of bytes, or a string with a binary unit
            ``K``, ``M``, ``G`` or ``T``, with or without ``iB`` (``"512M"``,
            ``"2G"``, ``"1.5GiB"``).  Past it the kernel's OOM killer
            kills one of them (cgroups); where only rlimits exist, an
            allocation past it fails in the process that makes it.
        cpus: a CPU quota: ``1.5`` lets the processes together use one and
            a half CPUs' worth of time, however many CPUs they run on; at
            least ``0.01``.  Only cgroups enforce it.
        pids: the most processes (and threads) that may exist at once.

    Attributes:
        memory: the memory limit in bytes, or ``None``.
        cpus: the CPU quota as a float, or ``None``.
        pids: the process limit, or ``None``.

    Raises:
        TypeError: a value has the wrong type (a bool is refused everywhere).
        ValueError: a value is out of range or not a size.
    """

    memory: int | None
    cpus: float | None
    pids: int | None

    def __init__(
        self,
        memory: int | str | None = None,
        cpus: float | None = None,
        pids: int | None = None,
    ) -> None:
        object.__setattr__(self, "memory", None if memory is None else parse_memory(memory))
        object.__setattr__(self, "cpus", None if cpus is None else _check_cpus(cpus))
        object.__setattr__(self, "pids", None if pids is None else _check_pids(pids))

    def __bool__(self) -> bool:
        """True when at least one limit is set."""
        return not (self.memory is None and self.cpus is None and self.pids is None)


def _check_cpus(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"cpus must be a number of CPUs such as 1.5, got {value!r}")
    cpus = float(value)
    if not math.isfinite(cpus) or cpus < MIN_CPUS:
        raise ValueError(
            f"cpus must be a finite number of CPUs of at least {MIN_CPUS}, got {value!r}"
        )
    return cpus


def _check_pids(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"pids must be a positive int, got {value!r}")
    if value < 1:
        raise ValueError(f"pids must be a positive int, got {value!r}")
    return value


# imported by users from the package itself: named so wherever it is reached from
public_module("aioproc", Limits)
