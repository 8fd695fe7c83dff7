"""Shared memory: large values cross as protocol-5 buffers in sealed memfds.

Values of ``SHM_MIN`` bytes or more are written into a sealed memfd
(``aioproc._child.shm``) passed beside their frame on the channel
(``aioproc._child.channel`` in the worker, ``aioproc._proc.channel`` in the
supervisor); the receiver's arrays and memoryviews view its mapping.  Values
with smaller out-of-band buffers carry them in the frame.  Small values keep
the marshal/pickle fast path.  The autouse leak check also fails any test
that leaves an fd (a memfd included) open.  Worker functions live in
``children/shm_funcs.py``.
"""

from __future__ import annotations

import asyncio
import errno
import mmap
import os
import random
import signal
import socket
import threading
from collections.abc import AsyncIterator
from types import ModuleType
from typing import Any

import pytest
from helpers import import_child, loop_name
from proc_utils import Fifo

import aioproc
from aioproc import BrokenWorkerError, WorkerProcess, open_pool, open_worker
from aioproc._child import shm as _shm
from aioproc._child.channel import (
    BUFFERS,
    MARSHAL,
    PICKLE,
    RESULT,
    SHM,
    decode_value,
    encode_value,
    write_frame,
)
from aioproc._proc.channel import Channel

MiB = 1 << 20
SIZES = [100, 200 * 1024, 2 * MiB + 3, 9 * MiB]  # in-band, in the frame, shared memory


