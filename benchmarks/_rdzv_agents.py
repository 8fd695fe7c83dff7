"""The agents of ``bench_rendezvous.py``: a process of simulated agents, driven by stdin lines.

``aioproc_agents`` runs aioproc's etcd handlers as coroutines, ``torch_agents``
torch's ``DynamicRendezvousHandler`` in threads (one ``TCPStore`` client
each), ``torch_store`` serves torch's store.  Commands: ``round`` (join the
next round), ``follow`` (from now on re-join at every world change),
``arrive`` (say when, then ``round``), ``mark`` (say the counts so far),
``close`` (answer ``closed FENCED SLACK LATE``: leases fenced meanwhile,
the closest a renewal came to its fence in seconds, fences in the exit
barrier and the sessions' ends); ``rejoin`` (torch: re-join
now).  Answers: ``open`` once every session is open, ``held T ROUND
REQUESTS EVENTS`` whenever every agent here holds a newer round (T: the
last one's wall clock), ``timeout``, ``mark ...``, ``closed ...``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from aioproc.rendezvous import RendezvousParameters, create_handler
from aioproc.rendezvous.etcd import EtcdRendezvousHandler

OPENING = 8  # sessions an agent process opens at once


async def aioproc_agents(args: list[str]) -> None:
    """``count`` agents of an aioproc job in this process (see ``_Child``'s commands).

    Commands: ``round`` (join the next round; answer ``held T ROUND REQ EVENTS``
    with the last agent's time), ``follow`` (from now on re-join at every world
    change; answer ``held ...`` whenever all agents here hold a newer round),
    ``close`` (exit barrier, then leave; answer ``closed FENCED SLACK LATE``).
    """
    port, job, count, low, high, last_call = (
        int(args[0]),
        args[1],
        int(args[2]),
        int(args[3]),
        int(args[4]),
        float(args[5]),
    )
    handlers: list[EtcdRendezvousHandler] = []
    for _ in range(count):
        params = RendezvousParameters(
            "etcd",
            f"127.0.0.1:{port}",
            job,
            low,
            high,
            local_addr="127.0.0.1",
            last_call_timeout=last_call,
        )
        handler = create_handler(params)
        assert isinstance(handler, EtcdRendezvousHandler)
        handlers.append(handler)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    opened = asyncio.Semaphore(0)
    # Hosts do not all start in the same instant: sessions open a few at a
    # time here, as many sessions opening at once on this one loop would hold
    # back the keep-alives of those already open (each host has a loop of its own).
    opening = asyncio.Semaphore(OPENING)
    commands: list[asyncio.Queue[str]] = [asyncio.Queue() for _ in handlers]
    rounds = [-1] * count
    held_at = [0.0] * count
    changed = asyncio.Event()

    def say(*words: object) -> None:
        print(*words, flush=True)

    # The fence of each agent's lease (monotonic), and how close a renewal's
    # answer came to the fence it moved: a lease is fenced when its fence
    # passes before a renewal is answered.
    fences: dict[int, float] = {}
    slack = [math.inf]

    def renewed(i: int) -> Callable[[float], None]:
        def moved(fence: float) -> None:
            if i in fences:
                slack[0] = min(slack[0], fences[i] - time.monotonic())
            fences[i] = fence

        return moved

    class _Fences(logging.Handler):
        """Counts the fences the handlers log, teardown's included (after ``fenced``)."""

        count = 0

        def emit(self, record: logging.LogRecord) -> None:
            if "no etcd keep-alive succeeded" in record.getMessage():
                self.count += 1

    logged = _Fences(logging.WARNING)
    logging.getLogger("aioproc.rendezvous").addHandler(logged)

    def fenced() -> int:
        now = time.monotonic()
        return sum(1 for fence in fences.values() if fence < now)

    async def agent(i: int) -> None:
        h = handlers[i]
        async with opening:
            session = h.session(1, renewed(i))
            await session.__aenter__()
        try:
            opened.release()
            following = False
            while True:
                if following and commands[i].empty():
                    get = asyncio.ensure_future(commands[i].get())
                    wait = asyncio.ensure_future(h.wait_for_change())
                    done, _ = await asyncio.wait({get, wait}, return_when=asyncio.FIRST_COMPLETED)
                    if wait in done:
                        wait.result()
                        if get.done():  # a command came with the change: keep it
                            commands[i].put_nowait(get.result())
                        else:
                            get.cancel()
                        command = "round"
                    else:
                        wait.cancel()
                        command = get.result()
                else:
                    command = await commands[i].get()
                if command == "round":
                    info = await h.next_rendezvous()
                    rounds[i], held_at[i] = info.round, time.time()
                    changed.set()
                elif command == "follow":
                    following = True
                elif command == "close":
                    await h.exit_barrier(120)
                    return
        finally:
            await session.__aexit__(None, None, None)

    def failed(task: asyncio.Future[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            # an agent that fails ends the benchmark, saying why
            traceback.print_exception(task.exception(), file=sys.stderr)
            os._exit(1)

    tasks = [asyncio.ensure_future(agent(i)) for i in range(count)]
    for task in tasks:
        task.add_done_callback(failed)
    for _ in handlers:
        await opened.acquire()
    say("open")

    async def reporter() -> None:
        reported = -1
        while True:
            await changed.wait()
            changed.clear()
            low_round = min(rounds)
            if low_round > reported and all(r == low_round for r in rounds):
                reported = low_round
                requests = sum(h.requests for h in handlers)
                events = sum(h.events for h in handlers)
                say("held", repr(max(held_at)), low_round, requests, events)

    report = asyncio.ensure_future(reporter())
    try:
        while line := (await reader.readline()).decode().strip():
            if line == "arrive":  # the extra agent: say when it starts to join
                say("arrive", repr(time.time()))
                line = "round"
            if line == "mark":
                say("mark", sum(h.requests for h in handlers), sum(h.events for h in handlers))
                continue
            for q in commands:
                q.put_nowait(line)
            if line == "close":
                lost = fenced()  # before the sessions end
                await asyncio.gather(*tasks)
                say("closed", lost, repr(slack[0]), logged.count - lost)
                return
    finally:
        report.cancel()
        for t in tasks:
            t.cancel()
        await asyncio.gather(report, *tasks, return_exceptions=True)


def torch_store(port: int) -> None:
    """torch's c10d store, served by this process until it is killed."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    print("ready", flush=True)
    threading.Event().wait()  # until terminated
    del store


class _CountingStore:
    """A c10d store for torch's rendezvous backend that counts the operations it makes."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.ops = 0
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        op = getattr(self._store, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                self.ops += 1
            return op(*args, **kwargs)

        return counted


def torch_agents(args: list[str]) -> None:
    """``count`` agents of a torch c10d job in this process, a thread each (commands as aioproc's).

    ``follow`` makes every agent poll ``num_nodes_waiting()`` every 0.1 s and
    re-join when it is not 0 (torch's agent); ``rejoin`` makes every agent
    re-join now (a loss its workers noticed).  A round not done by
    ``limit`` seconds answers ``timeout``.
    """
    from datetime import timedelta

    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
        C10dRendezvousBackend,
    )
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler,
        RendezvousTimeout,
    )

    port, job, count, low, high, last_call, limit = (
        int(args[0]),
        args[1],
        int(args[2]),
        int(args[3]),
        int(args[4]),
        float(args[5]),
        float(args[6]),
    )
    # torch 2.13 shares the rendezvous TCPStore by default, and then a node
    # joining a formed world blocks for good in RendezvousStoreInfo.build:
    # the old rank 0 keeps its server and never publishes the master address
    # under the new round's prefix.  torch's own opt-out makes every round's
    # rank 0 publish it, so that a scale-up can complete at all.
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    stores = []
    handlers = []
    for _ in range(count):
        store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=limit + 30))
        counting = _CountingStore(store)
        backend = C10dRendezvousBackend(counting, job)
        timeout = RendezvousTimeout(
            join=timedelta(seconds=limit), last_call=timedelta(seconds=last_call)
        )
        stores.append(counting)
        handlers.append(
            DynamicRendezvousHandler.from_backend(
                job, store, backend, low, high, local_addr="127.0.0.1", timeout=timeout
            )
        )
    print("open", flush=True)
    lock = threading.Lock()
    rounds = [-1] * count
    held_at = [0.0] * count
    failed: list[str] = []
    reported = [-1]
    following = threading.Event()
    rejoin = [threading.Event() for _ in handlers]
    go = [threading.Event() for _ in handlers]

    def say(*words: object) -> None:
        try:
            print(*words, flush=True)
        except BrokenPipeError:  # the benchmark is gone: so is this process
            os._exit(0)

    def report() -> None:
        low_round = min(rounds)
        if low_round > reported[0] and all(r == low_round for r in rounds):
            reported[0] = low_round
            say("held", repr(max(held_at)), low_round, sum(s.ops for s in stores), 0)

    def join(i: int) -> None:
        try:
            info = handlers[i].next_rendezvous()
        except Exception as e:  # torch's join timeout, mostly
            with lock:
                if not failed:
                    failed.append(type(e).__name__)
                    say("timeout")
            return
        with lock:
            rounds[i], held_at[i] = handlers[i]._state_holder.state.round, time.time()
            del info
            report()

    def agent(i: int) -> None:
        go[i].wait()
        join(i)
        while not failed:
            if rejoin[i].wait(0.1):  # torch's agent: monitor_interval 0.1 s
                rejoin[i].clear()
                join(i)
            elif following.is_set() and handlers[i].num_nodes_waiting() > 0:
                join(i)

    threads = [threading.Thread(target=agent, args=(i,), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    for line in sys.stdin:
        command = line.strip()
        if command == "arrive":
            print("arrive", repr(time.time()), flush=True)
            command = "round"
        if command == "round":
            for e in go:
                e.set()
        elif command == "follow":
            following.set()
        elif command == "rejoin":
            for e in rejoin:
                e.set()
        elif command == "mark":
            print("mark", sum(s.ops for s in stores), flush=True)
        elif command == "close":
            print("closed", flush=True)
            os._exit(0)  # torch's threads block in its store: nothing to wait for
