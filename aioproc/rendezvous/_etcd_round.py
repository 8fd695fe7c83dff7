"""Joining a round of the etcd rendezvous: the join, the round's leader, completing it.

One ``Joining`` per ``EtcdRendezvousHandler.next_rendezvous()`` call: it
writes this node's join (claiming the round's lead and signalling the
running world in the same transaction), and waits for the round's world;
while this node leads the round, it follows the round's joins and completes
the round: it assigns every node its seat (torch's ranks), writes each
into that node's seat key in batches of ``SEATS_PER_TXN``, then the
round's few-field world and ``current`` in one transaction.  The key layout
and the protocol are described in ``etcd.py``.
It reads and writes the job's keys through the handler's ``EtcdKeyspace``
(``_etcd_keyspace``), and is told the round's limits: it knows nothing of
the handler.

Every wait reads the copy's ``version`` before it looks at the copy, and
sleeps only if the version did not move meanwhile: an event that arrived
while a write was in flight (the leader's own world, after its completing
transaction) is never slept through, however few other events follow.
"""

from __future__ import annotations

import json
import logging
import secrets
import socket
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import anyio

from ._etcd_schema import Seat, World, assign
from .api import DEFAULT_ROLE, RendezvousNode

if TYPE_CHECKING:
    from ._etcd_client import KeyValue
    from ._etcd_keyspace import EtcdKeyspace
    from .api import RendezvousInfo

__all__ = ["SEATS_PER_TXN", "Joining"]

logger = logging.getLogger("aioproc.rendezvous")

SEATS_PER_TXN = 60
"""Seats a leader writes per transaction: each takes 2 of etcd's ``--max-txn-ops`` (128)."""
_BATCHES_IN_FLIGHT = 4  # seat transactions a leader has in flight at once


