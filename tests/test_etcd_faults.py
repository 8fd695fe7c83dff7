"""The etcd rendezvous when etcd fails or is not etcd: ``aioproc run`` agents as a user runs them.

- an endpoint that refuses, never answers, speaks HTTP/1 or does not
  resolve: the agent fails within ``join_timeout`` with one line naming the
  endpoint and the last error, after a progress line; an HTTP/2 server
  without etcd's API fails it at once; SIGTERM meanwhile says no worker
  was started;
- etcd SIGKILLed and restarted on its data dir while a 2-host job runs with
  ``lease_ttl=3``: the lease survives, so nobody fences and the job
  completes;
- a key under the job's prefix that no agent wrote: named once and ignored,
  or (a corrupt control key) every agent fails with one line;
- a reused run id: the job found closed exits 1, having run nothing; a host
  that waited for a place while the job finished exits 0.

Every case runs on asyncio's loop and on uvloop (the agents' ``AIOPROC_LOOP``;
``AIOPROC_TEST_LOOPS`` narrows it).
The etcd servers and agents are those of ``test_rendezvous_etcd``.
"""

from __future__ import annotations

import base64
import contextlib
import glob
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import _LOOP_FACTORIES
from helpers import CHILDREN_DIR, REPO_ROOT, free_port, pid_gone
from test_rendezvous_etcd import (
    ETCD,
    WORKER,
    Agent,
    Etcd,
    agents_cleanup,
    assert_only_closed,
    assert_world,
    records,
    wait_for_records,
)
from test_rendezvous_etcd import etcd as etcd  # the module's etcd server fixture

pytestmark = [
    pytest.mark.skipif(ETCD is None, reason="no etcd binary: apt-get install etcd-server"),
    pytest.mark.timeout(60),
    # the agents' loop (AIOPROC_LOOP): the loops this run tests
    pytest.mark.parametrize("loop", list(_LOOP_FACTORIES)),
]

FAKE = os.path.join(CHILDREN_DIR, "etcd_fake.py")
JOIN_TIMEOUT = 3
# the time an agent takes to start (Python, imports) and end, over join_timeout
MARGIN = 4.0


def _agent(endpoint: str, loop: str, out: str, *, conf: str) -> subprocess.Popen[bytes]:
    """``aioproc run`` of two workers in a 1-2 host job meeting at ``endpoint``."""
    env = dict(os.environ, MH_OUT=out, MH_HOST="127.0.0.2", AIOPROC_LOOP=loop, PYTHONPATH=REPO_ROOT)
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "aioproc",
            "run",
            "--nnodes",
            "1:2",
            "--nproc-per-node",
            "2",
            "--rdzv-backend",
            "etcd",
            "--rdzv-endpoint",
            endpoint,
            "--rdzv-id",
            "faults",
            "--rdzv-conf",
            conf,
            "--local-addr",
            "127.0.0.2",
            "--no-live",
            WORKER,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
        cwd=REPO_ROOT,
    )


@contextlib.contextmanager
def _killed_at_exit(proc: subprocess.Popen[Any]) -> Iterator[subprocess.Popen[Any]]:
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


@contextlib.contextmanager
def _endpoint(kind: str) -> Iterator[tuple[str, str]]:
    """An endpoint where no etcd answers, and a pattern of the error the agent should name."""
    if kind == "closed":
        yield f"127.0.0.1:{free_port()}", "Connection refused"
        return
    if kind == "unresolvable":
        yield "no-such-host.invalid:2379", "no-such-host[.]invalid"
        return
    fake = subprocess.Popen([sys.executable, FAKE, kind], stdout=subprocess.PIPE, text=True)
    with _killed_at_exit(fake):
        assert fake.stdout is not None
        port = int(fake.stdout.readline())
        # a silent server times out gRPC's connection attempt, or the call itself
        errors = {
            "silent": "SETTINGS frame|did not answer within",
            "http1": "http1",
            "h2-404": "404",
        }
        yield f"127.0.0.1:{port}", errors[kind]


