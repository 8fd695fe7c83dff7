"""Dynamic rendezvous through etcd v3: agents on many hosts agree on a world.

The semantics are those of torch's ``DynamicRendezvousHandler``; the
protocol is aioproc's own.  Keys under ``/aioproc/rdzv/<run_id>/``, the
control keys first (every agent copies them: a few writes per round):

``change/<r>``            a join that makes the running world (round r - 1) re-form
                          (and the members its writer knows were lost)
``closed``                the job is over (finished, or stopped by a signal)
``completed/<r>``         round r's world in a few fields: its size, group rank 0's
                          address and port, and the token of its seats
``current``               the number of the last completed round
``failed``                the job failed for good: the root cause
``lead/<r>``              (leased) the joiner that completes round r
``lookout/<r>``           (on the lookout's lease) the member of round r's world
                          that watches the others' liveness: group rank 0
``lost/<r>/<id>``         a member of round r's world that left (its address), as
                          the lookout tells the others

then the keys of every agent, which no agent copies in full:

``nodes/<id>``            (leased) one per live agent, written once: its lease is
                          its liveness
``rounds/<r>/join/<id>``  (leased) an agent waiting for round r: its address, port,
                          nproc and role
``rounds/<r>/done/<id>``  (leased) an agent whose workers finished (exit barrier)
``seats/<id>``            an agent's place in the last world it was seated in, as
                          that round's leader wrote it: round, token, group rank,
                          torch's rank figures, address, port, nproc, role; it
                          outlives the agent's lease, to tell whether a lost agent
                          was a member (``world()`` lists a world's seats)

A round ``r`` is open while ``current`` is ``r - 1``.  An agent joins by
writing its join key in a transaction that checks ``current`` did not move
and, in the same transaction, claims ``lead/<r>`` if it is free and writes
``change/<r>`` if its join must make the running world re-form (it is a
member of that world: its workers failed; or that world has room).  The
leader alone follows the round's joins: it completes the round when
``max_nodes`` joined, or when ``min_nodes`` joined, every live member of the
running world joined too, and ``last_call_timeout`` passed.  It computes
every node's seat (torch's rank assignment) and writes them in batches,
each seat only while the node's join is still there (a node whose lease is
gone gets none, and the round is frozen again without it), then writes the
world's few fields and ``current`` and drops the previous round's keys in
one transaction.  Each agent reads its own seat from its seat key, which it
watches: no agent reads a record of every agent.  A leader that dies takes
``lead/<r>`` with its lease; the other joiners see it go and one of them
claims the round (the world keeps the join order either way).  So a node
arriving while a full world runs waits; a node arriving while a world
below ``max_nodes`` runs makes its
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

One agent per world watches the agents' departures (deletions of
``nodes/`` keys): its lookout, group rank 0.  One read of a departed
agent's seat tells whether it was a member; if so the lookout writes
``lost/<r>/<id>``, which every member hears of with the other control
keys (in the order etcd wrote them).  The lookout's own loss takes its
leased ``lookout/<r>`` along.  A leader waiting for the running world's
members, or a c10d host waiting for the others to leave, watches the
departures while it waits.  No range that every agent watches holds keys
written or deleted by every agent: etcd matches each write against every
watch whose range holds the key (and etcd 3.4 does so for a lease's keys
holding the lock that every keep-alive needs), so N agents watching every
agent's liveness would cost O(N^2) when N leases go.  The exit barrier
counts the done keys with one read that returns none of them.  A round
costs each agent one transaction (its join), a few watch events and its
own seat: O(1) requests and O(1) bytes per agent (the leader: O(N), one
join event and one seat per node), O(N) in total.

This module is the handler (torch's API, the running world, the exit
barrier); ``_etcd_round`` joins a round and, on its leader, completes it;
``_etcd_keyspace`` owns the job's keys (their names, the checks on them,
the transactions), which both use; ``_etcd_schema`` says what the keys may
hold; ``_etcd_store`` holds the session: the lease and the copies of the
keys; ``_etcd_client`` the calls to etcd.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import anyio

from ._etcd_client import import_aetcd, ttl_seconds
from ._etcd_keyspace import KEY_ROOT as KEY_ROOT
from ._etcd_keyspace import EtcdKeyspace
from ._etcd_round import Joining
from ._etcd_schema import Seat, World
from ._etcd_store import FENCE_AT
from .api import (
    DEFAULT_ROLE,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousJobFailedError,
    RendezvousNode,
    RendezvousParameters,
    RendezvousTimeoutError,
    WorldChange,
    parse_endpoint,
)

__all__ = ["EtcdRendezvousHandler"]

logger = logging.getLogger("aioproc.rendezvous")

# what the etcd backend reads (``protocol=http`` included: the only one it speaks)
_READ_OPTIONS = frozenset(
    {"join_timeout", "timeout", "last_call_timeout", "close_timeout", "lease_ttl", "protocol"}
)


class EtcdRendezvousHandler(RendezvousHandler):
    """torch's ``DynamicRendezvousHandler`` semantics on an etcd v3 server.

    Build it with ``create_handler(RendezvousParameters("etcd", ...))``.
    The agent opens a session for its run (``async with
    handler.session(local_world_size):``), in which the lease is kept alive
    and the job's keys are watched; ``next_rendezvous()`` joins a round,
    ``wait_for_change()`` returns when the running world must be re-formed.
    """

    endpoint_help = "HOST:PORT (the etcd server)"
    # the etcd server outlives jobs: a job's keys stay, so each job needs an id of its own
    needs_run_id = True

    def __init__(self, params: RendezvousParameters) -> None:
        import_aetcd()  # fail now, with the install hint, not when the agent runs
        self._params = params
        self._host, self._port = parse_endpoint(params.endpoint, 2379)
        # torch's etcd backend takes its join timeout as ``timeout``
        timeout = "join_timeout" if "join_timeout" in params.config else "timeout"
        self.join_timeout = params.get_seconds(timeout, 600.0)
        self.last_call_timeout = params.get_seconds("last_call_timeout", 30.0)
        self.close_timeout = params.get_seconds("close_timeout", 30.0)
        self.lease_ttl = ttl_seconds(params.get_seconds("lease_ttl", 3.0, minimum=1.0))
        tls = sorted(
            key
            for key in ("cacert", "cert", "key", "protocol")
            if params.config.get(key) not in (None, "", "http")
        )
        if tls:
            # a user who asked for TLS must not get a plain connection
            raise ValueError(
                f"etcd rendezvous option(s) {', '.join(tls)}: aioproc connects to etcd "
                "over plain http only (no TLS); use an endpoint reachable without it"
            )
        self.unused_options = tuple(sorted(set(params.config) - _READ_OPTIONS))
        """Options this backend does not read: accepted, as torch's backends do."""
        if self.unused_options:
            logger.debug(
                "etcd rendezvous: option(s) %s not used by this backend",
                ", ".join(self.unused_options),
            )
        self.addr = params.local_addr or socket.getfqdn()
        self.node_id = f"{self.addr}_{os.getpid()}_{secrets.token_hex(3)}"
        # the job's keys: their names, this node's session, the checks and the writes
        self._keys = EtcdKeyspace(params.run_id, self.node_id, self.addr, self)
        self._nproc = 1
        self._role = DEFAULT_ROLE
        self._info: RendezvousInfo | None = None
        self._world_now: World | None = None  # the world of ``_info``
        self._lookout = False  # whether this node watches its world's liveness
        self._reported: set[str] = set()  # the members lost it told its world of
        self._spent = (0, 0, 0)  # requests, events and bytes of the sessions that ended
        # while the session opens: asked, after a call that failed as if etcd were not
        # up yet, whether the endpoint can be etcd at all (c10d knows; None: wait for it)
        self._vet: Callable[[float], Awaitable[None]] | None = None

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
        """Grace period for workers stopped by fencing: they must be gone within the TTL.

        The fence comes ``FENCE_AT`` (five sixths) of the TTL after the last
        renewal sent, and etcd expires the lease a TTL after it at the
        earliest: the workers get half of what is left.
        """
        return self.lease_ttl * (1 - FENCE_AT) / 2

    @property
    def requests(self) -> int:
        """Calls this agent made to etcd so far, in every session (the scale benchmark's count)."""
        session = self._keys.session
        return self._spent[0] + (session.requests if session is not None else 0)

    @property
    def events(self) -> int:
        """Watch events this agent received so far, in every session (as ``requests``)."""
        session = self._keys.session
        return self._spent[1] + (session.events if session is not None else 0)

    @property
    def renewals(self) -> int:
        """Keep-alives of this session's lease that etcd answered so far (0 without a session)."""
        session = self._keys.session
        return session.renewals if session is not None else 0

    @property
    def received(self) -> int:
        """Bytes of keys and values this agent received so far (events, reads; as ``requests``)."""
        session = self._keys.session
        return self._spent[2] + (session.received if session is not None else 0)

    def is_closed(self) -> bool:
        return self._keys.get("closed") is not None

    def num_nodes_waiting(self) -> int:
        """Agents waiting for the next round while this node's world runs.

        Exact where this node follows the next round's joins (its leader);
        elsewhere 1 when some node waits, else 0: a member learns that a node
        waits from the round's lead key, not from every join.
        """
        if self._info is None:
            return 0
        r = self._info.round + 1
        start, end = self._keys.key_range(f"rounds/{r}/join/")
        store = self._keys.store()
        if store.follows(start, end):
            return len(store.children(start))
        return 1 if self._keys.get(f"lead/{r}") is not None else 0

    def session(
        self,
        local_world_size: int,
        lease_renewed: Callable[[float], None] | None = None,
        role: str = DEFAULT_ROLE,
    ) -> _Session:
        """Connect, take a lease, follow the job's keys, for the agent's run.

        Leaving it revokes the lease: this node's keys vanish at once.

        Args:
            local_world_size: this node's number of workers.
            lease_renewed: called after the lease is granted and after every
                renewal, with the time (``time.monotonic()``) at which this
                node fences itself unless another renewal succeeds first.
            role: the role of this node's workers; each join publishes it
                with ``local_world_size``, so that every node of a round
                assigns role ranks as torch does (``RendezvousInfo``).
        """
        self._nproc = local_world_size
        self._role = role
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
        keys = self._keys
        store = keys.store()
        joining = Joining(
            keys,
            self._info,
            nproc=self._nproc,
            role=self._role,
            min_nodes=self.min_nodes,
            max_nodes=self.max_nodes,
            last_call_timeout=self.last_call_timeout,
        )
        self._info = self._world_now = None
        await self._stand_down()
        deadline = time.monotonic() + self.join_timeout
        joined = -1  # the round this node's join key is in
        with anyio.move_on_at(deadline):
            while True:
                seen = store.version
                keys.raise_if_over(waiting=True)
                current, current_rev = keys.current()
                r = current + 1
                if joined != r:
                    if not await joining.join(r, current_rev):
                        await store.changed(seen)  # ``current`` moved meanwhile: look again
                        continue
                    joined = r
                    keys.joined = True
                world = await joining.wait(r, current_rev, deadline)
                if world is not None:
                    seat = joining.seat or await keys.seat(world)
                    if seat is not None:
                        self._info, self._world_now = seat.info(), world
                        if world.lookout[0] == self.node_id:
                            # group rank 0 keeps watch over the world's liveness
                            store.watch_departures(world.since)
                            self._lookout = True
                        return self._info
                # the round completed without this node: wait for the next one
        joins = await joining.leave(keys.current()[0] + 1, joined)
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
        store = self._keys.store()
        world = self._running()
        while True:
            seen = store.version
            self._keys.raise_if_over()
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
        with one read (which returns none of them); the member whose key
        came last counts them all and closes the job, which every member
        sees.  A member lost meanwhile makes every member count again.  Once
        the job is closed, this node stops hearing of the others leaving.

        Raises:
            RendezvousJobFailedError: the job failed on another host.
            RendezvousLeaseLostError: this node lost its lease.
        """
        keys = self._keys
        store = keys.store()
        world = self._running()
        done_dir = f"rounds/{world.round}/done/"
        await keys.put(done_dir + self.node_id, b"1", leased=True)
        counted = -1  # how many lost members the last count allowed for
        with anyio.move_on_after(timeout) as scope:
            while True:
                seen = store.version
                closed = keys.get("closed")
                if closed is not None and json.loads(closed.value).get("reason") == "succeeded":
                    self._lookout = False
                    store.quiet()
                    return None  # the member that counted them all closed it
                keys.raise_if_over()
                lost = await self._lost(world)
                if len(lost) != counted:
                    counted = len(lost)
                    # only members write done keys, and a lost member's go with its lease
                    if await keys.count(done_dir) >= world.size - counted:
                        break
                    continue
                change = await self._change(world)
                if change is not None:
                    return change
                await store.changed(seen)
        if scope.cancelled_caught:
            logger.warning("exit barrier: timed out after %g s waiting for other hosts", timeout)
        await keys.close("succeeded")
        self._lookout = False
        store.quiet()
        return None

    async def world(self) -> tuple[RendezvousNode, ...]:
        """The nodes of this node's running world, in group-rank order (one read of N seats).

        Read when wanted: a round gives each node its own seat only (its
        ``RendezvousInfo`` has no ``nodes``).

        Raises:
            RuntimeError: no round completed with this node.
        """
        world = self._running()
        keys = self._keys
        store = keys.store()
        start, end = keys.key_range("seats/")
        result = await store.call(lambda: store.client.get_range(start, end))
        seats = []
        for kv in result.kvs:
            seat = Seat.parse(kv.key[len(start) :].decode(errors="replace"), kv.value)
            if seat is not None and (seat.round, seat.token) == (world.round, world.token):
                seats.append(seat)
        return tuple(seat.node for seat in sorted(seats, key=lambda seat: seat.group_rank))

    def _running(self) -> World:
        if self._info is None or self._world_now is None:
            raise RuntimeError(f"{self!r}: no completed rendezvous")
        return self._world_now

    async def _change(self, world: World) -> WorldChange | None:
        """Why ``world`` must be re-formed now, if it must.

        A loss is known from the control keys, in the order etcd wrote
        them: a stop or a failure written before it is seen first.

        Raises:
            RendezvousJobFailedError: a member was lost and fewer than
                ``min_nodes`` nodes are left.
        """
        keys = self._keys
        moved = keys.current()[0] != world.round
        change = keys.get(f"change/{world.round + 1}")
        lost = await self._lost(world)
        if not (moved or change is not None or lost):
            return None
        if lost:
            hosts = ", ".join(f"{addr} ({node_id})" for node_id, addr in lost)
            if world.size - len(lost) < self.min_nodes:
                # nodes waiting for a place count too: one read counts every live agent
                alive = await keys.count("nodes/")
                if alive < self.min_nodes:
                    raise RendezvousJobFailedError(
                        f"lost host {hosts}: {alive} node(s) left, fewer than "
                        f"min_nodes={self.min_nodes}"
                    )
            return WorldChange(f"lost host {hosts}", lost=tuple(addr for _, addr in lost))
        if moved:
            return WorldChange("the job re-formed its world without this node")
        assert change is not None
        why = json.loads(change.value)  # what ``malformed`` let into the copy
        if why["member"]:
            return WorldChange(f"host {why['host']} re-joined (its workers failed)")
        return WorldChange(f"host {why['host']} is waiting to join")

    async def report_failure(self, failure: Mapping[str, Any]) -> None:
        """Tell every agent that the job failed here, for good (``failure``: its root cause)."""
        await self._keys.fail(failure)

    async def shutdown(self) -> bool:
        """Close the rendezvous for every node (torch's ``shutdown``): a stop.

        Returns:
            True when the closed marker was written; False when it could
            not be, or when this node never had a session open (it never
            reached etcd, so it joined nothing to close).
        """
        if self._keys.session is None:
            return False
        try:
            with anyio.move_on_after(self.close_timeout):
                await self._keys.close("stopped")
                return True
        except Exception as e:  # the lease is gone, or etcd: nothing more to do
            logger.warning("rendezvous shutdown failed: %s", e)
        return False

    async def set_closed(self) -> None:
        await self._keys.close("stopped")

    # ---------------------------------------------------------- protocol

    async def _lost(self, world: World) -> list[tuple[str, str]]:
        """Members of ``world`` known lost: ``(node id, addr)``, in node id order.

        The world's lookout (group rank 0) watches the agents' departures,
        and tells the others of each member that left with a control key
        (``lost/<r>/<id>``); the lookout's own loss shows as its leased
        ``lookout/<r>`` gone.  Where etcd compacted the lookout's watch's
        history (departures may have been missed), one read of every
        agent's keys tells which members are gone.
        """
        keys = self._keys
        r = world.round
        if self._lookout:
            await self._keep_watch(world)
        start, _ = keys.key_range(f"lost/{r}/")
        lost = {name.decode(errors="replace"): kv.value.decode(errors="replace")
                for name, kv in keys.store().children(start).items()}  # fmt: skip
        if keys.get(f"lookout/{r}") is None and keys.current()[0] == r:
            lost[world.lookout[0]] = world.lookout[1]
        return sorted(lost.items())

    async def _keep_watch(self, world: World) -> None:
        """As the world's lookout: tell the others of the members that left, once each."""
        keys = self._keys
        store = keys.store()
        if store.gone_unsure:
            _, seats = await keys.live_members(world)
            store.gone_unsure = False
        else:
            seats = await keys.lost_members(world)
        new = [seat for seat in seats if seat.node_id not in self._reported]
        if new:
            await keys.report_lost(world, new)
            self._reported.update(seat.node_id for seat in new)

    async def _stand_down(self) -> None:
        """This node leaves its world: as its lookout, it stops watching departures."""
        if self._lookout:
            self._lookout = False
            self._reported = set()
            session = self._keys.session
            if session is not None:
                await session.unwatch_departures()


class _Session:
    def __init__(
        self, handler: EtcdRendezvousHandler, lease_renewed: Callable[[float], None] | None
    ) -> None:
        self._handler = handler
        self._lease_renewed = lease_renewed
        self._open: Any = None

    async def __aenter__(self) -> EtcdRendezvousHandler:
        h = self._handler
        keys = h._keys
        if keys.session is not None:
            raise RuntimeError(f"{h!r} already has a session")
        session = keys.new_session(h._host, h._port, h.lease_ttl)
        session.renewed = self._lease_renewed
        session.vet = h._vet
        # reaching etcd counts against join_timeout too: an endpoint that
        # never answers fails in time, naming itself and the last error
        self._open = session.open(h.join_timeout)
        await self._open.__aenter__()  # writes this node's liveness key too
        keys.session = session
        return h

    async def __aexit__(self, *exc: Any) -> None:
        h = self._handler
        session = h._keys.session
        h._keys.session = None
        h._info = h._world_now = None
        h._lookout, h._reported = False, set()
        try:
            await self._open.__aexit__(*exc)
        finally:
            if session is not None:
                r, e, b = h._spent
                h._spent = (r + session.requests, e + session.events, b + session.received)
