"""Joining a round of the etcd rendezvous: the join, the round's leader, completing it.

One ``Joining`` per ``EtcdRendezvousHandler.next_rendezvous()`` call: it
writes this node's join (claiming the round's lead and signalling the
running world in the same transaction), and waits for the round's world;
while this node leads the round, it follows the round's joins and completes
the round.  The key layout and the protocol are described in ``etcd.py``.

Every wait reads the copy's ``version`` before it looks at the copy, and
sleeps only if the version did not move meanwhile: an event that arrived
while a write was in flight (the leader's own world, after its completing
transaction) is never slept through, however few other events follow.

``malformed`` says which keys and values under a job's prefix the
protocol can use: every key enters the copy through it, so the protocol
never parses what another program wrote there.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio

from ._etcd_store import KeyValue, prefix_end
from .api import RendezvousInfo, RendezvousNode

if TYPE_CHECKING:
    from .etcd import EtcdRendezvousHandler

__all__ = ["Joining", "World", "malformed"]

logger = logging.getLogger("aioproc.rendezvous")


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
        return cls(
            r,
            tuple(
                RendezvousNode(n["id"], n["addr"], int(n["port"]), int(n["nproc"])) for n in nodes
            ),
            {n["id"]: int(n["rev"]) for n in nodes},
        )

    def info_for(self, node_id: str) -> RendezvousInfo | None:
        """This node's view of the world, or None if it is not in it."""
        for rank, node in enumerate(self.nodes):
            if node.node_id == node_id:
                return RendezvousInfo(self.round, rank, self.nodes)
        return None