@pytest.mark.parametrize("kind", ["closed", "silent", "http1", "unresolvable"])
def test_unreachable_endpoint_fails_within_join_timeout_naming_it(
    tmp_path: Any, loop: str, kind: str
) -> None:
    out = str(tmp_path)
    with _endpoint(kind) as (endpoint, error):
        conf = f"join_timeout={JOIN_TIMEOUT},lease_ttl=3"
        started = time.monotonic()
        with _killed_at_exit(_agent(endpoint, loop, out, conf=conf)) as agent:
            _, err_bytes = agent.communicate(timeout=JOIN_TIMEOUT + 20)
        took = time.monotonic() - started
    err = err_bytes.decode()
    assert agent.returncode == 1, err
    assert took < JOIN_TIMEOUT + MARGIN, (took, err)
    lines = err.strip().splitlines()
    # told while it waits, then one line: the endpoint, the timeout, the last error
    assert re.fullmatch(
        rf"WARNING:aioproc\.rendezvous:waiting for etcd at {re.escape(endpoint)}: .+; "
        rf"retrying \(\d s left\)",
        lines[0],
    ), err
    head = (
        f"aioproc run: could not reach etcd at {endpoint} within {JOIN_TIMEOUT} s (join_timeout): "
    )
    assert lines[-1].startswith(head), err
    assert re.search(error, lines[-1][len(head) :]), err  # the last error, in a few words
    assert "Traceback" not in err
    assert records(out) == []  # no worker ran


def test_http2_server_without_etcd_fails_at_once_naming_it(tmp_path: Any, loop: str) -> None:
    out = str(tmp_path)
    with _endpoint("h2-404") as (endpoint, _):
        started = time.monotonic()
        with _killed_at_exit(_agent(endpoint, loop, out, conf="join_timeout=600")) as agent:
            _, err_bytes = agent.communicate(timeout=30)
        took = time.monotonic() - started
    err = err_bytes.decode()
    assert agent.returncode == 1, err
    assert took < MARGIN, (took, err)  # no retries: it is not etcd and will not become it
    assert err.strip().splitlines()[-1] == (
        f"aioproc run: etcd at {endpoint} answered with an error: Received http2 header with "
        f"status: 404 (is {endpoint} etcd's client address?)"
    ), err
    assert "Traceback" not in err
    assert records(out) == []


def test_sigterm_while_waiting_for_etcd_says_no_worker_was_started(
    tmp_path: Any, loop: str
) -> None:
    with _endpoint("closed") as (endpoint, _):
        proc = _agent(endpoint, loop, str(tmp_path), conf="join_timeout=600")
        with _killed_at_exit(proc):
            assert proc.stderr is not None
            # the agent's first line: it is waiting for etcd
            ready, _, _ = select.select([proc.stderr], [], [], 20)
            assert ready, "no line from the agent in 20 s"
            first = proc.stderr.readline().decode()
            assert first.startswith(f"WARNING:aioproc.rendezvous:waiting for etcd at {endpoint}")
            sent = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            _, rest = proc.communicate(timeout=20)
            took = time.monotonic() - sent
    err = first + rest.decode()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert took < 3.0, took
    assert err.strip().splitlines()[1:] == [
        "aioproc run: got SIGTERM: stopping (no worker was started)",
        "aioproc run: got SIGTERM: stopped before any worker started",
    ], err


PAUSE = 0.8  # etcd stays down this long before it is started again
# etcd elects itself 0.1-0.5 s after a start with these: an outage is then
# PAUSE plus that (0.9-1.5 s), where etcd's own 1-2 s election (a random
# draw) can by itself pass what the fence promises to ride out
QUICK_ELECTION = ("--heartbeat-interval", "25", "--election-timeout", "250")
# The longest outage that fences nobody whenever it starts: the fence is five
# sixths of the TTL (3 s) after the last renewal sent, and renewals go out
# every third of the TTL, so the last one may have left a second before.
SAFE_OUTAGE = 3 * 5 / 6 - 3 / 3


