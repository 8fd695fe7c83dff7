"""Rendezvous at scale: N simulated agents meet through one real etcd, and through torch's c10d.

    python benchmarks/bench_rendezvous.py [--sizes 16,64,256,1024] [--procs 8]
        [--loop asyncio|uvloop] [--torch-limit 60] [--no-torch] [--no-aioproc] [--idle 6]
        [--last-call 1] [--json FILE] [--quick]

Each aioproc agent is the real ``EtcdRendezvousHandler`` (its own gRPC
connection, lease and watches), run as a coroutine with no workers; the N
agents are spread over ``--procs`` processes (8) and meet through one etcd
server started on a free port in a temp data dir, with default options
(``lease_ttl`` 3 s).  For each N, two jobs:

- **round** (``min_nodes = max_nodes = N``): from the moment every agent
  calls ``next_rendezvous()`` at once until every agent holds the world;
  then **idle**: ``--idle`` seconds of a formed world doing nothing (what
  keeping N leases alive costs);
- **scale-up** and **loss** (``min_nodes = N``, ``max_nodes = N + 1``,
  ``last_call_timeout`` ``--last-call``): a world of N runs, each agent
  re-joins on every ``wait_for_change()`` as the agent does; one more agent
  (a process of its own) arrives: from its arrival (the moment it calls
  ``next_rendezvous()``) until all N + 1 hold the new world (it fills
  ``max_nodes``: no last call); then that agent's process is SIGKILLed: from
  the kill until the N survivors hold a world without it (its lease must
  expire: ``lease_ttl``, then the last call).

Every phase reports its time, and per agent: requests (every gRPC message
etcd received, from its ``/metrics``, keep-alives apart), wire bytes (every
byte of the agents' TCP connections with etcd, both ways, counted by the
kernel: ``ss -ti`` on etcd's port, before and after), client CPU (the agent
processes' CPU time, all threads), and etcd's own CPU time and storage (the
job's keys and bytes, and etcd's database in use, which keeps the history of
every job of the run: nothing compacts it).  Wire and CPU are also shown
with what the same agents cost idle for as long taken away (the phase's own
cost; a loss lasts seconds, waiting for a lease to expire).  Each agent
process opens its sessions 8 at a time (hosts do not start in the same
instant; 128 sessions opening at once on one loop would hold back the
keep-alives of those already open there, each host having a loop of its own).

torch's c10d side by side (where torch is installed): each agent a thread
running torch's ``DynamicRendezvousHandler`` on its own ``TCPStore``
client, the store served by a process of its own, the same min/max nodes
and last call; its members poll ``num_nodes_waiting()`` every 0.1 s as
torch's agent does (scale-up), and re-join at once when the extra agent is
killed (torch hears of a loss from its workers: here, at once).  Requests
are the store operations its backend makes; a phase that does not finish
within ``--torch-limit`` seconds says so (and larger N are not tried).

The table is printed (markdown), with growth exponents (the slope of each
figure against N on log-log axes between successive sizes) and the targets:
a round and a scale-up within 3 s at 1,024 agents, at most 4 KB on the wire,
3 requests and 5 ms of client CPU per agent per round, at most 1 keep-alive
per agent per second idle, and survivors of a loss holding the new world
within the TTL plus the last call plus 2 s.

Needs the ``etcd`` binary, ``ss`` (iproute2) and aetcd (``pip install 'aioproc[etcd]'``).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import importlib.util
import itertools
import json
import math
import os
import queue
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import _rdzv_agents  # noqa: E402

TTL = 3.0  # the default lease_ttl: the loss target counts it
from aioproc.rendezvous._etcd_store import FENCE_AT  # noqa: E402  (the fence, in TTLs)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cpu_of(pid: int) -> float:
    """CPU seconds (user + system) of process ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _wire(port: int) -> dict[str, int]:
    """Bytes through each TCP connection of the server on ``port`` so far, by peer."""
    out = subprocess.run(
        ["ss", "-tinH", "state", "all", f"( sport = :{port} )"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    found: dict[str, int] = {}
    peer = ""
    for line in out.splitlines():
        if not line.startswith(("\t", " ")):
            parts = line.split()
            peer = parts[-1] if parts else ""
            continue
        sent = re.search(r"bytes_sent:(\d+)", line)
        got = re.search(r"bytes_received:(\d+)", line)
        if peer and (sent or got):
            found[peer] = (int(sent.group(1)) if sent else 0) + (int(got.group(1)) if got else 0)
    return found


def _wire_delta(before: dict[str, int], after: dict[str, int]) -> int:
    """Bytes moved between two ``_wire`` snapshots (connections opened meanwhile: all theirs)."""
    return sum(n - before.get(peer, 0) for peer, n in after.items())


class _Etcd:
    """One etcd server, default options, on free ports in a temp data dir."""

    def __init__(self) -> None:
        etcd = shutil.which("etcd")
        if etcd is None:
            raise SystemExit("no etcd binary: apt-get install etcd-server")
        self.dir = tempfile.mkdtemp(prefix="bench_rdzv_")
        self.port, peer_port = _free_port(), _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        peer = f"http://127.0.0.1:{peer_port}"
        self.proc = subprocess.Popen(
            [
                etcd,
                "--data-dir",
                os.path.join(self.dir, "data"),
                "--listen-client-urls",
                self.url,
                "--advertise-client-urls",
                self.url,
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
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)  # etcd is starting

    def metrics(self) -> dict[str, float]:
        """etcd's /metrics: gRPC messages received by method, database sizes."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as reply:
            text = reply.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("grpc_server_msg_received_total{"):
                method = re.search(r'grpc_method="(\w+)"', line)
                if method:
                    out[f"msg:{method.group(1)}"] = float(line.rsplit(" ", 1)[1])
            elif line.startswith(
                ("etcd_mvcc_db_total_size_in_use_in_bytes ", "etcd_debugging_mvcc_keys_total ")
            ):
                name, value = line.split()
                out[name] = float(value)
        return out

    def job_keys(self, job: str) -> tuple[int, int]:
        """How many keys the job holds in etcd, and their keys' and values' bytes."""
        prefix = f"/aioproc/rdzv/{job}/".encode()
        end = prefix[:-1] + bytes([prefix[-1] + 1])
        body = json.dumps(
            {"key": base64.b64encode(prefix).decode(), "range_end": base64.b64encode(end).decode()}
        ).encode()
        with urllib.request.urlopen(f"{self.url}/v3/kv/range", body, timeout=30) as reply:
            kvs = json.load(reply).get("kvs", [])
        size = sum(
            len(base64.b64decode(kv["key"])) + len(base64.b64decode(kv.get("value", "")))
            for kv in kvs
        )
        return len(kvs), size

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        shutil.rmtree(self.dir, ignore_errors=True)


@dataclass
class Snapshot:
    """What the machine had done by some moment: the phases are differences of two."""

    at: float
    wire: dict[str, int]
    server_cpu: float
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class Phase:
    """One phase of one size: its figures, totals (divided per agent when shown)."""

    name: str
    n: int
    seconds: float | None  # None: did not finish (see ``note``)
    requests: float = 0.0  # every message the server received, keep-alives apart
    keepalives: float = 0.0
    wire: float = 0.0
    client_cpu: float = 0.0
    server_cpu: float = 0.0
    storage: float = 0.0  # the server's database in use (bytes)
    job_keys: int = 0
    job_bytes: int = 0
    note: str = ""
    window: float = 0.0  # the phase's duration (for rates: idle)
    fenced: int = 0  # leases fenced in the job this phase ends (aioproc: idle, loss)
    slack: float = math.inf  # the closest a renewal came to its fence in that job (s)
    late: int = 0  # fences after the phases: in the exit barrier, the sessions' ends


# ----------------------------------------------------------------- the agents


class _Child:
    """A process of simulated agents, driven by lines on its stdin, answering on its stdout."""

    def __init__(self, argv: list[str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._reader, daemon=True).start()

    def _reader(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put("")

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def read(self, timeout: float | None = None) -> list[str]:
        """The next line's words; ``["timeout"]`` if none came within ``timeout`` seconds."""
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            return ["timeout"]
        if not line:
            raise RuntimeError(f"agent process {self.proc.pid} ended (rc {self.proc.wait()})")
        return line.split()

    def cpu(self) -> float:
        return _cpu_of(self.proc.pid)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def _split(n: int, procs: int) -> list[int]:
    procs = min(procs, n)
    return [n // procs + (1 if i < n % procs else 0) for i in range(procs)]


# ------------------------------------------------------------------ the phases


class _Run:
    """One job of N agents over ``procs`` processes: its processes and snapshots."""

    def __init__(
        self,
        kind: str,
        port: int,
        n: int,
        job: str,
        low: int,
        high: int,
        *,
        procs: int,
        loop: str,
        last_call: float,
        limit: float,
        server_pid: int,
        etcd: _Etcd | None,
    ) -> None:
        self.kind, self.port, self.n, self.job = kind, port, n, job
        self.etcd = etcd
        self.server_pid = server_pid
        self._argv = [kind, str(port), job, "", str(low), str(high), str(last_call), str(limit)]
        self.loop = loop
        self.children = [self._child(c) for c in _split(n, procs)]
        self.extra: _Child | None = None
        self.fenced = 0  # leases whose fence passed (aioproc's, told at ``close``)
        self.slack = math.inf  # the closest a renewal's answer came to its fence (s)
        self.late = 0  # fences in the exit barrier and the sessions' ends
        for child in self.children:
            self._expect(child, "open")

    def _child(self, count: int) -> _Child:
        argv = list(self._argv)
        argv[3] = str(count)
        return _Child(["--child", ",".join([*argv, self.loop])])

    def _expect(self, child: _Child, word: str) -> list[str]:
        got = child.read()
        if got[0] != word:
            raise RuntimeError(f"expected {word!r} from an agent process, got {got!r}")
        return got

    def snapshot(self) -> Snapshot:
        return Snapshot(
            time.time(),
            _wire(self.port),
            _cpu_of(self.server_pid),
            self.etcd.metrics() if self.etcd is not None else {},
        )

    def client_cpu(self, extra: bool = True) -> float:
        """CPU seconds of the agent processes so far (``extra``: the extra agent's too)."""
        everyone = [*self.children, *([self.extra] if extra and self.extra is not None else [])]
        return sum(c.cpu() for c in everyone if c.proc.poll() is None)

    def send(self, line: str, children: list[_Child] | None = None) -> None:
        for child in children if children is not None else self.children:
            child.send(line)

    def held(
        self, children: list[_Child], deadline: float, at_least: int = 0
    ) -> tuple[float, int] | None:
        """Wait until every child's agents hold a round ``>= at_least``: (when, the round).

        Earlier rounds a child reports meanwhile are skipped (a world formed
        without an agent that was to be in it).  None if not by ``deadline``.
        """
        last, highest = 0.0, at_least
        for child in children:
            while True:
                got = child.read(max(0.0, deadline - time.time()))
                if got[0] == "timeout":
                    return None
                if got[0] != "held":
                    raise RuntimeError(f"expected 'held', got {got!r}")
                if int(got[2]) >= at_least:
                    break
            last, highest = max(last, float(got[1])), max(highest, int(got[2]))
        return last, highest

    def phase(
        self, name: str, before: Snapshot, cpu_before: float, seconds: float | None, **extra: Any
    ) -> Phase:
        after = self.snapshot()
        cpu = self.client_cpu(extra=self.extra is not None) - cpu_before
        p = Phase(name, self.n, seconds, **extra)
        p.wire = _wire_delta(before.wire, after.wire)
        p.server_cpu = after.server_cpu - before.server_cpu
        p.client_cpu = cpu
        p.window = after.at - before.at
        if self.etcd is not None:
            msgs = {k: after.metrics.get(k, 0) - before.metrics.get(k, 0) for k in after.metrics}
            p.keepalives = msgs.get("msg:LeaseKeepAlive", 0.0)
            p.requests = sum(
                v for k, v in msgs.items() if k.startswith("msg:") and k != "msg:LeaseKeepAlive"
            )
            p.storage = after.metrics.get("etcd_mvcc_db_total_size_in_use_in_bytes", 0.0)
            p.job_keys, p.job_bytes = self.etcd.job_keys(self.job)
        return p

    def close(self) -> None:
        """End the agents; aioproc's say how many leases were fenced (``fenced``, ``slack``)."""
        for child in [*self.children, *([self.extra] if self.extra else [])]:
            if child.proc.poll() is None:
                try:
                    child.send("close")
                except OSError:
                    pass
        for child in [*self.children, *([self.extra] if self.extra else [])]:
            if self.kind == "aioproc" and child.proc.poll() is None:
                try:
                    got = child.read(120)
                    while got[0] == "held":  # a report that was on its way
                        got = child.read(120)
                except RuntimeError:  # it failed meanwhile (its error is on stderr)
                    got = ["failed"]
                if got[0] == "closed":
                    self.fenced += int(got[1])
                    self.slack = min(self.slack, float(got[2]))
                    self.late += int(got[3]) if len(got) > 3 else 0
            try:
                child.proc.wait(120)
            except subprocess.TimeoutExpired:
                child.kill()
            child.kill()


def measure_aioproc(
    etcd: _Etcd, n: int, *, procs: int, loop: str, idle: float, last_call: float, tag: str
) -> list[Phase]:
    """The four phases of aioproc's etcd rendezvous at ``n`` agents."""
    phases: list[Phase] = []
    common = dict(procs=procs, loop=loop, limit=0.0, server_pid=etcd.proc.pid, etcd=etcd)
    # round and idle: min = max = n
    run = _Run("aioproc", etcd.port, n, f"r{tag}{n}", n, n, last_call=last_call, **common)
    try:
        before, cpu = run.snapshot(), run.client_cpu()
        go = time.time()
        run.send("round")
        held = run.held(run.children, go + 300)
        if held is None:
            phases.append(Phase("round", n, None, note="no round in 300 s"))
            return phases
        phases.append(run.phase("round", before, cpu, held[0] - go))
        before, cpu = run.snapshot(), run.client_cpu()
        time.sleep(idle)  # a formed world doing nothing: the keep-alives' cost
        phases.append(run.phase("idle", before, cpu, None))
    finally:
        run.close()
    _fence_figures(phases, run)
    # scale-up and loss: a world of n with room for one more
    run = _Run("aioproc", etcd.port, n, f"s{tag}{n}", n, n + 1, last_call=last_call, **common)
    try:
        run.send("round")
        if run.held(run.children, time.time() + 300) is None:
            phases.append(Phase("scale-up", n, None, note="no first world in 300 s"))
            return phases
        run.send("follow")
        extra = run._child(1)
        run._expect(extra, "open")
        run.extra = extra
        before, cpu = run.snapshot(), run.client_cpu()
        extra.send("arrive")
        arrived = float(run._expect(extra, "arrive")[1])
        joined = run.held([extra], arrived + 300)
        held = joined and run.held(run.children, arrived + 300, at_least=joined[1])
        if not held:
            phases.append(Phase("scale-up", n + 1, None, note="no world of all in 300 s"))
            return phases
        phases.append(run.phase("scale-up", before, cpu, max(held[0], joined[0]) - arrived))
        extra.send("follow")
        before, cpu = run.snapshot(), run.client_cpu(extra=False)
        extra.kill()
        run.extra = None
        killed = time.time()
        held = run.held(run.children, killed + 300, at_least=held[1] + 1)
        if held is None:
            phases.append(Phase("loss", n, None, note="no new world in 300 s"))
            return phases
        phases.append(run.phase("loss", before, cpu, held[0] - killed))
    finally:
        run.close()
    _fence_figures(phases, run)
    return phases


def _fence_figures(phases: list[Phase], run: _Run) -> None:
    """Give the last phase of ``run``'s job the leases fenced in it and the closest call."""
    if phases:
        phases[-1].fenced, phases[-1].slack, phases[-1].late = run.fenced, run.slack, run.late


def measure_torch(
    n: int, *, procs: int, idle: float, last_call: float, limit: float, tag: str
) -> list[Phase]:
    """The same phases through torch's ``DynamicRendezvousHandler`` on a ``TCPStore``."""
    phases: list[Phase] = []
    for job, high in ((f"r{tag}{n}", n), (f"s{tag}{n}", n + 1)):
        port = _free_port()
        server = subprocess.Popen(
            [sys.executable, __file__, "--torch-store", str(port)],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert server.stdout is not None
            assert server.stdout.readline() == "ready\n"
            run = _Run(
                "torch",
                port,
                n,
                job,
                n,
                high,
                procs=procs,
                loop="asyncio",
                last_call=last_call,
                limit=limit,
                server_pid=server.pid,
                etcd=None,
            )
            try:
                before, cpu = run.snapshot(), run.client_cpu()
                ops = _torch_ops(run)
                go = time.time()
                run.send("round")
                held = run.held(run.children, go + limit + 5)
                name = "round" if high == n else "first world"
                if held is None:
                    phases.append(Phase(name, n, None, note=f"no round in {limit:g} s"))
                    return phases
                if high == n:
                    p = run.phase("round", before, cpu, held[0] - go)
                    p.requests = _torch_ops(run) - ops
                    phases.append(p)
                    before, cpu = run.snapshot(), run.client_cpu()
                    ops = _torch_ops(run)
                    time.sleep(idle)
                    p = run.phase("idle", before, cpu, None)
                    p.keepalives = _torch_ops(run) - ops
                    phases.append(p)
                    continue
                run.send("follow")
                extra = run._child(1)
                run._expect(extra, "open")
                run.extra = extra
                before, cpu = run.snapshot(), run.client_cpu()
                ops = _torch_ops(run)
                extra.send("arrive")
                arrived = float(run._expect(extra, "arrive")[1])
                joined = run.held([extra], arrived + limit)
                held = joined and run.held(run.children, arrived + limit, at_least=joined[1])
                if not held:
                    note = f"no world of all in {limit:g} s"
                    phases.append(Phase("scale-up", n + 1, None, note=note))
                    return phases
                p = run.phase("scale-up", before, cpu, max(held[0], joined[0]) - arrived)
                p.requests = _torch_ops(run) - ops
                phases.append(p)
                extra.send("follow")
                run.extra = None  # its CPU and operations are not the survivors'
                before, cpu = run.snapshot(), run.client_cpu()
                ops = _torch_ops(run)
                extra.kill()
                killed = time.time()
                run.send("rejoin")
                held = run.held(run.children, killed + limit, at_least=held[1] + 1)
                if held is None:
                    phases.append(Phase("loss", n, None, note=f"no world in {limit:g} s"))
                    return phases
                p = run.phase("loss", before, cpu, held[0] - killed)
                p.requests = _torch_ops(run) - ops
                phases.append(p)
            finally:
                run.close()
        finally:
            server.terminate()
            server.wait(30)
    return phases


def _torch_ops(run: _Run) -> float:
    """Store operations torch's backends made so far, summed over the agent processes."""
    everyone = [*run.children, *([run.extra] if run.extra is not None else [])]
    total = 0.0
    for child in everyone:
        child.send("mark")
    for child in everyone:
        got = child.read(60)
        while got[0] == "held":  # a report that was on its way: not this answer
            got = child.read(60)
        if got[0] != "mark":
            raise RuntimeError(f"expected 'mark', got {got!r}")
        total += float(got[1])
    return total


# ------------------------------------------------------------------ the report

TARGETS = {
    "round": "<= 3 s at 1,024 agents",
    "scale-up": "<= 3 s at 1,024 agents",
    "loss": f"<= TTL ({TTL:g} s) + last call + 2 s",
}


def _fmt_bytes(b: float) -> str:
    if b >= 1e6:
        return f"{b / 1e6:.1f} MB"
    if b >= 1e3:
        return f"{b / 1e3:.2f} KB"
    return f"{b:.0f} B"


def _slopes(xs: list[int], ys: list[float | None]) -> str:
    """Growth exponents of ``ys`` against ``xs`` between successive points (log-log)."""
    out = []
    points = list(zip(xs, ys, strict=True))
    for (x0, y0), (x1, y1) in itertools.pairwise(points):
        if y0 is None or y1 is None or y0 <= 0 or y1 <= 0:
            out.append("-")
        else:
            out.append(f"{math.log(y1 / y0) / math.log(x1 / x0):.2f}")
    return " / ".join(out)


def _idle_rates(phases: list[Phase], agents: int) -> tuple[float, float]:
    """Wire bytes and client CPU seconds per agent per second of the size's idle phase."""
    idle = next((p for p in phases if p.name == "idle"), None)
    if idle is None or not idle.window:
        return 0.0, 0.0
    return idle.wire / agents / idle.window, idle.client_cpu / agents / idle.window


def report(results: dict[str, dict[int, list[Phase]]], loads: dict[str, dict[int, str]]) -> str:
    """The markdown tables: per phase, per N, aioproc then torch; growth exponents.

    "Apart" columns take away what the same agents cost idle for as long
    (keep-alives, heartbeats), so that a phase that lasts seconds (a loss
    waits for a lease to expire) shows what its own round cost.
    """
    lines: list[str] = []
    sizes = sorted({n for by_n in results.values() for n in by_n})
    for phase in ("round", "idle", "scale-up", "loss"):
        lines.append(f"\n**{phase}**" + (f" (target {TARGETS[phase]})" if phase in TARGETS else ""))
        lines.append("")
        if phase == "idle":
            header = (
                "| N | impl | keep-alives/agent/s | other requests/agent/s | wire/agent/s "
                "| client CPU/agent/s | server CPU | load |"
            )
        else:
            header = (
                "| N | impl | time | requests/agent | wire/agent (keep-alives apart) "
                "| client CPU/agent (apart) | server CPU | job's keys, bytes (etcd db in use) "
                "| load |"
            )
        lines.append(header)
        lines.append("|" + "---|" * (header.count("|") - 1))
        for n in sizes:
            for impl in results:
                load = loads.get(impl, {})
                p = next((x for x in results[impl].get(n, []) if x.name == phase), None)
                if p is None:
                    continue
                agents = n + 1 if phase == "scale-up" else n
                if p.seconds is None and phase != "idle":
                    lines.append(f"| {n} | {impl} | {p.note} | | | | | | {load.get(n, '')} |")
                    continue
                if phase == "idle":
                    w = p.window or 1.0
                    lines.append(
                        f"| {n} | {impl} | {p.keepalives / agents / w:.2f} "
                        f"| {p.requests / agents / w:.3f} | {_fmt_bytes(p.wire / agents / w)} "
                        f"| {p.client_cpu / agents / w * 1e3:.2f} ms "
                        f"| {p.server_cpu / w * 1e3:.0f} ms/s | {load.get(n, '')} |"
                    )
                    continue
                wire_rate, cpu_rate = _idle_rates(results[impl][n], n)
                wire, cpu = p.wire / agents, p.client_cpu / agents
                stored = "-"
                if impl == "aioproc":
                    stored = f"{p.job_keys}, {_fmt_bytes(p.job_bytes)} (db {_fmt_bytes(p.storage)})"
                lines.append(
                    f"| {n} | {impl} | {p.seconds:.2f} s | {p.requests / agents:.2f} "
                    f"| {_fmt_bytes(wire)} ({_fmt_bytes(wire - wire_rate * p.window)}) "
                    f"| {cpu * 1e3:.2f} ms ({(cpu - cpu_rate * p.window) * 1e3:.2f} ms) "
                    f"| {p.server_cpu * 1e3:.0f} ms | {stored} | {load.get(n, '')} |"
                )
        for impl in results:
            got = [next((x for x in results[impl].get(n, []) if x.name == phase), None)
                   for n in sizes]  # fmt: skip
            if not any(g is not None for g in got):
                continue

            def col(f: Any, got: list[Phase | None] = got, idle: bool = phase == "idle") -> str:
                finished = [g if g is not None and (idle or g.seconds is not None) else None
                            for g in got]  # fmt: skip
                return _slopes(sizes, [f(g) if g is not None else None for g in finished])

            span = " -> ".join(map(str, sizes))
            if phase == "idle":
                lines.append(
                    f"\n{impl} growth exponents ({span}): keep-alives in all "
                    f"{col(lambda g: g.keepalives)}; wire in all {col(lambda g: g.wire)}; "
                    f"server CPU {col(lambda g: g.server_cpu)}"
                )
            else:
                lines.append(
                    f"\n{impl} growth exponents ({span}): time {col(lambda g: g.seconds)}; "
                    f"requests/agent {col(lambda g: g.requests / g.n)}; wire/agent "
                    f"{col(lambda g: g.wire / g.n)}; client CPU/agent "
                    f"{col(lambda g: g.client_cpu / g.n)}; server CPU {col(lambda g: g.server_cpu)}"
                )
    fence = [
        f"{n}: {p.fenced} fenced, closest {p.slack:.2f} s, {p.late} at the end ({p.name} job)"
        for n in sizes
        for p in results.get("aioproc", {}).get(n, [])
        if p.name in ("idle", "loss") and p.slack != math.inf
    ]
    if fence:
        lines.append(
            f"\n**leases** (aioproc; the fence is {FENCE_AT * TTL:g} s after a renewal is sent, "
            f"renewals every {TTL / 3:g} s): leases fenced, and the closest a renewal's answer "
            "came to its fence, per N and job (and fences after the phases: in the exit barrier "
            "or as the sessions end): " + "; ".join(fence)
        )
    return "\n".join(lines)


def rdzv_rows(cfg: Any) -> list[Any] | str:
    """run_all's ``rdzv``: aioproc's four phases at N = 64 and 256 (16 and 64 with ``--quick``).

    Per size and loop: the round's time, requests, wire bytes and client CPU
    per agent (with the issue's targets), idle keep-alives per agent per
    second, the scale-up's and the loss's times.  torch's c10d is not run
    here (``python benchmarks/bench_rendezvous.py`` runs it).  Without etcd,
    aetcd or ``ss``, a message saying so instead of rows.
    """
    from _util import Row, Target

    for binary, package in (("etcd", "etcd-server"), ("ss", "iproute2")):
        if shutil.which(binary) is None:
            return f"rdzv skipped: no {binary} binary (apt-get install {package})"
    if importlib.util.find_spec("aetcd") is None:
        return "rdzv skipped: aetcd not installed (pip install 'aioproc[etcd]')"
    sizes = [16, 64] if cfg.quick else [64, 256]
    out: list[Any] = []
    for loop in cfg.loops:
        etcd = _Etcd()
        try:
            for n in sizes:
                phases = {p.name: p for p in measure_aioproc(
                    etcd, n, procs=8, loop=loop, idle=3.0, last_call=1.0, tag=f"ra{loop}"
                )}  # fmt: skip

                def row(
                    what: str,
                    value: float,
                    unit: str,
                    target: Any = None,
                    n: int = n,
                    lp: str = loop,
                ) -> Any:
                    return Row(f"rdzv: {what}, {n} agents", lp, value, value, unit, target,
                               note="agents on 8 processes, one etcd", timed=False)  # fmt: skip

                rnd, idle = phases.get("round"), phases.get("idle")
                if rnd is None or rnd.seconds is None or idle is None:
                    out.append(row("etcd rendezvous round", math.nan, "ms"))
                    continue
                out.append(row("etcd rendezvous round", rnd.seconds, "ms",
                               Target("max", 3.0, "ms")))  # fmt: skip
                out.append(row("requests per agent per round", rnd.requests / n, "requests",
                               Target("max", 3.0, "requests")))  # fmt: skip
                out.append(row("wire bytes per agent per round", rnd.wire / n, "bytes",
                               Target("max", 4096.0, "bytes")))  # fmt: skip
                out.append(row("client CPU per agent per round", rnd.client_cpu / n, "ms",
                               Target("max", 0.005, "ms")))  # fmt: skip
                out.append(row("idle keep-alives per agent per second",
                               idle.keepalives / n / (idle.window or 1.0), "requests",
                               Target("max", 1.0, "requests")))  # fmt: skip
                for name in ("scale-up", "loss"):
                    p = phases.get(name)
                    if p is not None and p.seconds is not None:
                        out.append(row(f"etcd rendezvous {name}", p.seconds, "ms"))
        finally:
            etcd.close()
    return out


def _load() -> str:
    return f"{os.getloadavg()[0]:.1f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="16,64,256,1024")
    p.add_argument("--quick", action="store_true", help="smoke test: N = 16, 64, short idle")
    p.add_argument("--procs", type=int, default=8, help="processes the agents are spread over")
    p.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio")
    p.add_argument("--idle", type=float, default=6.0, help="seconds of the idle phase")
    p.add_argument("--last-call", type=float, default=1.0, help="scale-up/loss jobs' last call")
    p.add_argument("--torch-limit", type=float, default=60.0, help="seconds a torch phase gets")
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--no-aioproc", action="store_true", help="torch's c10d only")
    p.add_argument("--json", default="", help="also write every figure to this file")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    p.add_argument("--torch-store", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.torch_store:
        _rdzv_agents.torch_store(args.torch_store)
        return
    if args.child:
        kind, *rest = args.child.split(",")
        if kind == "torch":
            _rdzv_agents.torch_agents(rest)
            return
        coro = _rdzv_agents.aioproc_agents(rest)
        if rest[-1] == "uvloop":
            import uvloop

            uvloop.run(coro)
        else:
            asyncio.run(coro)
        return
    sizes = [16, 64] if args.quick else [int(x) for x in args.sizes.split(",")]
    idle = 3.0 if args.quick else args.idle
    torch_ok = not args.no_torch and importlib.util.find_spec("torch") is not None
    results: dict[str, dict[int, list[Phase]]] = {} if args.no_aioproc else {"aioproc": {}}
    if torch_ok:
        results["torch c10d"] = {}
    loads: dict[str, dict[int, str]] = {impl: {} for impl in results}
    tag = f"{os.getpid()}x"
    etcd = _Etcd()
    try:
        for n in [] if args.no_aioproc else sizes:
            start = _load()
            try:
                results["aioproc"][n] = measure_aioproc(
                    etcd, n, procs=args.procs, loop=args.loop, idle=idle,
                    last_call=args.last_call, tag=tag,
                )  # fmt: skip
            except RuntimeError as e:  # an agent failed (fenced, mostly: its error is above)
                note = f"failed at load {_load()}: {e}"
                results["aioproc"][n] = [Phase("round", n, None, note=note)]
            loads["aioproc"][n] = f"{start} -> {_load()}"
            print(f"aioproc N={n} done (load {loads['aioproc'][n]})", file=sys.stderr, flush=True)
    finally:
        etcd.close()
    if torch_ok:
        for n in sizes:
            start = _load()
            phases = measure_torch(
                n, procs=args.procs, idle=idle, last_call=args.last_call,
                limit=args.torch_limit, tag=tag,
            )  # fmt: skip
            results["torch c10d"][n] = phases
            loads["torch c10d"][n] = f"{start} -> {_load()}"
            print(f"torch N={n} done (load {loads['torch c10d'][n]})", file=sys.stderr, flush=True)
            if any(ph.seconds is None and ph.name != "idle" for ph in phases):
                break  # a larger world will not do better
    print(
        f"rendezvous at scale: agents on {args.procs} processes ({args.loop}), one etcd "
        f"(default options, lease_ttl {TTL:g} s), last call {args.last_call:g} s for the "
        f"scale-up/loss jobs; load average at the start -> end of each size"
    )
    print(report(results, loads))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {impl: {n: [ph.__dict__ for ph in phases] for n, phases in by_n.items()}
                 for impl, by_n in results.items()},
                f, indent=1,
            )  # fmt: skip


if __name__ == "__main__":
    main()
