"""One agent's session with etcd: a lease kept alive, and live copies of the job's keys.

Everything runs on the agent's event loop (``aetcd`` speaks etcd's v3 gRPC
API through ``grpc.aio``): no thread keeps the lease alive and nothing
polls.  The lease is refreshed every third of its TTL.  Keys are followed
with the list-and-watch pattern (list a range once, then watch it from the
listed revision), so every decision is taken on a local copy that wakes its
waiters when an event arrives; a broken watch (etcd restarted, connection
lost) is resumed from the last revision seen, a compacted one re-listed.

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
workers in time.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import anyio

from .api import RendezvousLeaseLostError

if TYPE_CHECKING:
    import aetcd

__all__ = ["EtcdSession", "KeyValue", "prefix_end", "ttl_seconds"]

logger = logging.getLogger("aioproc.rendezvous")

T = TypeVar("T")

# gRPC reconnects with a 1 s initial backoff growing to 120 s by default: an
# agent must find a restarted etcd well within its lease TTL.
_CHANNEL_OPTIONS = {
    "grpc.initial_reconnect_backoff_ms": 100,
    "grpc.min_reconnect_backoff_ms": 100,
    "grpc.max_reconnect_backoff_ms": 500,
}
_RETRY_FIRST, _RETRY_MAX = 0.05, 0.5  # backoff between calls to an unreachable etcd


async def bounded(coro: Awaitable[T], timeout: float) -> T:
    """``await coro`` (a gRPC call), at most ``timeout`` seconds.

    The call runs in a task of its own: grpc.aio answers a cancellation with
    a CancelledError of its own making, which an anyio cancel scope would
    not recognise as its own and would let escape.  Awaiting the task
    through ``asyncio.wait`` keeps every cancellation this task receives
    the caller's own; the call is cancelled with it.

    Raises:
        TimeoutError: the call took longer than ``timeout``.
    """
    task = asyncio.ensure_future(coro)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout)
    except BaseException:
        task.cancel()
        task.add_done_callback(_retrieve)  # it ends by itself, promptly
        raise
    if not done:
        task.cancel()
        task.add_done_callback(_retrieve)
        raise TimeoutError(f"etcd did not answer within {timeout:.3g} s")
    return task.result()


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()  # a cancelled call's error is of no interest


def import_aetcd() -> Any:
    """``aetcd``, or an ImportError that says how to install it."""
    try:
        import aetcd
    except ImportError as e:
        raise ImportError(
            "the etcd rendezvous backend needs the aetcd package: pip install 'aioproc[etcd]'"
        ) from e
    return aetcd


class KeyValue:
    """A key of the job as last seen: its value and creation revision."""

    __slots__ = ("create_revision", "lease", "mod_revision", "value")

    def __init__(self, value: bytes, create_revision: int, mod_revision: int, lease: int) -> None:
        self.value = value
        self.create_revision = create_revision
        self.mod_revision = mod_revision
        self.lease = lease


class EtcdSession:
    """A lease and watched copies of the job's keys (see the module's docstring).

    Args:
        host, port: etcd's client address.
        prefix: the job's key prefix, where the control range starts.
        liveness: the directory of the agents' leased keys, right after
            the control range (which is ``[prefix, liveness)``).
        ttl: the lease's time to live, in whole seconds.
        name: how this node is named in messages (its address).

    Use ``async with session.open():``; its tasks (keep-alive, watches)
    live in that block.  ``keys`` is the live copy; ``await
    changed(since)`` returns once ``version`` moved past ``since`` (or when
    the lease is lost).
    """

    def __init__(
        self, host: str, port: int, prefix: bytes, liveness: bytes, ttl: int, name: str
    ) -> None:
        if not (prefix < liveness and liveness.endswith(b"/")):
            raise ValueError(f"liveness directory {liveness!r} must follow prefix {prefix!r}")
        self._aetcd = import_aetcd()
        self.prefix = prefix
        self.liveness = liveness
        self.ttl = ttl
        self.name = name
        self.client: aetcd.Client = self._aetcd.Client(
            host, port, timeout=max(1, ttl), options=_CHANNEL_OPTIONS
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
        self.events = 0  # watch events received, for the scale benchmark
        self.version = 0  # moves at every change of the copy (see ``changed``)
        self.control = _Range(prefix, liveness, deletions_only=False)
        self._liveness = _Range(liveness, prefix_end(liveness), deletions_only=True)
        self._followed: dict[tuple[bytes, bytes], _Range] = {}
        self._change = anyio.Event()
        self._last_ok = 0.0
        # a call must not hang on a partition longer than it takes to notice one
        self.call_timeout = max(1.0, ttl / 2)

    # ------------------------------------------------------------ lifecycle

    def open(self) -> _Open:
        """An async context manager: grant the lease, list, watch, keep alive.

        Leaving it revokes the lease (the agent's leased keys vanish at
        once) and closes the connection, shielded and bounded.
        """
        return _Open(self)

    async def _start(self) -> None:
        self._last_ok = time.monotonic()
        lease = await self.call(lambda: self.client.lease(self.ttl))
        self.lease_id = int(lease.id)
        # one read for both: the control range and the liveness directory
        # at the same revision, from which both watches start
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

        Raises:
            RendezvousLeaseLostError: the lease was lost meanwhile.
        """
        aetcd = self._aetcd
        delay = _RETRY_FIRST
        while True:
            self._check_lease()
            try:
                self.requests += 1
                return await bounded(fn(), self.call_timeout)
            except (TimeoutError, aetcd.ConnectionFailedError, aetcd.ConnectionTimeoutError) as e:
                logger.debug("etcd call failed, retrying in %.2f s: %r", delay, e)
            # etcd is unreachable: back off before the next try
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
        self._change = anyio.Event()

    # ---------------------------------------------------------------- copy

    def children(self, directory: bytes) -> dict[bytes, KeyValue]:
        """The copied keys right under ``directory`` (ending in "/"), by name; do not modify."""
        return self.dirs.get(directory, {})

    def _set(self, key: bytes, kv: KeyValue) -> None:
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

    def _replace(self, copied: _Range, kvs: Any, revision: int) -> None:
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
        followed = _Range(start, end, deletions_only=False)
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

    async def _relist(self, watched: _Range) -> None:
        """A fresh list of ``watched``'s range, after its watch's history was compacted."""
        if watched is self._liveness:
            await self.refresh_liveness()
            self._liveness.revision = self.alive_at
            return
        result = await self.call(lambda: self.client.get_range(watched.start, watched.end))
        self._replace(watched, result.kvs, int(result.header.revision))

    def _apply(self, watched: _Range, event: Any) -> None:
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

    async def _watch(self, watched: _Range) -> None:
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
            except aetcd.ClientError as e:
                logger.debug("etcd watch broke, resuming in %.2f s: %r", delay, e)
            # etcd is unreachable: back off before resuming the watch
            await anyio.sleep(delay)
            delay = min(_RETRY_MAX, delay * 2)

    # ---------------------------------------------------------- keep-alive

    async def _keep_alive(self) -> None:
        interval = self.ttl / 3
        fence_after = self.ttl * 2 / 3
        while True:
            sent = time.monotonic()
            reply = None
            with anyio.move_on_at(self._last_ok + fence_after):
                reply = await self._refresh()
            if reply is None:
                self._lose(
                    f"no etcd keep-alive succeeded for {fence_after:.3g} s "
                    f"(lease TTL {self.ttl} s): etcd is unreachable from this host"
                )
                return
            if reply.TTL <= 0:
                self._lose(f"its etcd lease {self.lease_id:x} expired")
                return
            self._last_ok = sent
            # the keep-alive period of the lease protocol
            await anyio.sleep_until(sent + interval)

    async def _refresh(self) -> Any:
        delay = _RETRY_FIRST
        while True:
            try:
                self.requests += 1
                return await bounded(self.client.refresh_lease(self.lease_id), self.ttl / 3)
            except (TimeoutError, self._aetcd.ClientError) as e:
                logger.debug("etcd keep-alive failed: %r", e)
            # etcd is unreachable: back off before the next try
            await anyio.sleep(delay)
            delay = min(_RETRY_MAX, delay * 2)

    def _lose(self, why: str) -> None:
        self.lost = f"this node ({self.name}) was fenced: {why}; its workers are stopped"
        logger.warning("rendezvous: %s", why)
        self._notify()


