"""Multi-host jobs through a real etcd: several ``aioproc run`` agents on this machine.

Each agent is a separate process standing for a host, known by its own
loopback address (127.0.0.2, 127.0.0.3, ...), meeting the others through an
``etcd`` server this module starts on a free port in a temp data dir.  The
workers (``children/mh_worker.py``) record their environment and exchange
their ranks over TCP through MASTER_ADDR:MASTER_PORT.

Needs the ``etcd`` binary (Debian's ``etcd-server``; ``.ci/run`` installs it)
and ``aetcd`` (the ``etcd`` extra): the tests skip, saying which, without them.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import glob
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from helpers import CHILDREN_DIR, REPO_ROOT, free_port, pid_gone

pytest.importorskip("aetcd", reason="aetcd not installed: pip install 'aioproc[etcd]'")

ETCD = shutil.which("etcd") or ("/usr/bin/etcd" if os.path.exists("/usr/bin/etcd") else None)
pytestmark = [
    pytest.mark.skipif(ETCD is None, reason="no etcd binary: apt-get install etcd-server"),
    pytest.mark.timeout(60),
]

WORKER = os.path.join(CHILDREN_DIR, "mh_worker.py")
AGENTS = os.path.join(CHILDREN_DIR, "rdzv_agents.py")
PROXY = os.path.join(CHILDREN_DIR, "tcp_proxy.py")
TTL = 3
PARTITIONED = "127.0.0.4"  # the host the partition tests cut off


def _iptables_usable() -> str | None:
    """Why an iptables rule cannot be used here, or None when it can."""
    if shutil.which("iptables") is None:
        return "no iptables binary"
    if os.geteuid() != 0:
        return "not root"
    probe = subprocess.run(["iptables", "-n", "-L", "INPUT"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"iptables unusable: {probe.stderr.strip()}"
    return None


CONF = f"last_call_timeout=1,lease_ttl={TTL},join_timeout=30"


class Etcd:
    """A real etcd server on a free loopback port, restartable on its data dir.

    ``options`` are more of etcd's command-line options.
    """

    def __init__(self, data_dir: str, *options: str) -> None:
        self.data_dir = data_dir
        self.options = options
        self.port = free_port()
        self.peer_port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.started = False  # once it has answered, its clients know its port

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        """Start it and return once it answers.

        The first start takes other ports if etcd exits at once: a free port
        picked here can be taken (by another test process's connection) before
        etcd binds it.  A restart keeps its ports, which its clients know.
        """
        assert ETCD is not None
        log = os.path.join(os.path.dirname(self.data_dir), "etcd.log")
        for attempt in range(1 if self.started else 3):
            url = f"http://127.0.0.1:{self.port}"
            peer = f"http://127.0.0.1:{self.peer_port}"
            with open(log, "ab") as stderr:
                self.proc = self._popen(ETCD, url, peer, stderr)
            try:
                self.keys()  # waits until it answers
            except OSError as e:
                self.stop()  # nothing left running, whatever happens next
                if self.started or attempt == 2:
                    with open(log, "rb") as f:
                        tail = f.read()[-2000:].decode(errors="replace")
                    raise OSError(
                        f"etcd did not answer on {self.endpoint}; its log ends:\n{tail}"
                    ) from e
                self.port, self.peer_port = free_port(), free_port()
            else:
                self.started = True
                return

    def _popen(self, etcd: str, url: str, peer: str, stderr: Any) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [
                etcd,
                "--data-dir",
                self.data_dir,
                "--listen-client-urls",
                # the partitioned host reaches etcd at its own address (see IPTABLES)
                f"{url},http://{PARTITIONED}:{self.port}",
                "--advertise-client-urls",
                url,
                "--listen-peer-urls",
                peer,
                "--initial-advertise-peer-urls",
                peer,
                "--initial-cluster",
                f"default={peer}",
                *self.options,
            ],
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None

    def keys(self, prefix: str = "/aioproc/") -> dict[str, Any]:
        """The keys under ``prefix`` with their values (JSON where they are).

        Read through etcd's JSON gateway, so this process never loads gRPC
        (whose poller fds would outlive a test).
        """
        end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
        body = json.dumps({"key": _b64(prefix.encode()), "range_end": _b64(end.encode())}).encode()
        deadline = time.monotonic() + 15
        while True:
            try:
                with urllib.request.urlopen(
                    f"http://{self.endpoint}/v3/kv/range", body, timeout=5
                ) as reply:
                    result = json.load(reply)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                proc = getattr(self, "proc", None)  # a Store of test_c10d has none
                if proc is not None and proc.poll() is not None:
                    raise  # exited (its port taken?): it will never answer
                time.sleep(0.1)  # etcd is still starting
        out: dict[str, Any] = {}
        for kv in result.get("kvs", []):
            value = base64.b64decode(kv.get("value", "")).decode()
            try:
                out[base64.b64decode(kv["key"]).decode()] = json.loads(value)
            except ValueError:
                out[base64.b64decode(kv["key"]).decode()] = value
        return out


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def put(etcd: Etcd, key: str, value: bytes) -> None:
    """Write ``key`` through etcd's JSON gateway (this process never loads gRPC)."""
    body = json.dumps({"key": _b64(key.encode()), "value": _b64(value)}).encode()
    with urllib.request.urlopen(f"http://{etcd.endpoint}/v3/kv/put", body, timeout=5) as reply:
        reply.read()


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Etcd]:
    server = Etcd(str(tmp_path_factory.mktemp("etcd") / "data"))
    # module-scoped: set up before the leak check's snapshot of the first
    # test that uses it, so no test is blamed for it
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def own_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Etcd]:
    """An etcd of the test's own, which the test may restart (stopped before the leak check)."""
    server = Etcd(str(tmp_path_factory.mktemp("etcd") / "data"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


class Agent:
    """One ``aioproc run`` agent, standing for the host ``addr``."""

    def __init__(
        self,
        etcd: Etcd,
        job: str,
        addr: str,
        out: str,
        *worker_args: str,
        nnodes: str = "3:3",
        nproc: int = 2,
        max_restarts: int = 0,
        endpoint: str | None = None,
        conf: str = CONF,
        loop: str = "asyncio",
    ) -> None:
        self.addr = addr
        env = dict(os.environ, MH_OUT=out, MH_HOST=addr, AIOPROC_LOOP=loop, PYTHONPATH=REPO_ROOT)
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "aioproc",
                "run",
                "--nnodes",
                nnodes,
                "--nproc-per-node",
                str(nproc),
                "--rdzv-backend",
                "etcd",
                "--rdzv-endpoint",
                endpoint or etcd.endpoint,
                "--rdzv-id",
                job,
                "--rdzv-conf",
                conf,
                "--local-addr",
                addr,
                "--max-restarts",
                str(max_restarts),
                "--grace-period",
                "5",
                "--log-dir",
                os.path.join(out, "logs", addr),
                "--no-live",
                WORKER,
                *worker_args,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            cwd=REPO_ROOT,
        )

    def finish(self, timeout: float = 40) -> tuple[int, str]:
        _, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, err.decode()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate()


@contextlib.contextmanager
def agents_cleanup(agents: list[Agent]) -> Iterator[list[Agent]]:
    try:
        yield agents
    finally:
        for a in agents:
            a.kill()


def records(out: str, world: int | None = None) -> list[dict[str, Any]]:
    found = []
    for path in glob.glob(os.path.join(out, "*.json")):
        with open(path) as f:
            record = json.load(f)
        if world is None or int(record["env"]["WORLD_SIZE"]) == world:
            found.append(record)
    return sorted(found, key=lambda r: int(r["env"]["RANK"]))


def wait_for_records(out: str, world: int, count: int, agents: list[Agent]) -> list[dict[str, Any]]:
    """The records of ``count`` workers of a world of ``world``, once written."""
    deadline = time.monotonic() + 30
    while len(records(out, world)) < count:
        dead = [a for a in agents if a.proc.poll() is not None]
        if dead or time.monotonic() > deadline:
            for a in agents:
                a.kill()
            errs = "\n".join(f"{a.addr}: rc={a.proc.returncode} {a.finish()[1]}" for a in agents)
            pytest.fail(f"{len(records(out, world))}/{count} workers of world {world}:\n{errs}")
        time.sleep(0.05)  # the workers write their records when they run
    return records(out, world)


def assert_world(recs: list[dict[str, Any]], world: int, job: str, restarts: str = "0") -> None:
    """Every worker of the world saw torchrun's environment and all its peers."""
    assert [int(r["env"]["RANK"]) for r in recs] == list(range(world))
    masters = {(r["env"]["MASTER_ADDR"], r["env"]["MASTER_PORT"]) for r in recs}
    assert len(masters) == 1, masters
    by_group: dict[int, list[dict[str, Any]]] = {}
    for r in recs:
        by_group.setdefault(int(r["env"]["GROUP_RANK"]), []).append(r)
    assert sorted(by_group) == list(range(len(by_group)))
    (master_addr, _) = masters.pop()
    assert {r["host"] for r in by_group[0]} == {master_addr}  # group rank 0's address
    base = 0
    for group in sorted(by_group):
        members = by_group[group]
        assert len({r["host"] for r in members}) == 1
        for local, r in enumerate(members):
            env = r["env"]
            assert env["LOCAL_RANK"] == str(local)
            assert env["RANK"] == env["ROLE_RANK"] == str(base + local)
            assert env["WORLD_SIZE"] == env["ROLE_WORLD_SIZE"] == str(world)
            assert env["LOCAL_WORLD_SIZE"] == str(len(members))
            assert env["GROUP_WORLD_SIZE"] == str(len(by_group))
            assert env["TORCHELASTIC_RUN_ID"] == job
            assert env["TORCHELASTIC_RESTART_COUNT"] == restarts
            assert r["peers"] == list(range(world))
        base += len(members)


def assert_only_closed(etcd: Etcd, job: str, reason: str = "succeeded") -> None:
    keys = etcd.keys(f"/aioproc/rdzv/{job}/")
    assert list(keys) == [f"/aioproc/rdzv/{job}/closed"], keys
    assert keys[f"/aioproc/rdzv/{job}/closed"]["reason"] == reason


def test_three_hosts_meet_and_exchange_ranks(etcd: Etcd, tmp_path: Any) -> None:
    out, job = str(tmp_path), "three"
    with agents_cleanup(
        [
            Agent(
                etcd,
                job,
                f"127.0.0.{i}",
                out,
                "--all-reduce",
                loop="uvloop" if i == 3 else "asyncio",
            )
            for i in (2, 3, 4)
        ]
    ) as agents:
        results = [a.finish() for a in agents]
    assert [rc for rc, _ in results] == [0, 0, 0], results
    recs = records(out)
    assert len(recs) == 6
    assert_world(recs, 6, job)
    # with torch, the gloo all_reduce of the ranks 0..5 summed them on every worker
    expected = sum(range(6)) if importlib.util.find_spec("torch") is not None else None
    assert [r["allreduce"] for r in recs] == [expected] * 6
    assert {r["env"]["TORCHELASTIC_MAX_RESTARTS"] for r in recs} == {"0"}
    assert all(pid_gone(r["pid"]) for r in recs)
    assert_only_closed(etcd, job)


def test_heterogeneous_nproc_and_late_joiner_exits_1_having_run_nothing(
    etcd: Etcd, tmp_path: Any
) -> None:
    out, job = str(tmp_path), "hetero"
    with agents_cleanup(
        [
            Agent(etcd, job, "127.0.0.2", out, nnodes="2:2", nproc=1),
            Agent(etcd, job, "127.0.0.3", out, nnodes="2:2", nproc=3),
        ]
    ) as agents:
        results = [a.finish() for a in agents]
        assert [rc for rc, _ in results] == [0, 0], results
        late = Agent(etcd, job, "127.0.0.4", out, nnodes="2:2", nproc=1)
        agents.append(late)
        rc, err = late.finish()
    assert rc == 1, err  # a job found over ran nothing here: no success (torchrun exits 1)
    assert err.strip().splitlines()[-1] == (
        "aioproc run: the rendezvous of job 'hetero' is closed: the job already finished, "
        "before this node joined (a new job needs a new run id)"
    )
    recs = records(out)
    assert_world(recs, 4, job)
    sizes = sorted(int(r["env"]["LOCAL_WORLD_SIZE"]) for r in recs if r["env"]["LOCAL_RANK"] == "0")
    assert sizes == [1, 3]
    assert_only_closed(etcd, job)


def test_scale_up_restarts_every_worker_once_without_using_restarts(
    etcd: Etcd, tmp_path: Any
) -> None:
    out, job = str(tmp_path), "scaleup"
    args = ("--hold-unless-world", "8")
    with agents_cleanup(
        [
            Agent(etcd, job, f"127.0.0.{i}", out, *args, nnodes="2:4", max_restarts=1)
            for i in (2, 3, 4)
        ]
    ) as agents:
        first = wait_for_records(out, 6, 6, agents)
        agents.append(Agent(etcd, job, "127.0.0.5", out, *args, nnodes="2:4", max_restarts=1))
        results = [a.finish() for a in agents]
    assert [rc for rc, _ in results] == [0, 0, 0, 0], results
    try:
        assert_world(first, 6, job)
        assert_world(records(out, 8), 8, job, restarts="0")  # the restart budget is untouched
    except AssertionError as e:  # the agents' own account of their rounds
        raise AssertionError(f"{e}\n" + "\n".join(err for _, err in results)) from None
    # each first-world worker was stopped once (SIGTERM), none started twice in world 6
    terms = glob.glob(os.path.join(out, "*-w6-*.term"))
    assert len(terms) == 6
    assert len(records(out, 6)) == 6
    # group ranks are stable: the first three hosts keep theirs
    group = {r["host"]: r["env"]["GROUP_RANK"] for r in first}
    assert {
        r["host"]: r["env"]["GROUP_RANK"] for r in records(out, 8) if r["host"] in group
    } == group
    assert_only_closed(etcd, job)


def test_host_loss_reforms_the_world_with_the_rest(etcd: Etcd, tmp_path: Any) -> None:
    out, job = str(tmp_path), "hostloss"
    args = ("--hold-unless-world", "4")
    with agents_cleanup(
        [
            Agent(etcd, job, f"127.0.0.{i}", out, *args, nnodes="2:3", max_restarts=1)
            for i in (2, 3, 4)
        ]
    ) as agents:
        first = wait_for_records(out, 6, 6, agents)
        victim = agents[2]
        killed_at = time.time()
        victim.proc.kill()  # the agent's workers die with it (its guardian)
        victim.proc.wait()
        results = [a.finish() for a in agents[:2]]
    assert [rc for rc, _ in results] == [0, 0], results
    lost = [r for r in first if r["host"] == victim.addr]
    assert len(lost) == 2 and all(pid_gone(r["pid"]) for r in lost)
    for _, err in results:
        assert f"lost host {victim.addr} (" in err, err
    # the survivors' first-world workers were stopped within TTL + 1 s of the loss
    terms = []
    for path in glob.glob(os.path.join(out, "*-w6-*.term")):
        with open(path) as f:
            terms.append(float(f.read()))
    assert len(terms) == 4
    assert max(terms) - killed_at < TTL + 1, max(terms) - killed_at
    # re-formed with the remaining hosts, the loss costing one restart
    assert_world(records(out, 4), 4, job, restarts="1")
    assert {r["host"] for r in records(out, 4)} == {"127.0.0.2", "127.0.0.3"}
    assert_only_closed(etcd, job)


def _wait_joins(etcd: Etcd, job: str, count: int, agents: list[Agent]) -> list[str]:
    """The hosts whose join keys of round 0 are in etcd, once there are ``count``."""
    prefix = f"/aioproc/rdzv/{job}/rounds/0/join/"
    deadline = time.monotonic() + 3 * TTL + 10
    while True:
        joins = etcd.keys(prefix)
        if len(joins) == count:
            return sorted(v["addr"] for v in joins.values())
        if time.monotonic() > deadline or any(a.proc.poll() is not None for a in agents):
            pytest.fail(f"{len(joins)} join key(s), waiting for {count}: {sorted(joins)}")
        time.sleep(0.05)  # the agents join, or a lease expires


def test_first_joiner_lost_mid_round_the_next_completes_it(etcd: Etcd, tmp_path: Any) -> None:
    """The round's first joiner completes it: killed while waiting, the next one takes over."""
    out, job = str(tmp_path), "takeover"
    with agents_cleanup([Agent(etcd, job, "127.0.0.2", out)]) as agents:
        assert _wait_joins(etcd, job, 1, agents) == ["127.0.0.2"]
        agents.append(Agent(etcd, job, "127.0.0.3", out))
        assert _wait_joins(etcd, job, 2, agents) == ["127.0.0.2", "127.0.0.3"]
        agents[0].proc.kill()  # the first joiner, before the round is full
        agents[0].proc.wait()
        assert _wait_joins(etcd, job, 1, agents[1:]) == ["127.0.0.3"]  # its lease expired
        agents.append(Agent(etcd, job, "127.0.0.4", out))
        assert _wait_joins(etcd, job, 2, agents[1:]) == ["127.0.0.3", "127.0.0.4"]
        agents.append(Agent(etcd, job, "127.0.0.5", out))
        results = [a.finish() for a in agents[1:]]
    assert [rc for rc, _ in results] == [0, 0, 0], results
    recs = records(out)
    assert_world(recs, 6, job)
    # 127.0.0.3, now the earliest joiner, completed the round, keeping the join order
    assert [r["host"] for r in recs] == ["127.0.0.3"] * 2 + ["127.0.0.4"] * 2 + ["127.0.0.5"] * 2
    assert all(pid_gone(r["pid"]) for r in recs)
    assert_only_closed(etcd, job)


@contextlib.contextmanager
def _many_agents(
    etcd: Etcd, job: str, count: int, nnodes: str, held: int = 0, then: str = "barrier"
) -> Iterator[Any]:
    """``children/rdzv_agents.py``: ``count`` agents as coroutines of one process."""
    proc = subprocess.Popen(
        [sys.executable, AGENTS, etcd.endpoint, job, str(count), nnodes, str(held), then],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=REPO_ROOT),
        cwd=REPO_ROOT,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def _opened(proc: Any) -> list[str]:
    """The node ids of the agents, once their sessions are open."""
    line = proc.stdout.readline()
    assert line, proc.communicate()[1]
    return list(json.loads(line)["open"])


def _agents_report(proc: Any) -> list[dict[str, Any]]:
    """Each agent's account of its round, once every agent is through the exit barrier."""
    out, err = proc.communicate(timeout=50)
    assert proc.returncode == 0, err
    return [json.loads(line) for line in out.splitlines()]


def _assert_one_world(recs: list[dict[str, Any]], members: list[str]) -> None:
    """Every agent holds the same world of ``members``, at its own group rank."""
    assert sorted(r["node"] for r in recs) == sorted(members), (recs, members)
    worlds = {tuple(r["world"]) for r in recs}
    assert len(worlds) == 1, worlds
    assert sorted(worlds.pop()) == sorted(members)
    assert sorted(r["rank"] for r in recs) == list(range(len(members)))
    assert all(r["world"][r["rank"]] == r["node"] for r in recs)


def test_many_agents_meet_each_hearing_of_the_round_through_a_few_keys(
    etcd: Etcd, tmp_path: Any
) -> None:
    """Only the round's leader follows the joins: O(1) watch events for every other agent."""
    job, n = "many", 24
    with _many_agents(etcd, job, n, f"{n}:{n}") as proc:
        ids = _opened(proc)
        recs = _agents_report(proc)
    _assert_one_world(recs, ids)
    # every agent but the leader hears of the round through the control keys
    # (lead, completed, current): following every join would be n - 1 events each
    events = sorted(r["events"] for r in recs)
    assert events[-2] <= 6, events
    # and writes its join in one transaction (the leader also lists, watches, completes)
    requests = sorted(r["requests"] for r in recs)
    assert requests[-2] <= 2 and requests[-1] <= 6, requests
    assert_only_closed(etcd, job)


def test_what_each_agent_reads_of_a_round_does_not_grow_with_the_world(
    etcd: Etcd, tmp_path: Any
) -> None:
    """Each agent reads its own seat and a few small keys, not a record of every agent."""
    received = {}
    for n in (4, 32):
        job = f"reads{n}"
        with _many_agents(etcd, job, n, f"{n}:{n}") as proc:
            ids = _opened(proc)
            recs = _agents_report(proc)
        _assert_one_world(recs, ids)
        # the leader reads every join (O(n)); every other agent, the same few keys
        received[n] = sorted(r["received"] for r in recs)[:-1]
        # and writes its join in one transaction (the leader also reads, seats, completes)
        assert sorted(r["requests"] for r in recs)[-2] <= 2, recs
        assert_only_closed(etcd, job)
    # a world 8 times larger costs each agent a few more digits (and at most a
    # second read of its own seat, ~270 bytes), not 28 more records
    assert max(received[32]) <= max(received[4]) + 400, received
    assert max(received[32]) < 1500, received


def test_an_idle_world_renews_each_lease_every_third_of_its_ttl(etcd: Etcd, tmp_path: Any) -> None:
    """Keep-alives as etcd's own clients send them: about 3 per TTL, nothing else while idle."""
    job, n, idle = "idle", 6, 7.0  # the agents' lease_ttl is 10 s (children/rdzv_agents.py)
    with _many_agents(etcd, job, n, f"{n}:{n}", then=f"idle:{idle}") as proc:
        ids = _opened(proc)
        lines = _agents_report(proc)
    rounds = [r for r in lines if "round" in r]
    _assert_one_world(rounds, ids)
    idles = [r for r in lines if "idle_renewals" in r]
    assert len(idles) == n
    for r in idles:
        # 7 s at one renewal per 3.3 s: 2 (3 at most, the first may come early)
        assert 1 <= r["idle_renewals"] <= 3, idles
        assert r["idle_requests"] == 0, idles
    assert_only_closed(etcd, job)


@pytest.mark.parametrize("who", ["the lookout", "another member"])
def test_a_member_leaving_is_a_loss_for_every_other_member_naming_it(
    etcd: Etcd, tmp_path: Any, who: str
) -> None:
    """Only the world's lookout (group rank 0) watches departures; every member hears of each.

    A member other than the lookout: the lookout tells the others; the
    lookout itself: its leased lookout key goes with it.
    """
    job = f"loss-{who.split()[-1]}"
    with _many_agents(etcd, job, 4, "2:4", then="change") as proc:
        _opened(proc)
        rounds = [json.loads(proc.stdout.readline()) for _ in range(4)]
        assert sorted(r["rank"] for r in rounds) == [0, 1, 2, 3], rounds
        leaving = next(r for r in rounds if (r["rank"] == 0) == (who == "the lookout"))
        proc.stdin.write(f"leave {leaving['node']}\n")
        proc.stdin.flush()
        changes = _agents_report(proc)
    assert sorted(c["node"] for c in changes) == sorted(
        r["node"] for r in rounds if r is not leaving
    ), changes
    for c in changes:
        assert c["change"] == f"lost host 127.0.0.1 ({leaving['node']})", changes
        assert c["lost"] == ["127.0.0.1"], changes


def _wait_for(etcd: Etcd, job: str, proc: Any, what: str, ready: Any) -> dict[str, Any]:
    """The job's keys once ``ready(keys)`` holds (``what`` names it on failure)."""
    deadline = time.monotonic() + 3 * TTL + 10
    while True:
        keys = etcd.keys(f"/aioproc/rdzv/{job}/")
        if ready(keys):
            return keys
        if time.monotonic() > deadline or proc.poll() is not None:
            pytest.fail(f"waiting for {what}: {sorted(keys)}")
        time.sleep(0.05)  # the agents join, or claim the round


def test_leader_leaving_mid_round_another_joiner_claims_and_completes_it(
    etcd: Etcd, tmp_path: Any
) -> None:
    job = "leaderleft"
    prefix = f"/aioproc/rdzv/{job}/"

    def joins(keys: dict[str, Any]) -> int:
        return sum(k.startswith(prefix + "rounds/0/join/") for k in keys)

    # 10 of 12 agents join a round of 11; the other 2 join after the leader left
    with _many_agents(etcd, job, 12, "11:11", held=2) as proc:
        assert proc.stdin is not None
        ids = _opened(proc)
        keys = _wait_for(
            etcd, job, proc, "10 joins", lambda k: joins(k) == 10 and prefix + "lead/0" in k
        )
        leader = keys[prefix + "lead/0"]
        assert leader in ids[:10]
        proc.stdin.write(f"leave {leader}\n")
        proc.stdin.flush()
        keys = _wait_for(
            etcd,
            job,
            proc,
            "9 joins and another leader",
            lambda k: joins(k) == 9 and k.get(prefix + "lead/0", leader) != leader,
        )
        successor = keys[prefix + "lead/0"]
        proc.stdin.write("join\n")
        proc.stdin.flush()
        recs = _agents_report(proc)
    members = [i for i in ids if i != leader]
    assert successor in members[:9]
    _assert_one_world(recs, members)
    assert_only_closed(etcd, job)


def test_host_loss_below_min_fails_every_agent_naming_the_host(etcd: Etcd, tmp_path: Any) -> None:
    out, job = str(tmp_path), "belowmin"
    with agents_cleanup(
        [
            Agent(etcd, job, f"127.0.0.{i}", out, "--hold-unless-world", "99", max_restarts=3)
            for i in (2, 3, 4)
        ]
    ) as agents:
        first = wait_for_records(out, 6, 6, agents)
        agents[0].proc.kill()
        agents[0].proc.wait()
        results = [a.finish() for a in agents[1:]]
    for rc, err in results:
        assert rc == 1, err
        last = err.strip().splitlines()[-1]
        assert last.startswith("aioproc run: lost host 127.0.0.2 (127.0.0.2_"), err
        assert last.endswith(": 2 node(s) left, fewer than min_nodes=3"), err
    assert all(pid_gone(r["pid"]) for r in first)


def test_worker_failure_restarts_every_host_then_fails_naming_host_and_rank(
    etcd: Etcd, tmp_path: Any
) -> None:
    out, job = str(tmp_path), "workerfail"
    with agents_cleanup(
        [
            Agent(etcd, job, f"127.0.0.{i}", out, "--fail-rank", "3", max_restarts=1)
            for i in (2, 3, 4)
        ]
    ) as agents:
        results = [a.finish() for a in agents]
    assert [rc for rc, _ in results] == [1, 1, 1], results
    recs = records(out)
    by_rank: dict[int, list[dict[str, Any]]] = {}
    for r in recs:
        by_rank.setdefault(int(r["env"]["RANK"]), []).append(r)
    # every rank ran twice: the first attempt and the one restart
    assert sorted(by_rank) == list(range(6)) and all(len(v) == 2 for v in by_rank.values())
    failing_host = by_rank[3][0]["host"]
    for _, err in results:
        assert "FAILED" in err, err
        root = err[err.index("Root Cause") :]
        assert f"  host      : {failing_host}" in root, err
        assert "  rank      : 3 (local_rank: 1)" in root, err
        assert "  exitcode  : 3" in root, err
    assert all(pid_gone(r["pid"]) for r in recs)


def test_ctrl_c_during_rendezvous_exits_at_once_leaving_only_closed(
    etcd: Etcd, tmp_path: Any
) -> None:
    out, job = str(tmp_path), "ctrlc"
    with agents_cleanup([Agent(etcd, job, "127.0.0.2", out, nnodes="2:2")]) as agents:
        deadline = time.monotonic() + 20
        while not any("/nodes/" in k for k in etcd.keys(f"/aioproc/rdzv/{job}/")):
            assert time.monotonic() < deadline and agents[0].proc.poll() is None
            time.sleep(0.05)  # the agent is connecting
        deadline = time.monotonic() + 20
        while not any("/join/" in k for k in etcd.keys(f"/aioproc/rdzv/{job}/")):
            assert time.monotonic() < deadline and agents[0].proc.poll() is None
            time.sleep(0.05)  # the agent is joining
        sent = time.monotonic()
        agents[0].proc.send_signal(signal.SIGINT)
        rc, err = agents[0].finish()
        took = time.monotonic() - sent
    assert rc == 130, err
    assert took < 1.0, took
    assert (
        err.strip().splitlines()[-1] == "aioproc run: got SIGINT: stopped before any worker started"
    )
    assert "stopping the workers" not in err
    assert_only_closed(etcd, job, reason="stopped")


def test_sigterm_on_one_host_stops_the_job_on_every_host(etcd: Etcd, tmp_path: Any) -> None:
    out, job = str(tmp_path), "sigterm"
    with agents_cleanup(
        [
            Agent(etcd, job, f"127.0.0.{i}", out, "--hold-unless-world", "99", nnodes="2:2")
            for i in (2, 3)
        ]
    ) as agents:
        first = wait_for_records(out, 4, 4, agents)
        agents[0].proc.send_signal(signal.SIGTERM)
        (rc0, err0), (rc1, err1) = (a.finish() for a in agents)
    assert rc0 == 128 + signal.SIGTERM, err0
    assert err0.strip().splitlines()[-1] == "aioproc run: got SIGTERM: the workers were stopped"
    assert rc1 == 1, err1
    assert err1.strip().splitlines()[-1] == (
        "aioproc run: the rendezvous of job 'sigterm' is closed: "
        "the job was stopped on host 127.0.0.2"
    )
    assert all(pid_gone(r["pid"]) for r in first)
    assert_only_closed(etcd, job, reason="stopped")


def test_join_timeout_fails_and_leaves_no_key(etcd: Etcd, tmp_path: Any) -> None:
    out, job = str(tmp_path), "jointimeout"
    conf = "last_call_timeout=1,lease_ttl=3,join_timeout=1"
    with agents_cleanup([Agent(etcd, job, "127.0.0.2", out, nnodes="2:2", conf=conf)]) as agents:
        rc, err = agents[0].finish()
    assert rc == 1, err
    assert err.strip().splitlines()[-1] == (
        "aioproc run: the rendezvous of job 'jointimeout' did not complete within 1 s "
        "(join_timeout): 1 node(s) joined, min_nodes is 2"
    )
    assert etcd.keys(f"/aioproc/rdzv/{job}/") == {}


@contextlib.contextmanager
def _proxy_cut(etcd: Etcd, blackhole: bool = False) -> Iterator[tuple[str, Any]]:
    """A TCP proxy between the host and etcd; ``cut()`` resets its connections,
    or with ``blackhole`` stops forwarding while keeping them open (bytes vanish)."""
    proxy = subprocess.Popen(
        [sys.executable, PROXY, PARTITIONED, str(etcd.port)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proxy.stdout is not None
        port = int(proxy.stdout.readline())

        def cut() -> None:
            assert proxy.stdout is not None
            proxy.send_signal(signal.SIGUSR2 if blackhole else signal.SIGUSR1)
            assert proxy.stdout.readline() == ("blackhole\n" if blackhole else "cut\n")

        yield f"{PARTITIONED}:{port}", cut
    finally:
        proxy.kill()
        proxy.wait()
        if proxy.stdout is not None:
            proxy.stdout.close()


@contextlib.contextmanager
def _iptables_cut(etcd: Etcd) -> Iterator[tuple[str, Any]]:
    """An iptables rule dropping the host's traffic with etcd (packets vanish); removed after."""
    why = _iptables_usable()
    if why is not None:
        pytest.skip(why)
    rules = [
        ["INPUT", "-p", "tcp", "-d", PARTITIONED, "--dport", str(etcd.port), "-j", "DROP"],
        ["INPUT", "-p", "tcp", "-s", PARTITIONED, "--sport", str(etcd.port), "-j", "DROP"],
    ]
    added: list[list[str]] = []

    def cut() -> None:
        for rule in rules:
            subprocess.run(["iptables", "-I", *rule], check=True)
            added.append(rule)

    try:
        yield f"{PARTITIONED}:{etcd.port}", cut
    finally:
        for rule in added:
            subprocess.run(["iptables", "-D", *rule], check=True)


@pytest.mark.parametrize("how", ["iptables", "proxy-reset", "proxy-blackhole"])
def test_partition_fences_the_cut_host_and_the_others_reform(
    etcd: Etcd, tmp_path: Any, how: str
) -> None:
    out, job = str(tmp_path), f"partition-{how}"
    partitions = {
        "iptables": _iptables_cut,
        "proxy-reset": _proxy_cut,
        "proxy-blackhole": functools.partial(_proxy_cut, blackhole=True),
    }
    with partitions[how](etcd) as (endpoint, cut):
        args = ("--hold-unless-world", "4")
        with agents_cleanup(
            [
                Agent(etcd, job, "127.0.0.2", out, *args, nnodes="2:3", max_restarts=1),
                Agent(etcd, job, "127.0.0.3", out, *args, nnodes="2:3", max_restarts=1),
                Agent(
                    etcd,
                    job,
                    PARTITIONED,
                    out,
                    *args,
                    nnodes="2:3",
                    max_restarts=1,
                    endpoint=endpoint,
                ),
            ]
        ) as agents:
            first = wait_for_records(out, 6, 6, agents)
            cut_at = time.time()
            cut()
            results = [a.finish() for a in agents]
    (rc2, _), (rc3, _), (rc4, err4) = results
    assert (rc2, rc3) == (0, 0), results
    assert rc4 == 1, err4
    assert "aioproc run: this node (127.0.0.4) was fenced: no etcd keep-alive succeeded" in err4
    # the cut host's workers were stopped within the TTL: before etcd expired its lease
    fenced = []
    for r in first:
        if r["host"] == "127.0.0.4":
            with open(os.path.join(out, f"127.0.0.4-r{r['env']['RANK']}-w6-{r['pid']}.term")) as f:
                fenced.append(float(f.read()))
    assert len(fenced) == 2 and max(fenced) - cut_at < TTL, fenced
    assert_world(records(out, 4), 4, job, restarts="1")
    assert {r["host"] for r in records(out, 4)} == {"127.0.0.2", "127.0.0.3"}
    assert all(pid_gone(r["pid"]) for r in first)


def test_job_survives_an_etcd_restart(own_etcd: Etcd, tmp_path: Any) -> None:
    etcd = own_etcd
    out, job = str(tmp_path), "etcdrestart"
    conf = "last_call_timeout=1,lease_ttl=5,join_timeout=30"
    with agents_cleanup(
        [
            Agent(etcd, job, f"127.0.0.{i}", out, "--hold", "6", nnodes="2:2", conf=conf)
            for i in (2, 3)
        ]
    ) as agents:
        wait_for_records(out, 4, 4, agents)
        etcd.stop()
        etcd.start()
        results = [a.finish() for a in agents]
    assert [rc for rc, _ in results] == [0, 0], results
    recs = records(out)
    assert len(recs) == 4  # nobody restarted
    assert_world(recs, 4, job)
    assert not glob.glob(os.path.join(out, "*.term"))
    assert_only_closed(etcd, job)


def test_agents_of_three_roles_get_torchs_role_ranks(etcd: Etcd, tmp_path: Any) -> None:
    """7 agents (master, trainer, ps; 1 to 3 workers each) meet; ranks are torch's.

    Each agent publishes its role and nproc with its join; whatever group
    ranks the round gives them, every worker's ranks are those torch's
    ``_assign_worker_ranks`` computes for that order (``torch_assignment``).
    """
    from test_role_ranks import expected_env, torch_assignment

    job = "roles"
    roles = [
        ("master", 1),
        ("trainer", 2),
        ("ps", 1),
        ("trainer", 3),
        ("ps", 2),
        ("trainer", 1),
        ("ps", 1),
    ]
    child = os.path.join(CHILDREN_DIR, "role_agents.py")
    proc = subprocess.run(
        [sys.executable, child, etcd.endpoint, job, *(f"{r}:{n}" for r, n in roles)],
        capture_output=True,
        text=True,
        timeout=50,
        env=dict(os.environ, PYTHONPATH=REPO_ROOT),
        cwd=str(tmp_path),
    )
    assert proc.returncode == 0, proc.stderr
    agents = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [(a["role"], a["nproc"]) for a in agents] == roles
    assert {a["state"] for a in agents} == {"SUCCEEDED"}
    # the world in group-rank order, as the round formed it
    order = sorted(agents, key=lambda a: a["group_rank"])
    assert [a["group_rank"] for a in order] == list(range(len(roles)))
    nodes = [(a["role"], a["nproc"]) for a in order]
    assigned = torch_assignment(nodes)
    for a in agents:
        group_rank = a["group_rank"]
        base, world, role_base, role_world = assigned[group_rank]
        assert a["workers"] == [
            [local, base + local, role_base + local, world, role_world]
            for local in range(a["nproc"])
        ]
        # every worker's environment, keyed by its global rank
        assert a["values"] == {
            str(base + local): expected_env(nodes, group_rank, local) for local in range(a["nproc"])
        }
    assert_only_closed(etcd, job)


@pytest.mark.parametrize(
    ("addr", "port"),
    [("test_host", "42"), ("test_host", "-"), ("-", "42"), ("-", "-")],
    ids=["both", "addr", "port", "neither"],
)
def test_the_specs_master_address_overrides_the_rendezvous_as_in_torch(
    etcd: Etcd, tmp_path: Any, addr: str, port: str
) -> None:
    """torch's ``check_master_addr_port_override``: ``spec.master_addr or`` the round's, each."""
    child = os.path.join(CHILDREN_DIR, "master_override.py")
    proc = subprocess.run(
        [sys.executable, child, etcd.endpoint, f"master-{addr}-{port}", addr, port],
        capture_output=True,
        text=True,
        timeout=50,
        env=dict(os.environ, PYTHONPATH=REPO_ROOT),
        cwd=str(tmp_path),
    )
    assert proc.returncode == 0, proc.stderr
    record = json.loads(proc.stdout)
    assert record["state"] == "SUCCEEDED", proc.stderr
    rdzv_addr, rdzv_port = record["rendezvous"]
    assert rdzv_addr == "127.0.0.1"  # the agent's --local-addr, published as group rank 0
    assert rdzv_port != 42
    expected = [
        rdzv_addr if addr == "-" else addr,
        rdzv_port if port == "-" else int(port),
    ]
    assert record["group"] == expected  # the agent's WorkerGroup, as torch's
    assert record["worker"] == [expected[0], str(expected[1])]  # what the worker saw
