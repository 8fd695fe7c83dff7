"""One agent's session with etcd: a lease kept alive, and live copies of the job's keys.

Everything runs on the agent's event loop (``aetcd`` speaks etcd's v3 gRPC
API through ``grpc.aio``): no thread keeps the lease alive and nothing
polls.  Keys are followed with the list-and-watch pattern (list a range
once, then watch it from the listed revision), so every decision is taken
on a local copy that wakes its waiters when an event arrives; a broken
watch (etcd restarted, connection lost) is resumed from the last revision
seen, a compacted one re-listed.

Opening a session (the first connection, the lease's grant, the first
list) is bounded by the caller's timeout (the handler's ``join_timeout``):
an endpoint that refuses, never answers, does not resolve or speaks
HTTP/1 is retried with a progress line every few seconds, then fails with
one line naming it and the last error; one that answers as etcd never does
(an HTTP/2 server without etcd's API) fails at once.  Every call after
that is bounded by the lease (see Fencing).

What a session follows is chosen so that an agent receives O(1) events
and O(1) bytes per rendezvous round, not one record per agent of the job:

- the control range ``[prefix, liveness)``, a handful of small keys
  written once per round, copied in full from ``open()`` on (one read of
  those keys alone: opening a session costs O(1) however many agents run);
- its own seat key (``own``), into which a round's leader writes the
  node's place in the world: each agent reads its own, not the world;
- other ranges only while a caller needs them (``follow``/``unfollow``):
  the round's leader follows the round's joins; the departures from the
  liveness directory (one leased key per agent) only while a caller
  watches them (``watch_departures``): the world's lookout, a leader
  waiting for members, a c10d host waiting for the others to leave.

No range that every agent watches holds keys written or deleted at every
round or by every agent: etcd matches each write against every watch whose
range holds the key, and etcd 3.4 does so for a lease's keys while it holds
the lock that every keep-alive needs, so N agents watching every agent's
liveness key would stall renewals for O(N^2) when the N leases go.

Keep-alive and fencing: the lease is renewed every third of its TTL (as
etcd's own clients do: one small message on one keep-alive stream, so an
idle agent costs etcd ``3 / TTL`` requests a second), and a broken stream
is re-opened at once to wait for etcd's return (gRPC's wait-for-ready, with
a short reconnect backoff).  etcd can expire the lease no sooner than a
TTL after the last renewal it received, hence after the last renewal this
node *sent*: so when no renewal has succeeded for ``FENCE_AT`` of the TTL
(five sixths) after the last one sent, the session declares its lease lost
at once and the agent stops its workers, which get the rest of the TTL but
a twelfth to go (the guardian kills them at eleven twelfths), before the
other agents can form a world without this one.  etcd restarted on its data
dir keeps the lease (and restarts its clock), so an outage up to the fence
less the time since the last renewal, between 1.5 s and 2.5 s at
``lease_ttl=3``, passes without fencing.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import math
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import anyio.abc

from .._base.owner import Owner
from ._etcd_client import (
    CHANNEL_OPTIONS,
    KeyRange,
    KeyValue,
    bounded,
    count,
    describe,
    import_aetcd,
    prefix_end,
    put_and_range,
)
from .api import RendezvousConnectionError, RendezvousLeaseLostError

if TYPE_CHECKING:
    import aetcd

__all__ = ["FENCE_AT", "EtcdSession"]

logger = logging.getLogger("aioproc.rendezvous")

T = TypeVar("T")

_RETRY_FIRST, _RETRY_MAX = 0.05, 0.5  # backoff between calls to an unreachable etcd
# etcd's own clients renew a lease every third of its TTL: fewer renewals
# would leave an outage less time before the fence, more would load etcd.
_RENEWALS_PER_TTL = 3
FENCE_AT = 5 / 6
"""The fence, in TTLs after the last renewal sent (see the module's docstring)."""
_PROGRESS_EVERY = 5.0  # seconds between "waiting for etcd" lines while opening


class EtcdSession:
    """A lease and watched copies of the job's keys (see the module's docstring).

    Args:
        host, port: etcd's client address.
        prefix: the job's key prefix, where the control range starts.
        liveness: the directory of the agents' leased keys, right after
            the control range (which is ``[prefix, liveness)``).
        alive: this node's key in ``liveness``, and what it writes there
            (on its lease) as the session opens.
        own: this node's seat key, watched for puts (outside the control range).
        ttl: the lease's time to live, in whole seconds.
        name: how this node is named in messages (its address).
        check: called with each key and value before it enters the copy;
            False keeps it out (the caller has said why).

    Use ``async with session.open(timeout):``; its tasks (keep-alive,
    watches) live in that block.  ``keys`` is the live copy; ``await
    changed(since)`` returns once ``version`` moved past ``since`` (or when
    the lease is lost).
    """

    def __init__(
        self,
        host: str,
        port: int,
        prefix: bytes,
        liveness: bytes,
        alive: tuple[bytes, bytes],
        own: bytes,
        ttl: int,
        name: str,
        check: Callable[[bytes, KeyValue], bool] | None = None,
    ) -> None:
        if not (prefix < liveness and liveness.endswith(b"/")):
            raise ValueError(f"liveness directory {liveness!r} must follow prefix {prefix!r}")
        if not (alive[0].startswith(liveness) and len(alive[0]) > len(liveness)):
            raise ValueError(f"key {alive[0]!r} must be in the liveness directory {liveness!r}")
        if prefix <= own < liveness:
            raise ValueError(f"own key {own!r} must not be in the control range")
        self._aetcd = import_aetcd()
        self.endpoint = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self._check = check
        self.prefix = prefix
        self.liveness = liveness
        self.ttl = ttl
        self.name = name
        self.client: aetcd.Client = self._aetcd.Client(
            host, port, timeout=max(1, ttl), options=CHANNEL_OPTIONS
        )
        self.keys: dict[bytes, KeyValue] = {}
        # the same keys by directory (up to the last "/"): the leader counts
        # the round's joins at every join without going over all of them
        self.dirs: dict[bytes, dict[bytes, KeyValue]] = {}
        # liveness: the names of the keys deleted since the session opened,
        # each with the revision of its deletion
        self.gone: dict[bytes, int] = {}
        # set when deletions may have been missed (etcd compacted the watch's history)
        self.gone_unsure = False
        self.liveness_version = 0  # moves whenever ``gone`` (or ``gone_unsure``) does
        self.lease_id = 0
        self.lost: str | None = None  # why the lease was lost, once it is
        self.requests = 0  # calls made to etcd, for the scale benchmark
        self.renewals = 0  # keep-alives answered (not calls: one stream carries them)
        self.events = 0  # watch events received, for the scale benchmark
        # bytes of the keys and values received in watch events and reads into the
        # copy (the scale benchmark's and tests' measure of what an agent reads)
        self.received = 0
        self.version = 0  # moves at every change of the copy (see ``changed``)
        self.control = KeyRange(prefix, liveness)
        self._liveness = KeyRange(liveness, prefix_end(liveness), kind="deletes")
        self._departures_wanted = 0  # callers of ``watch_departures`` not yet done
        self._alive = alive
        self.own = own
        self._own = KeyRange(own, own + b"\0", kind="puts")
        self._followed: dict[tuple[bytes, bytes], KeyRange] = {}
        self._change = asyncio.Event()
        self._last_ok = 0.0
        # told the time by which the next renewal must succeed, after each one
        # (the agent's guardian fences the workers itself when it passes)
        self.renewed: Callable[[float], None] | None = None
        self._fence: anyio.CancelScope | None = None  # the keep-alive's; its deadline: the fence
        # while opening: the caller's (deadline, timeout); later the lease bounds calls
        self._opening: tuple[float, float] | None = None
        # while opening, after a call that failed as if etcd were not up yet: called with
        # the seconds left; it raises when the endpoint will never answer as etcd
        self.vet: Callable[[float], Awaitable[None]] | None = None
        # a call must not hang on a partition longer than it takes to notice one
        self.call_timeout = max(1.0, ttl / 2)

    # ------------------------------------------------------------ lifecycle

    def open(self, timeout: float) -> _Open:
        """An async context manager: grant the lease, list, watch, keep alive.

        Entering it takes at most ``timeout`` seconds (the handler's
        ``join_timeout``): an etcd not reached by then raises
        ``RendezvousConnectionError``, naming the endpoint and the last
        error.  Leaving it revokes the lease (the agent's leased keys
        vanish at once) and closes the connection, shielded and bounded.
        """
        return _Open(self, timeout)

    async def _grant(self) -> Any:
        """A new lease, counted as renewed when the grant was sent (etcd starts its TTL later)."""
        sent = time.monotonic()
        lease = await self.client.lease(self.ttl)
        self.lease_id = int(lease.id)
        self._renewed(sent)
        return lease

    async def _list(self) -> None:
        """Write this node's key, and copy the control range, in one transaction.

        Every watch starts after its revision.
        """
        kvs, revision = await self.call(
            lambda: put_and_range(
                self.client,
                *self._alive,
                self.lease_id,
                self.prefix,
                self.liveness,
                self.call_timeout,
            )
        )
        self._replace(self.control, kvs, revision)
        self._own.revision = revision

    async def _stop(self) -> None:
        for followed in [*self._followed.values(), self._liveness]:
            await followed.stop()
        self._followed.clear()
        with anyio.move_on_after(max(1.0, self.ttl / 2), shield=True):
            if self.lease_id and self.lost is None:
                try:
                    await bounded(self.client.revoke_lease(self.lease_id), self.call_timeout)
                    self.requests += 1
                except Exception as e:  # etcd gone: the lease expires by itself
                    logger.debug("revoking lease %x failed: %r", self.lease_id, e)
        with anyio.CancelScope(shield=True):
            try:
                await bounded(self.client.close(), 1.0)
            except Exception as e:  # the connection is dropped with the process anyway
                logger.debug("closing the etcd connection failed: %r", e)

    # --------------------------------------------------------------- calls

    async def call(self, fn: Callable[[], Awaitable[T]]) -> T:
        """``await fn()``, retried with backoff while etcd is unreachable.

        While the session opens, the retries end at the caller's deadline,
        with a progress line every few seconds, or at once when ``vet``
        says the endpoint is no etcd; later the lease bounds them (a lost
        lease ends them).

        Raises:
            RendezvousLeaseLostError: the lease was lost meanwhile.
            RendezvousConnectionError: etcd was not reached before the
                opening deadline, or it answered with an error no retry
                cures (the endpoint is not etcd's client address, say), or
                ``vet`` raised it.
        """
        aetcd = self._aetcd
        retried = (
            TimeoutError,
            aetcd.ConnectionFailedError,
            aetcd.ConnectionTimeoutError,
            aetcd.WatchTimeoutError,
        )
        delay = _RETRY_FIRST
        say_at = 0.0  # when the next progress line is due
        while True:
            self._check_lease()
            timeout = self.call_timeout
            if self._opening is not None:
                timeout = max(0.05, min(timeout, self._opening[0] - time.monotonic()))
            try:
                self.requests += 1
                return await bounded(fn(), timeout)
            except aetcd.RevisionCompactedError:
                raise  # not a failure of etcd: the watch re-lists
            except retried as e:
                last = describe(e)
            except aetcd.ClientError as e:
                hint = f" (is {self.endpoint} etcd's client address?)" if not self.lease_id else ""
                raise RendezvousConnectionError(
                    f"etcd at {self.endpoint} answered with an error: {describe(e)}{hint}"
                ) from None
            # etcd is unreachable: back off before the next try
            now = time.monotonic()
            if self._opening is None:
                logger.debug("etcd call failed, retrying in %.2f s: %s", delay, last)
            else:
                deadline, whole = self._opening
                left = deadline - now
                if left > 0 and self.vet is not None:
                    await self.vet(left)
                    now = time.monotonic()
                    left = deadline - now
                if left <= 0:
                    raise RendezvousConnectionError(
                        f"could not reach etcd at {self.endpoint} within {whole:g} s "
                        f"(join_timeout): {last}"
                    )
                if now >= say_at:
                    say_at = now + _PROGRESS_EVERY
                    logger.warning(
                        "waiting for etcd at %s: %s; retrying (%d s left)",
                        self.endpoint,
                        last,
                        math.ceil(left),
                    )
                delay = min(delay, left)
            await anyio.sleep(delay)
            delay = min(_RETRY_MAX, delay * 2)

    def _check_lease(self) -> None:
        if self.lost is not None:
            raise RendezvousLeaseLostError(self.lost)

    async def changed(self, since: int) -> None:
        """Return once ``version`` is no longer ``since``, or at once if the lease is lost.

        Callers read ``version`` before they look at the copy and pass it
        here, so a change that arrived while they were awaiting something
        else is never slept through.

        Raises:
            RendezvousLeaseLostError: the lease is lost.
        """
        self._check_lease()
        if self.version == since:
            await self._change.wait()
        self._check_lease()

    def _notify(self) -> None:
        self.version += 1
        self._change.set()
        self._change = asyncio.Event()

    # ---------------------------------------------------------------- copy

    def children(self, directory: bytes) -> dict[bytes, KeyValue]:
        """The copied keys right under ``directory`` (ending in "/"), by name; do not modify."""
        return self.dirs.get(directory, {})

    def _set(self, key: bytes, kv: KeyValue) -> None:
        if self._check is not None and not self._check(key, kv):
            self._pop(key)  # overwritten with what the protocol cannot use: gone for it
            return
        self.keys[key] = kv
        cut = key.rindex(b"/") + 1
        self.dirs.setdefault(key[:cut], {})[key[cut:]] = kv

    def _pop(self, key: bytes) -> None:
        if self.keys.pop(key, None) is None:
            return
        cut = key.rindex(b"/") + 1
        directory = key[:cut]
        children = self.dirs.get(directory)
        if children is not None:
            children.pop(key[cut:], None)
            if not children:
                del self.dirs[directory]

    def _replace(self, copied: KeyRange, kvs: Any, revision: int) -> None:
        """Make the copy of ``copied``'s range what a list at ``revision`` returned."""
        for key in [k for k in self.keys if copied.start <= k < copied.end]:
            self._pop(key)
        for kv in kvs:
            self.received += len(kv.key) + len(kv.value)
            self._set(kv.key, KeyValue(kv.value, kv.create_revision, kv.mod_revision, kv.lease))
        copied.revision = revision
        self._notify()

    def follows(self, start: bytes, end: bytes) -> bool:
        """Whether ``[start, end)`` is followed (``follow``) right now."""
        return (start, end) in self._followed

    async def follow(self, start: bytes, end: bytes) -> int:
        """Copy the keys in ``[start, end)`` too, until ``unfollow``: list them, then watch.

        Idempotent: a range already followed costs nothing.

        Returns:
            The revision the range was listed at (the copy holds it from then on).
        """
        if (start, end) in self._followed:
            return self._followed[(start, end)].listed
        followed = KeyRange(start, end)
        result = await self.call(lambda: self.client.get_range(start, end))
        if (start, end) in self._followed:  # followed meanwhile, by another caller
            return self._followed[(start, end)].listed
        self._followed[(start, end)] = followed
        followed.listed = int(result.header.revision)
        self._replace(followed, result.kvs, followed.listed)
        followed.task = asyncio.get_running_loop().create_task(
            self._watch(followed), name="aioproc-etcd-watch"
        )
        return followed.listed

    def watch_departures(self, since: int) -> None:
        """Hear of the agents that leave (``gone``) from revision ``since`` on, until ``unwatch``.

        Callers count: the watch runs while one wants it, from the earliest
        revision one asked for (a running watch is not moved back: its
        callers asked for it before).
        """
        self._departures_wanted += 1
        watched = self._liveness
        if watched.task is None or watched.task.done():
            watched.revision = max(watched.revision, since - 1)
            watched.task = asyncio.get_running_loop().create_task(
                self._watch(watched), name="aioproc-etcd-watch-departures"
            )

    async def unwatch_departures(self) -> None:
        """One caller of ``watch_departures`` is done; the watch stops with the last.

        Cancellation: shielded; the watch is cancelled with a bounded wait.
        """
        self._departures_wanted = max(0, self._departures_wanted - 1)
        if not self._departures_wanted:
            await self._liveness.stop()

    async def unfollow(self, start: bytes, end: bytes) -> None:
        """Stop following ``[start, end)`` and drop its keys from the copy.

        Cancellation: shielded; the watch is cancelled with a bounded wait.
        """
        followed = self._followed.pop((start, end), None)
        if followed is None:
            return
        await followed.stop()
        for key in [k for k in self.keys if start <= k < end]:
            self._pop(key)
        self._notify()

    # ------------------------------------------------------------ reads

    async def count(self, start: bytes, end: bytes) -> int:
        """How many keys are in ``[start, end)`` now (one read, O(1) bytes whatever the count)."""
        found, _ = await self.call(lambda: count(self.client, start, end, self.call_timeout))
        return found

    async def own_now(self) -> KeyValue | None:
        """This node's key as etcd holds it now (one read), also put into the copy."""
        own = self.own
        result = await self.call(lambda: self.client.get(own))
        if result is None:
            return None
        self.received += len(own) + len(result.value)
        self._set(
            own, KeyValue(result.value, result.create_revision, result.mod_revision, result.lease)
        )
        self._notify()
        return self.keys.get(own)

    def quiet(self) -> None:
        """Stop hearing of this node's seats and of departures (the job is over).

        Every agent revokes its lease as it leaves: a watch of the others'
        departures would hear of each, so it stops as soon as the job ended.
        """
        self._departures_wanted = 0
        for watched in (self._liveness, self._own):
            if watched.scope is not None:
                watched.scope.cancel()

    # ---------------------------------------------------------------- watch

    async def _relist(self, watched: KeyRange) -> None:
        """A fresh list of ``watched``'s range, after its watch's history was compacted."""
        if watched is self._liveness:
            # deletions may have been missed, and a list cannot show them:
            # whoever needs to know of losses must count instead
            start, end = watched.start, watched.end
            _, revision = await self.call(lambda: count(self.client, start, end, self.call_timeout))
            self.gone_unsure = True
            self.liveness_version += 1
            watched.revision = revision
            self._notify()
            return
        result = await self.call(lambda: self.client.get_range(watched.start, watched.end))
        self._replace(watched, result.kvs, int(result.header.revision))

    def _apply(self, watched: KeyRange, event: Any) -> None:
        kv = event.kv
        self.events += 1
        self.received += len(kv.key) + len(kv.value)
        if event.prev_kv is not None:
            self.received += len(event.prev_kv.key) + len(event.prev_kv.value)
        if watched is self._liveness:
            # only deletions are delivered: a liveness key is never re-created
            self.gone[kv.key[len(self.liveness) :]] = int(kv.mod_revision)
            self.liveness_version += 1
        elif event.kind == "DELETE":
            self._pop(kv.key)
        else:
            self._set(kv.key, KeyValue(kv.value, kv.create_revision, kv.mod_revision, kv.lease))
        watched.revision = max(watched.revision, int(kv.mod_revision))
        self._notify()

    async def _watch(self, watched: KeyRange) -> None:
        """Apply the watch's events to the copy; resume it when it breaks.

        Runs until cancelled, or until ``quiet()`` cancels ``watched.scope``.
        """
        with anyio.CancelScope() as watched.scope:
            await self._follow_events(watched)
        watched.scope = None

    async def _follow_events(self, watched: KeyRange) -> None:
        aetcd = self._aetcd
        kinds = {"deletes": aetcd.rtypes.EventKind.DELETE, "puts": aetcd.rtypes.EventKind.PUT}
        kind = kinds.get(watched.kind)
        delay = _RETRY_FIRST
        while self.lost is None:
            try:
                watch = await self.call(
                    lambda: self.client.watch(
                        watched.start,
                        range_end=watched.end,
                        start_revision=watched.revision + 1,
                        kind=kind,
                        prev_kv=watched.prev_kv,
                    )
                )
                try:
                    async for event in watch:
                        self._apply(watched, event)
                        delay = _RETRY_FIRST
                finally:
                    with anyio.CancelScope(shield=True):
                        try:
                            await bounded(watch.cancel(), 1.0)
                        except Exception as e:  # the stream is gone: nothing to cancel
                            logger.debug("cancelling the etcd watch failed: %r", e)
            except aetcd.RevisionCompactedError:
                await self._relist(watched)  # events were lost: start from a fresh list
                continue
            except RendezvousLeaseLostError:
                return
            except (aetcd.ClientError, aetcd.rpc.AioRpcError, RendezvousConnectionError) as e:
                logger.debug("etcd watch broke, resuming in %.2f s: %r", delay, e)
            # etcd is unreachable: back off before resuming the watch
            await anyio.sleep(delay)
            delay = min(_RETRY_MAX, delay * 2)

    # ---------------------------------------------------------- keep-alive

    @property
    def fence_deadline(self) -> float:
        """When this node fences itself unless a keep-alive succeeds first (monotonic)."""
        return self._last_ok + self.ttl * FENCE_AT

    def _renewed(self, sent: float) -> None:
        """A renewal (or the grant) sent at ``sent`` succeeded.

        etcd expires the lease ``ttl`` seconds after it received the
        renewal at the earliest, so the fence moves to ``sent`` plus
        ``FENCE_AT`` of the TTL, here and in ``renewed`` (the agent's guardian).
        """
        self._last_ok = sent
        if self._fence is not None:
            self._fence.deadline = self.fence_deadline
        if self.renewed is not None:
            self.renewed(self.fence_deadline)

    async def _keep_alive(self) -> None:
        expired = False
        # the scope's deadline is the fence: every renewal moves it (``_renewed``)
        with anyio.CancelScope(deadline=self.fence_deadline) as self._fence:
            expired = await self._renew()
        self._fence = None
        if expired:
            self._lose(f"its etcd lease {self.lease_id:x} expired")
        else:
            self._lose(
                f"no etcd keep-alive succeeded for {self.ttl * FENCE_AT:.3g} s "
                f"(lease TTL {self.ttl} s): etcd is unreachable from this host"
            )

    async def _renew(self) -> bool:
        """Renew the lease on a keep-alive stream, re-opened when it breaks.

        Returns True once etcd says the lease expired; runs until the
        fence cancels it otherwise.  A renewal goes out every period
        whether or not the previous one was answered yet (etcd answers
        each in order), so a slow etcd delays the answers but not the
        renewals: each answer moves the fence from the time its renewal
        was sent.  A stream is opened with gRPC's wait-for-ready: while
        etcd is down its first renewal waits for the connection, and goes
        out the moment etcd is back.
        """
        while True:
            stream = None
            tasks: list[asyncio.Task[Any]] = []
            sent: collections.deque[float] = collections.deque()  # renewals not answered yet
            try:
                await self.client.connect()
                stream = self.client.leasestub.LeaseKeepAlive(
                    metadata=self.client.metadata, wait_for_ready=True
                )
                # Two plain tasks per stream, one writing, one reading: grpc.aio
                # cancels the call with a cancelled read, so neither is cancelled
                # but with the stream, and a renewal costs no task of its own.
                loop = asyncio.get_running_loop()
                tasks = [
                    loop.create_task(self._send_renewals(stream, sent)),
                    loop.create_task(self._read_renewals(stream, sent)),
                ]
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if task.result():
                        return True  # etcd says the lease expired
            except Exception as e:  # gRPC's errors vary (an RPC error, a finished call...)
                logger.debug("etcd keep-alive stream broke, re-opening it: %s", describe(e))
            finally:
                for task in tasks:
                    task.cancel()
                    task.add_done_callback(_retrieve)
                if stream is not None:
                    stream.cancel()
            # etcd answered and ended the stream: a short pause before re-opening it
            # (the new stream's first renewal then waits for etcd, however long)
            await anyio.sleep(_RETRY_FIRST)

    async def _send_renewals(self, stream: Any, sent: collections.deque[float]) -> bool:
        """Write a renewal every period, the first as soon as the stream connects."""
        request = self._aetcd.rpc.LeaseKeepAliveRequest(ID=self.lease_id)
        period = self.ttl / _RENEWALS_PER_TTL
        while True:
            now = time.monotonic()
            sent.append(now)
            await stream.write(request)
            await asyncio.sleep(max(0.0, now + period - time.monotonic()))

    async def _read_renewals(self, stream: Any, sent: collections.deque[float]) -> bool:
        """Move the fence with each answer; True once etcd says the lease expired."""
        answer = self._aetcd.rpc.LeaseKeepAliveResponse
        while True:
            reply = await stream.read()
            if not isinstance(reply, answer):
                raise EOFError("etcd ended the keep-alive stream")
            if reply.TTL <= 0:
                return True
            self.renewals += 1
            self._renewed(sent.popleft())

    def _lose(self, why: str) -> None:
        self.lost = f"this node ({self.name}) was fenced: {why}; its workers are stopped"
        logger.warning("rendezvous: %s", why)
        self._notify()


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()  # a task cancelled with its stream: its error is of no interest


class _Open:
    """The session's lifetime: an ``Owner`` holds its tasks from entry to exit.

    The owner's task group runs in a task of its own: the agent holds the
    session open across its own cancel scopes, which a task group opened in
    the agent's task would straddle.
    """

    def __init__(self, session: EtcdSession, timeout: float) -> None:
        self._session = session
        self._timeout = timeout
        self._owner: Owner[None] = Owner("aioproc-etcd-session")

    async def __aenter__(self) -> EtcdSession:
        s = self._session
        s._opening = (time.monotonic() + self._timeout, self._timeout)
        self._owner.start(self._hold)
        try:
            await s.call(s._grant)
            await self._owner.opened()
            # kept alive from now on: the first list may have to wait for etcd too
            self._start(s._keep_alive, "aioproc-etcd-keepalive")
            await s._list()
        except BaseException as e:
            await self.__aexit__(type(e), e, e.__traceback__)
            raise
        finally:
            s._opening = None
        self._start(functools.partial(s._watch, s.control), "aioproc-etcd-watch")
        self._start(functools.partial(s._watch, s._own), "aioproc-etcd-watch-own")
        return s

    def _start(self, task: Callable[[], Coroutine[Any, Any, None]], name: str) -> None:
        group = self._owner.group
        assert group is not None, "the owner ended before the session was open"
        group.start_soon(task, name=name)

    async def _hold(self, group: anyio.abc.TaskGroup) -> None:
        await self._owner.closing(None)
        group.cancel_scope.cancel()  # the tasks run until the session ends

    async def __aexit__(self, *exc: object) -> None:
        try:
            await self._owner.close(None)
        except Exception as e:  # a bug in a task: do not hide the run's own outcome
            logger.warning("etcd session task failed: %r", e)
        await self._session._stop()