class Joining:
    """This node's way into the next round (one per ``next_rendezvous()`` call).

    Args:
        handler: the node's handler: its session, its copy of the keys, its limits.
        prev: the round this node ran before, if any (its group rank is kept).
    """

    def __init__(self, handler: EtcdRendezvousHandler, prev: RendezvousInfo | None) -> None:
        self._h = handler
        self._prev = prev
        # the round this node claimed the lead of (the copy may not show it yet)
        self._claimed = -1
        # (round, revision) of a lead this node was told of: until the copy
        # caught up with it, its absence there is no reason to claim
        self._lead_seen = (-1, 0)

    async def join(self, r: int, current_rev: int) -> bool:
        """Write this node's join key of round ``r`` (False: ``current`` moved).

        In the same transaction: claim ``lead/<r>`` unless the copy shows a
        leader, and write ``change/<r>`` if this join makes the running
        world re-form.
        """
        h = self._h
        store = h._store()
        port = _free_port(h.addr)
        prev_rank = None
        prev = self._prev
        if prev is not None and prev.round == r - 1:
            prev_rank = prev.group_rank
        value = json.dumps(
            {"addr": h.addr, "port": port, "nproc": h._nproc, "prev_rank": prev_rank}
        ).encode()
        tx = store.client.transactions
        success = [tx.put(h._key(f"rounds/{r}/join/{h.node_id}"), value, lease=store.lease_id)]
        claim = h._get(f"lead/{r}") is None
        if claim:
            success.append(self._claim_op(r))
        why = self._change_made(r)
        if why is not None:
            change = h._key(f"change/{r}")
            success.append(
                tx.txn(
                    compare=[tx.create(change) == 0],
                    success=[tx.put(change, json.dumps(why).encode())],
                    failure=[],
                )
            )
        current = h._key("current")
        ok, responses = await store.call(
            lambda: store.client.transaction(
                compare=[tx.mod(current) == current_rev], success=success, failure=[]
            )
        )
        if ok and claim:
            self._claimed_or_seen(r, responses[1].response_txn)
        return bool(ok)

    def _change_made(self, r: int) -> dict[str, Any] | None:
        """Why a join of round ``r`` makes the running world re-form, if it does."""
        h = self._h
        if h._get(f"change/{r}") is not None:
            return None  # the running world's members know already
        world = h._world(r - 1)
        if world is None:
            return None  # no world runs
        if h.node_id in world.revs:
            return {"host": h.addr, "member": True}  # its workers failed: all re-join
        if len(world.nodes) < h.max_nodes:
            return {"host": h.addr, "member": False}  # room for it: grow the world
        return None  # a full world: wait for a place

    def _claim_op(self, r: int) -> Any:
        """A nested transaction: take ``lead/<r>`` if free, else read who holds it."""
        h = self._h
        store = h._store()
        tx = store.client.transactions
        lead = h._key(f"lead/{r}")
        return tx.txn(
            compare=[tx.create(lead) == 0],
            success=[tx.put(lead, h.node_id.encode(), lease=store.lease_id)],
            failure=[tx.get(lead)],
        )

    def _claimed_or_seen(self, r: int, result: Any) -> None:
        """Note what a claim of ``lead/<r>`` found (``result``: its TxnResponse)."""
        h = self._h
        if result.succeeded:
            self._claimed = r
            return
        for response in result.responses:
            for kv in response.response_range.kvs:
                if kv.value == h.node_id.encode():
                    self._claimed = r  # a retried call: the first try had claimed it
                else:
                    self._lead_seen = (r, int(kv.mod_revision))

    async def _leads(self, r: int, current_rev: int) -> bool:
        """Whether this node leads round ``r``; claims it if it has no leader."""
        h = self._h
        lead = h._get(f"lead/{r}")
        if lead is not None:
            return lead.value == h.node_id.encode()
        if self._claimed == r:
            return True  # the copy does not show the claim yet
        seen_round, seen_rev = self._lead_seen
        if seen_round == r and h._store().control.revision < seen_rev:
            return False  # the copy does not show that leader yet
        # no leader: none yet, or it died (its lease took the key along)
        store = h._store()
        tx = store.client.transactions
        current = h._key("current")
        ok, responses = await store.call(
            lambda: store.client.transaction(
                compare=[tx.mod(current) == current_rev], success=[self._claim_op(r)], failure=[]
            )
        )
        if ok:
            self._claimed_or_seen(r, responses[0].response_txn)
        return self._claimed == r

    async def wait(self, r: int, current_rev: int, deadline: float) -> World | None:
        """Round ``r``'s world once it completed (None: superseded before this node saw it).

        Cancellation: the joins followed while leading are unfollowed.
        """
        h = self._h
        store = h._store()
        joins_dir = h._key(f"rounds/{r}/join/")
        ready_since: float | None = None
        frozen = False
        try:
            while True:
                seen = store.version
                h._raise_if_over(waiting=True)
                current = h._current()[0]
                if current >= r:
                    return h._world(r)  # completed (and superseded, when None)
                wake_at = deadline
                leading = not frozen and await self._leads(r, current_rev)
                if not leading:
                    ready_since = None
                else:
                    await store.follow(joins_dir, prefix_end(joins_dir))
                    joins = store.children(joins_dir)
                    if len(joins) >= h.max_nodes:
                        frozen = await self._freeze(r, current_rev, joins)
                    elif len(joins) >= h.min_nodes and not self._members_pending(r, joins):
                        now = time.monotonic()
                        ready_since = now if ready_since is None else ready_since
                        if now >= ready_since + h.last_call_timeout:
                            frozen = await self._freeze(r, current_rev, joins)
                        wake_at = min(deadline, ready_since + h.last_call_timeout)
                    else:
                        ready_since = None
                    if frozen:
                        # its world arrives in the copy: stop following the joins now
                        await store.unfollow(joins_dir, prefix_end(joins_dir))
                with anyio.move_on_at(wake_at):
                    await store.changed(seen)
        finally:
            await store.unfollow(joins_dir, prefix_end(joins_dir))

    def _members_pending(self, r: int, joins: Mapping[bytes, KeyValue]) -> list[str]:
        """Live members of the running world (round r - 1) that have not joined round r."""
        h = self._h
        world = h._world(r - 1)
        if world is None:
            return []
        store = h._store()
        return [
            n.node_id
            for n in world.nodes
            if n.node_id.encode() not in joins
            and not store.gone_since(n.node_id.encode(), world.revs[n.node_id])
        ]

    async def _freeze(self, r: int, current_rev: int, joins: Mapping[bytes, KeyValue]) -> bool:
        """Complete round ``r`` with ``joins`` (True), unless another write came first."""
        h = self._h
        store = h._store()

        def order(item: tuple[bytes, KeyValue]) -> tuple[int, int]:
            value = json.loads(item[1].value)
            if value.get("prev_rank") is not None:
                return (0, int(value["prev_rank"]))  # stable group ranks
            return (1, item[1].create_revision)

        chosen = sorted(joins.items(), key=order)[: h.max_nodes]
        nodes = []
        for name, kv in chosen:
            value = json.loads(kv.value)
            nodes.append(
                {
                    "id": name.decode(),
                    "addr": value["addr"],
                    "port": value["port"],
                    "nproc": value["nproc"],
                    "rev": kv.create_revision,
                }
            )
        world = json.dumps({"round": r, "nodes": nodes}).encode()
        tx = store.client.transactions
        world_key = h._key(f"completed/{r}")
        success = [
            tx.put(world_key, world),
            tx.put(h._key("current"), str(r).encode()),
            tx.delete(h._key(f"lead/{r}")),
            tx.delete(h._key(f"change/{r}")),
        ]
        if r > 0:
            old = h._key(f"rounds/{r - 1}/")
            success.append(tx.delete(old, range_end=prefix_end(old)))
            success.append(tx.delete(h._key(f"completed/{r - 1}")))
        seen = store.version
        ok, _ = await store.call(
            lambda: store.client.transaction(
                compare=[tx.create(world_key) == 0, tx.mod(h._key("current")) == current_rev],
                success=success,
                failure=[],
            )
        )
        if ok:
            logger.info("rendezvous round %d completed with %d node(s)", r, len(nodes))
        else:
            await store.changed(seen)  # another agent's write came first: see it
        return bool(ok)

    async def leave(self, r: int, joined: int) -> str:
        """After a join timeout: drop this node's join and lead; how many nodes had joined.

        Cancellation: shielded and bounded; the lease takes the keys away anyway.
        """
        h = self._h
        store = h._store()
        tx = store.client.transactions
        joins = h._key(f"rounds/{r}/join/")
        ops = [tx.get(joins, prefix_end(joins))]
        if joined >= 0:
            lead = h._key(f"lead/{joined}")
            ops.append(tx.delete(h._key(f"rounds/{joined}/join/{h.node_id}")))
            ops.append(
                tx.txn(
                    compare=[tx.value(lead) == h.node_id.encode()],
                    success=[tx.delete(lead)],
                    failure=[],
                )
            )
        self._claimed = -1
        with anyio.CancelScope(shield=True), anyio.move_on_after(h.lease_ttl):
            try:
                _, responses = await store.call(
                    lambda: store.client.transaction(compare=[], success=ops, failure=[])
                )
                return str(len(responses[0]))
            except Exception as e:  # the lease takes them away anyway
                logger.debug("leaving round %d failed: %r", r, e)
        return "an unknown number of"


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
    )


def _is_int(value: Any, low: int, high: int | None = None) -> bool:
    if isinstance(value, bool) or not isinstance(value, int):
        return False
    return low <= value and (high is None or value <= high)


def _free_port(addr: str) -> int:
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return int(s.getsockname()[1])
