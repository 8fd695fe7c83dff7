"""The control channel between supervisor and worker.

Its parent half is ``aioproc._proc.channel`` (``Channel``, on the loop), its
child half ``aioproc._child.channel`` (frames read and written with blocking
calls, served by the worker's ``aioproc._child.boot``).  The parent half is
tested on a bare socketpair (the test plays the worker and writes raw
bytes), the child half on one too (the test plays the supervisor); the rest
starts real function and persistent workers whose functions, in
``children/channel_funcs.py``, write forged frame headers to their own end
of the channel.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import marshal
import multiprocessing
import os
import select
import shutil
import socket
import tracemalloc
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from helpers import import_child, pid_gone

import aioproc
from aioproc import BrokenWorkerError, ChildFailedError, open_worker
from aioproc._child import channel
from aioproc._child import shm as _shm
from aioproc._proc.channel import Channel, frame

GiB = 1 << 30
MiB = 1 << 20


@pytest.fixture
def cf(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The worker-function module, importable here and (by path) in workers."""
    return import_child(monkeypatch, "channel_funcs")


class Pair:
    """A parent ``Channel`` and the raw socket a test writes as the worker."""

    def __init__(self, parent: Channel, worker: socket.socket) -> None:
        self.channel = parent
        self.worker = worker
        self.frames: list[tuple[int, bytes]] = []
        self.errors: list[BrokenWorkerError] = []


async def open_pair(max_frame_size: int | None = None) -> Pair:
    parent, worker = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    frames: list[tuple[int, bytes]] = []
    errors: list[BrokenWorkerError] = []
    try:
        opened = await Channel.open(
            parent,
            lambda kind, body: frames.append((kind, bytes(body))),
            on_error=errors.append,
            max_frame_size=max_frame_size,
        )
    except BaseException:
        parent.close()
        worker.close()
        raise
    pair = Pair(opened, worker)
    pair.frames, pair.errors = frames, errors
    return pair


@pytest.fixture
async def pair() -> AsyncIterator[Pair]:
    p = await open_pair()
    try:
        yield p
    finally:
        p.worker.close()
        await p.channel.aclose()


async def failure_of(p: Pair) -> BrokenWorkerError:
    error = await asyncio.wait_for(asyncio.shield(p.channel.failed), 10)
    assert p.channel.error is error
    assert p.errors == [error]  # on_error: called once, with the same error
    # the connection was aborted: the worker sees EOF (or a reset, as unread
    # bytes were discarded), and waiters are released
    p.worker.settimeout(10)
    try:
        assert p.worker.recv(1) == b""
    except ConnectionResetError:
        pass
    await asyncio.wait_for(p.channel.settled(), 10)
    return error


# ---------------------------------------------------------- parent half alone


async def test_header_over_the_cap_fails_the_channel_before_allocating(pair: Pair) -> None:
    tracemalloc.start()
    try:
        pair.worker.sendall(channel.header(channel.RESULT, 2 * GiB) + b"some of the body")
        error = await failure_of(pair)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert isinstance(error, BrokenWorkerError)
    assert str(error) == (
        "worker sent a RESULT (10) frame of 2147483648 bytes (2 GiB), over the 1 GiB limit "
        "of the control channel; the supervisor closed the channel"
    )
    assert peak < 64 * MiB, f"the parent allocated {peak} bytes for a forged header"
    assert pair.frames == []


async def test_unknown_frame_kind_fails_the_channel(pair: Pair) -> None:
    pair.worker.sendall(channel.header(99, 5) + b"hello")
    error = await failure_of(pair)
    assert str(error) == (
        "worker sent a frame of unknown kind 99; the supervisor closed the channel"
    )
    assert pair.frames == []


async def test_a_kind_only_the_supervisor_sends_fails_the_channel(pair: Pair) -> None:
    pair.worker.sendall(channel.header(channel.CALL, 0))
    error = await failure_of(pair)
    assert "worker sent a CALL (2) frame, a kind only the supervisor sends" in str(error)


async def test_frames_before_a_bad_one_are_delivered_and_nothing_after(pair: Pair) -> None:
    pair.worker.sendall(
        channel.header(channel.PONG, 0)
        + channel.header(channel.RESULT, 3)
        + b"abc"
        + channel.header(0, 0)
        + channel.header(channel.RESULT, 3)
        + b"def"
    )
    error = await failure_of(pair)
    assert "unknown kind 0" in str(error)
    assert pair.frames == [(channel.PONG, b""), (channel.RESULT, b"abc")]


