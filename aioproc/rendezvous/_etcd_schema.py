"""What the keys under a job's prefix hold: the names and values the protocol writes.

``malformed`` says which keys and values under a job's prefix the
protocol can use: every key enters the copy through it (``EtcdKeyspace``
checks each one), so the protocol never parses what another program wrote
there.  ``World`` is a completed round as its ``completed/<r>`` key holds
it (the same few fields however many nodes it has), ``Seat`` one node's
place in it as the round's leader writes it into the node's seat key
(``seats/<id>``), and ``assign`` computes every node's seat the way torch
assigns ranks.
The key layout and the protocol are described in ``etcd.py``.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .api import DEFAULT_ROLE, RendezvousAssignment, RendezvousInfo, RendezvousNode

__all__ = ["Seat", "World", "assign", "malformed"]


@dataclass(frozen=True)
class World:
    """A completed round as ``completed/<r>`` holds it: O(1) fields, whatever its size.

    Attributes:
        round: the round's number.
        token: names this completion: the seats its leader wrote carry it
            (a leader that died mid-way left seats with another token).
        size: how many nodes it has (group world size).
        master_addr, master_port: group rank 0's address and reserved port.
        lookout: the member that watches the others' liveness for the
            world (group rank 0), and its address.
        since: the revision from which the lookout hears of departures:
            every member still had its join then.
    """

    round: int
    token: str
    size: int
    master_addr: str
    master_port: int
    lookout: tuple[str, str]
    since: int

    def value(self) -> bytes:
        return json.dumps(
            {
                "round": self.round,
                "token": self.token,
                "size": self.size,
                "master": [self.master_addr, self.master_port],
                "lookout": list(self.lookout),
                "since": self.since,
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
        lookout, since = parsed["lookout"], parsed["since"]
        if not (isinstance(token, str) and token and _is_int(size, 1) and _is_int(since, 0)):
            raise TypeError(f"not a world's token, size and revision: {parsed!r}")
        if not (isinstance(master, list) and len(master) == 2 and isinstance(master[0], str)):
            raise TypeError(f"not a master address and port: {master!r}")
        if not _is_int(master[1], 1, 65535):
            raise TypeError(f"not a port: {master[1]!r}")
        if not (isinstance(lookout, list) and len(lookout) == 2):
            raise TypeError(f"not a node id and address: {lookout!r}")
        if not all(isinstance(x, str) and x for x in lookout):
            raise TypeError(f"not a node id and address: {lookout!r}")
        return cls(r, token, size, master[0], master[1], (lookout[0], lookout[1]), since)


@dataclass(frozen=True)
class Seat:
    """One node's place in a round's world: what the round's leader writes for it.

    It goes into the node's seat key (``seats/<id>``), which the node
    watches: each node reads its own seat, never the others'.  The key
    outlives the node's lease, so that a node whose liveness key vanished
    is known lost to the world its last seat names (one read).

    Attributes:
        node: the node as it joined (id, address, port, nproc, role).
        round, token: the completion that seated it.
        group_rank: its rank among the nodes.
        assignment: its workers' figures (torch's rank assignment).
    """

    node: RendezvousNode
    round: int
    token: str
    group_rank: int
    assignment: RendezvousAssignment

    @property
    def node_id(self) -> str:
        return self.node.node_id

    @property
    def addr(self) -> str:
        return self.node.addr

    def value(self) -> bytes:
        a = self.assignment
        return json.dumps(
            {
                "addr": self.node.addr,
                "port": self.node.port,
                "nproc": self.node.nproc,
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
        """The seat a seat key's ``value`` holds; None for what no leader writes."""
        try:
            v = json.loads(value)
            if not isinstance(v, dict):
                return None
            master = v["master"]
            ints = [v[k] for k in ("round", "rank", "size", "world", "base", "role_base")]
            ok = (
                all(_is_int(i, 0) for i in ints)
                and _is_int(v["role_world"], 1)
                and _is_int(v["port"], 1, 65535)
                and _is_int(v["nproc"], 1)
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
            node = RendezvousNode(node_id, v["addr"], v["port"], v["nproc"], v["role"])
            return cls(node, v["round"], v["token"], v["rank"], assignment)
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
        seats.append(Seat(n, r, token, rank, a))
        base += n.nproc
        role_bases[n.role] += n.nproc
    return seats


# the key names under a job's prefix (see etcd.py); a number is a round
_CONTROL_KEY = re.compile(
    rb"(change|completed|lead|lookout)/(0|[1-9][0-9]{0,17})|(lost)/(0|[1-9][0-9]{0,17})/[^/]+"
    rb"|closed|current|failed"
)
_ROUND_KEY = re.compile(rb"rounds/(0|[1-9][0-9]{0,17})/(join|done)/[^/]+")
_NODE_KEY = re.compile(rb"(nodes|seats)/([^/]+)")
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
        kind = (control.group(1) or control.group(3) or name).decode()
        why = _control_value(kind, int(control.group(2) or control.group(4) or 0), value)
        return None if why is None else (True, why)
    node = _NODE_KEY.fullmatch(name)
    if node is not None:
        if node.group(1) == b"nodes":
            return None if _is_node(value) else (False, "not a node (JSON with addr)")
        if Seat.parse(node.group(2).decode(errors="replace"), value) is None:
            return False, "not a seat (JSON with addr, port, nproc, round, token, rank...)"
        return None
    found = _ROUND_KEY.fullmatch(name)
    if found is None:
        return False, "not a key aioproc's rendezvous writes"
    if found.group(2) == b"done":
        return None
    if _is_join(value):
        return None
    return False, "not a join (JSON with addr, port, nproc, prev_rank)"


def _control_value(kind: str, r: int, value: bytes) -> str | None:
    """Why ``value`` is no value of the control key ``kind`` (of round ``r``), or None."""
    if kind in ("lead", "lookout"):
        return None if value else "not a node id"
    if kind == "lost":
        return None if value else "not an address"
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
            return "not a round's world (JSON with token, size, master, lookout, since)"
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


def _is_node(value: bytes) -> bool:
    """Whether ``value`` is what an agent writes into its liveness key."""
    try:
        v = json.loads(value)
    except ValueError:
        return False
    return isinstance(v, dict) and isinstance(v.get("addr"), str)


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