def test_quick_etcd_restarts_do_not_fence_a_running_job(tmp_path: Any, loop: str) -> None:
    """SIGKILL + restart on the same data dir, 3 times: the lease survives, so nobody fences."""
    etcd = Etcd(str(tmp_path / "etcd" / "data"), *QUICK_ELECTION)
    os.makedirs(os.path.dirname(etcd.data_dir))
    etcd.start()
    out, job = str(tmp_path / "out"), "restarts"
    os.makedirs(out)
    conf = "last_call_timeout=1,lease_ttl=3,join_timeout=30"
    try:
        with agents_cleanup(
            [
                Agent(
                    etcd,
                    job,
                    f"127.0.0.{i}",
                    out,
                    "--hold",
                    "7",
                    nnodes="2:2",
                    conf=conf,
                    loop=loop,
                )
                for i in (2, 3)
            ]
        ) as agents:
            wait_for_records(out, 4, 4, agents)
            outages = []
            for _ in range(3):
                assert etcd.proc is not None
                etcd.proc.kill()
                etcd.proc.wait()
                killed = time.monotonic()
                time.sleep(PAUSE)  # the outage: etcd is down
                etcd.start()  # returns once etcd answers
                outages.append(time.monotonic() - killed)
                # renewals queued meanwhile go out now; the next outage starts soon
                time.sleep(0.5)
            results = [a.finish() for a in agents]
        # each outage was real (etcd down at least PAUSE)
        assert all(t >= PAUSE for t in outages), outages
        if any(t > SAFE_OUTAGE for t in outages):
            # A loaded host restarted etcd slower than the fence promises to
            # ride out: fencing may then be right, and is all this run shows.
            for rc, err in results:
                assert rc == 0 or "etcd is unreachable" in err, (outages, results)
            return
        assert [rc for rc, _ in results] == [0, 0], (outages, results)
        for _, err in results:
            assert "fenced" not in err, err
        recs = records(out)
        assert len(recs) == 4  # nobody restarted
        assert_world(recs, 4, job)
        assert not glob.glob(os.path.join(out, "*.term"))
        assert_only_closed(etcd, job)
    finally:
        etcd.stop()


def _put(etcd: Etcd, key: str, value: bytes) -> None:
    """Write ``key`` through etcd's JSON gateway (this process never loads gRPC)."""
    body = json.dumps(
        {"key": base64.b64encode(key.encode()).decode(), "value": base64.b64encode(value).decode()}
    ).encode()
    with urllib.request.urlopen(f"http://{etcd.endpoint}/v3/kv/put", body, timeout=5) as reply:
        reply.read()


def test_keys_no_agent_writes_are_named_once_and_ignored(
    etcd: Etcd, tmp_path: Any, loop: str
) -> None:
    out, job = str(tmp_path), f"stray-{loop}"
    prefix = f"/aioproc/rdzv/{job}/"
    _put(etcd, prefix + "bogus", b"x")  # a name the protocol never writes
    _put(etcd, prefix + "rounds/0/join/ghost", b"not json")  # a join nobody could have written
    with agents_cleanup(
        [Agent(etcd, job, f"127.0.0.{i}", out, nnodes="2:2", loop=loop) for i in (2, 3)]
    ) as agents:
        results = [a.finish() for a in agents]
    assert [rc for rc, _ in results] == [0, 0], results
    stray = (
        f"WARNING:aioproc.rendezvous:rendezvous of job '{job}': ignoring key {prefix}bogus = "
        "b'x': not a key aioproc's rendezvous writes"
    )
    ghost = (
        f"WARNING:aioproc.rendezvous:rendezvous of job '{job}': ignoring key "
        f"{prefix}rounds/0/join/ghost = b'not json': not a join (JSON with addr, port, nproc, "
        "prev_rank)"
    )
    for _, err in results:
        assert err.splitlines().count(stray) == 1, err
        assert "Traceback" not in err
    # the round's leader follows the joins: it names the stray one, once
    assert sorted(err.splitlines().count(ghost) for _, err in results) in ([0, 1], [1, 1])
    assert_world(records(out), 4, job)
    keys = etcd.keys(prefix)
    assert sorted(keys) == [prefix + "bogus", prefix + "closed"], keys


