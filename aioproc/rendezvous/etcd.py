"""Dynamic rendezvous through etcd v3: agents on many hosts agree on a world.

The semantics are those of torch's ``DynamicRendezvousHandler``; the
protocol is aioproc's own.  Keys under ``/aioproc/rdzv/<run_id>/``:

``nodes/<id>``            (leased) one per live agent: its lease is its liveness
``current``               the number of the last completed round
``rounds/<r>/join/<id>``  (leased) an agent waiting for round ``r``
``rounds/<r>/world``      the completed round: its nodes in group-rank order
``rounds/<r>/done/<id>``  (leased) an agent whose workers finished (exit barrier)
``failed``                the job failed for good: the root cause
``closed``                the job is over (finished, or stopped by a signal)

A round ``r`` is open while ``current`` is ``r - 1``.  An agent joins by
writing its join key in a transaction that checks ``current`` did not move;
the first of the joiners (lowest creation revision) completes the round when
``max_nodes`` joined, or when ``min_nodes`` joined, every live member of the
running world joined too, and ``last_call_timeout`` passed; it writes the
world and ``current`` and drops the previous round's keys in one
transaction.  So a node arriving while a full world runs waits; a node
arriving while a world below ``max_nodes`` runs makes its members re-join
(a re-rendezvous that costs no restart); a member lost (its lease expired)
makes the others re-join, or fail if fewer than ``min_nodes`` are left.

Each agent decides from its live copy of these keys (list once, then watch)
and writes O(1) keys per round: O(N) requests per round in total.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import time
from collections.abc import Mapping
from typing import Any

import anyio

from ._etcd_store import EtcdSession, KeyValue, import_aetcd, ttl_seconds
from .api import (
    RendezvousClosedError,
    RendezvousInfo,
    RendezvousJobFailedError,
    RendezvousLeaseLostError,
    RendezvousNode,
    RendezvousParameters,
    RendezvousTimeoutError,
    WorldChange,
    parse_endpoint,
)

__all__ = ["EtcdRendezvousHandler"]

logger = logging.getLogger("aioproc.rendezvous")

KEY_ROOT = "/aioproc/rdzv/"


class EtcdRendezvousHandler:
    """torch's ``DynamicRendezvousHandler`` semantics on an etcd v3 server.

    Build it with ``create_handler(RendezvousParameters("etcd", ...))``.
    The agent opens a session for its run (``async with
    handler.session(local_world_size):``), in which the lease is kept alive
    and the job's keys are watched; ``next_rendezvous()`` joins a round,
    ``wait_for_change()`` returns when the running world must be re-formed.
    """

    def __init__(self, params: RendezvousParameters) -> None:
        import_aetcd()  # fail now, with the install hint, not when the agent runs
        self._params = params
        self._host, self._port = parse_endpoint(params.endpoint, 2379)
        self.join_timeout = params.get_seconds("join_timeout", 600.0)
        self.last_call_timeout = params.get_seconds("last_call_timeout", 30.0)
        self.close_timeout = params.get_seconds("close_timeout", 30.0)
        self.lease_ttl = ttl_seconds(params.get_seconds("lease_ttl", 3.0, minimum=1.0))
        unknown = set(params.config) - {
            "join_timeout",
            "last_call_timeout",
            "close_timeout",
            "lease_ttl",
        }
        if unknown:
            raise ValueError(
                f"unknown etcd rendezvous option(s) {', '.join(sorted(unknown))}; known: "
                "join_timeout, last_call_timeout, close_timeout, lease_ttl"
            )
        self.addr = params.local_addr or socket.getfqdn()
        self.node_id = f"{self.addr}_{os.getpid()}_{secrets.token_hex(3)}"
        self._prefix = f"{KEY_ROOT}{params.run_id}/"
        self._session: EtcdSession | None = None
        self._nproc = 1
        self._info: RendezvousInfo | None = None
        self._first_cache: tuple[tuple[bytes, int], str | None] | None = None
        self._lost_cache: tuple[tuple[int, int], list[RendezvousNode]] | None = None

    def __repr__(self) -> str:
        state = f"round {self._info.round}" if self._info is not None else "not joined"
        return (
            f"<EtcdRendezvousHandler {self._params.run_id} at {self._host}:{self._port} "
            f"node {self.addr} {state}>"
        )

    # -------------------------------------------------------- torch's API

    def get_backend(self) -> str:
        return "etcd"

    def get_run_id(self) -> str:
        return self._params.run_id

    @property
    def min_nodes(self) -> int:
        return self._params.min_nodes

    @property
    def max_nodes(self) -> int:
        return self._params.max_nodes

    @property
    def fence_grace(self) -> float:
        """Grace period for workers stopped by fencing: they must be gone within the TTL."""
        return self.lease_ttl / 6

    @property
    def requests(self) -> int:
        """Calls this agent made to etcd so far (the scale benchmark counts them)."""
        return self._session.requests if self._session is not None else 0

    def is_closed(self) -> bool:
        return self._get("closed") is not None

    def num_nodes_waiting(self) -> int:
        """Agents waiting for the next round while this node's world runs."""
        if self._info is None:
            return 0
        return len(self._joins(self._info.round + 1))

    def session(self, local_world_size: int) -> _Session:
        """Connect, take a lease, follow the job's keys, for the agent's run.

        Leaving it revokes the lease: this node's keys vanish at once.
        """
        self._nproc = local_world_size
        return _Session(self)

    async def next_rendezvous(self) -> RendezvousInfo:
        """Join the next round; return once it completed with this node.

        Raises:
            RendezvousTimeoutError: no round completed with this node
                within ``join_timeout``; its join key is removed.
            RendezvousClosedError: the job is over.
            RendezvousJobFailedError: the job failed on some host.
            RendezvousLeaseLostError: this node lost its lease.

        Cancellation: the join key stays until the session ends (it is
        leased), so a cancelled join leaves nothing behind.
        """
        store = self._store()
        prev = self._info
        self._info = None
        deadline = time.monotonic() + self.join_timeout
        joined: tuple[int, bytes] | None = None
        with anyio.move_on_at(deadline):
            while True:
                self._raise_if_over()
                current, current_rev = self._current()
                r = current + 1
                if joined is None or joined[0] != r:
                    joined = await self._join(r, current_rev, prev)
                    if joined is None:
                        await store.changed()  # ``current`` moved meanwhile: look again
                        continue
                info = await self._wait_round(r, deadline)
                if info is not None:
                    self._info = info
                    return info
                # the round completed without this node: wait for the next one
        joins = len(self._joins(self._current()[0] + 1))
        if joined is not None:
            await self._delete(joined[1])
        raise RendezvousTimeoutError(
            f"the rendezvous of job {self._params.run_id!r} did not complete within "
            f"{self.join_timeout:g} s (join_timeout): {joins} node(s) joined, "
            f"min_nodes is {self.min_nodes}"
        )

    async def wait_for_change(self) -> WorldChange:
        """Return when this node's running world must be re-formed.

        A member's lost lease returns a change naming the lost host; nodes
        waiting to join (with room for them) or a member re-joining after
        its workers failed return a change without a loss.

        Raises:
            RendezvousJobFailedError: the job failed elsewhere, or fewer than
                ``min_nodes`` nodes are left after a loss.
            RendezvousClosedError: another agent stopped the job.
            RendezvousLeaseLostError: this node lost its lease (fenced).
        """
        store = self._store()
        info = self._running()
        while True:
            self._raise_if_over()
            change = self._change(info)
            if change is not None:
                return change
            await store.changed()

    async def exit_barrier(self, timeout: float) -> WorldChange | None:
        """After this node's workers succeeded: wait for the other members' workers.

        Returns None once every live member's workers finished (or after
        ``timeout``, with a warning), having closed the rendezvous; or the
        change that makes the world re-form meanwhile (a member re-joined
        after its workers failed, a member was lost): this node's workers
        then run again in the new world, as everyone's do.

        Raises:
            RendezvousJobFailedError: the job failed on another host.
            RendezvousLeaseLostError: this node lost its lease.
        """
        store = self._store()
        info = self._running()
        await self._put(f"rounds/{info.round}/done/{self.node_id}", b"1", leased=True)
        with anyio.move_on_after(timeout) as scope:
            while True:
                closed = self._get("closed")
                if closed is not None and json.loads(closed.value).get("reason") == "succeeded":
                    break  # the last member to finish closed it
                self._raise_if_over()
                # only members write done keys, and a lost member's go with its lease
                done = len(self._store().children(self._key(f"rounds/{info.round}/done/")))
                if done >= len(info.nodes) - len(self._lost(info)):
                    break
                change = self._change(info)
                if change is not None:
                    return change
                await store.changed()
        if scope.cancelled_caught:
            logger.warning("exit barrier: timed out after %g s waiting for other hosts", timeout)
        await self._close("succeeded")
        return None

    def _running(self) -> RendezvousInfo:
        if self._info is None:
            raise RuntimeError(f"{self!r}: no completed rendezvous")
        return self._info

    def _change(self, info: RendezvousInfo) -> WorldChange | None:
        """Why the world ``info`` must be re-formed now, if it must.

        Raises:
            RendezvousJobFailedError: a member was lost and fewer than
                ``min_nodes`` nodes are left.
        """
        lost = self._lost(info)
        if lost:
            hosts = ", ".join(f"{n.addr} ({n.node_id})" for n in lost)
            alive = self._alive()
            if len(alive) < self.min_nodes:
                raise RendezvousJobFailedError(
                    f"lost host {hosts}: {len(alive)} node(s) left, fewer than "
                    f"min_nodes={self.min_nodes}"
                )
            return WorldChange(f"lost host {hosts}", lost=tuple(n.addr for n in lost))
        if self._current()[0] != info.round:
            return WorldChange("the job re-formed its world without this node")
        joins = self._joins(info.round + 1)
        if not joins:
            return None
        members = {n.node_id: n for n in info.nodes}
        again = [members[i].addr for i in joins if i in members]
        if again:
            return WorldChange(f"host {', '.join(again)} re-joined (its workers failed)")
        if len(members) < self.max_nodes:
            return WorldChange(f"{len(joins)} node(s) waiting to join")
        return None

    async def report_failure(self, failure: Mapping[str, Any]) -> None:
        """Tell every agent that the job failed here, for good (``failure``: its root cause)."""
        store = self._store()
        value = json.dumps({**failure, "host": self.addr, "node": self.node_id}).encode()
        key = (self._prefix + "failed").encode()
        tx = store.client.transactions
        await store.call(
            lambda: store.client.transaction(
                compare=[tx.create(key) == 0], success=[tx.put(key, value)], failure=[]
            )
        )

    async def shutdown(self) -> bool:
        """Close the rendezvous for every node (torch's ``shutdown``): a stop.

        Returns:
            True when the closed marker was written.
        """
        try:
            with anyio.move_on_after(self.close_timeout):
                await self._close("stopped")
                return True
        except Exception as e:  # the lease is gone, or etcd: nothing more to do
            logger.warning("rendezvous shutdown failed: %s", e)
        return False

    async def set_closed(self) -> None:
        await self._close("stopped")

    # ---------------------------------------------------------- protocol

    async def _join(
        self, r: int, current_rev: int, prev: RendezvousInfo | None
    ) -> tuple[int, bytes] | None:
        store = self._store()
        port = _free_port(self.addr)
        prev_rank = None
        if prev is not None and prev.round == r - 1:
            prev_rank = prev.group_rank
        value = json.dumps(
            {"addr": self.addr, "port": port, "nproc": self._nproc, "prev_rank": prev_rank}
        ).encode()
        key = self._key(f"rounds/{r}/join/{self.node_id}")
        current = self._key("current")
        tx = store.client.transactions
        ok, _ = await store.call(
            lambda: store.client.transaction(
                compare=[tx.mod(current) == current_rev],
                success=[tx.put(key, value, lease=store.lease_id)],
                failure=[],
            )
        )
        return (r, key) if ok else None

    async def _wait_round(self, r: int, deadline: float) -> RendezvousInfo | None:
        """This node's info once round ``r`` completed (None: completed without it)."""
        store = self._store()
        ready_since: float | None = None
        while True:
            self._raise_if_over()
            world = self._get(f"rounds/{r}/world")
            if world is not None:
                return self._info_from(r, world)
            if self._current()[0] >= r:
                return None  # completed and already superseded
            joins = self._store().children(self._key(f"rounds/{r}/join/"))
            freeze_at = deadline
            if self._first_joiner(r) == self.node_id:
                if len(joins) >= self.max_nodes:
                    await self._freeze(r, self._joins(r))
                    continue
                if len(joins) >= self.min_nodes and not self._members_pending(r):
                    now = time.monotonic()
                    ready_since = now if ready_since is None else ready_since
                    if now >= ready_since + self.last_call_timeout:
                        await self._freeze(r, self._joins(r))
                        continue
                    freeze_at = min(deadline, ready_since + self.last_call_timeout)
                else:
                    ready_since = None
            else:
                ready_since = None
            with anyio.move_on_at(freeze_at):
                await store.changed()

    def _members_pending(self, r: int) -> list[str]:
        """Live members of the running world (round r - 1) that have not joined round r."""
        world = self._get(f"rounds/{r - 1}/world")
        if world is None:
            return []
        store = self._store()
        alive = store.children(self._key("nodes/"))
        joins = store.children(self._key(f"rounds/{r}/join/"))
        nodes = json.loads(world.value)["nodes"]
        return [
            n["id"] for n in nodes if n["id"].encode() in alive and n["id"].encode() not in joins
        ]

    def _first_joiner(self, r: int) -> str | None:
        """The node id of round ``r``'s earliest live join (the one that completes it).

        Cached until a join of the round is deleted: a new join is never earlier.
        """
        store = self._store()
        directory = self._key(f"rounds/{r}/join/")
        key = (directory, store.deletions.get(directory, 0))
        cached = self._first_cache
        joins = store.children(directory)
        if cached is None or cached[0] != key or cached[1] is None:
            first = min(joins.items(), key=lambda kv: kv[1].create_revision)[0] if joins else None
            cached = self._first_cache = (key, first.decode() if first is not None else None)
        return cached[1]

    def _lost(self, info: RendezvousInfo) -> list[RendezvousNode]:
        """Members of ``info``'s world whose lease is gone; cached until a node key goes."""
        store = self._store()
        directory = self._key("nodes/")
        key = (info.round, store.deletions.get(directory, 0))
        if self._lost_cache is None or self._lost_cache[0] != key:
            alive = store.children(directory)
            lost = [n for n in info.nodes if n.node_id.encode() not in alive]
            self._lost_cache = (key, lost)
        return self._lost_cache[1]

    async def _freeze(self, r: int, joins: Mapping[str, tuple[str, KeyValue]]) -> None:
        store = self._store()

        def order(item: tuple[str, tuple[str, KeyValue]]) -> tuple[int, int]:
            value = json.loads(item[1][1].value)
            if value.get("prev_rank") is not None:
                return (0, int(value["prev_rank"]))  # stable group ranks
            return (1, item[1][1].create_revision)

        chosen = sorted(joins.items(), key=order)[: self.max_nodes]
        nodes = []
        for node_id, (_, kv) in chosen:
            value = json.loads(kv.value)
            nodes.append(
                {
                    "id": node_id,
                    "addr": value["addr"],
                    "port": value["port"],
                    "nproc": value["nproc"],
                }
            )
        world = json.dumps({"round": r, "nodes": nodes}).encode()
        current, current_rev = self._current()
        tx = store.client.transactions
        world_key = self._key(f"rounds/{r}/world")
        success = [tx.put(world_key, world), tx.put(self._key("current"), str(r).encode())]
        if current >= 0:
            old = self._key(f"rounds/{current}/")
            success.append(tx.delete(old, range_end=_prefix_end(old)))
        ok, _ = await store.call(
            lambda: store.client.transaction(
                compare=[tx.create(world_key) == 0, tx.mod(self._key("current")) == current_rev],
                success=success,
                failure=[],
            )
        )
        if ok:
            logger.info("rendezvous round %d completed with %d node(s)", r, len(nodes))
        else:
            await store.changed()  # another agent's write came first: see it

    def _info_from(self, r: int, world: KeyValue) -> RendezvousInfo | None:
        nodes = tuple(
            RendezvousNode(n["id"], n["addr"], int(n["port"]), int(n["nproc"]))
            for n in json.loads(world.value)["nodes"]
        )
        for rank, node in enumerate(nodes):
            if node.node_id == self.node_id:
                return RendezvousInfo(r, rank, nodes)
        return None

    async def _close(self, reason: str) -> None:
        store = self._store()
        tx = store.client.transactions
        closed = self._key("closed")
        rounds = self._key("rounds/")
        value = json.dumps({"reason": reason, "host": self.addr, "node": self.node_id}).encode()
        await store.call(
            lambda: store.client.transaction(
                compare=[tx.create(closed) == 0],
                success=[
                    tx.put(closed, value),
                    tx.delete(rounds, range_end=_prefix_end(rounds)),
                    tx.delete(self._key("current")),
                ],
                failure=[],
            )
        )

    def _raise_if_over(self) -> None:
        store = self._store()
        if store.lost is not None:
            raise RendezvousLeaseLostError(store.lost)
        failed = self._get("failed")
        if failed is not None:
            failure = json.loads(failed.value)
            raise RendezvousJobFailedError(
                f"the job failed on host {failure.get('host')}: rank {failure.get('rank')} "
                f"(local_rank {failure.get('local_rank')}) {failure.get('how', 'failed')}",
                failure,
            )
        closed = self._get("closed")
        if closed is not None:
            value = json.loads(closed.value)
            finished = value.get("reason") == "succeeded"
            how = "already finished" if finished else f"was stopped on host {value.get('host')}"
            raise RendezvousClosedError(
                f"the rendezvous of job {self._params.run_id!r} is closed: the job {how}",
                finished,
            )

    # ------------------------------------------------------------ the copy

    def _store(self) -> EtcdSession:
        if self._session is None:
            raise RuntimeError(f"{self!r}: use it inside 'async with handler.session(n)'")
        return self._session

    def _key(self, name: str) -> bytes:
        return (self._prefix + name).encode()

    def _get(self, name: str) -> KeyValue | None:
        return self._store().keys.get(self._key(name))

    def _current(self) -> tuple[int, int]:
        kv = self._get("current")
        return (int(kv.value), kv.mod_revision) if kv is not None else (-1, 0)

    def _alive(self) -> set[str]:
        return {k.decode() for k in self._store().children(self._key("nodes/"))}

    def _joins(self, r: int) -> dict[str, tuple[str, KeyValue]]:
        children = self._store().children(self._key(f"rounds/{r}/join/"))
        return {k.decode(): (k.decode(), kv) for k, kv in children.items()}

    async def _put(self, name: str, value: bytes, *, leased: bool) -> None:
        store = self._store()
        lease = store.lease_id if leased else None
        await store.call(lambda: store.client.put(self._key(name), value, lease=lease))

    async def _delete(self, key: bytes) -> None:
        store = self._store()
        with anyio.CancelScope(shield=True), anyio.move_on_after(self.lease_ttl):
            try:
                await store.call(lambda: store.client.delete(key))
            except Exception as e:  # the lease takes it away anyway
                logger.debug("deleting %r failed: %r", key, e)


class _Session:
    def __init__(self, handler: EtcdRendezvousHandler) -> None:
        self._handler = handler
        self._open: Any = None

    async def __aenter__(self) -> EtcdRendezvousHandler:
        h = self._handler
        if h._session is not None:
            raise RuntimeError(f"{h!r} already has a session")
        session = EtcdSession(h._host, h._port, h._prefix.encode(), h.lease_ttl, h.addr)
        self._open = session.open()
        await self._open.__aenter__()
        h._session = session
        try:
            value = json.dumps({"addr": h.addr, "pid": os.getpid()}).encode()
            await h._put(f"nodes/{h.node_id}", value, leased=True)
        except BaseException as e:
            h._session = None
            await self._open.__aexit__(type(e), e, e.__traceback__)
            raise
        return h

    async def __aexit__(self, *exc: Any) -> None:
        h = self._handler
        h._session = None
        h._info = None
        await self._open.__aexit__(*exc)


def _prefix_end(prefix: bytes) -> bytes:
    return prefix[:-1] + bytes([prefix[-1] + 1])


def _free_port(addr: str) -> int:
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return int(s.getsockname()[1])
