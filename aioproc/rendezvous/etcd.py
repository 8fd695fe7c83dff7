"""Dynamic rendezvous through etcd v3: agents on many hosts agree on a world.

The semantics are those of torch's ``DynamicRendezvousHandler``; the
protocol is aioproc's own.  Keys under ``/aioproc/rdzv/<run_id>/``, the
control keys first (every agent copies them: a few writes per round):

``change/<r>``            a join that makes the running world (round r - 1) re-form
``closed``                the job is over (finished, or stopped by a signal)
``completed/<r>``         round r's world: its nodes in group-rank order
``current``               the number of the last completed round
``failed``                the job failed for good: the root cause
``lead/<r>``              (leased) the joiner that completes round r

then the keys written by every agent, which no agent copies in full:

``nodes/<id>``            (leased) one per live agent: its lease is its liveness
``rounds/<r>/join/<id>``  (leased) an agent waiting for round r
``rounds/<r>/done/<id>``  (leased) an agent whose workers finished (exit barrier)

A round ``r`` is open while ``current`` is ``r - 1``.  An agent joins by
writing its join key in a transaction that checks ``current`` did not move
and, in the same transaction, claims ``lead/<r>`` if it is free and writes
``change/<r>`` if its join must make the running world re-form (it is a
member of that world: its workers failed; or that world has room).  The
leader alone follows the round's joins: it completes the round when
``max_nodes`` joined, or when ``min_nodes`` joined, every live member of the
running world joined too, and ``last_call_timeout`` passed, by writing the
world and ``current`` and dropping the previous round's keys in one
transaction.  A leader that dies takes ``lead/<r>`` with its lease; the
other joiners see it go and one of them claims the round (the world keeps
the join order either way).  So a node arriving while a full world runs
waits; a node arriving while a world below ``max_nodes`` runs makes its
members re-join (a re-rendezvous that costs no restart); a member lost
makes the others re-join, or fail if fewer than ``min_nodes`` are left.

A key under the prefix that the protocol never writes (another name, a
join that is not JSON) is named in one warning and ignored; a control key
holding what no agent writes fails the job on every agent with
``RendezvousStateError``, naming the key.  A job found closed on arrival
(``closed`` already there: a reused run id) raises ``RendezvousClosedError``
even when it finished, so a run that ran nothing never passes for a success;
a node that had joined and was waiting when the job finished gets
``RendezvousGracefulExitError`` instead (torch's standby nodes).

Every agent learns of losses from a watch that delivers only deletions of
``nodes/`` keys, and of everything else from the control keys; the exit
barrier counts the done keys with one read per agent.  A round costs O(1)
requests and O(1) watch events per agent (the leader: O(N) events, one per
join): O(N) in total, where following every agent's keys costs O(N^2).

This module is the handler (torch's API, the running world, the exit
barrier); ``_etcd_round`` joins a round and, on its leader, completes it;
``_etcd_store`` holds the session: the lease and the copies of the keys.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable, Mapping
from typing import Any

import anyio

from ._etcd_round import Joining, World, malformed
from ._etcd_store import EtcdSession, KeyValue, import_aetcd, prefix_end, ttl_seconds
from .api import (
    RendezvousClosedError,
    RendezvousGracefulExitError,
    RendezvousInfo,
    RendezvousJobFailedError,
    RendezvousLeaseLostError,
    RendezvousNode,
    RendezvousParameters,
    RendezvousStateError,
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
        self._world_now: World | None = None  # the world of ``_info``
        self._worlds: dict[bytes, tuple[int, World]] = {}  # parsed, by key and revision
        self._lost_cache: tuple[tuple[int, int], list[RendezvousNode]] | None = None
        self._joined = False  # whether this node joined a round in this session
        self._corrupt: str | None = None  # the first corrupt control key seen, described
        self._warned: set[tuple[bytes, int]] = set()  # ignored keys (and revisions) told of

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

    @property
    def events(self) -> int:
        """Watch events this agent received so far (the scale benchmark counts them)."""
        return self._session.events if self._session is not None else 0

    def is_closed(self) -> bool:
        return self._get("closed") is not None

    def num_nodes_waiting(self) -> int:
        """Agents waiting for the next round while this node's world runs.

        Exact where this node follows the next round's joins (its leader);
        elsewhere 1 when some node waits, else 0: a member learns that a node
        waits from the round's lead key, not from every join.
        """
        if self._info is None:
            return 0
        r = self._info.round + 1
        start = self._key(f"rounds/{r}/join/")
        store = self._store()
        if store.follows(start, prefix_end(start)):
            return len(store.children(start))
        return 1 if self._get(f"lead/{r}") is not None else 0

    def session(
        self, local_world_size: int, lease_renewed: Callable[[float], None] | None = None
    ) -> _Session:
        """Connect, take a lease, follow the job's keys, for the agent's run.

        Leaving it revokes the lease: this node's keys vanish at once.

        Args:
            local_world_size: this node's number of workers.
            lease_renewed: called after the lease is granted and after every
                renewal, with the time (``time.monotonic()``) at which this
                node fences itself unless another renewal succeeds first.
        """
        self._nproc = local_world_size
        return _Session(self, lease_renewed)

    async def next_rendezvous(self) -> RendezvousInfo:
        """Join the next round; return once it completed with this node.

        Raises:
            RendezvousTimeoutError: no round completed with this node
                within ``join_timeout``; its join key is removed.
            RendezvousClosedError: the job was stopped, or it was over
                (finished too) before this node joined it.
            RendezvousGracefulExitError: the job finished while this node
                waited for a round it had joined.
            RendezvousJobFailedError: the job failed on some host.
            RendezvousStateError: a control key of the job is corrupt.
            RendezvousLeaseLostError: this node lost its lease.

        Cancellation: the join key stays until the session ends (it is
        leased), so a cancelled join leaves nothing behind.
        """
        store = self._store()
        joining = Joining(self, self._info)
        self._info = self._world_now = None
        deadline = time.monotonic() + self.join_timeout
        joined = -1  # the round this node's join key is in
        with anyio.move_on_at(deadline):
            while True:
                seen = store.version
                self._raise_if_over(waiting=True)
                current, current_rev = self._current()
                r = current + 1
                if joined != r:
                    if not await joining.join(r, current_rev):
                        await store.changed(seen)  # ``current`` moved meanwhile: look again
                        continue
                    joined = r
                    self._joined = True
                world = await joining.wait(r, current_rev, deadline)
                if world is not None:
                    info = world.info_for(self.node_id)
                    if info is not None:
                        self._info, self._world_now = info, world
                        return info
                # the round completed without this node: wait for the next one
        joins = await joining.leave(self._current()[0] + 1, joined)
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
        world = self._running()
        while True:
            seen = store.version
            self._raise_if_over()
            change = await self._change(world)
            if change is not None:
                return change
            await store.changed(seen)

    async def exit_barrier(self, timeout: float) -> WorldChange | None:
        """After this node's workers succeeded: wait for the other members' workers.

        Returns None once every live member's workers finished (or after
        ``timeout``, with a warning), having closed the rendezvous; or the
        change that makes the world re-form meanwhile (a member re-joined
        after its workers failed, a member was lost): this node's workers
        then run again in the new world, as everyone's do.

        Each member writes its done key, then counts the round's done keys
        with one read; the member whose key came last counts them all and
        closes the job, which every member sees.  A member lost meanwhile
        makes every member count again.

        Raises:
            RendezvousJobFailedError: the job failed on another host.
            RendezvousLeaseLostError: this node lost its lease.
        """
        store = self._store()
        world = self._running()
        done_dir = f"rounds/{world.round}/done/"
        await self._put(done_dir + self.node_id, b"1", leased=True)
        counted = -1  # how many lost members the last count allowed for
        with anyio.move_on_after(timeout) as scope:
            while True:
                seen = store.version
                closed = self._get("closed")
                if closed is not None and json.loads(closed.value).get("reason") == "succeeded":
                    return None  # the member that counted them all closed it
                self._raise_if_over()
                lost = self._lost(world)
                if len(lost) != counted:
                    counted = len(lost)
                    # only members write done keys, and a lost member's go with its lease
                    if await self._count(done_dir) >= len(world.nodes) - counted:
                        break
                    continue
                change = await self._change(world)
                if change is not None:
                    return change
                await store.changed(seen)
        if scope.cancelled_caught:
            logger.warning("exit barrier: timed out after %g s waiting for other hosts", timeout)
        await self._close("succeeded")
        return None

    def _running(self) -> World:
        if self._info is None or self._world_now is None:
            raise RuntimeError(f"{self!r}: no completed rendezvous")
        return self._world_now

    async def _change(self, world: World) -> WorldChange | None:
        """Why ``world`` must be re-formed now, if it must.

        Decided on a fresh list of the live nodes (one read), so a loss that
        caused the change is reported as one even before its watch event.

        Raises:
            RendezvousJobFailedError: a member was lost and fewer than
                ``min_nodes`` nodes are left.
        """
        moved = self._current()[0] != world.round
        change = self._get(f"change/{world.round + 1}")
        if not (moved or change is not None or self._lost(world)):
            return None
        alive = await self._store().refresh_liveness()
        lost = self._lost(world)
        if lost:
            # a stop or a failure elsewhere ends agents too: if one came
            # first, it is the news (its watch event may trail the loss's)
            await self._raise_if_over_now()
            hosts = ", ".join(f"{n.addr} ({n.node_id})" for n in lost)
            if alive < self.min_nodes:
                raise RendezvousJobFailedError(
                    f"lost host {hosts}: {alive} node(s) left, fewer than "
                    f"min_nodes={self.min_nodes}"
                )
            return WorldChange(f"lost host {hosts}", lost=tuple(n.addr for n in lost))
        if moved:
            return WorldChange("the job re-formed its world without this node")
        assert change is not None
        why = json.loads(change.value)  # what ``malformed`` let into the copy
        if why["member"]:
            return WorldChange(f"host {why['host']} re-joined (its workers failed)")
        return WorldChange(f"host {why['host']} is waiting to join")

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
            True when the closed marker was written; False when it could
            not be, or when this node never had a session open (it never
            reached etcd, so it joined nothing to close).
        """
        if self._session is None:
            return False
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

    def _lost(self, world: World) -> list[RendezvousNode]:
        """Members of ``world`` whose lease is gone; cached until liveness news arrive."""
        store = self._store()
        key = (world.round, store.liveness_version)
        if self._lost_cache is None or self._lost_cache[0] != key:
            lost = [
                n
                for n in world.nodes
                if store.gone_since(n.node_id.encode(), world.revs[n.node_id])
            ]
            self._lost_cache = (key, lost)
        return self._lost_cache[1]

    def _world(self, r: int) -> World | None:
        """Round ``r``'s world from the copy (parsed once per version of its key)."""
        key = self._key(f"completed/{r}")
        kv = self._store().keys.get(key)
        if kv is None:
            return None
        cached = self._worlds.get(key)
        if cached is None or cached[0] != kv.mod_revision:
            world = World.parse(r, kv.value)
            self._worlds = {key: (kv.mod_revision, world)}  # one at a time is all it takes
            cached = self._worlds[key]
        return cached[1]

    async def _count(self, directory: str) -> int:
        """How many keys are in ``directory`` now (one read)."""
        store = self._store()
        key = self._key(directory)
        result = await store.call(lambda: store.client.get_prefix(key, keys_only=True))
        return len(result.kvs)

    async def _close(self, reason: str) -> None:
        store = self._store()
        tx = store.client.transactions
        closed = self._key("closed")
        value = json.dumps({"reason": reason, "host": self.addr, "node": self.node_id}).encode()
        # everything but the liveness keys (they go with their leases) and ``failed``
        dirs = [self._key(d) for d in ("change/", "completed/", "lead/", "rounds/")]
        await store.call(
            lambda: store.client.transaction(
                compare=[tx.create(closed) == 0],
                success=[
                    tx.put(closed, value),
                    tx.delete(self._key("current")),
                    *(tx.delete(d, range_end=prefix_end(d)) for d in dirs),
                ],
                failure=[],
            )
        )

    def _raise_if_over(self, waiting: bool = False) -> None:
        """Raise the error that ends this node's part in the job, if one does.

        ``waiting``: called while this node waits for a round (see
        ``_raise_if_ended``).
        """
        store = self._store()
        if store.lost is not None:
            raise RendezvousLeaseLostError(store.lost)
        self._raise_if_corrupt()
        failed, closed = self._get("failed"), self._get("closed")
        self._raise_if_ended(
            failed.value if failed is not None else None,
            closed.value if closed is not None else None,
            waiting,
        )

    async def _raise_if_over_now(self) -> None:
        """``_raise_if_over`` on what etcd holds now rather than on the copy (one read)."""
        store = self._store()
        tx = store.client.transactions
        _, responses = await store.call(
            lambda: store.client.transaction(
                compare=[],
                success=[tx.get(self._key("failed")), tx.get(self._key("closed"))],
                failure=[],
            )
        )
        failed, closed = (r[0][0] if r else None for r in responses)
        for name, value in (("failed", failed), ("closed", closed)):
            if value is not None:
                self._check_key(self._key(name), KeyValue(value, 0, 0, 0))
        self._raise_if_corrupt()
        self._raise_if_ended(failed, closed)

    def _raise_if_corrupt(self) -> None:
        if self._corrupt is not None:
            raise RendezvousStateError(
                f"the rendezvous of job {self._params.run_id!r} is corrupt: {self._corrupt}; "
                f"something other than its agents writes under {self._prefix}"
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
            job = self._params.run_id
            if finished and waiting and self._joined:
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

    def _check_key(self, key: bytes, kv: KeyValue) -> bool:
        """Whether the protocol may use ``key`` (under the prefix) holding ``kv``.

        A key it can ignore is named in one warning (per key and revision);
        a corrupt control key is kept for ``_raise_if_over`` to fail the job.
        """
        problem = malformed(key[len(self._prefix) :], kv.value)
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
            logger.warning("rendezvous of job %r: ignoring %s", self._params.run_id, text)
        return False

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

    async def _put(self, name: str, value: bytes, *, leased: bool) -> None:
        store = self._store()
        lease = store.lease_id if leased else None
        await store.call(lambda: store.client.put(self._key(name), value, lease=lease))


class _Session:
    def __init__(
        self, handler: EtcdRendezvousHandler, lease_renewed: Callable[[float], None] | None
    ) -> None:
        self._handler = handler
        self._lease_renewed = lease_renewed
        self._open: Any = None

    async def __aenter__(self) -> EtcdRendezvousHandler:
        h = self._handler
        if h._session is not None:
            raise RuntimeError(f"{h!r} already has a session")
        prefix = h._prefix.encode()
        h._joined, h._corrupt = False, None
        session = EtcdSession(
            h._host,
            h._port,
            prefix,
            prefix + b"nodes/",
            h.lease_ttl,
            h.addr,
            check=h._check_key,
        )
        session.renewed = self._lease_renewed
        # reaching etcd counts against join_timeout too: an endpoint that
        # never answers fails in time, naming itself and the last error
        self._open = session.open(h.join_timeout)
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
        h._info = h._world_now = None
        await self._open.__aexit__(*exc)
