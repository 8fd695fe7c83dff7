"""A worker of the multi-host tests: records its environment, meets the others.

Every worker connects to MASTER_ADDR:MASTER_PORT, where rank 0 collects all
WORLD_SIZE ranks and sends the sorted list back, so each worker proves it
reached the same world.  Then, with ``--hold-unless-world N``, a worker of
any other world size waits (until stopped); with ``--fail-rank R`` rank R
exits 3; with ``--rows`` a holding worker appends the time to
``...-<pid>.rows`` every 20 ms, as a training loop writes its steps.  The
record goes to ``$MH_OUT/<host>-r<rank>-w<world>-<pid>.json``; a SIGTERM
is recorded with its time in ``...-<pid>.term``.

With ``--all-reduce`` and torch importable, the world then also forms a gloo process group (its
TCPStore on MASTER_PORT + 1, served by rank 0) and all-reduces the ranks:
the record's ``allreduce`` is the sum, or None without torch.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import signal
import socket
import sys
import time

ENV = (
    "RANK",
    "LOCAL_RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
)


def exchange(rank: int, world: int, addr: str, port: int) -> list[int]:
    deadline = time.monotonic() + 20
    if rank == 0:
        with socket.create_server((addr, port)) as server:
            server.settimeout(20)
            conns = [server.accept()[0] for _ in range(world - 1)]
            ranks = [0] + [int(c.makefile().readline()) for c in conns]
            reply = (json.dumps(sorted(ranks)) + "\n").encode()
            for c in conns:
                c.sendall(reply)
                c.close()
            return sorted(ranks)
    while True:
        try:
            conn = socket.create_connection((addr, port), timeout=20)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)  # rank 0 is not listening yet
    with conn:
        conn.sendall(f"{rank}\n".encode())
        return list(json.loads(conn.makefile().readline()))


def all_reduce_ranks(rank: int, world: int, addr: str, port: int) -> int | None:
    """The gloo all_reduce sum of every rank, or None when torch is not installed."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return None
    timeout = datetime.timedelta(seconds=30)
    store = dist.TCPStore(addr, port + 1, world, is_master=rank == 0, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        total = torch.tensor([rank])
        dist.all_reduce(total)
        return int(total.item())
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hold-unless-world", type=int, default=0)
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument("--hold", type=float, default=0.0)
    parser.add_argument("--all-reduce", action="store_true", help="gloo all_reduce (with torch)")
    parser.add_argument(
        "--rows", action="store_true", help="while holding, append a timestamp every 20 ms"
    )
    args = parser.parse_args()
    env = {k: os.environ[k] for k in ENV}
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    host = os.environ["MH_HOST"]
    base = os.path.join(os.environ["MH_OUT"], f"{host}-r{rank}-w{world}-{os.getpid()}")

    def on_term(signum: int, frame: object) -> None:
        with open(base + ".term", "w") as f:
            f.write(repr(time.time()))
        sys.exit(143)

    signal.signal(signal.SIGTERM, on_term)
    master, master_port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
    peers = exchange(rank, world, master, master_port)
    total = all_reduce_ranks(rank, world, master, master_port) if args.all_reduce else None
    record = {"env": env, "host": host, "pid": os.getpid(), "peers": peers, "allreduce": total}
    record["time"] = time.time()
    with open(base + ".tmp", "w") as f:
        json.dump(record, f)
    os.rename(base + ".tmp", base + ".json")
    if rank == args.fail_rank:
        # fail once every rank of this attempt recorded itself (this host's
        # restart count is the number of attempts before this one)
        expected = world * (int(env["TORCHELASTIC_RESTART_COUNT"]) + 1)
        pattern = os.path.join(os.environ["MH_OUT"], f"*-w{world}-*.json")
        deadline = time.monotonic() + 10
        while len(glob.glob(pattern)) < expected and time.monotonic() < deadline:
            time.sleep(0.02)  # the other ranks are writing their records
        print(f"rank {rank} fails on purpose", file=sys.stderr)
        sys.exit(3)
    hold = args.hold
    if args.hold_unless_world and world != args.hold_unless_world:
        hold = 60  # until the agent stops this world
    if not args.rows:
        time.sleep(hold)
        return
    # a training loop: one row per step, each with the time it was written
    end = time.monotonic() + hold
    with open(base + ".rows", "a") as rows:
        while time.monotonic() < end:
            rows.write(f"{time.time()!r}\n")
            rows.flush()
            time.sleep(0.02)


if __name__ == "__main__":
    main()
