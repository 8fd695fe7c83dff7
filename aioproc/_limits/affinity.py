"""CPU placement: which CPUs a process may run on, checked, then applied from its parent.

A CPU set is given as a list of CPU ids or as ``"numa:<node>"``, the CPUs of
one NUMA node as ``/sys/devices/system/node/node<N>/cpulist`` lists them.
Every set is checked against this process's own allowed set
(``os.sched_getaffinity(0)``, which a container's cpuset or a ``taskset``
already narrowed): a CPU outside it could never be used, so naming one is a
mistake to report before anything starts, not a set to trim silently.

``set_affinity(pid, cpus)`` is what a launcher runs from the parent right
after the start, where it joins the placement: an affinity set on a
process's main thread before it starts any thread is inherited by every
thread and child it makes later.  Standard library only.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

NODE_ROOT = Path("/sys/devices/system/node")
"""Where Linux lists the NUMA nodes (tests point it elsewhere)."""

ROUND_ROBIN = "round-robin"
"""``cpus="round-robin"``: one CPU of the allowed set for each worker, in turn."""


def allowed_cpus() -> tuple[int, ...]:
    """The CPUs this process may run on, in order (``os.sched_getaffinity(0)``).

    Raises:
        ValueError: this platform has no CPU affinity (only Linux has).
    """
    if not hasattr(os, "sched_getaffinity"):
        raise ValueError("cpus= needs os.sched_setaffinity, which this platform lacks (Linux)")
    return tuple(sorted(os.sched_getaffinity(0)))


def parse_cpulist(text: str) -> tuple[int, ...]:
    """``"0-3,8,10-11"`` (the kernel's list format) -> ``(0, 1, 2, 3, 8, 10, 11)``.

    Raises:
        ValueError: ``text`` is not a CPU list.
    """
    cpus: set[int] = set()
    for item in filter(None, text.strip().split(",")):
        first, dash, last = item.partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"{text.strip()!r} is not a CPU list such as '0-3,8'")
        cpus.update(range(int(first), int(last if dash else first) + 1))
    return tuple(sorted(cpus))


def numa_cpus(node: int) -> tuple[int, ...]:
    """The CPUs of NUMA node ``node``, as the kernel lists them.

    Raises:
        ValueError: this machine publishes no such node (the message names
            the file looked for), or the file is not a CPU list.
    """
    path = NODE_ROOT / f"node{node}" / "cpulist"
    try:
        text = path.read_text()
    except FileNotFoundError:
        nodes = sorted(p.parent.name for p in NODE_ROOT.glob("node*/cpulist"))
        known = f"nodes here: {', '.join(nodes)}" if nodes else "no NUMA information here"
        raise ValueError(f"cpus='numa:{node}': {path} does not exist ({known})") from None
    return parse_cpulist(text)


def check_cpu_set(
    value: object, what: str, allowed: Sequence[int] | None = None
) -> tuple[int, ...]:
    """One CPU set checked: a non-empty list of allowed CPU ids, or ``"numa:<node>"``.

    A NUMA node's CPUs are narrowed to the allowed set (a cpuset may hold
    only part of a node); a node none of whose CPUs is allowed is an error.

    Args:
        value: what the user gave.
        what: how messages name it (``"cpus"``, ``"cpus[2]"``).
        allowed: the allowed set (``allowed_cpus()`` by default).

    Returns:
        The CPU ids, sorted, without duplicates.

    Raises:
        TypeError: not a list of ints nor a ``"numa:<node>"`` string.
        ValueError: empty, a CPU this process may not use, or an unknown node.
    """
    allowed = allowed_cpus() if allowed is None else tuple(allowed)
    if isinstance(value, str):
        prefix, _, node = value.partition(":")
        if prefix != "numa" or not node.isdigit():
            raise ValueError(f"{what}={value!r}: a string must be 'numa:<node>' or {ROUND_ROBIN!r}")
        on_node = numa_cpus(int(node))
        cpus = tuple(cpu for cpu in on_node if cpu in allowed)
        if not cpus:
            raise ValueError(
                f"{what}={value!r}: none of the node's CPUs {list(on_node)} is in this "
                f"process's allowed set {list(allowed)}"
            )
        return cpus
    if isinstance(value, (bytes, bytearray)) or not isinstance(value, (Sequence, set, frozenset)):
        raise TypeError(
            f"{what} must be a list of CPU ids, 'numa:<node>' or {ROUND_ROBIN!r}, got {value!r}"
        )
    for cpu in value:
        if isinstance(cpu, bool) or not isinstance(cpu, int):
            raise TypeError(f"{what}: CPU ids must be ints, got {cpu!r} in {value!r}")
    if not value:
        raise ValueError(f"{what}={value!r} is empty: name at least one CPU")
    outside = sorted(set(value) - set(allowed))
    if outside:
        raise ValueError(
            f"{what}={list(value)!r}: CPU {', '.join(map(str, outside))} not in this "
            f"process's allowed set {list(allowed)} (os.sched_getaffinity(0))"
        )
    return tuple(sorted(set(value)))


def set_affinity(pid: int, cpus: Sequence[int]) -> None:
    """Pin ``pid`` to ``cpus`` from its parent; a process that already exited is no error.

    Raises:
        OSError: the kernel refused the set (a CPU went offline, or the
            cpuset changed since it was checked).
    """
    try:
        os.sched_setaffinity(pid, cpus)
    except ProcessLookupError:
        pass  # it exited already: nothing left to place


class Pinned:
    """A join that pins the process to ``cpus``, then runs a placement's join, if any.

    ``cpus`` is also what a spawner gives its own thread while it starts the
    process (``_proc.spawn``): a child inherits its parent thread's CPU set
    at the fork, so a binary runs on ``cpus`` from its first instruction,
    not from when this join lands.
    """

    __slots__ = ("_join", "cpus")

    def __init__(self, join: Callable[[int], None] | None, cpus: Sequence[int]) -> None:
        self.cpus = tuple(cpus)
        self._join = join

    def __call__(self, pid: int) -> None:
        set_affinity(pid, self.cpus)
        if self._join is not None:
            self._join(pid)


def with_affinity(join: Callable[[int], None] | None, cpus: Sequence[int]) -> Pinned:
    """A join that pins the process to ``cpus``, then runs ``join`` (a placement's), if any."""
    return Pinned(join, cpus)