@pytest.mark.parametrize("when", ["mid-job", "at-start"])
def test_corrupt_control_key_fails_every_agent_in_one_line(
    etcd: Etcd, tmp_path: Any, loop: str, when: str
) -> None:
    out, job = str(tmp_path), f"corrupt-{when}-{loop}"
    prefix = f"/aioproc/rdzv/{job}/"
    key, value, why = {
        "mid-job": ("failed", b"garbage", "not a JSON object"),
        "at-start": ("current", b'{"round": 1}', "not a round number"),
    }[when]
    if when == "at-start":
        _put(etcd, prefix + key, value)
    with agents_cleanup(
        [
            Agent(
                etcd, job, f"127.0.0.{i}", out, "--hold-unless-world", "99", nnodes="2:2", loop=loop
            )
            for i in (2, 3)
        ]
    ) as agents:
        first = wait_for_records(out, 4, 4, agents) if when == "mid-job" else []
        if when == "mid-job":
            _put(etcd, prefix + key, value)
        results = [a.finish(timeout=20) for a in agents]
    for rc, err in results:
        assert rc == 1, err
        assert err.strip().splitlines()[-1] == (
            f"aioproc run: the rendezvous of job '{job}' is corrupt: key {prefix}{key} = "
            f"{value!r}: {why}; something other than its agents writes under {prefix}"
        ), err
        assert "Traceback" not in err
    assert all(pid_gone(r["pid"]) for r in first)
    assert len(records(out)) == len(first)  # nothing ran after (or, at start, at all)


def _wait_for_key(etcd: Etcd, prefix: str, agents: list[Agent]) -> None:
    """Return once a key under ``prefix`` is in etcd."""
    deadline = time.monotonic() + 20
    while not etcd.keys(prefix):
        assert time.monotonic() < deadline, f"no key under {prefix} in 20 s"
        assert all(a.proc.poll() is None for a in agents), [a.finish() for a in agents]
        time.sleep(0.05)  # the agent is starting, then joins


def test_reused_rdzv_id_exits_1_having_run_nothing(etcd: Etcd, tmp_path: Any, loop: str) -> None:
    out, job = str(tmp_path / "first"), f"reused-{loop}"
    os.makedirs(out)
    # a 2-host job, and a third host that joins the next round while the job
    # runs: when the job finishes, its part ends gracefully (exit 0), as torch's
    # standby nodes' does
    args = ("--hold", "4")
    with agents_cleanup(
        [
            Agent(etcd, job, f"127.0.0.{i}", out, *args, nnodes="2:2", nproc=1, loop=loop)
            for i in (2, 3)
        ]
    ) as agents:
        wait_for_records(out, 2, 2, agents)
        agents.append(Agent(etcd, job, "127.0.0.4", out, *args, nnodes="2:2", nproc=1, loop=loop))
        _wait_for_key(etcd, f"/aioproc/rdzv/{job}/rounds/1/join/", agents)
        results = [a.finish() for a in agents]
    assert [rc for rc, _ in results] == [0, 0, 0], results
    assert results[2][1].strip().splitlines()[-1] == (
        f"aioproc run: the job '{job}' finished while this node waited for a round: "
        "nothing is left to do"
    ), results[2][1]
    assert len(records(out)) == 2
    # the same run id again: the job is over, nothing runs, and that is no success
    again = str(tmp_path / "again")
    os.makedirs(again)
    with agents_cleanup([Agent(etcd, job, "127.0.0.2", again, nnodes="2:2", loop=loop)]) as late:
        rc, err = late[0].finish()
    assert rc == 1, err
    assert err.strip().splitlines()[-1] == (
        f"aioproc run: the rendezvous of job '{job}' is closed: the job already finished, "
        "before this node joined (a new job needs a new run id)"
    ), err
    assert records(again) == []
    assert_only_closed(etcd, job)
