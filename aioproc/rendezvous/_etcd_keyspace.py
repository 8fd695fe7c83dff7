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

from ._etcd_client import KeyValue, prefix_end, ranges
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

# How long a node waits for its seat's event once it saw the round complete,
# before it reads the seat: the event is on its way on the same watch stream.
_SEAT_WAIT = 0.2


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
        # the last seats of the agents whose liveness keys went (None: had none)
        self._gone_seats: dict[bytes, Seat | None] = {}

    def new_session(self, host: str, port: int, ttl: int) -> EtcdSession:
        """A session (not open yet) with etcd at ``host:port`` following the job's keys.

        Its lease lives ``ttl`` seconds; opening it writes this node's
        liveness key (``nodes/<id>``: its address and pid), and it watches
        this node's seat (``seats/<id>``); every key enters its copy
        through ``check``.  This node's part in the job starts afresh with it: it
        has joined no round, and seen no corrupt key.
        """
        prefix = self.prefix.encode()
        self.joined, self._corrupt = False, None
        self._gone_seats = {}
        return EtcdSession(
            host,
            port,
            prefix,
            prefix + b"nodes/",
            (
                self.key(f"nodes/{self.node_id}"),
                json.dumps({"addr": self.addr, "pid": os.getpid()}).encode(),
            ),
            self.key(f"seats/{self.node_id}"),
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

        Read from the copy of this node's seat key, which the round's leader
        wrote before it completed the round: its event comes before the
        world's on the session's one watch stream, so it is applied at once
        or in a moment (each watch applies its events in a task of its own).
        One read of the key when the copy does not show that seat by then
        (a watch catching up, a node that was not seated): what etcd holds
        then is the answer.
        """
        store = self.store()
        with anyio.move_on_after(_SEAT_WAIT):
            while True:
                seen = store.version
                seat = self._seat_in(store.keys.get(store.own), world)
                if seat is not None:
                    return seat
                await store.changed(seen)
        return self._seat_in(await store.own_now(), world)

    def _seat_in(self, kv: KeyValue | None, world: World) -> Seat | None:
        seat = Seat.parse(self.node_id, kv.value) if kv is not None else None
        if seat is not None and (seat.round, seat.token) == (world.round, world.token):
            return seat
        return None

    async def lost_members(self, world: World) -> list[Seat]:
        """The members of ``world`` whose liveness keys went while departures were watched.

        The agents that left since the last call are looked up in one read
        (``departures``, which also raises if the job ended meanwhile); the
        others are known already.
        """
        store = self.store()
        new = [name for name in store.gone if name not in self._gone_seats]
        if new:
            found = await self.departures([name.decode(errors="replace") for name in new])
            for name in new:
                self._gone_seats[name] = found[name.decode(errors="replace")]
        return [
            seat
            for seat in self._gone_seats.values()
            if seat is not None and (seat.round, seat.token) == (world.round, world.token)
        ]

    async def live_members(self, world: World) -> tuple[int, list[Seat]]:
        """How many members of ``world`` are alive now, and the lost ones' seats.

        One read of every agent's liveness key and seat: for a leader
        waiting for the running world's members, or a lookout whose watch
        may have missed departures.
        """
        store = self.store()
        (nodes, seats), _ = await store.call(
            lambda: ranges(
                store.client,
                [(*self.key_range("nodes/"), True), (*self.key_range("seats/"), False)],
                store.call_timeout,
            )
        )
        cut = len(self.key("nodes/"))
        alive = {kv.key[cut:] for kv in nodes}
        cut = len(self.key("seats/"))
        live, lost = 0, []
        for kv in seats:
            name = kv.key[cut:]
            store.received += len(kv.key) + len(kv.value)
            seat = Seat.parse(name.decode(errors="replace"), kv.value)
            if seat is None or (seat.round, seat.token) != (world.round, world.token):
                continue
            if name in alive:
                live += 1
            else:
                lost.append(seat)
        return live, lost

    async def departures(self, names: list[str]) -> dict[str, Seat | None]:
        """The last seats of the agents ``names`` (gone), and the job's end if it ended.

        One transaction reads ``failed`` and ``closed`` (a stop or a failure
        elsewhere ends agents too: if one came first, it is the news, and
        ``raise_if_over_now``'s error is raised) and each agent's seat key,
        which outlives its lease.

        Raises:
            RendezvousJobFailedError, RendezvousClosedError,
            RendezvousStateError: as ``raise_if_over_now``.
        """
        store = self.store()
        tx = store.client.transactions
        ops = [tx.get(self.key("failed")), tx.get(self.key("closed"))]
        ops += [tx.get(self.key(f"seats/{name}")) for name in names]
        _, responses = await store.call(
            lambda: store.client.transaction(compare=[], success=ops, failure=[])
        )
        failed, closed = (r[0][0] if r else None for r in responses[:2])
        self._check_ended(failed, closed)
        seats: dict[str, Seat | None] = {}
        for name, found in zip(names, responses[2:], strict=True):
            seats[name] = Seat.parse(name, found[0][0]) if found else None
            if found:
                store.received += len(found[0][0])
        return seats

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
        self._check_ended(failed, closed)

    def _check_ended(self, failed: bytes | None, closed: bytes | None) -> None:
        """``raise_if_over`` on the values of ``failed`` and ``closed`` just read."""
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
        dirs = [
            self.key(d)
            for d in ("change/", "completed/", "lead/", "lookout/", "lost/", "rounds/", "seats/")
        ]
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
        self, r: int, entries: list[tuple[bytes, int, Seat]], current_rev: int
    ) -> list[str] | None:
        """Write the seats of one batch of round ``r``'s nodes, unless ``current`` moved.

        ``entries``: for each node, its join key (``rounds/<r>/join/<id>``,
        the whole key), the join's create revision, and its seat.  Each
        node's seat goes into its seat key, but only while its join key is
        the one the leader saw: a node whose lease expired meanwhile (its
        join went with it) gets none.

        Returns:
            None when ``current`` moved (another leader completed the round);
            else the ids of the nodes that were gone (empty: all seated).
        """
        store = self.store()
        tx = store.client.transactions
        ops = []
        for join, create_revision, seat in entries:
            ops.append(
                tx.txn(
                    compare=[tx.create(join) == create_revision],
                    success=[tx.put(self.key(f"seats/{seat.node_id}"), seat.value())],
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
            for (_, _, seat), response in zip(entries, responses, strict=True)
            if not response.response_txn.succeeded
        ]

    async def complete(
        self, r: int, world: World, current_rev: int, lookout: tuple[bytes, int, int]
    ) -> bool:
        """Write round ``r``'s ``world`` and make it current (True), unless a write came first.

        ``lookout``: the lookout's join key, its create revision and its
        lease: ``lookout/<r>`` goes on that lease, so that the world hears
        of the lookout's own loss; the lookout's join must still be there.
        In the same transaction: drop the round's lead and change keys, and
        round r - 1's keys.  Another agent's write came first if round ``r``
        has a world already or ``current`` moved from ``current_rev``.
        """
        store = self.store()
        tx = store.client.transactions
        world_key = self.key(f"completed/{r}")
        join, create_revision, lease = lookout
        success = [
            tx.put(world_key, world.value()),
            # before ``current``: an agent that sees the world current sees its lookout
            tx.put(self.key(f"lookout/{r}"), world.lookout[0].encode(), lease=lease),
            tx.put(self.key("current"), str(r).encode()),
            tx.delete(self.key(f"lead/{r}")),
            tx.delete(self.key(f"change/{r}")),
        ]
        if r > 0:
            for old in (self.key(f"rounds/{r - 1}/"), self.key(f"lost/{r - 1}/")):
                success.append(tx.delete(old, range_end=prefix_end(old)))
            success.append(tx.delete(self.key(f"completed/{r - 1}")))
            success.append(tx.delete(self.key(f"lookout/{r - 1}")))
        ok, _ = await store.call(
            lambda: store.client.transaction(
                compare=[
                    tx.create(world_key) == 0,
                    tx.mod(self.key("current")) == current_rev,
                    tx.create(join) == create_revision,
                ],
                success=success,
                failure=[],
            )
        )
        return bool(ok)

    async def report_lost(self, world: World, seats: list[Seat]) -> None:
        """Tell the members of ``world`` that the agents of ``seats`` were lost (its lookout).

        Writes ``lost/<r>/<id>`` (the address) for each, unless the world
        was re-formed meanwhile.
        """
        store = self.store()
        tx = store.client.transactions
        r = world.round
        ops = [tx.put(self.key(f"lost/{r}/{seat.node_id}"), seat.addr.encode()) for seat in seats]
        await store.call(
            lambda: store.client.transaction(
                compare=[tx.value(self.key("current")) == str(r).encode()],
                success=ops,
                failure=[],
            )
        )

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
