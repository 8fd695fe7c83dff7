"""The etcd client, call by call: what ``_etcd_store``'s session is built on.

The lowest layer of the etcd rendezvous: the import of the client
(``aetcd``, an optional dependency) and its channel's options; a gRPC call
bounded in time without letting grpc.aio's own cancellations escape, and
its error told in a few words; a count of keys that returns none; a key
as read (``KeyValue``) and a key range as copied and watched
(``KeyRange``); the arithmetic of key ranges and lease TTLs.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
from collections.abc import Awaitable
from typing import Any, TypeVar

import anyio

__all__ = [
    "CHANNEL_OPTIONS",
    "KeyRange",
    "KeyValue",
    "bounded",
    "count",
    "describe",
    "import_aetcd",
    "prefix_end",
    "put_and_range",
    "ranges",
    "ttl_seconds",
]

logger = logging.getLogger("aioproc.rendezvous")

T = TypeVar("T")

# gRPC reconnects with a 1 s initial backoff growing to 120 s by default: an
# agent must find a restarted etcd within a small part of its lease TTL,
# and an attempt on a closed port costs next to nothing.  (gRPC takes the
# "min" option as the least time a connection attempt is given.)
# A session's connection is its own (gRPC would share one between channels
# of a process with the same target): several agents in one process (tests,
# benchmarks, an embedding service) each keep their lease on a connection of
# their own, as agents on separate hosts do.
CHANNEL_OPTIONS = {
    "grpc.initial_reconnect_backoff_ms": 50,
    "grpc.min_reconnect_backoff_ms": 1000,
    "grpc.max_reconnect_backoff_ms": 100,
    "grpc.use_local_subchannel_pool": 1,
}


async def bounded(coro: Awaitable[T], timeout: float | None) -> T:
    """``await coro`` (a gRPC call), at most ``timeout`` seconds (None: no bound).

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


_GRPC_NOISE = re.compile(
    r"^failed to connect to all addresses; last error: [A-Z_]+: (?:ipv[46]:\S+: |unix:\S+: )?"
)


def describe(e: BaseException) -> str:
    """A failed etcd call's error in a few words, for a one-line message."""
    if isinstance(e, TimeoutError):
        return str(e) or "no answer"
    text = " ".join(str(e).split()) or type(e).__name__
    if text == "Deadline Exceeded":
        return "no answer (deadline exceeded)"
    return _GRPC_NOISE.sub("", text)


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


class KeyRange:
    """A copied key range: where its watch resumes, and (if followed) the task applying it.

    ``kind`` is what its watch delivers: ``"all"`` events, ``"deletes"``
    only (with each deleted key's last value when ``prev_kv``), or
    ``"puts"`` only.
    """

    def __init__(
        self, start: bytes, end: bytes, *, kind: str = "all", prev_kv: bool = False
    ) -> None:
        if kind not in ("all", "deletes", "puts"):
            raise ValueError(f"kind must be 'all', 'deletes' or 'puts', got {kind!r}")
        self.start, self.end = start, end
        self.kind = kind
        self.prev_kv = prev_kv
        self.revision = 0
        self.listed = 0  # the revision of its first list, where it has one
        self.task: asyncio.Task[None] | None = None
        self.scope: anyio.CancelScope | None = None  # while its watch runs in the session's tasks

    async def stop(self) -> None:
        """Cancel the watch task and wait for it (shielded)."""
        if self.scope is not None:
            self.scope.cancel()
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


async def count(
    client: Any, start: bytes, end: bytes, timeout: float | None = None
) -> tuple[int, int]:
    """How many keys are in ``[start, end)``, and etcd's revision (one read returning no key)."""
    aetcd = import_aetcd()
    await client.connect()
    request = aetcd.rpc.RangeRequest(key=start, range_end=end, count_only=True)
    try:
        response = await client.kvstub.Range(request, timeout=timeout, metadata=client.metadata)
    except aetcd.rpc.AioRpcError as e:
        aetcd.exceptions._handle_exception(e)  # raises aetcd's error for it
        raise
    return int(response.count), int(response.header.revision)


async def put_and_range(
    client: Any,
    key: bytes,
    value: bytes,
    lease: int,
    start: bytes,
    end: bytes,
    timeout: float | None = None,
) -> tuple[list[Any], int]:
    """Put ``key`` on ``lease`` and read ``[start, end)`` in one transaction.

    Returns:
        The keys read (etcd's KeyValue messages) and the transaction's revision.
    """
    aetcd = import_aetcd()
    rpc = aetcd.rpc
    await client.connect()
    request = rpc.TxnRequest(
        success=[
            rpc.RequestOp(request_put=rpc.PutRequest(key=key, value=value, lease=lease)),
            rpc.RequestOp(request_range=rpc.RangeRequest(key=start, range_end=end)),
        ]
    )
    try:
        response = await client.kvstub.Txn(request, timeout=timeout, metadata=client.metadata)
    except rpc.AioRpcError as e:
        aetcd.exceptions._handle_exception(e)  # raises aetcd's error for it
        raise
    return list(response.responses[1].response_range.kvs), int(response.header.revision)


async def ranges(
    client: Any, spans: list[tuple[bytes, bytes, bool]], timeout: float | None = None
) -> tuple[list[list[Any]], int]:
    """Read each ``(start, end, keys_only)`` span in one transaction, at one revision.

    Returns:
        Each span's keys (etcd's KeyValue messages), and the revision read.
    """
    aetcd = import_aetcd()
    rpc = aetcd.rpc
    await client.connect()
    request = rpc.TxnRequest(
        success=[
            rpc.RequestOp(
                request_range=rpc.RangeRequest(key=start, range_end=end, keys_only=keys_only)
            )
            for start, end, keys_only in spans
        ]
    )
    try:
        response = await client.kvstub.Txn(request, timeout=timeout, metadata=client.metadata)
    except rpc.AioRpcError as e:
        aetcd.exceptions._handle_exception(e)  # raises aetcd's error for it
        raise
    found = [list(r.response_range.kvs) for r in response.responses]
    return found, int(response.header.revision)


def prefix_end(prefix: bytes) -> bytes:
    """The end of the key range of everything that starts with ``prefix``."""
    return prefix[:-1] + bytes([prefix[-1] + 1])


def ttl_seconds(value: float) -> int:
    """A lease TTL in whole seconds (etcd's unit), at least 2."""
    return max(2, math.ceil(value))