async def test_cap_is_inclusive_and_frames_arrive_in_pieces() -> None:
    p = await open_pair(max_frame_size=1024)
    try:
        data = channel.header(channel.RESULT, 1024) + bytes(range(256)) * 4
        for i in range(0, len(data), 100):  # a frame split across many reads
            p.worker.sendall(data[i : i + 100])
        p.worker.sendall(channel.header(channel.ERROR, 1025))
        error = await failure_of(p)
        assert p.frames == [(channel.RESULT, bytes(range(256)) * 4)]
        assert "ERROR (11) frame of 1025 bytes (1 KiB), over the 1 KiB limit" in str(error)
    finally:
        p.worker.close()
        await p.channel.aclose()


async def test_one_whole_frame_in_one_read_is_checked_like_any_other() -> None:
    # a reply that comes whole in one read takes a shorter path: same checks
    p = await open_pair(max_frame_size=16)
    try:
        p.worker.sendall(channel.header(channel.RESULT, 16) + b"M" * 16)
        await asyncio.wait_for(p.channel.settled(), 10)
        assert p.frames == [(channel.RESULT, b"M" * 16)]
        p.worker.sendall(channel.header(channel.RESULT, 17) + b"M" * 17)
        error = await failure_of(p)
        assert "RESULT (10) frame of 17 bytes (17 bytes), over the 16 bytes limit" in str(error)
        assert p.frames == [(channel.RESULT, b"M" * 16)]
    finally:
        p.worker.close()
        await p.channel.aclose()
    p = await open_pair()
    try:
        p.worker.sendall(channel.header(channel.DEFINE, 3) + b"abc")
        error = await failure_of(p)
        assert "worker sent a DEFINE (8) frame, a kind only the supervisor sends" in str(error)
        assert p.frames == []
    finally:
        p.worker.close()
        await p.channel.aclose()


async def test_a_definition_goes_out_with_its_call_in_one_write(pair: Pair) -> None:
    """The worker wakes once for a DEFINE and the CALL that uses it."""
    pair.channel.send(channel.CALL, b"M", b"call", before=frame(channel.DEFINE, b"definition"))
    fd = pair.worker.fileno()
    poller = _StrictPoller(fd)
    got = [channel.read_frame(fd, poller) for _ in range(2)]
    assert [(kind, bytes(body)) for kind, body in got] == [
        (channel.DEFINE, b"definition"),
        (channel.CALL, b"Mcall"),
    ]
    assert poller.waits == 1


async def test_small_and_big_frames_mixed_in_any_pieces_arrive_intact(pair: Pair) -> None:
    """Small frames are parsed out of the read buffer, bigger ones get their own."""
    big = bytes(range(256)) * 1200  # 300 KiB: more than one read buffer
    frames = [
        (channel.PONG, b""),
        (channel.RESULT, b"M" + b"x" * 100),
        (channel.RESULT, big),
        (channel.ERROR, b"e" * (channel.READ_SIZE - channel.HEADER_SIZE)),  # exactly one buffer
        (channel.PONG, b""),
        (channel.RESULT, b"tail"),
    ]
    data = b"".join(channel.header(kind, len(body)) + body for kind, body in frames)
    pair.worker.sendall(data[:5])  # half a header, read on its own
    await asyncio.wait_for(pair.channel.settled(), 10)
    assert pair.channel.progress.received == 5

    def send_rest() -> None:  # pieces that cut headers and bodies anywhere
        for i in range(5, len(data), 7001):
            pair.worker.sendall(data[i : i + 7001])

    await asyncio.to_thread(send_rest)
    pair.worker.shutdown(socket.SHUT_WR)
    await asyncio.wait_for(asyncio.shield(pair.channel._protocol.closed), 10)
    assert pair.frames == frames
    assert pair.errors == []


