"""Joining a round of the etcd rendezvous: the join, the round's leader, completing it.

One ``Joining`` per ``EtcdRendezvousHandler.next_rendezvous()`` call: it
writes this node's join (claiming the round's lead and signalling the
running world in the same transaction), and waits for the round's world;
while this node leads the round, it follows the round's joins and completes
the round.  The key layout and the protocol are described in ``etcd.py``.
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
import socket
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import anyio

from .api import DEFAULT_ROLE

if TYPE_CHECKING:
    from ._etcd_client import KeyValue
    from ._etcd_keyspace import EtcdKeyspace
    from ._etcd_schema import World
    from .api import RendezvousInfo

__all__ = ["Joining"]

logger = logging.getLogger("aioproc.rendezvous")


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
        if keys.node_id in world.revs:
            return {"host": keys.addr, "member": True}  # its workers failed: all re-join
        if len(world.nodes) < self._max_nodes:
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
                    await store.follow(joins_dir, joins_end)
                    joins = store.children(joins_dir)
                    if len(joins) >= self._max_nodes:
                        frozen = await self._freeze(r, current_rev, joins)
                    elif len(joins) >= self._min_nodes and not self._members_pending(r, joins):
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

    def _members_pending(self, r: int, joins: Mapping[bytes, KeyValue]) -> list[str]:
        """Live members of the running world (round r - 1) that have not joined round r."""
        keys = self._keys
        world = keys.world(r - 1)
        if world is None:
            return []
        store = keys.store()
        return [
            n.node_id
            for n in world.nodes
            if n.node_id.encode() not in joins
            and not store.gone_since(n.node_id.encode(), world.revs[n.node_id])
        ]

    async def _freeze(self, r: int, current_rev: int, joins: Mapping[bytes, KeyValue]) -> bool:
        """Complete round ``r`` with ``joins`` (True), unless another write came first."""
        store = self._keys.store()

        def order(item: tuple[bytes, KeyValue]) -> tuple[int, int]:
            value = json.loads(item[1].value)
            if value.get("prev_rank") is not None:
                return (0, int(value["prev_rank"]))  # stable group ranks
            return (1, item[1].create_revision)

        chosen = sorted(joins.items(), key=order)[: self._max_nodes]
        nodes = []
        for name, kv in chosen:
            value = json.loads(kv.value)
            nodes.append(
                {
                    "id": name.decode(),
                    "addr": value["addr"],
                    "port": value["port"],
                    "nproc": value["nproc"],
                    "role": value.get("role", DEFAULT_ROLE),
                    "rev": kv.create_revision,
                }
            )
        world = json.dumps({"round": r, "nodes": nodes}).encode()
        seen = store.version
        ok = await self._keys.complete(r, world, current_rev)
        if ok:
            logger.info("rendezvous round %d completed with %d node(s)", r, len(nodes))
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
