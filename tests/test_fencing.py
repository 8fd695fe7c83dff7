"""Fencing that does not need the agent's loop: a stopped agent's workers die in time.

Two ``aioproc run`` agents meet through a real etcd (see
``test_rendezvous_etcd.py`` for the setup); one of them is stopped with
SIGSTOP (a debugger, Ctrl-Z, swap) for three lease TTLs.  Its loop can do
nothing, yet its workers must be gone before the other host re-forms the
world without it: the guardian process fences them at the lease deadline.
"""

from __future__ import annotations

import glob
import os
import signal
import time
from typing import Any

import pytest
from conftest import _LOOP_FACTORIES
from test_rendezvous_etcd import TTL, Agent, Etcd, agents_cleanup, records, wait_for_records
from test_rendezvous_etcd import etcd as etcd  # the module's etcd server fixture

pytestmark = [pytest.mark.timeout(90)]


def _rows(out: str, host: str, world: int) -> list[float]:
    found: list[float] = []
    for path in glob.glob(os.path.join(out, f"{host}-r*-w{world}-*.rows")):
        with open(path) as f:
            found.extend(float(line) for line in f if line.strip())
    return found


@pytest.mark.parametrize("loop", list(_LOOP_FACTORIES))
def test_a_stopped_agents_workers_never_train_beside_the_reformed_world(
    etcd: Etcd, tmp_path: Any, loop: str
) -> None:
    out, job = str(tmp_path), f"fence-stop-{loop}"
    args = ("--hold-unless-world", "2", "--rows")
    with agents_cleanup(
        [
            Agent(etcd, job, addr, out, *args, nnodes="1:2", max_restarts=1, loop=loop)
            for addr in ("127.0.0.2", "127.0.0.3")
        ]
    ) as agents:
        a, b = agents
        wait_for_records(out, 4, 4, agents)
        # both hosts train: rows are being written on the host about to be stopped
        deadline = time.monotonic() + 10
        while not _rows(out, b.addr, 4):
            assert time.monotonic() < deadline, "the stopped host's workers never wrote a row"
            time.sleep(0.02)  # the workers write a row every 20 ms
        os.kill(b.proc.pid, signal.SIGSTOP)
        stopped_at = time.time()
        try:
            rc_a, err_a = a.finish(timeout=3 * TTL + 20)
            time.sleep(max(0.0, stopped_at + 3 * TTL - time.time()))
        finally:
            os.kill(b.proc.pid, signal.SIGCONT)
        rc_b, err_b = b.finish()
    assert rc_a == 0, err_a
    reformed = records(out, 2)
    assert [r["host"] for r in reformed] == ["127.0.0.2", "127.0.0.2"], reformed
    first_new = min(r["time"] for r in reformed)
    old_rows = _rows(out, b.addr, 4)
    assert old_rows, "no row of the old world"
    # fenced within the lease TTL, and before the other host formed the new world
    assert max(old_rows) < stopped_at + TTL, (max(old_rows) - stopped_at, TTL)
    assert max(old_rows) < first_new, (max(old_rows), first_new)
    old_pids = [r["pid"] for r in records(out, 4) if r["host"] == b.addr]
    assert len(old_pids) == 2
    assert all(not os.path.exists(f"/proc/{pid}") for pid in old_pids)
    assert rc_b != 0, err_b
