"""Rendezvous at scale: N simulated agents meet through one real etcd.

    python benchmarks/bench_rendezvous.py [--quick] [--rounds R] [--sizes 8,64,256]

Each agent is the real ``EtcdRendezvousHandler`` (its own gRPC connection,
lease and watch), run as a coroutine with no workers; the N agents are
spread over ``--procs`` processes (8) and meet through one etcd server
started on a free port in a temp data dir.  For each N the table gives, as medians over rounds:

- the completion time: from the moment every agent has its session open
  until every agent holds the completed round (``min_nodes = max_nodes = N``,
  so no last-call window is waited);
- etcd requests per node for the round (join, world, watch resumptions:
  every call an agent makes), and their ratio to N = 8's, the baseline
  measured in the same run: a ratio near 1 means O(N) requests per round in
  total;
- watch events per node for the round (every event an agent's watches
  delivered): flat in N means O(N) events per round in total, where an
  agent that watched every agent's keys would receive O(N) itself;
- the whole lifetime per node (session open, round, exit barrier, close).

Targets: O(N) requests per round in total; < 2 s for 256 nodes.
Needs the ``etcd`` binary and aetcd (``pip install 'aioproc[etcd]'``).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from aioproc.rendezvous import RendezvousParameters, create_handler  # noqa: E402
from aioproc.rendezvous.etcd import EtcdRendezvousHandler  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Etcd:
    def __init__(self) -> None:
        etcd = shutil.which("etcd")
        if etcd is None:
            raise SystemExit("no etcd binary: apt-get install etcd-server")
        self.dir = tempfile.mkdtemp(prefix="bench_rdzv_")
        self.port, peer_port = _free_port(), _free_port()
        url, peer = f"http://127.0.0.1:{self.port}", f"http://127.0.0.1:{peer_port}"
        self.proc = subprocess.Popen(
            [
                etcd,
                "--data-dir",
                os.path.join(self.dir, "data"),
                "--listen-client-urls",
                url,
                "--advertise-client-urls",
                url,
                "--listen-peer-urls",
                peer,
                "--initial-advertise-peer-urls",
                peer,
                "--initial-cluster",
                f"default={peer}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 15
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)  # etcd is starting

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


async def _agents(port: int, n: int, count: int, job: str) -> None:
    """``count`` of the job's ``n`` agents in this process; talks to the parent on stdio.

    Prints ``open`` once every session is open, waits for ``go`` on stdin,
    then prints ``done <last completion, wall clock> <round requests> <life requests>
    <round events>``.
    """
    handlers: list[EtcdRendezvousHandler] = []
    for _ in range(count):
        params = RendezvousParameters(
            "etcd",
            f"127.0.0.1:{port}",
            job,
            n,
            n,
            local_addr="127.0.0.1",
            join_timeout=120,
            lease_ttl=30,  # liveness is not measured: a saturated core must not fence anyone
        )
        handler = create_handler(params)
        assert isinstance(handler, EtcdRendezvousHandler)
        handlers.append(handler)
    loop = asyncio.get_running_loop()
    opened = 0
    all_open = asyncio.Event()
    go = asyncio.Event()
    during = [0] * count
    life = [0] * count
    events = [0] * count
    done_at = [0.0] * count

    async def agent(i: int) -> None:
        nonlocal opened
        h = handlers[i]
        async with h.session(1):
            opened += 1
            if opened == count:
                all_open.set()
            await go.wait()
            before, events_before = h.requests, h.events
            info = await h.next_rendezvous()
            done_at[i] = time.time()
            during[i] = h.requests - before
            events[i] = h.events - events_before
            assert info.group_world_size == n
            await h.exit_barrier(60)
            life[i] = h.requests + 1  # and the lease's revoke on leaving

    tasks = [asyncio.ensure_future(agent(i)) for i in range(count)]
    await all_open.wait()
    print("open", flush=True)
    await loop.run_in_executor(None, sys.stdin.readline)
    go.set()
    await asyncio.gather(*tasks)
    print(f"done {max(done_at)!r} {sum(during)} {sum(life)} {sum(events)}", flush=True)


def _round(port: int, n: int, job: str, procs: int, loop: str) -> tuple[float, float, float, float]:
    """(completion s, requests per node for the round, whole-life requests per node,
    watch events per node for the round)."""
    procs = min(procs, n)
    counts = [n // procs + (1 if i < n % procs else 0) for i in range(procs)]
    children = [
        subprocess.Popen(
            [sys.executable, __file__, "--child", f"{port},{n},{c},{job},{loop}"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for c in counts
    ]
    try:
        for child in children:
            assert child.stdout is not None
            assert child.stdout.readline() == "open\n"
        start = time.time()
        for child in children:
            assert child.stdin is not None
            child.stdin.write("go\n")
            child.stdin.flush()
        last, during, life, events = 0.0, 0, 0, 0
        for child in children:
            assert child.stdout is not None
            word, at, d, lf, ev = child.stdout.readline().split()
            assert word == "done"
            last, during, life = max(last, float(at)), during + int(d), life + int(lf)
            events += int(ev)
            child.wait(60)
        return last - start, during / n, life / n, events / n
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()


def measure(
    sizes: list[int], rounds: int, procs: int, loop: str
) -> list[tuple[int, float, float, float, float]]:
    """(N, completion s, requests/node for the round, whole-life requests/node,
    watch events/node for the round), medians."""
    etcd = _Etcd()
    try:
        rows = []
        for n in sizes:
            samples = [_round(etcd.port, n, f"bench{n}r{r}", procs, loop) for r in range(rounds)]
            rows.append(
                (
                    n,
                    statistics.median(s[0] for s in samples),
                    statistics.median(s[1] for s in samples),
                    statistics.median(s[2] for s in samples),
                    statistics.median(s[3] for s in samples),
                )
            )
        return rows
    finally:
        etcd.close()


def rdzv_rows(cfg: Any) -> list[Any] | str:
    """run_all's ``rdzv``: completion time per N, requests and watch events per node
    against N = 8's.

    ``--quick``: N = 8, 32, one round (a few seconds).  Without etcd or
    aetcd, a message saying so instead of rows.
    """
    from _util import Row, Target

    if shutil.which("etcd") is None:
        return "rdzv skipped: no etcd binary (apt-get install etcd-server)"
    if importlib.util.find_spec("aetcd") is None:
        return "rdzv skipped: aetcd not installed (pip install 'aioproc[etcd]')"
    sizes = [8, 32] if cfg.quick else [8, 64, 256]
    rounds = 1 if cfg.quick else min(cfg.rounds, 3)
    out: list[Any] = []
    for loop in cfg.loops:
        rows = measure(sizes, rounds, 8, loop)
        base_n, _, base_req, _, base_events = rows[0]
        for n, seconds, per_node, _, events in rows:
            note = f"median of {rounds} round(s), agents on 8 processes"
            out.append(
                Row(
                    f"rdzv: etcd rendezvous completion, {n} agents",
                    loop,
                    seconds,
                    seconds,
                    "ms",
                    Target("max", 2.0, "ms") if n >= 256 else None,
                    note=note,
                    timed=False,
                )
            )
            out.append(
                Row(
                    f"rdzv: etcd requests per node per round, {n} agents (baseline N={base_n})",
                    loop,
                    per_node,
                    base_req,
                    "requests",
                    Target("ratio", 1.5),
                    note="a ratio near 1: O(N) requests per round in total",
                    timed=False,
                )
            )
            out.append(
                Row(
                    f"rdzv: watch events per node per round, {n} agents (baseline N={base_n})",
                    loop,
                    events,
                    base_events,
                    "events",
                    Target("ratio", 1.5),
                    note="a ratio near 1: O(N) watch events per round in total",
                    timed=False,
                )
            )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke test: N = 8, 32, one round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--sizes", default="8,64,256")
    p.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio")
    p.add_argument("--procs", type=int, default=8, help="processes the agents are spread over")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        port, n, count, job, loop = args.child.split(",")
        coro = _agents(int(port), int(n), int(count), job)
        if loop == "uvloop":
            import uvloop

            uvloop.run(coro)
        else:
            asyncio.run(coro)
        return
    sizes = [8, 32] if args.quick else [int(x) for x in args.sizes.split(",")]
    rounds = 1 if args.quick else args.rounds
    rows = measure(sizes, rounds, args.procs, args.loop)
    base = rows[0][2]
    print(
        f"rendezvous through one etcd, agents on {args.procs} processes ({args.loop}), "
        f"median of {rounds} round(s)\n"
    )
    print(
        f"| N | completion | requests/node (round) | ratio to N={rows[0][0]} "
        "| watch events/node (round) | requests/node (life) |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    for n, seconds, per_node, life, events in rows:
        print(
            f"| {n} | {seconds:.3f} s | {per_node:.2f} | {per_node / base:.2f} "
            f"| {events:.2f} | {life:.2f} |"
        )
    last = rows[-1]
    if last[0] >= 256:
        verdict = "PASS" if last[1] < 2.0 else "FAIL"
        print(f"\n{last[0]} nodes in {last[1]:.3f} s (target < 2 s): {verdict}")


if __name__ == "__main__":
    main()