class _Range:
    """A copied key range: where its watch resumes, and (if followed) the task applying it."""

    def __init__(self, start: bytes, end: bytes, *, deletions_only: bool) -> None:
        self.start, self.end = start, end
        self.deletions_only = deletions_only
        self.revision = 0
        self.task: asyncio.Task[None] | None = None

    async def stop(self) -> None:
        """Cancel the watch task and wait for it (shielded)."""
        task, self.task = self.task, None
        if task is None:
            return
        task.cancel()
        with anyio.CancelScope(shield=True):
            try:
                await task
            except asyncio.CancelledError:
                pass
            except Exception as e:  # a bug in the task: do not hide the run's own outcome
                logger.warning("etcd watch task failed: %r", e)


class _Open:
    """The session's lifetime: its tasks are created on entry and ended on exit.

    Plain tasks, not an anyio task group: the agent holds the session open
    across its own cancel scopes, which a task group's scope must not straddle.
    """

    def __init__(self, session: EtcdSession) -> None:
        self._session = session
        self._tasks: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> EtcdSession:
        s = self._session
        try:
            await s._start()
        except BaseException:
            await s._stop()
            raise
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(s._keep_alive(), name="aioproc-etcd-keepalive"),
            loop.create_task(s._watch(s.control), name="aioproc-etcd-watch"),
            loop.create_task(s._watch(s._liveness), name="aioproc-etcd-watch-liveness"),
        ]
        return s

    async def __aexit__(self, *exc: object) -> None:
        for task in self._tasks:
            task.cancel()
        with anyio.CancelScope(shield=True):
            for task in self._tasks:
                try:
                    await task
                except asyncio.CancelledError:
                    pass
                except Exception as e:  # a bug in a task: do not hide the run's own outcome
                    logger.warning("etcd session task %s failed: %r", task.get_name(), e)
        await self._session._stop()


def prefix_end(prefix: bytes) -> bytes:
    """The end of the key range of everything that starts with ``prefix``."""
    return prefix[:-1] + bytes([prefix[-1] + 1])


def ttl_seconds(value: float) -> int:
    """A lease TTL in whole seconds (etcd's unit), at least 2."""
    return max(2, math.ceil(value))
