"""What the keys under a job's prefix hold: the names and values the protocol writes.

``malformed`` says which keys and values under a job's prefix the
protocol can use: every key enters the copy through it (``EtcdKeyspace``
checks each one), so the protocol never parses what another program wrote
there.  ``World`` is a completed round as its ``completed/<r>`` key holds
it.  The key layout and the protocol are described in ``etcd.py``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .api import DEFAULT_ROLE, RendezvousInfo, RendezvousNode

__all__ = ["World", "malformed"]


@dataclass(frozen=True)
class World:
    """A completed round as ``completed/<r>`` holds it."""

    round: int
    nodes: tuple[RendezvousNode, ...]
    # each node's join revision: its liveness key existed then (``gone_since``)
    revs: Mapping[str, int]

    @classmethod
    def parse(cls, r: int, value: bytes) -> World:
        """Round ``r``'s world from its key's value.

        Raises:
            ValueError, TypeError, KeyError: not a world (``malformed`` says so first).
        """
        nodes = json.loads(value)["nodes"]
        if not isinstance(nodes, list):
            raise TypeError(f"nodes must be a list, got {nodes!r}")
        for n in nodes:
            if not (isinstance(n["id"], str) and isinstance(n["addr"], str)):
                raise TypeError(f"a node's id and addr must be strings, got {n!r}")
            if not _is_role(n.get("role", DEFAULT_ROLE)):
                raise TypeError(f"a node's role must be a non-empty string, got {n!r}")
        return cls(
            r,
            tuple(
                RendezvousNode(
                    n["id"],
                    n["addr"],
                    int(n["port"]),
                    int(n["nproc"]),
                    n.get("role", DEFAULT_ROLE),
                )
                for n in nodes
            ),
            {n["id"]: int(n["rev"]) for n in nodes},
        )

    def info_for(self, node_id: str) -> RendezvousInfo | None:
        """This node's view of the world, or None if it is not in it."""
        for rank, node in enumerate(self.nodes):
            if node.node_id == node_id:
                return RendezvousInfo(self.round, rank, self.nodes)
        return None


# the key names under a job's prefix (see etcd.py); a number is a round
_CONTROL_KEY = re.compile(rb"(change|completed|lead)/(0|[1-9][0-9]{0,17})|closed|current|failed")
_ROUND_KEY = re.compile(rb"rounds/(0|[1-9][0-9]{0,17})/(join|done)/[^/]+")
_FAILURE_INTS = ("rank", "local_rank", "pid", "exitcode", "timestamp")


def malformed(name: bytes, value: bytes) -> tuple[bool, str] | None:
    """What is wrong with the key ``name`` (under the job's prefix) holding ``value``.

    Returns:
        None for a key and value the protocol writes; else ``(control,
        why)``: ``control`` when the key is one of the job's control keys
        (its state is then corrupt: the job cannot go on), False for a key
        the protocol can ignore (a name it never writes, a join nobody
        could have written); ``why`` says what the key is not, in a few words.
    """
    control = _CONTROL_KEY.fullmatch(name)
    if control is not None:
        kind = (control.group(1) or name).decode()
        why = _control_value(kind, int(control.group(2) or 0), value)
        return None if why is None else (True, why)
    found = _ROUND_KEY.fullmatch(name)
    if found is None:
        return False, "not a key aioproc's rendezvous writes"
    if found.group(2) == b"done" or _is_join(value):
        return None
    return False, "not a join (JSON with addr, port, nproc, prev_rank)"


def _control_value(kind: str, r: int, value: bytes) -> str | None:
    """Why ``value`` is no value of the control key ``kind`` (of round ``r``), or None."""
    if kind == "lead":
        return None if value else "not a node id"
    if kind == "current":
        ok = value.isdigit() and value.isascii() and len(value) < 19
        return None if ok else "not a round number"
    try:
        parsed = json.loads(value)
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        return "not a JSON object"
    if kind == "completed":
        try:
            world = World.parse(r, value)
        except (KeyError, TypeError, ValueError):
            world = None
        if world is None or not world.nodes:
            return "not a round's world (JSON with nodes: id, addr, port, nproc, rev)"
    elif kind == "change":
        if not (isinstance(parsed.get("host"), str) and isinstance(parsed.get("member"), bool)):
            return "not a reason to re-form (JSON with host, member)"
    elif kind == "closed":
        if parsed.get("reason") not in ("succeeded", "stopped"):
            return "not a reason to close (JSON with reason succeeded or stopped)"
    elif kind == "failed":
        ints = [parsed.get(k, 0) for k in _FAILURE_INTS]
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in ints):
            return "not a failure (JSON with integers " + ", ".join(_FAILURE_INTS) + ")"
    return None


def _is_join(value: bytes) -> bool:
    """Whether ``value`` is what ``Joining.join`` writes."""
    try:
        join = json.loads(value)
    except ValueError:
        return False
    if not isinstance(join, dict):
        return False
    port, nproc, prev = join.get("port"), join.get("nproc"), join.get("prev_rank")
    return (
        isinstance(join.get("addr"), str)
        and bool(join["addr"])
        and _is_int(port, 1, 65535)
        and _is_int(nproc, 1)
        and (prev is None or _is_int(prev, 0))
        and _is_role(join.get("role", DEFAULT_ROLE))
    )


def _is_role(value: Any) -> bool:
    # a join or a world without one comes from an agent that ran one role: the default
    return isinstance(value, str) and bool(value)


def _is_int(value: Any, low: int, high: int | None = None) -> bool:
    if isinstance(value, bool) or not isinstance(value, int):
        return False
    return low <= value and (high is None or value <= high)
