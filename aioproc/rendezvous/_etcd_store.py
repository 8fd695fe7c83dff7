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

What a session follows is chosen so that an agent receives O(1) events per
rendezvous round, not one per agent of the job:

- the control range ``[prefix, liveness)``, a handful of keys written once
  per round, copied in full from ``open()`` on;
- the liveness directory (one leased key per agent) through a snapshot of
  its names and a watch that only delivers deletions: an agent learns of
  every loss, never of every arrival (see ``gone_since``);
- other ranges only while a caller needs them (``follow``/``unfollow``):
  the round's leader follows the round's joins.

Fencing: if no keep-alive has succeeded for two thirds of the TTL, the
session declares its lease lost at once, before etcd can expire it and the
other agents can form a world without this one, so the agent stops its
workers in time.  That deadline counts from the last renewal *sent* before
etcd became unreachable, so the lease is renewed often (``_RENEWALS_PER_TTL``
times per TTL, one small message each on one keep-alive stream) and a
broken stream is re-opened at once to wait for etcd's return (gRPC's
wait-for-ready, with a short reconnect backoff): etcd restarted on its
data dir keeps the lease, and an outage up to two thirds of the TTL less
one renewal period (1.9 s at ``lease_ttl=3``) passes without fencing.
"""

from __future__ import annotations

import asyncio
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
    describe,
    exchange,
    import_aetcd,
    prefix_end,
)
from .api import RendezvousConnectionError, RendezvousLeaseLostError

if TYPE_CHECKING:
    import aetcd

__all__ = ["EtcdSession"]

logger = logging.getLogger("aioproc.rendezvous")

T = TypeVar("T")

_RETRY_FIRST, _RETRY_MAX = 0.05, 0.5  # backoff between calls to an unreachable etcd
# The fence counts from the last renewal sent before an outage: the more
# often the lease is renewed, the longer an outage it survives (two thirds
# of the TTL less one period).
_RENEWALS_PER_TTL = 30
_PROGRESS_EVERY = 5.0  # seconds between "waiting for etcd" lines while opening


class EtcdSession:
    """A lease and watched copies of the job's keys (see the module's docstring).

    Args:
        host, port: etcd's client address.
        prefix: the job's key prefix, where the control range starts.
        liveness: the directory of the agents' leased keys, right after
            the control range (which is ``[prefix, liveness)``).
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
        ttl: int,
        name: str,
        check: Callable[[bytes, KeyValue], bool] | None = None,
    ) -> None:
        if not (prefix < liveness and liveness.endswith(b"/")):
            raise ValueError(f"liveness directory {liveness!r} must follow prefix {prefix!r}")
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
        # liveness: the names listed at ``alive_at``, and those deleted since
        self.alive: frozenset[bytes] = frozenset()
        self.alive_at = 0
        self.gone: set[bytes] = set()
        self.liveness_version = 0  # moves whenever ``gone_since`` may answer differently
        self.lease_id = 0
        self.lost: str | None = None  # why the lease was lost, once it is
        self.requests = 0  # calls made to etcd, for the scale benchmark
        self.renewals = 0  # keep-alives answered (not calls: one stream carries them)
        self.events = 0  # watch events received, for the scale benchmark
        self.version = 0  # moves at every change of the copy (see ``changed``)
        self.control = KeyRange(prefix, liveness, deletions_only=False)
        self._liveness = KeyRange(liveness, prefix_end(liveness), deletions_only=True)
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
        """The first copy of the control range and of the liveness directory."""
        # one read for both, at the same revision, from which both watches start
        start, end = self.prefix, self._liveness.end
        result = await self.call(lambda: self.client.get_range(start, end))
        revision = int(result.header.revision)
        self._replace(self.control, [kv for kv in result.kvs if kv.key < self.liveness], revision)
        self._snapshot([kv.key for kv in result.kvs if kv.key >= self.liveness], revision)
        self._liveness.revision = revision

    async def _stop(self) -> None:
        for followed in list(self._followed.values()):
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
            self._set(kv.key, KeyValue(kv.value, kv.create_revision, kv.mod_revision, kv.lease))
        copied.revision = revision
        self._notify()

    def follows(self, start: bytes, end: bytes) -> bool:
        """Whether ``[start, end)`` is followed (``follow``) right now."""
        return (start, end) in self._followed

    async def follow(self, start: bytes, end: bytes) -> None:
        """Copy the keys in ``[start, end)`` too, until ``unfollow``: list them, then watch.

        Idempotent: a range already followed costs nothing.
        """
        if (start, end) in self._followed:
            return
        followed = KeyRange(start, end, deletions_only=False)
        result = await self.call(lambda: self.client.get_range(start, end))
        if (start, end) in self._followed:  # followed meanwhile, by another caller
            return
        self._followed[(start, end)] = followed
        self._replace(followed, result.kvs, int(result.header.revision))
        followed.task = asyncio.get_running_loop().create_task(
            self._watch(followed), name="aioproc-etcd-watch"
        )

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

    # ------------------------------------------------------------ liveness

    def gone_since(self, name: bytes, revision: int) -> bool:
        """Whether the liveness key ``name`` that existed at ``revision`` is gone now.

        The premise holds for an agent that wrote a leased key at
        ``revision`` (a join): its liveness key, on the same lease, existed
        then.  Gone if its deletion was watched, or if the snapshot was
        listed after ``revision`` without it (deletions before the watch
        started show as absence from the snapshot).
        """
        if name in self.gone:
            return True
        return revision <= self.alive_at and name not in self.alive

    async def refresh_liveness(self) -> int:
        """List the liveness directory anew (names only); the number of live agents.

        Makes ``gone_since`` exact as of now, whatever the deletion watch
        has delivered so far.
        """
        directory = self.liveness
        result = await self.call(lambda: self.client.get_prefix(directory, keys_only=True))
        self._snapshot([kv.key for kv in result.kvs], int(result.header.revision))
        return len(result.kvs)

    def _snapshot(self, keys: list[bytes], revision: int) -> None:
        if revision < self.alive_at:
            return  # an older list than the one held: it tells nothing new
        cut = len(self.liveness)
        self.alive = frozenset(k[cut:] for k in keys)
        self.alive_at = revision
        self.liveness_version += 1
        self._notify()

    # ---------------------------------------------------------------- watch

    async def _relist(self, watched: KeyRange) -> None:
        """A fresh list of ``watched``'s range, after its watch's history was compacted."""
        if watched is self._liveness:
            await self.refresh_liveness()
            self._liveness.revision = self.alive_at
            return
        result = await self.call(lambda: self.client.get_range(watched.start, watched.end))
        self._replace(watched, result.kvs, int(result.header.revision))

    def _apply(self, watched: KeyRange, event: Any) -> None:
        kv = event.kv
        self.events += 1
        if watched.deletions_only:
            # only deletions are delivered: a liveness key is never re-created
            self.gone.add(kv.key[len(self.liveness) :])
            self.liveness_version += 1
        elif event.kind == "DELETE":
            self._pop(kv.key)
        else:
            self._set(kv.key, KeyValue(kv.value, kv.create_revision, kv.mod_revision, kv.lease))
        watched.revision = max(watched.revision, int(kv.mod_revision))
        self._notify()

    async def _watch(self, watched: KeyRange) -> None:
        """Apply the watch's events to the copy; resume it when it breaks."""
        aetcd = self._aetcd
        kind = aetcd.rtypes.EventKind.DELETE if watched.deletions_only else None
        delay = _RETRY_FIRST
        while self.lost is None:
            try:
                watch = await self.call(
                    lambda: self.client.watch(
                        watched.start,
                        range_end=watched.end,
                        start_revision=watched.revision + 1,
                        kind=kind,
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
        return self._last_ok + self.ttl * 2 / 3

    def _renewed(self, sent: float) -> None:
        """A renewal (or the grant) sent at ``sent`` succeeded.

        etcd expires the lease ``ttl`` seconds after it received the
        renewal at the earliest, so the fence moves to ``sent`` plus two
        thirds of the TTL, here and in ``renewed`` (the agent's guardian).
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
                f"no etcd keep-alive succeeded for {self.ttl * 2 / 3:.3g} s "
                f"(lease TTL {self.ttl} s): etcd is unreachable from this host"
            )

    async def _renew(self) -> bool:
        """Renew the lease on a keep-alive stream, re-opened when it breaks.

        Returns True once etcd says the lease expired; runs until the
        fence cancels it otherwise.  A stream is opened with gRPC's
        wait-for-ready: while etcd is down its first renewal waits for the
        connection, and goes out the moment etcd is back.
        """
        aetcd = self._aetcd
        period = self.ttl / _RENEWALS_PER_TTL
        request = aetcd.rpc.LeaseKeepAliveRequest(ID=self.lease_id)
        answer = aetcd.rpc.LeaseKeepAliveResponse
        delay = _RETRY_FIRST
        while True:
            stream = None
            try:
                await self.client.connect()
                stream = self.client.leasestub.LeaseKeepAlive(
                    metadata=self.client.metadata, wait_for_ready=True
                )
                while True:
                    sent = time.monotonic()
                    # an answer slower than this is a stream to replace, well before the fence
                    reply = await bounded(exchange(stream, request, answer), self.ttl / 3)
                    if reply.TTL <= 0:
                        return True
                    self.renewals += 1
                    self._renewed(sent)
                    delay = _RETRY_FIRST
                    # the keep-alive period of the lease protocol
                    await anyio.sleep_until(sent + period)
            except Exception as e:  # gRPC's errors vary (an RPC error, a finished call...)
                logger.debug("etcd keep-alive stream broke, re-opening it: %s", describe(e))
            finally:
                if stream is not None:
                    stream.cancel()
            # etcd answered and ended the stream: back off before re-opening it
            await anyio.sleep(delay)
            delay = min(period, delay * 2)

    def _lose(self, why: str) -> None:
        self.lost = f"this node ({self.name}) was fenced: {why}; its workers are stopped"
        logger.warning("rendezvous: %s", why)
        self._notify()


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
        self._start(functools.partial(s._watch, s._liveness), "aioproc-etcd-watch-liveness")
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