class Joining:
    """This node's way into the next round (one per ``next_rendezvous()`` call).

    Args:
        keys: the job's keys: the node's session, its copy of them, the writes on them.
        prev: the round this node ran before, if any (its group rank is kept).
        nproc: this node's number of workers (its join says so).
        role: the role of this node's workers (its join says so too): the
            world carries both, so every node assigns role ranks as torch does.
        min_nodes, max_nodes: how many nodes a round's world may have.
        last_call_timeout: how long a leader waits for more joins once
            the round could complete with fewer than ``max_nodes``.

    ``seat`` is this node's seat once it completed the round as its leader.
    """

    def __init__(
        self,
        keys: EtcdKeyspace,
        prev: RendezvousInfo | None,
        *,
        nproc: int,
        role: str = DEFAULT_ROLE,
        min_nodes: int,
        max_nodes: int,
        last_call_timeout: float,
    ) -> None:
        self._keys = keys
        self._prev = prev
        self.seat: Seat | None = None
        self._nproc = nproc
        self._role = role
        self._min_nodes = min_nodes
        self._max_nodes = max_nodes
        self._last_call_timeout = last_call_timeout
        # the round this node claimed the lead of (the copy may not show it yet)
        self._claimed = -1
        # (round, revision) of a lead this node was told of: until the copy
        # caught up with it, its absence there is no reason to claim
        self._lead_seen = (-1, 0)
        # while leading: each join parsed once (by key: its mod revision and
        # whether it is a running member's), the live members of the running
        # world as last counted (and the liveness version then), and the
        # joins found gone while seating
        self._parsed: dict[bytes, tuple[int, bool]] = {}
        self._members: tuple[int, int] | None = None
        self._gone: set[bytes] = set()
        self._departures = False  # whether this leader watches departures
        self._since = 0  # the revision of the leader's list of the joins

    async def join(self, r: int, current_rev: int) -> bool:
        """Write this node's join key of round ``r`` (False: ``current`` moved).

        In the same transaction: claim ``lead/<r>`` unless the copy shows a
        leader, and write ``change/<r>`` if this join makes the running
        world re-form.
        """
        keys = self._keys
        port = _free_port(keys.addr)
        prev_rank = None
        prev = self._prev
        if prev is not None and prev.round == r - 1:
            prev_rank = prev.group_rank
        value = json.dumps(
            {
                "addr": keys.addr,
                "port": port,
                "nproc": self._nproc,
                "role": self._role,
                "prev_rank": prev_rank,
            }
        ).encode()
        claim = keys.get(f"lead/{r}") is None
        why = self._change_made(r)
        ok, claimed = await keys.join(r, value, current_rev, claim=claim, why=why)
        if ok and claim:
            self._claimed_or_seen(r, claimed)
        return ok

    def _change_made(self, r: int) -> dict[str, Any] | None:
        """Why a join of round ``r`` makes the running world re-form, if it does."""
        keys = self._keys
        if keys.get(f"change/{r}") is not None:
            return None  # the running world's members know already
        world = keys.world(r - 1)
        if world is None:
            return None  # no world runs
        prev = self._prev
        if prev is not None and prev.round == r - 1:
            # a member: a host was lost, or its workers failed: all re-join
            return {"host": keys.addr, "member": True}
        if world.size < self._max_nodes:
            return {"host": keys.addr, "member": False}  # room for it: grow the world
        return None  # a full world: wait for a place

    def _claimed_or_seen(self, r: int, result: Any) -> None:
        """Note what a claim of ``lead/<r>`` found (``result``: its TxnResponse)."""
        node_id = self._keys.node_id.encode()
        if result.succeeded:
            self._claimed = r
            return
        for response in result.responses:
            for kv in response.response_range.kvs:
                if kv.value == node_id:
                    self._claimed = r  # a retried call: the first try had claimed it
                else:
                    self._lead_seen = (r, int(kv.mod_revision))

    async def _leads(self, r: int, current_rev: int) -> bool:
        """Whether this node leads round ``r``; claims it if it has no leader."""
        keys = self._keys
        lead = keys.get(f"lead/{r}")
        if lead is not None:
            return lead.value == keys.node_id.encode()
        if self._claimed == r:
            return True  # the copy does not show the claim yet
        seen_round, seen_rev = self._lead_seen
        if seen_round == r and keys.store().control.revision < seen_rev:
            return False  # the copy does not show that leader yet
        # no leader: none yet, or it died (its lease took the key along)
        ok, claimed = await keys.claim(r, current_rev)
        if ok:
            self._claimed_or_seen(r, claimed)
        return self._claimed == r

    async def wait(self, r: int, current_rev: int, deadline: float) -> World | None:
        """Round ``r``'s world once it completed (None: superseded before this node saw it).

        Cancellation: the joins followed while leading are unfollowed.
        """
        keys = self._keys
        store = keys.store()
        joins_dir, joins_end = keys.key_range(f"rounds/{r}/join/")
        ready_since: float | None = None
        frozen = False
        self._departures = False
        try:
            while True:
                seen = store.version
                keys.raise_if_over(waiting=True)
                current = keys.current()[0]
                if current >= r:
                    return keys.world(r)  # completed (and superseded, when None)
                wake_at = deadline
                leading = not frozen and await self._leads(r, current_rev)
                if not leading:
                    ready_since = None
                else:
                    self._since = await store.follow(joins_dir, joins_end)
                    joins = store.children(joins_dir)
                    if len(joins) >= self._max_nodes:
                        frozen = await self._freeze(r, current_rev, joins)
                    elif len(joins) >= self._min_nodes and not await self._members_pending(
                        r, joins
                    ):
                        now = time.monotonic()
                        ready_since = now if ready_since is None else ready_since
                        if now >= ready_since + self._last_call_timeout:
                            frozen = await self._freeze(r, current_rev, joins)
                        wake_at = min(deadline, ready_since + self._last_call_timeout)
                    else:
                        ready_since = None
                    if frozen:
                        # its world arrives in the copy: stop following the joins now
                        await store.unfollow(joins_dir, joins_end)
                with anyio.move_on_at(wake_at):
                    await store.changed(seen)
        finally:
            await store.unfollow(joins_dir, joins_end)
            if self._departures:
                await store.unwatch_departures()

    async def _members_pending(self, r: int, joins: Mapping[bytes, KeyValue]) -> bool:
        """Whether live members of the running world (round r - 1) have not joined round r.

        A member's join names its previous group rank.  The live members
        are counted by one read of every agent's liveness key and seat,
        again whenever an agent leaves meanwhile (the leader watches the
        departures while it waits for members).
        """
        keys = self._keys
        world = keys.world(r - 1)
        if world is None:
            return False
        store = keys.store()
        joined = 0
        for name, kv in joins.items():
            parsed = self._parsed.get(name)
            if parsed is None or parsed[0] != kv.mod_revision:
                member = json.loads(kv.value).get("prev_rank") is not None
                parsed = self._parsed[name] = (kv.mod_revision, member)
            joined += parsed[1]
        if self._members is not None and joined >= self._members[0]:
            return False
        if not self._departures:
            # from before the count: a member that leaves after it is heard of
            store.watch_departures(store.control.revision + 1)
            self._departures = True
        if self._members is None or self._members[1] != store.liveness_version:
            version = store.liveness_version
            live, _ = await keys.live_members(world)
            self._members = (live, version)
        return joined < self._members[0]

    async def _freeze(self, r: int, current_rev: int, joins: Mapping[bytes, KeyValue]) -> bool:
        """Complete round ``r`` with ``joins`` (True), unless another write came first.

        Seats every chosen node (its seat key, in batches), then writes the
        world and ``current``.  A chosen node whose
        lease expired meanwhile gets no seat: the round is frozen again
        without it (False, after noting it).
        """
        keys = self._keys
        store = keys.store()

        def order(item: tuple[bytes, KeyValue]) -> tuple[int, int]:
            value = json.loads(item[1].value)
            if value.get("prev_rank") is not None:
                return (0, int(value["prev_rank"]))  # stable group ranks
            return (1, item[1].create_revision)

        live = [item for item in joins.items() if item[0] not in self._gone]
        chosen = sorted(live, key=order)[: self._max_nodes]
        if len(chosen) < min(len(joins), self._max_nodes):
            return False  # a join found gone while seating: the copy shows the rest soon
        nodes = []
        for name, kv in chosen:
            value = json.loads(kv.value)
            nodes.append(
                RendezvousNode(
                    name.decode(),
                    value["addr"],
                    value["port"],
                    value["nproc"],
                    value.get("role", DEFAULT_ROLE),
                )
            )
        seats = assign(r, secrets.token_hex(4), nodes)
        joins_dir = keys.key(f"rounds/{r}/join/")
        entries = [
            (joins_dir + name, kv.create_revision, seat)
            for (name, kv), seat in zip(chosen, seats, strict=True)
        ]
        seen = store.version
        gone: list[str] = []
        moved = False
        limiter = anyio.CapacityLimiter(_BATCHES_IN_FLIGHT)

        async def seat_batch(batch: list[tuple[bytes, int, Seat]]) -> None:
            nonlocal moved
            async with limiter:
                if moved:
                    return
                found = await keys.seat_all(r, batch, current_rev)
                if found is None:
                    moved = True
                else:
                    gone.extend(found)

        async with anyio.create_task_group() as tg:
            for i in range(0, len(entries), SEATS_PER_TXN):
                tg.start_soon(seat_batch, entries[i : i + SEATS_PER_TXN])
        if moved:
            await store.changed(seen)  # another agent completed the round: see it
            return False
        if gone:
            logger.info("rendezvous round %d: %d joined node(s) gone while seated", r, len(gone))
            self._gone.update(g.encode() for g in gone)
            return False
        # group rank 0 keeps watch over the world's liveness, on its lease
        lookout, (name, kv) = seats[0], chosen[0]
        a = lookout.assignment
        world = World(r, lookout.token, len(seats), a.master_addr, a.master_port,
                      (lookout.node_id, lookout.addr), self._since)  # fmt: skip
        ok = await keys.complete(
            r, world, current_rev, (joins_dir + name, kv.create_revision, kv.lease)
        )
        if ok:
            logger.info("rendezvous round %d completed with %d node(s)", r, len(nodes))
            self.seat = next((x for x in seats if x.node_id == keys.node_id), None)
        else:
            await store.changed(seen)  # another agent's write came first: see it
        return ok

    async def leave(self, r: int, joined: int) -> str:
        """After a join timeout: drop this node's join and lead; how many nodes had joined.

        Cancellation: shielded and bounded; the lease takes the keys away anyway.
        """
        self._claimed = -1
        return await self._keys.leave(r, joined)


def _free_port(addr: str) -> int:
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return int(s.getsockname()[1])
