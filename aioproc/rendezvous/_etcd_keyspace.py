"""One job's keys in etcd, as one node reads and writes them.

``EtcdKeyspace`` owns what names and changes the job's keys: the prefix
``/aioproc/rdzv/<run_id>/`` and the names under it (the layout and the
protocol are described in ``etcd.py``), this node's session (the lease and
the copy of the keys, ``_etcd_store``), the check every key passes before
it enters the copy (``malformed``), what the control keys say about the
job (``raise_if_over``), and the transactions on the keys.  The handler
(``etcd.py``) and a round's join (``_etcd_round.py``) share one keyspace:
they name keys by their names under the prefix (``"lead/3"``) and read and
write them through it, so neither reaches into the other.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from typing import Any

import anyio

from ._etcd_client import KeyValue, prefix_end
from ._etcd_schema import Seat, World, malformed
from ._etcd_store import EtcdSession
from .api import (
    RendezvousClosedError,
    RendezvousGracefulExitError,
    RendezvousJobFailedError,
    RendezvousLeaseLostError,
    RendezvousStateError,
)

__all__ = ["KEY_ROOT", "EtcdKeyspace"]

logger = logging.getLogger("aioproc.rendezvous")

KEY_ROOT = "/aioproc/rdzv/"


class EtcdKeyspace:
    """One job's keys in etcd, for one node: their names, its copy of them, their writes.

    Args:
        run_id: the job: its keys are under ``/aioproc/rdzv/<run_id>/``.
        node_id: this node's id, which names its keys (and fills its lead key).
        addr: this node's address, which the values it writes name.
        owner: what uses the keys (the handler): errors name it by its repr.

    ``session`` is this node's session while one is open (``new_session``
    makes it; the handler opens it and sets it here), else None.
    """

    def __init__(self, run_id: str, node_id: str, addr: str, owner: object) -> None:
        self.run_id = run_id
        self.prefix = f"{KEY_ROOT}{run_id}/"
        self.node_id = node_id
        self.addr = addr
        self._owner = owner
        self.session: EtcdSession | None = None
        self.joined = False  # whether this node joined a round in this session
        self._worlds: dict[bytes, tuple[int, World]] = {}  # parsed, by key and revision
        self._corrupt: str | None = None  # the first corrupt control key seen, described
        self._warned: set[tuple[bytes, int]] = set()  # ignored keys (and revisions) told of

    def new_session(self, host: str, port: int, ttl: int) -> EtcdSession:
        """A session (not open yet) with etcd at ``host:port`` following the job's keys.

        Its lease lives ``ttl`` seconds; opening it writes this node's
        liveness key (``nodes/<id>``: its address and pid); every key
        enters its copy through ``check``.  This node's part in the job starts afresh with it: it
        has joined no round, and seen no corrupt key.
        """
        prefix = self.prefix.encode()
        self.joined, self._corrupt = False, None
        return EtcdSession(
            host,
            port,
            prefix,
            prefix + b"nodes/",
            self.key(f"nodes/{self.node_id}"),
            json.dumps({"addr": self.addr, "pid": os.getpid()}).encode(),
            ttl,
            self.addr,
            check=self.check,
        )

    # ------------------------------------------------------------ the copy

    def store(self) -> EtcdSession:
        if self.session is None:
            raise RuntimeError(f"{self._owner!r}: use it inside 'async with handler.session(n)'")
        return self.session

    def key(self, name: str) -> bytes:
        return (self.prefix + name).encode()

    def key_range(self, directory: str) -> tuple[bytes, bytes]:
        """The key range ``[start, end)`` of ``directory`` (a name ending in "/")."""
        start = self.key(directory)
        return start, prefix_end(start)

    def get(self, name: str) -> KeyValue | None:
        return self.store().keys.get(self.key(name))

    def current(self) -> tuple[int, int]:
        kv = self.get("current")
        return (int(kv.value), kv.mod_revision) if kv is not None else (-1, 0)

    def world(self, r: int) -> World | None:
        """Round ``r``'s world (its few fields) from the copy, parsed once per version."""
        key = self.key(f"completed/{r}")
        kv = self.store().keys.get(key)
        if kv is None:
            return None
        cached = self._worlds.get(key)
        if cached is None or cached[0] != kv.mod_revision:
            world = World.parse(r, kv.value)
            self._worlds = {key: (kv.mod_revision, world)}  # one at a time is all it takes
            cached = self._worlds[key]
        return cached[1]

    async def count(self, directory: str) -> int:
        """How many keys are in ``directory`` now (one read that returns none of them)."""
        return await self.store().count(*self.key_range(directory))

    async def seat(self, world: World) -> Seat | None:
        """This node's seat in ``world``, or None if the world has no place for it.

        Read from the copy of this node's key, which the round's leader
        wrote before it completed the round; one read of it when the copy
        does not show that seat (yet): what etcd holds then is the answer.
        """
        store = self.store()
        for fresh in (False, True):
            kv = await store.own_now() if fresh else store.keys.get(store.own)
            seat = Seat.parse(self.node_id, kv.value) if kv is not None else None
            if seat is not None and (seat.round, seat.token) == (world.round, world.token):
                return seat
        return None

    # ---------------------------------------------------------- the job's end

    def check(self, key: bytes, kv: KeyValue) -> bool:
        """Whether the protocol may use ``key`` (under the prefix) holding ``kv``.

        A key it can ignore is named in one warning (per key and revision);
        a corrupt control key is kept for ``raise_if_over`` to fail the job.
        """
        problem = malformed(key[len(self.prefix) :], kv.value)
        if problem is None:
            return True
        control, why = problem
        shown = kv.value if len(kv.value) <= 60 else kv.value[:57] + b"..."
        text = f"key {key.decode(errors='backslashreplace')} = {shown!r}: {why}"
        if control:
            if self._corrupt is None:
                self._corrupt = text
        elif (key, kv.mod_revision) not in self._warned:
            self._warned.add((key, kv.mod_revision))
            logger.warning("rendezvous of job %r: ignoring %s", self.run_id, text)
        return False

    def raise_if_over(self, waiting: bool = False) -> None:
        """Raise the error that ends this node's part in the job, if one does.

        ``waiting``: called while this node waits for a round (see
        ``_raise_if_ended``).
        """
        store = self.store()
        if store.lost is not None:
            raise RendezvousLeaseLostError(store.lost)
        self._raise_if_corrupt()
        failed, closed = self.get("failed"), self.get("closed")
        self._raise_if_ended(
            failed.value if failed is not None else None,
            closed.value if closed is not None else None,
            waiting,
        )

    async def raise_if_over_now(self) -> None:
        """``raise_if_over`` on what etcd holds now rather than on the copy (one read)."""
        store = self.store()
        tx = store.client.transactions
        _, responses = await store.call(
            lambda: store.client.transaction(
                compare=[],
                success=[tx.get(self.key("failed")), tx.get(self.key("closed"))],
                failure=[],
            )
        )
        failed, closed = (r[0][0] if r else None for r in responses)
        for name, value in (("failed", failed), ("closed", closed)):
            if value is not None:
                self.check(self.key(name), KeyValue(value, 0, 0, 0))
        self._raise_if_corrupt()
        self._raise_if_ended(failed, closed)

    def _raise_if_corrupt(self) -> None:
        if self._corrupt is not None:
            raise RendezvousStateError(
                f"the rendezvous of job {self.run_id!r} is corrupt: {self._corrupt}; "
                f"something other than its agents writes under {self.prefix}"
            )

    def _raise_if_ended(
        self, failed: bytes | None, closed: bytes | None, waiting: bool = False
    ) -> None:
        """Raise what ``failed`` and ``closed`` (checked values) say, if either is set.

        A job that finished ends a node waiting for a round gracefully if
        the node had joined one in this session (it stood by, or re-joined
        after running); one that arrives to find it finished ran nothing,
        which is no success (a reused run id).
        """
        if failed is not None:
            failure = json.loads(failed)
            raise RendezvousJobFailedError(
                f"the job failed on host {failure.get('host')}: rank {failure.get('rank')} "
                f"(local_rank {failure.get('local_rank')}) {failure.get('how', 'failed')}",
                failure,
            )
        if closed is not None:
            value = json.loads(closed)
            finished = value.get("reason") == "succeeded"
            job = self.run_id
            if finished and waiting and self.joined:
                raise RendezvousGracefulExitError(
                    f"the job {job!r} finished while this node waited for a round: "
                    "nothing is left to do"
                )
            if not finished:
                how = f"was stopped on host {value.get('host')}"
            elif waiting:
                how = "already finished, before this node joined (a new job needs a new run id)"
            else:
                how = "already finished"
            raise RendezvousClosedError(
                f"the rendezvous of job {job!r} is closed: the job {how}", finished
            )

    # -------------------------------------------------------------- writes

    async def put(self, name: str, value: bytes, *, leased: bool) -> None:
        store = self.store()
        lease = store.lease_id if leased else None
        await store.call(lambda: store.client.put(self.key(name), value, lease=lease))

    async def fail(self, failure: Mapping[str, Any]) -> None:
        """Write ``failed`` (``failure``: the root cause) unless the job failed already."""
        store = self.store()
        value = json.dumps({**failure, "host": self.addr, "node": self.node_id}).encode()
        key = (self.prefix + "failed").encode()
        tx = store.client.transactions
        await store.call(
            lambda: store.client.transaction(
                compare=[tx.create(key) == 0], success=[tx.put(key, value)], failure=[]
            )
        )

    async def close(self, reason: str) -> None:
        """Write ``closed`` (``reason``: succeeded or stopped) and drop the rounds' keys.

        Unless the job is closed already.
        """
        store = self.store()
        tx = store.client.transactions
        closed = self.key("closed")
        value = json.dumps({"reason": reason, "host": self.addr, "node": self.node_id}).encode()
        # everything but the liveness keys (they go with their leases) and ``failed``
        dirs = [self.key(d) for d in ("change/", "completed/", "lead/", "rounds/")]
        await store.call(
            lambda: store.client.transaction(
                compare=[tx.create(closed) == 0],
                success=[
                    tx.put(closed, value),
                    tx.delete(self.key("current")),
                    *(tx.delete(d, range_end=prefix_end(d)) for d in dirs),
                ],
                failure=[],
            )
        )

    # ---------------------------------------------------------- a round's writes

    async def join(
        self, r: int, value: bytes, current_rev: int, *, claim: bool, why: dict[str, Any] | None
    ) -> tuple[bool, Any]:
        """Write this node's join key of round ``r`` (``value``) unless ``current`` moved.

        ``current`` must still be at ``current_rev``.  In the same
        transaction: claim ``lead/<r>`` if ``claim``, and write
        ``change/<r>`` (``why``: the reason to re-form the running world)
        if given and the key is not there yet.

        Returns:
            Whether the join was written (False: ``current`` moved), and
            what the claim found (its TxnResponse: see ``claim``) when the
            join was written with one, else None.
        """
        store = self.store()
        tx = store.client.transactions
        success = [tx.put(self.key(f"rounds/{r}/join/{self.node_id}"), value, lease=store.lease_id)]
        if claim:
            success.append(self._claim_op(r))
        if why is not None:
            change = self.key(f"change/{r}")
            success.append(
                tx.txn(
                    compare=[tx.create(change) == 0],
                    success=[tx.put(change, json.dumps(why).encode())],
                    failure=[],
                )
            )
        current = self.key("current")
        ok, responses = await store.call(
            lambda: store.client.transaction(
                compare=[tx.mod(current) == current_rev], success=success, failure=[]
            )
        )
        return bool(ok), responses[1].response_txn if ok and claim else None

    def _claim_op(self, r: int) -> Any:
        """A nested transaction: take ``lead/<r>`` if free, else read who holds it."""
        store = self.store()
        tx = store.client.transactions
        lead = self.key(f"lead/{r}")
        return tx.txn(
            compare=[tx.create(lead) == 0],
            success=[tx.put(lead, self.node_id.encode(), lease=store.lease_id)],
            failure=[tx.get(lead)],
        )

    async def claim(self, r: int, current_rev: int) -> tuple[bool, Any]:
        """Take ``lead/<r>`` if it is free, unless ``current`` moved from ``current_rev``.

        Returns:
            Whether ``current`` had not moved, and then what the claim found
            (its TxnResponse: succeeded, or the holder's key), else None.
        """
        store = self.store()
        tx = store.client.transactions
        current = self.key("current")
        ok, responses = await store.call(
            lambda: store.client.transaction(
                compare=[tx.mod(current) == current_rev], success=[self._claim_op(r)], failure=[]
            )
        )
        return bool(ok), responses[0].response_txn if ok else None

    async def seat_all(
        self, r: int, entries: list[tuple[bytes, int, int, Seat, bytes]], current_rev: int
    ) -> list[str] | None:
        """Write the seats of one batch of round ``r``'s nodes, unless ``current`` moved.

        ``entries``: for each node, its join key (``rounds/<r>/join/<id>``,
        the whole key), the join's create revision and lease,
        its seat, and its record for ``rounds/<r>/assign/<token>/<id>``.
        Each node's seat goes into its liveness key and its record into the
        assign directory, both on the node's own lease, but only while its
        join key is the one the leader saw: a node whose lease expired
        meanwhile gets nothing (its lease would not take a key).

        Returns:
            None when ``current`` moved (another leader completed the round);
            else the ids of the nodes that were gone (empty: all seated).
        """
        store = self.store()
        tx = store.client.transactions
        ops = []
        for join, create_revision, lease, seat, record in entries:
            assigned = self.key(f"rounds/{r}/assign/{seat.token}/{seat.node_id}")
            ops.append(
                tx.txn(
                    compare=[tx.create(join) == create_revision],
                    success=[
                        tx.put(self.key(f"nodes/{seat.node_id}"), seat.value(), lease=lease),
                        tx.put(assigned, record, lease=lease),
                    ],
                    failure=[],
                )
            )
        current = self.key("current")
        ok, responses = await store.call(
            lambda: store.client.transaction(
                compare=[tx.mod(current) == current_rev], success=ops, failure=[]
            )
        )
        if not ok:
            return None
        return [
            seat.node_id
            for (_, _, _, seat, _), response in zip(entries, responses, strict=True)
            if not response.response_txn.succeeded
        ]

    async def complete(self, r: int, world: bytes, current_rev: int) -> bool:
        """Write round ``r``'s ``world`` and make it current (True), unless a write came first.

        In the same transaction: drop the round's lead and change keys, and
        round r - 1's keys.  Another agent's write came first if round ``r``
        has a world already or ``current`` moved from ``current_rev``.
        """
        store = self.store()
        tx = store.client.transactions
        world_key = self.key(f"completed/{r}")
        success = [
            tx.put(world_key, world),
            tx.put(self.key("current"), str(r).encode()),
            tx.delete(self.key(f"lead/{r}")),
            tx.delete(self.key(f"change/{r}")),
        ]
        if r > 0:
            old = self.key(f"rounds/{r - 1}/")
            success.append(tx.delete(old, range_end=prefix_end(old)))
            success.append(tx.delete(self.key(f"completed/{r - 1}")))
        ok, _ = await store.call(
            lambda: store.client.transaction(
                compare=[tx.create(world_key) == 0, tx.mod(self.key("current")) == current_rev],
                success=success,
                failure=[],
            )
        )
        return bool(ok)

    async def leave(self, r: int, joined: int) -> str:
        """Drop this node's join and lead of round ``joined``; how many nodes joined round ``r``.

        ``joined`` is -1 when this node has no join key (nothing to drop).

        Cancellation: shielded and bounded by the lease's TTL; the lease
        takes the keys away anyway.
        """
        store = self.store()
        tx = store.client.transactions
        joins = self.key(f"rounds/{r}/join/")
        ops = [tx.get(joins, prefix_end(joins))]
        if joined >= 0:
            lead = self.key(f"lead/{joined}")
            ops.append(tx.delete(self.key(f"rounds/{joined}/join/{self.node_id}")))
            ops.append(
                tx.txn(
                    compare=[tx.value(lead) == self.node_id.encode()],
                    success=[tx.delete(lead)],
                    failure=[],
                )
            )
        with anyio.CancelScope(shield=True), anyio.move_on_after(store.ttl):
            try:
                _, responses = await store.call(
                    lambda: store.client.transaction(compare=[], success=ops, failure=[])
                )
                return str(len(responses[0]))
            except Exception as e:  # the lease takes them away anyway
                logger.debug("leaving round %d failed: %r", r, e)
        return "an unknown number of"
