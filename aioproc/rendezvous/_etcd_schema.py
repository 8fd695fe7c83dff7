"""What the keys under a job's prefix hold: the names and values the protocol writes.

``malformed`` says which keys and values under a job's prefix the
protocol can use: every key enters the copy through it (``EtcdKeyspace``
checks each one), so the protocol never parses what another program wrote
there.  ``World`` is a completed round as its ``completed/<r>`` key holds
it (the same few fields however many nodes it has), ``Seat`` one node's
place in it as the round's leader writes it into the node's liveness key,
and ``assign`` computes every node's seat the way torch assigns ranks.
The key layout and the protocol are described in ``etcd.py``.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .api import DEFAULT_ROLE, RendezvousAssignment, RendezvousInfo, RendezvousNode

__all__ = ["Seat", "World", "assign", "lost_in", "malformed", "node_record", "parse_node_record"]


@dataclass(frozen=True)
class World:
    """A completed round as ``completed/<r>`` holds it: O(1) fields, whatever its size.

    Attributes:
        round: the round's number.
        token: names this completion: the seats its leader wrote carry it
            (a leader that died mid-way left seats with another token).
        size: how many nodes it has (group world size).
        master_addr, master_port: group rank 0's address and reserved port.
    """

    round: int
    token: str
    size: int
    master_addr: str
    master_port: int

    def value(self) -> bytes:
        return json.dumps(
            {
                "round": self.round,
                "token": self.token,
                "size": self.size,
                "master": [self.master_addr, self.master_port],
            }
        ).encode()

    @classmethod
    def parse(cls, r: int, value: bytes) -> World:
        """Round ``r``'s world from its key's value.

        Raises:
            ValueError, TypeError, KeyError: not a world (``malformed`` says so first).
        """
        parsed = json.loads(value)
        token, size, master = parsed["token"], parsed["size"], parsed["master"]
        if not (isinstance(token, str) and token and _is_int(size, 1)):
            raise TypeError(f"not a world's token and size: {parsed!r}")
        if not (isinstance(master, list) and len(master) == 2 and isinstance(master[0], str)):
            raise TypeError(f"not a master address and port: {master!r}")
        if not _is_int(master[1], 1, 65535):
            raise TypeError(f"not a port: {master[1]!r}")
        return cls(r, token, size, master[0], master[1])


@dataclass(frozen=True)
class Seat:
    """One node's place in a round's world: what the round's leader writes for it.

    It goes into the node's liveness key (``nodes/<id>``), which the node
    watches: each node reads its own seat, never the others'.  A node whose
    liveness key vanishes is lost to the world its last seat names (the
    deletion's event carries the seat).

    Attributes:
        node_id: the node's id.
        addr: its address.
        round, token: the completion that seated it.
        group_rank: its rank among the nodes.
        assignment: its workers' figures (torch's rank assignment).
    """

    node_id: str
    addr: str
    round: int
    token: str
    group_rank: int
    assignment: RendezvousAssignment

    def value(self) -> bytes:
        a = self.assignment
        return json.dumps(
            {
                "addr": self.addr,
                "round": self.round,
                "token": self.token,
                "rank": self.group_rank,
                "size": a.group_world_size,
                "world": a.world_size,
                "base": a.base_global_rank,
                "role": a.role,
                "role_base": a.base_role_rank,
                "role_world": a.role_world_size,
                "master": [a.master_addr, a.master_port],
            }
        ).encode()

    @classmethod
    def parse(cls, node_id: str, value: bytes) -> Seat | None:
        """The seat a liveness key's ``value`` holds; None if it holds none (or garbage)."""
        try:
            v = json.loads(value)
            if not isinstance(v, dict) or "round" not in v:
                return None
            master = v["master"]
            ints = [v[k] for k in ("round", "rank", "size", "world", "base", "role_base")]
            ok = (
                all(_is_int(i, 0) for i in ints)
                and _is_int(v["role_world"], 1)
                and isinstance(v["token"], str)
                and isinstance(v["addr"], str)
                and _is_role(v["role"])
                and isinstance(master, list)
                and len(master) == 2
                and isinstance(master[0], str)
                and _is_int(master[1], 1, 65535)
                and v["rank"] < v["size"]
            )
            if not ok:
                return None
            assignment = RendezvousAssignment(
                v["size"], v["world"], v["base"], v["role"], v["role_base"], v["role_world"],
                master[0], master[1],
            )  # fmt: skip
            return cls(node_id, v["addr"], v["round"], v["token"], v["rank"], assignment)
        except (KeyError, TypeError, ValueError):
            return None

    def info(self) -> RendezvousInfo:
        """This node's ``RendezvousInfo``: its assignment, without the other nodes."""
        return RendezvousInfo(self.round, self.group_rank, (), self.assignment)


