"""Many rendezvous agents as coroutines of one process (the real etcd handler, no workers).

    rdzv_agents.py ENDPOINT JOB COUNT MIN:MAX [HELD] [THEN]

Opens COUNT sessions, prints ``{"open": [node ids]}``, and lets every agent
join the round at once, but for the last HELD (0) agents, which wait for a
``join`` line on stdin.  A ``leave NODE_ID`` line on stdin ends that agent
(its session closes: its lease is revoked, its keys vanish).  Each agent
that completes the round prints ``{"node", "round", "rank", "world",
"events", "requests", "received"}`` (watch events received, etcd calls
made and bytes of keys and values received during the round; the world is
read after them, with ``world()``).  THEN says what each agent does next:
``barrier`` (the default) waits in the exit barrier, and the process exits
0 once every agent that stayed is through it; ``idle:SECONDS`` first stays
idle that long and prints ``{"node", "idle_requests", "idle_renewals"}``;
``change`` waits for the world to change and prints ``{"node", "change",
"lost"}`` (then leaves, without the barrier).
"""

from __future__ import annotations

import asyncio
import json
import sys

from aioproc.rendezvous import RendezvousParameters, create_handler
from aioproc.rendezvous.etcd import EtcdRendezvousHandler


def say(**record: object) -> None:
    print(json.dumps(record), flush=True)


async def main() -> None:
    endpoint, job, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
    low, high = (int(x) for x in sys.argv[4].split(":"))
    held = int(sys.argv[5]) if len(sys.argv) > 5 else 0
    then = sys.argv[6] if len(sys.argv) > 6 else "barrier"
    handlers = []
    for _ in range(count):
        params = RendezvousParameters(
            "etcd",
            endpoint,
            job,
            low,
            high,
            local_addr="127.0.0.1",
            join_timeout=40,
            last_call_timeout=30,  # a round completes by max_nodes here, never by last call
            lease_ttl=10,  # a loaded machine must not fence anyone
        )
        handler = create_handler(params)
        assert isinstance(handler, EtcdRendezvousHandler)
        handlers.append(handler)
    opened = asyncio.Semaphore(0)
    go = [asyncio.Event() for _ in handlers]

    left: set[str] = set()

    async def agent(i: int) -> None:
        h = handlers[i]
        try:
            async with h.session(1):
                opened.release()
                await go[i].wait()
                requests, events, received = h.requests, h.events, h.received
                info = await h.next_rendezvous()
                events, requests = h.events - events, h.requests - requests
                received = h.received - received
                say(
                    node=h.node_id,
                    round=info.round,
                    rank=info.group_rank,
                    world=[n.node_id for n in await h.world()],  # read after the round's counts
                    events=events,
                    requests=requests,
                    received=received,
                )
                if then.startswith("idle:"):
                    requests, renewals = h.requests, h.renewals
                    await asyncio.sleep(float(then[5:]))  # a formed world doing nothing
                    say(
                        node=h.node_id,
                        idle_requests=h.requests - requests,
                        idle_renewals=h.renewals - renewals,
                    )
                if then == "change":
                    change = await h.wait_for_change()
                    say(node=h.node_id, change=change.reason, lost=list(change.lost))
                    return
                assert await h.exit_barrier(30) is None
        except asyncio.CancelledError:
            if h.node_id not in left:
                raise

    tasks = {h.node_id: asyncio.ensure_future(agent(i)) for i, h in enumerate(handlers)}
    for _ in handlers:
        await opened.acquire()
    say(open=[h.node_id for h in handlers])
    for event in go[: count - held]:
        event.set()
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)

    async def commands() -> None:
        while line := (await reader.readline()).decode().split():
            if line[0] == "join":
                for event in go:
                    event.set()
            elif line[0] == "leave":
                left.add(line[1])
                tasks[line[1]].cancel()

    commander = asyncio.ensure_future(commands())
    try:
        await asyncio.gather(*tasks.values())  # an agent's failure fails the process
    finally:
        commander.cancel()
        for task in tasks.values():
            task.cancel()
        await asyncio.gather(commander, *tasks.values(), return_exceptions=True)


if __name__ == "__main__":
    asyncio.run(main())