async def test_clean_eof_is_not_a_failure(pair: Pair) -> None:
    pair.worker.sendall(channel.header(channel.PONG, 0))
    pair.worker.shutdown(socket.SHUT_WR)
    await asyncio.wait_for(pair.channel.settled(), 10)
    await asyncio.wait_for(asyncio.shield(pair.channel._protocol.closed), 10)
    assert pair.frames == [(channel.PONG, b"")]
    assert not pair.channel.failed.done() and pair.channel.error is None
    assert pair.errors == []


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "1"])
async def test_bad_max_frame_size_is_rejected_before_anything_opens(bad: Any) -> None:
    parent, worker = socket.socketpair()
    with parent, worker:
        with pytest.raises(ValueError, match=f"max_frame_size must be .*got {bad!r}"):
            await Channel.open(parent, lambda kind, body: None, max_frame_size=bad)


# -------------------------------------------------- child half (blocking, no loop)


@pytest.fixture
def raw_pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    saved = channel._pending
    channel._pending = b""
    try:
        yield a, b
    finally:
        channel._pending = saved
        a.close()
        b.close()


# three frames sent back to back, and what reading them one at a time gives
THREE_FRAMES = (
    channel.header(channel.INIT, 3)
    + b"abc"
    + channel.header(channel.PING, 0)
    + channel.header(channel.CALL, 2)
    + b"de"
)
THREE_DECODED = [(channel.INIT, b"abc"), (channel.PING, b""), (channel.CALL, b"de")]


def test_child_reads_back_to_back_frames_one_at_a_time(
    raw_pair: tuple[socket.socket, socket.socket],
) -> None:
    parent, child = raw_pair
    parent.sendall(THREE_FRAMES)
    fd = child.fileno()
    got = [channel.read_frame(fd) for _ in range(3)]
    assert [(kind, bytes(body)) for kind, body in got] == THREE_DECODED
    parent.sendall(channel.header(channel.CALL, 10) + b"part")
    parent.shutdown(socket.SHUT_WR)
    with pytest.raises(channel.ChannelClosed, match="channel closed after 4 of 10 body bytes"):
        channel.read_frame(fd)


class _StrictPoller:
    """A ``select.poll`` on one fd that fails instead of blocking when nothing is readable."""

    def __init__(self, fd: int) -> None:
        self._poller = select.poll()
        self._poller.register(fd, select.POLLIN)
        self.waits = 0

    def poll(self) -> list[tuple[int, int]]:
        self.waits += 1
        ready = self._poller.poll(0)
        assert ready, "waited for input while a whole frame was already buffered"
        return ready


def test_persistent_worker_waits_in_poll_only_when_nothing_is_buffered(
    raw_pair: tuple[socket.socket, socket.socket],
) -> None:
    # A persistent worker waits for requests in poll() (see _child.boot._serve):
    # frames that came in the same read are served without waiting again.
    parent, child = raw_pair
    fd = child.fileno()
    poller = _StrictPoller(fd)
    parent.sendall(THREE_FRAMES)
    got = [channel.read_frame(fd, poller) for _ in range(3)]
    assert [(kind, bytes(body)) for kind, body in got] == THREE_DECODED
    assert poller.waits == 1
    parent.sendall(channel.header(channel.PING, 0))
    assert channel.read_frame(fd, poller) == (channel.PING, b"")
    assert poller.waits == 2
    # the supervisor gone: poll() reports the hangup and the read says so
    parent.close()
    with pytest.raises(channel.ChannelClosed, match="channel closed after 0 of 9 header bytes"):
        channel.read_frame(fd, poller)
    assert poller.waits == 3


def test_child_eof_inside_a_header_is_channel_closed(
    raw_pair: tuple[socket.socket, socket.socket],
) -> None:
    parent, child = raw_pair
    parent.sendall(channel.header(channel.CALL, 1)[:4])
    parent.shutdown(socket.SHUT_WR)
    with pytest.raises(channel.ChannelClosed, match="after 4 of 9 header bytes"):
        channel.read_frame(child.fileno())