@pytest.fixture
def of(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return import_child(monkeypatch, "shm_funcs")


@pytest.fixture
async def worker(of: ModuleType) -> AsyncIterator[WorkerProcess]:
    async with open_worker() as w:
        yield w


def _payload(kind: str, size: int) -> Any:
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    if kind == "bytearray":
        return bytearray(data)
    if kind == "memoryview":
        return memoryview(data)
    return data


def _memfds() -> int:
    out = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            out += "memfd:" in os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return out


@pytest.mark.parametrize("kind", ["bytes", "bytearray", "memoryview"])
async def test_bytes_like_values_round_trip_exactly(
    worker: WorkerProcess, of: ModuleType, kind: str
) -> None:
    for size in SIZES:
        sent = _payload(kind, size)
        back = await worker.call(of.identity, sent)
        assert type(back) is type(sent)
        assert bytes(back) == bytes(sent)
        made = await worker.call(of.make_bytes, kind, size)
        assert type(made) is type(sent) and bytes(made) == bytes(sent)


async def test_shaped_memoryview_keeps_format_shape_and_writability(
    worker: WorkerProcess, of: ModuleType
) -> None:
    for size in (64, 300_000):  # in-band and shared memory (8 bytes each)
        writable = memoryview(bytearray(8 * size)).cast("d", (size // 4, 4))
        writable[1, 2] = 2.5
        back = await worker.call(of.identity, writable)
        assert (back.format, back.shape, back.readonly) == ("d", (size // 4, 4), False)
        assert back[1, 2] == 2.5 and back.tobytes() == writable.tobytes()
        frozen = await worker.call(of.identity, memoryview(b"ab" * size))
        assert frozen.readonly and frozen.tobytes() == b"ab" * size
    strided = memoryview(b"0123456789" * 200_000)[::2]
    assert (await worker.call(of.identity, strided)).tobytes() == strided.tobytes()


async def test_receivers_view_the_shared_memory(worker: WorkerProcess, of: ModuleType) -> None:
    big = memoryview(bytes(3 * MiB))
    # the worker's argument views its mapping of the memfd, read-only like the original
    assert await worker.call(of.describe, big) == ("memoryview", "mmap", True)
    assert await worker.call(of.describe, memoryview(bytearray(3 * MiB))) == (
        "memoryview",
        "mmap",
        False,
    )
    # smaller out-of-band buffers view the frame's buffer: no copy either
    assert await worker.call(of.describe, memoryview(bytes(200 * 1024))) == (
        "memoryview",
        "bytearray",
        True,
    )
    back = await worker.call(of.make_bytes, "memoryview", 3 * MiB)
    assert isinstance(back.obj, mmap.mmap) and back.readonly


async def test_numpy_arrays_round_trip_as_views_of_shared_memory(
    worker: WorkerProcess, of: ModuleType
) -> None:
    np = pytest.importorskip("numpy")
    arrays = {
        "small": np.arange(10, dtype=np.int16),
        "frame": np.arange(50_000, dtype=np.float32),
        "big": np.arange(3 * MiB // 8, dtype=np.float64).reshape(-1, 8),
        "fortran": np.asfortranarray(np.arange(600_000, dtype=np.int32).reshape(1000, 600)),
        "strided": np.arange(2 * MiB, dtype=np.uint8)[::3],
        "readonly": np.frombuffer(bytes(range(256)) * 8192, dtype=np.uint8),
    }
    back = await worker.call(of.identity, arrays)
    assert back.keys() == arrays.keys()
    for key, sent in arrays.items():
        got = back[key]
        assert got.dtype == sent.dtype and got.shape == sent.shape, key
        assert np.array_equal(got, sent), key
        assert got.flags.writeable == sent.flags.writeable, key
    assert of.root(back["big"]) == "mmap" and of.root(back["fortran"]) == "mmap"
    assert back["fortran"].flags.f_contiguous
    # a received writable array is private: writing to it is allowed and local
    back["big"][0, 0] = -1.0
    assert back["big"][0, 0] == -1.0 and arrays["big"][0, 0] == 0.0
    received = await worker.call(of.describe, np.ones(MiB))
    assert received == ("ndarray", "mmap", False)


async def test_pool_submit_carries_large_values(of: ModuleType) -> None:
    async with open_pool(2) as pool:
        values = [_payload("bytes", 2 * MiB + i) for i in range(4)]
        back = await asyncio.gather(*(pool.submit(of.identity, v) for v in values))
        assert back == values
        assert await pool.submit(of.describe, memoryview(values[0])) == (
            "memoryview",
            "mmap",
            True,
        )


async def test_start_processes_args_and_return_values_go_out_of_band(of: ModuleType) -> None:
    data = {0: (memoryview(bytes(range(256)) * 12_000),), 1: (bytes(5 * MiB),)}
    result = await aioproc.run(of.identity, 2, args=data, name="oob")
    assert bytes(result.return_values[0]) == bytes(data[0][0])
    assert isinstance(result.return_values[0].obj, mmap.mmap)
    assert result.return_values[1] == data[1][0]
    described = await aioproc.run(of.describe, 1, args=(memoryview(bytes(4 * MiB)),), name="d")
    assert described.return_values[0] == ("memoryview", "mmap", True)


async def test_numpy_through_start_processes(of: ModuleType) -> None:
    np = pytest.importorskip("numpy")
    array = np.arange(MiB, dtype=np.float64)
    result = await aioproc.run(of.identity, 1, args=(array,), name="np")
    assert np.array_equal(result.return_values[0], array)
    assert of.root(result.return_values[0]) == "mmap"


async def test_no_fd_or_memfd_accumulates_over_100_calls(
    worker: WorkerProcess, of: ModuleType
) -> None:
    value = _payload("bytes", 2 * MiB)
    await worker.call(of.identity, value)  # warm: lazy imports, the worker's fd socket
    await worker.call(of.identity, 1)  # the loop drops its last reference to the reply
    fds_before = len(os.listdir("/proc/self/fd"))
    worker_memfds = await worker.call(of.memfds)
    for _ in range(100):
        assert await worker.call(of.identity, value) == value
    await worker.call(of.identity, 1)
    assert len(os.listdir("/proc/self/fd")) == fds_before
    assert _memfds() == 0
    assert await worker.call(of.memfds) == worker_memfds == 0


async def test_small_values_stay_in_band() -> None:
    segments: list[_shm.Segment] = []
    for value in (b"x" * 100, [1, "a", None], {"k": b"v" * 1000}):
        assert encode_value(value, segments)[0] == MARSHAL
    assert encode_value(object, segments)[0] == PICKLE
    assert encode_value(bytearray(100 * 1024), segments)[0] == PICKLE
    assert encode_value(memoryview(bytes(100 * 1024)), segments)[0] == BUFFERS
    assert segments == []
    assert encode_value(bytes(2 * MiB), segments)[0] == SHM
    assert len(segments) == 1
    segments[0].close()


async def test_without_memfds_large_values_travel_in_the_frame(
    monkeypatch: pytest.MonkeyPatch, of: ModuleType
) -> None:
    monkeypatch.setattr(_shm, "AVAILABLE", False)
    async with open_worker() as w:
        # the worker got no fd socket, so neither side uses shared memory
        assert await w.call(of.describe, memoryview(bytes(3 * MiB))) == (
            "memoryview",
            "bytearray",
            True,
        )
        back = await w.call(of.make_bytes, "memoryview", 3 * MiB)
        assert isinstance(back.obj, bytearray)
        assert bytes(back) == _payload("bytes", 3 * MiB)


async def test_worker_killed_with_an_fd_in_flight_leaves_nothing(
    worker: WorkerProcess, of: ModuleType, tmp_path: Any
) -> None:
    async with Fifo(tmp_path / "ready") as fifo:
        call = asyncio.ensure_future(worker.call(of.send_fd_then_block, fifo.path, 8 * MiB))
        assert await asyncio.wait_for(fifo.reader.readexactly(1), 20) == b"r"
        os.kill(worker.pid, signal.SIGKILL)
        with pytest.raises(BrokenWorkerError, match="killed by SIGKILL during a call"):
            await asyncio.wait_for(call, 20)
    await worker.aclose()
    # the memfd queued on the fd socket went with it: the socket is closed
    assert worker._channel.fd_socket is not None and worker._channel.fd_socket.fileno() == -1
    assert _memfds() == 0


async def test_cancelled_call_with_a_large_argument_leaves_nothing(
    worker: WorkerProcess, of: ModuleType, tmp_path: Any
) -> None:
    async with Fifo(tmp_path / "ready") as fifo:
        call = asyncio.ensure_future(worker.call(of.announce_then_block, fifo.path, bytes(4 * MiB)))
        # a second call with a large argument, cancelled while it waits its turn
        queued = asyncio.ensure_future(worker.call(of.identity, bytes(4 * MiB)))
        assert await asyncio.wait_for(fifo.reader.readexactly(1), 20) == b"r"
        queued.cancel()
        call.cancel()
        for task in (queued, call):
            with pytest.raises(asyncio.CancelledError):
                await task
    assert _memfds() == 0
    with pytest.raises(BrokenWorkerError):
        await worker.call(of.identity, 1)


async def _channel_pair() -> tuple[Channel, socket.socket, socket.socket, asyncio.Future[Any]]:
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pair = _shm.fd_socketpair()
    assert pair is not None
    fd_parent, fd_child = pair
    frames: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

    def on_frame(kind: int, body: bytearray) -> None:
        if not frames.done():
            frames.set_result(decode_value(body))

    channel = await Channel.open(parent, on_frame, fd_socket=fd_parent)
    return channel, child, fd_child, frames


async def test_shm_frame_without_its_memfd_fails_the_channel() -> None:
    channel, child, fd_child, _ = await _channel_pair()
    try:
        segments: list[_shm.Segment] = []
        parts = encode_value(bytes(2 * MiB), segments)
        segments[0].close()  # never sent
        write_frame(child.fileno(), RESULT, *parts)
        error = await asyncio.wait_for(channel.failed, 10)
        assert "shared-memory RESULT frame, but its file descriptor did not arrive" in str(error)
    finally:
        await channel.aclose()
        child.close()
        fd_child.close()


async def test_unsealed_memfd_is_refused() -> None:
    channel, child, fd_child, _ = await _channel_pair()
    try:
        segments: list[_shm.Segment] = []
        parts = encode_value(bytes(2 * MiB), segments)
        size = segments[0].size
        segments[0].close()
        fd = os.memfd_create("unsealed", os.MFD_CLOEXEC)
        os.ftruncate(fd, size)
        _shm.send(fd_child, [_shm.Segment(fd, size)])
        write_frame(child.fileno(), RESULT, *parts)
        error = await asyncio.wait_for(channel.failed, 10)
        assert "its memfd is not sealed against writes" in str(error)
    finally:
        await channel.aclose()
        child.close()
        fd_child.close()


async def test_shm_result_over_a_channel_decodes_from_the_mapping() -> None:
    channel, child, fd_child, frames = await _channel_pair()
    try:
        value = {"a": bytes(3 * MiB), "b": memoryview(bytearray(b"xy" * MiB))}
        segments: list[_shm.Segment] = []
        parts = encode_value(value, segments)
        assert parts[0] == SHM
        _shm.send(fd_child, segments)
        write_frame(child.fileno(), RESULT, *parts)
        got = await asyncio.wait_for(frames, 10)
        assert got["a"] == value["a"] and got["b"].tobytes() == b"xy" * MiB
        assert isinstance(got["b"].obj, mmap.mmap)
    finally:
        await channel.aclose()
        child.close()
        fd_child.close()


async def test_shared_memory_values_are_not_held_to_the_frame_cap(
    of: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the cap guards what the supervisor allocates from a header; a memfd
    # was allocated (and paid for) by its sender and is only mapped here
    monkeypatch.setattr("aioproc._child.channel.MAX_FRAME_SIZE", MiB)
    async with open_worker(name="capped") as w:
        assert await w.call(of.make_bytes, "bytes", 4 * MiB) == _payload("bytes", 4 * MiB)
        assert bytes(await w.call(of.identity, memoryview(bytes(4 * MiB)))) == bytes(4 * MiB)


async def test_large_arguments_are_copied_into_shared_memory_off_the_loop(
    worker: WorkerProcess, of: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A big value's copy runs on a thread; a small one's stays on the loop."""
    threads: list[tuple[int, int]] = []
    fill = _shm.Segment.fill

    def spy(segment: _shm.Segment) -> None:
        if not segment.filled:  # sending checks again: a no-op by then
            threads.append((segment.size, threading.get_ident()))
        fill(segment)

    monkeypatch.setattr(_shm.Segment, "fill", spy)
    loop_thread = threading.get_ident()
    big, small = _payload("bytes", 8 * MiB), _payload("bytes", 2 * MiB)
    assert await worker.call(of.identity, big) == big
    assert await worker.call(of.identity, small) == small
    copies = [(size >= 8 * MiB, ident == loop_thread) for size, ident in threads]
    assert copies == [(True, False), (False, True)]
    assert not [t for t in threading.enumerate() if t.name == "aioproc-copy"]


def gate_the_copies(
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[threading.Event, threading.Event]:
    """Make each memfd's copy wait for ``release``; ``started`` is set as one begins."""
    started, release = threading.Event(), threading.Event()
    fill = _shm.Segment.fill

    def slow(segment: _shm.Segment) -> None:
        started.set()
        release.wait(30)
        fill(segment)

    monkeypatch.setattr(_shm.Segment, "fill", slow)
    return started, release


async def test_a_call_cancelled_during_its_copy_leaves_the_worker_usable(
    worker: WorkerProcess, of: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancelled before its frame was sent: nothing reached the worker, and the
    memfd is closed once the copy that was still writing it ends."""
    started, release = gate_the_copies(monkeypatch)
    call = asyncio.ensure_future(worker.call(of.identity, bytes(8 * MiB)))
    assert await asyncio.to_thread(started.wait, 30)
    assert _memfds() == 1  # reserved, being filled
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert _memfds() == 1  # still the copy's: closing it now could close a reused fd
    release.set()
    copier = next(t for t in threading.enumerate() if t.name == "aioproc-copy")
    await asyncio.to_thread(copier.join, 30)
    await asyncio.sleep(0)  # the loop closes it in the callback the copier posted
    assert _memfds() == 0
    monkeypatch.undo()
    assert await worker.call(of.identity, 7) == 7


async def test_calls_reach_the_worker_in_the_order_they_were_made(
    worker: WorkerProcess, of: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """A small call made while an earlier call's large argument is still being
    copied waits for it, although the small one could be sent at once."""
    started, release = gate_the_copies(monkeypatch)
    log = tmp_path / "order"
    big = asyncio.ensure_future(worker.call(of.append_line, str(log), "big", bytes(8 * MiB)))
    assert await asyncio.to_thread(started.wait, 30)
    small = asyncio.ensure_future(worker.call(of.append_line, str(log), "small"))
    for _ in range(3):  # the small call runs as far as it can: its frame would be written
        await asyncio.sleep(0)
    release.set()
    await asyncio.wait_for(asyncio.gather(big, small), 30)
    assert log.read_text().splitlines() == ["big", "small"]


async def test_memfds_that_cannot_be_filled_send_the_value_in_the_frame(
    worker: WorkerProcess, of: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_memory(segment: _shm.Segment) -> None:
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(_shm.Segment, "fill", no_memory)
    for size in (2 * MiB, 8 * MiB):  # on the loop, on a thread
        value = _payload("memoryview", size)
        # the worker's argument views the frame's buffer, not a mapping
        assert await worker.call(of.describe, value) == ("memoryview", "bytearray", True)
        assert await worker.call(of.identity, value) == value
    await worker.call(of.identity, 1)  # the loop drops its last reference to the reply
    assert _memfds() == 0


async def test_calls_cancelled_at_random_points_keep_order_and_leave_nothing(
    of: ModuleType, tmp_path: Any
) -> None:
    """Bursts of calls with small and large (copied off the loop) arguments, some
    cancelled at random moments: the calls that complete ran in the order they
    were made, a cancelled one that was sent killed the worker (later calls
    raise ``BrokenWorkerError``, a fresh worker takes over), and no memfd or
    copy thread is left."""
    rng = random.Random(f"shm-cancel-{loop_name()}")
    log = tmp_path / "order"
    worker = await open_worker()
    workers = [worker]
    broken = cancelled = 0
    try:
        for burst in range(60):
            calls = []
            for i in range(rng.randint(2, 4)):
                size = rng.choice([0, 64 * 1024, 5 * MiB])
                line = f"{burst}.{i}"
                calls.append(
                    asyncio.ensure_future(worker.call(of.append_line, str(log), line, bytes(size)))
                )
            for _ in range(rng.randint(0, 6)):
                await asyncio.sleep(0)
            for call in calls:
                if rng.random() < 0.3:
                    call.cancel()
            outcomes = await asyncio.gather(*calls, return_exceptions=True)
            for outcome in outcomes:
                if isinstance(outcome, asyncio.CancelledError):
                    cancelled += 1
                elif isinstance(outcome, BrokenWorkerError):
                    broken += 1
                else:
                    assert outcome is None, outcome
            if worker._killed or any(isinstance(o, BrokenWorkerError) for o in outcomes):
                await worker.aclose()
                worker = await open_worker()
                workers.append(worker)
        assert cancelled >= 20
        # every line a worker wrote came in the order its calls were made
        written = [tuple(map(int, line.split("."))) for line in log.read_text().splitlines()]
        assert written == sorted(written)
    finally:
        for w in workers:
            await w.aclose()
    copiers = [t for t in threading.enumerate() if t.name == "aioproc-copy"]
    for copier in copiers:
        await asyncio.to_thread(copier.join, 30)
    await asyncio.sleep(0)  # memfds of abandoned copies close in the callback they post
    assert _memfds() == 0
