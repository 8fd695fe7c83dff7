"""The barrier of a group of function workers, and the supervisor's other requests.

A worker that calls ``barrier()`` (``_child.boot``) sends ARRIVE on its
private control channel and blocks until RELEASE comes: it reads the channel
itself, or in a cluster run its lifeline thread reads it and wakes it (see
``_child.boot``).  The supervisor side is a ``ControlHub``: every worker of the group (a rank of a
``PContext``, or a task of a cluster run whose tasks are groups of their own)
is a *member* known by a key.  When ``parties`` members have arrived, each of
them is sent an empty RELEASE and the next generation begins.  No Manager
process, no polling: an arrival and an exit are events on the loop.

A member that ends without coming back (its owner says whether a replacement
will come, as an auto-restarted cluster task does) can never arrive again, so
the barrier breaks: every waiter, and every later arrival, gets a RELEASE that
carries the reason, and ``barrier()`` raises ``threading.BrokenBarrierError``
with it instead of hanging.

The hub also carries stack dumps, for cluster runs: ``dump_stacks`` sends
DUMP, the worker's lifeline thread writes a faulthandler dump of every
thread into its stderr and answers STACKS with the same text.  Workers of
other groups run no such thread (``PContext`` tells them so in INIT) and
are never sent DUMP.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable

from .._child.channel import ARRIVE, DUMP, RELEASE, STACKS
from .._proc.channel import Channel

__all__ = ["ControlHub"]


class _Member:
    __slots__ = ("channel", "label", "stacks")

    def __init__(self, channel: Channel, label: str) -> None:
        self.channel = channel
        self.label = label
        self.stacks: asyncio.Future[str] | None = None


class ControlHub:
    """The supervisor's half of the barrier and of stack dumps (see the module docstring).

    Args:
        parties: how many members must arrive to pass the barrier.
        returns: called with ``(key, exit code)`` when a member ends; True if
            a replacement will take its place (the barrier then does not break).
    """

    def __init__(
        self, parties: int, returns: Callable[[Hashable, int], bool] | None = None
    ) -> None:
        self.parties = parties
        self._returns = returns
        self._members: dict[Hashable, _Member] = {}
        self._arrived: dict[Hashable, _Member] = {}
        self.broken = ""  # why the barrier broke ("": it did not)

    def attach(self, key: Hashable, channel: Channel, label: str) -> None:
        """``key``'s worker is running, talking on ``channel``."""
        self._members[key] = _Member(channel, label)

    def on_frame(self, key: Hashable, kind: int, body: bytearray) -> None:
        """A frame of ``key``'s worker that is not its result."""
        member = self._members.get(key)
        if member is None:
            return
        if kind == ARRIVE:
            self._arrive(key, member)
        elif kind == STACKS and member.stacks is not None and not member.stacks.done():
            member.stacks.set_result(bytes(body).decode("utf-8", "replace"))

    def _arrive(self, key: Hashable, member: _Member) -> None:
        if self.broken:
            member.channel.send(RELEASE, self.broken.encode())
            return
        self._arrived[key] = member
        if len(self._arrived) >= self.parties:
            arrived, self._arrived = self._arrived, {}
            for waiting in arrived.values():
                waiting.channel.send(RELEASE)

    def left(self, key: Hashable, code: int) -> None:
        """``key``'s worker exited with ``code`` (negative: killed by that signal)."""
        member = self._members.pop(key, None)
        if member is None:
            return
        if member.stacks is not None and not member.stacks.done():
            member.stacks.set_result("")
        self._arrived.pop(key, None)
        if self.broken or (self._returns is not None and self._returns(key, code)):
            return
        how = f"exited with code {code}" if code >= 0 else f"was killed by signal {-code}"
        self.broken = f"barrier broken: {member.label} {how} without reaching it"
        arrived, self._arrived = self._arrived, {}
        for waiting in arrived.values():
            waiting.channel.send(RELEASE, self.broken.encode())

    async def dump_stacks(self, key: Hashable, timeout: float) -> str:
        """The faulthandler dump of every thread of ``key``'s worker ("" if none came).

        ``timeout`` bounds the wait: a worker whose main thread holds the GIL
        in C code never lets its lifeline run.
        """
        member = self._members.get(key)
        if member is None:
            return ""
        if member.stacks is None or member.stacks.done():
            member.stacks = asyncio.get_running_loop().create_future()
            member.channel.send(DUMP)
        try:
            return await asyncio.wait_for(asyncio.shield(member.stacks), timeout)
        except asyncio.TimeoutError:
            return ""