@pytest.mark.parametrize("size", [0, 10, channel.JOIN_LIMIT, channel.JOIN_LIMIT + 1, 5 * MiB])
def test_child_frames_of_any_size_round_trip(
    raw_pair: tuple[socket.socket, socket.socket], size: int
) -> None:
    """Written with one write (small) or writev (big, partial writes), read back whole."""
    import threading

    writer, reader = raw_pair
    body = bytes(range(256)) * (size // 256) + b"z" * (size % 256)
    parts = [b"M", body, b"", b"!"]
    sender = threading.Thread(
        target=channel.write_frame, args=(writer.fileno(), channel.RESULT, *parts)
    )
    sender.start()
    try:
        kind, got = channel.read_frame(reader.fileno())
    finally:
        sender.join(10)
    assert kind == channel.RESULT
    assert bytes(got) == b"M" + body + b"!"
    assert channel._pending == b""


def test_default_cap_is_one_gib_and_hundreds_of_mib_fit() -> None:
    assert channel.MAX_FRAME_SIZE == 1 << 30
    assert channel.format_size(GiB) == "1 GiB"
    assert channel.format_size(300 * MiB) == "300 MiB"
    assert channel.format_size(1536) == "1.5 KiB"
    assert channel.format_size(12) == "12 bytes"


# ------------------------------------------------------------- real workers


async def test_persistent_worker_call_sending_a_2gib_header_does_not_hang(
    cf: ModuleType,
) -> None:
    async with open_worker(name="forger", grace_period=5) as w:
        with pytest.raises(BrokenWorkerError, match=r"worker forger \(pid \d+\)"):
            await asyncio.wait_for(w.call(cf.forge_header, channel.RESULT, 2 * GiB), 20)
        with pytest.raises(BrokenWorkerError):
            await asyncio.wait_for(w.call(cf.make_bytes, 1), 20)
    assert pid_gone(w.pid)


async def test_an_answer_for_no_call_in_flight_is_dropped(cf: ModuleType) -> None:
    # a RESULT with an id the supervisor never gave (a stale or forged one)
    # finds no call: the call gets its own answer, and the worker goes on
    stray = channel.MARSHAL + marshal.dumps(5) + (2**63).to_bytes(channel.ID_SIZE, "big")
    async with open_worker(name="stray") as w:
        assert await asyncio.wait_for(w.call(cf.forge_frame, channel.RESULT, stray, 7), 20) == 7
        assert await w.call(cf.make_bytes, 2) == b"xx"
        assert w.alive


async def test_an_answer_without_a_call_id_breaks_the_worker(cf: ModuleType) -> None:
    async with open_worker(name="idless", grace_period=5) as w:
        with pytest.raises(
            BrokenWorkerError,
            match=r"worker idless \(pid \d+\): worker sent a RESULT \(10\) frame without a call id",
        ):
            await asyncio.wait_for(w.call(cf.forge_frame, channel.RESULT, b"M"), 20)
        assert not w.alive
    assert pid_gone(w.pid)


async def test_persistent_worker_call_raises_the_channel_error_at_once(
    cf: ModuleType,
) -> None:
    async with open_worker(name="forger", grace_period=5) as w:
        # the worker stays blocked: only the channel error can end the call
        call = w.call(cf.forge_header_then_block, channel.RESULT, 2 * GiB)
        with pytest.raises(BrokenWorkerError) as info:
            await asyncio.wait_for(call, 20)
        assert "RESULT (10) frame of 2147483648 bytes (2 GiB), over the 1 GiB limit" in str(
            info.value
        )
        assert f"worker forger (pid {w.pid})" in str(info.value)
    assert pid_gone(w.pid)


async def test_function_worker_sending_an_unknown_kind_fails_its_group(
    cf: ModuleType,
) -> None:
    # the supervisor closes the channel; the worker's lifeline sees EOF and
    # ends the worker, which would otherwise block forever
    with pytest.raises(ChildFailedError) as info:
        await asyncio.wait_for(
            aioproc.run(cf.forge_header_then_block, 1, args=(99, 0), name="forger"), 30
        )
    failure = info.value.failures[0]
    assert failure.exitcode != 0
    assert pid_gone(failure.pid)


async def test_function_worker_failure_names_the_broken_frame(cf: ModuleType) -> None:
    with pytest.raises(ChildFailedError) as info:
        await asyncio.wait_for(
            aioproc.run(cf.forge_header_then_block, 1, args=(channel.RESULT, 2 * GiB)), 30
        )
    assert info.value.failures[0].message == (
        "worker sent a RESULT (10) frame of 2147483648 bytes (2 GiB), over the 1 GiB limit "
        "of the control channel; the supervisor closed the channel"
    )


async def test_value_over_the_cap_fails_in_the_worker_with_a_clear_error(
    cf: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(channel, "MAX_FRAME_SIZE", MiB)  # read at each start
    # in the frame: a value in shared memory is not capped (see test_shm.py)
    monkeypatch.setattr(_shm, "AVAILABLE", False)
    with pytest.raises(ChildFailedError) as info:
        await asyncio.wait_for(aioproc.run(cf.make_bytes, 1, args=(2 * MiB,)), 30)
    cause = info.value.__cause__
    assert isinstance(cause, ValueError)
    assert str(cause) == (
        "worker return value of type bytes encodes to 2097226 bytes (2 MiB), over the "
        "1 MiB limit of aioproc's control channel; pass data that large through a file "
        "or shared memory"
    )
    assert info.value.failures[0].exitcode == 1
    # a failed run keeps its temp dir (error.json) and names it
    shutil.rmtree(os.path.dirname(info.value.log_dir))
    # under the cap the same function works
    result = await asyncio.wait_for(aioproc.run(cf.make_bytes, 1, args=(MiB // 2,)), 30)
    assert result.return_values == {0: b"x" * (MiB // 2)}


async def test_persistent_worker_value_over_the_cap_raises_and_the_worker_stays_usable(
    cf: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(channel, "MAX_FRAME_SIZE", MiB)
    monkeypatch.setattr(_shm, "AVAILABLE", False)  # in the frame, as without memfds
    async with open_worker(name="big") as w:
        with pytest.raises(ValueError, match=r"return value of type bytes encodes to 2097226"):
            await asyncio.wait_for(w.call(cf.make_bytes, 2 * MiB), 20)
        assert await asyncio.wait_for(w.call(cf.make_bytes, 3), 20) == b"xxx"


# ------------------------------------------------- multiprocessing authkey


@contextlib.contextmanager
def manager() -> Iterator[Any]:
    """A Manager whose proxies (and their cached connections) are gone on exit."""
    # fork: the spawn context would start a resource tracker that outlives the test
    with multiprocessing.get_context("fork").Manager() as m:
        try:
            yield m
        finally:
            gc.collect()  # proxies the test dropped close their connections


async def test_manager_proxies_work_in_function_workers(cf: ModuleType) -> None:
    with manager() as m:
        shared, queue = m.dict(), m.Queue()
        result = await asyncio.wait_for(
            aioproc.run(cf.write_to_proxy, 2, args={0: (shared, "a", 1), 1: (queue, "b", [2, 3])}),
            60,
        )
        assert set(result.return_values) == {0, 1}
        assert dict(shared) == {"a": 1}
        assert queue.get(timeout=10) == ("b", [2, 3])
        del shared, queue


async def test_manager_proxies_work_in_persistent_workers(cf: ModuleType) -> None:
    with manager() as m:
        async with open_worker(name="mp") as w:
            # the worker has not imported multiprocessing yet: the key is set when it does
            shared = m.dict()
            await asyncio.wait_for(w.call(cf.write_to_proxy, shared, "k", "v"), 30)
            assert dict(shared) == {"k": "v"}
            del shared
            key = await asyncio.wait_for(w.call(cf.authkey), 30)
    assert key == bytes(multiprocessing.current_process().authkey)


async def test_authkey_is_set_when_multiprocessing_was_imported_at_startup(
    cf: ModuleType, tmp_path: Path
) -> None:
    # a sitecustomize that imports multiprocessing before the worker boots
    (tmp_path / "sitecustomize.py").write_text("import multiprocessing.process\n")
    async with open_worker(name="site", env={"PYTHONPATH": str(tmp_path)}) as w:
        assert await asyncio.wait_for(w.call(cf.imported_at_startup), 30) == (
            True,
            bytes(multiprocessing.current_process().authkey),
        )


async def test_authkey_travels_in_init_not_in_env_or_argv(cf: ModuleType) -> None:
    key = bytes(multiprocessing.current_process().authkey)
    async with open_worker(name="env") as w:
        assert await asyncio.wait_for(w.call(cf.authkey), 30) == key
        with open(f"/proc/{w.pid}/cmdline", "rb") as f:
            cmdline = f.read()
        with open(f"/proc/{w.pid}/environ", "rb") as f:
            environ = f.read()
    for text in (cmdline, environ):
        assert key not in text and key.hex().encode() not in text