def assign(r: int, token: str, nodes: Sequence[RendezvousNode]) -> list[Seat]:
    """Every node's seat in round ``r``'s world of ``nodes`` (in group-rank order).

    torch's ``_assign_worker_ranks``: global ranks are running sums of
    nproc over every node, role ranks over the nodes of each role, in
    group-rank order; group rank 0's address and port are the master's.
    """
    role_sizes: dict[str, int] = defaultdict(int)
    for n in nodes:
        role_sizes[n.role] += n.nproc
    world_size = sum(role_sizes.values())
    master = nodes[0]
    base = 0
    role_bases: dict[str, int] = defaultdict(int)
    seats = []
    for rank, n in enumerate(nodes):
        a = RendezvousAssignment(
            len(nodes), world_size, base, n.role, role_bases[n.role], role_sizes[n.role],
            master.addr, master.port,
        )  # fmt: skip
        seats.append(Seat(n.node_id, n.addr, r, token, rank, a))
        base += n.nproc
        role_bases[n.role] += n.nproc
    return seats


def node_record(node: RendezvousNode, rank: int) -> bytes:
    """What ``rounds/<r>/assign/<token>/<id>`` holds: the node as ``world()`` lists it."""
    return json.dumps(
        {"rank": rank, "addr": node.addr, "port": node.port, "nproc": node.nproc, "role": node.role}
    ).encode()


def parse_node_record(node_id: str, value: bytes) -> tuple[int, RendezvousNode] | None:
    """``(rank, node)`` from an assign key's value, or None for garbage."""
    try:
        v = json.loads(value)
        if not (
            isinstance(v, dict)
            and _is_int(v["rank"], 0)
            and isinstance(v["addr"], str)
            and _is_int(v["port"], 1, 65535)
            and _is_int(v["nproc"], 1)
            and _is_role(v["role"])
        ):
            return None
        return v["rank"], RendezvousNode(node_id, v["addr"], v["port"], v["nproc"], v["role"])
    except (KeyError, TypeError, ValueError):
        return None


# the key names under a job's prefix (see etcd.py); a number is a round
_CONTROL_KEY = re.compile(rb"(change|completed|lead)/(0|[1-9][0-9]{0,17})|closed|current|failed")
_ROUND_KEY = re.compile(rb"rounds/(0|[1-9][0-9]{0,17})/(?:(join|done)|assign/[0-9a-f]+)/[^/]+")
_NODE_KEY = re.compile(rb"nodes/[^/]+")
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
    if _NODE_KEY.fullmatch(name) is not None:
        return None if _is_node(name[6:], value) else (False, "not a node (JSON with addr)")
    found = _ROUND_KEY.fullmatch(name)
    if found is None:
        return False, "not a key aioproc's rendezvous writes"
    if found.group(2) == b"done":
        return None
    if found.group(2) is None:
        if parse_node_record(name.rsplit(b"/", 1)[1].decode(errors="replace"), value) is None:
            return False, "not a node record (JSON with rank, addr, port, nproc, role)"
        return None
    if _is_join(value):
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
            World.parse(r, value)
        except (KeyError, TypeError, ValueError):
            return "not a round's world (JSON with token, size, master)"
    elif kind == "change":
        lost = parsed.get("lost", [])
        if not (
            isinstance(parsed.get("host"), str)
            and isinstance(parsed.get("member"), bool)
            and isinstance(lost, list)
            and all(_is_lost(x) for x in lost)
        ):
            return "not a reason to re-form (JSON with host, member)"
    elif kind == "closed":
        if parsed.get("reason") not in ("succeeded", "stopped"):
            return "not a reason to close (JSON with reason succeeded or stopped)"
    elif kind == "failed":
        ints = [parsed.get(k, 0) for k in _FAILURE_INTS]
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in ints):
            return "not a failure (JSON with integers " + ", ".join(_FAILURE_INTS) + ")"
    return None


def lost_in(change: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The lost members ``(node id, addr)`` a checked ``change/<r>`` value names."""
    return [(str(i), str(a)) for i, a in change.get("lost", [])]


def _is_lost(x: Any) -> bool:
    return isinstance(x, list) and len(x) == 2 and all(isinstance(s, str) for s in x)


def _is_node(node_id: bytes, value: bytes) -> bool:
    """Whether ``value`` is what an agent (or a round's leader) writes into its liveness key."""
    try:
        v = json.loads(value)
    except ValueError:
        return False
    if not (isinstance(v, dict) and isinstance(v.get("addr"), str)):
        return False
    return "round" not in v or Seat.parse(node_id.decode(errors="replace"), value) is not None


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
