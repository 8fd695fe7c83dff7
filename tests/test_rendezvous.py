"""``aioproc.rendezvous`` without a store: parameters, errors, the static backend.

The etcd backend against a real server is in ``test_rendezvous_etcd.py``.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import socket
import subprocess
import sys
from typing import Any

import pytest
from helpers import CHILDREN_DIR, REPO_ROOT, pid_gone

from aioproc.rendezvous import (
    RendezvousAssignment,
    RendezvousInfo,
    RendezvousNode,
    RendezvousParameters,
    create_handler,
)

WORKER = os.path.join(CHILDREN_DIR, "mh_worker.py")


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "aioproc", "run", "--no-live", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
        env=dict(os.environ, PYTHONPATH=REPO_ROOT, **(env or {})),
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"min_nodes": 0}, "min_nodes must be an int >= 1, got 0"),
        ({"max_nodes": True}, "max_nodes must be an int >= 1, got True"),
        ({"min_nodes": 3, "max_nodes": 2}, "max_nodes (2) must be >= min_nodes (3)"),
        ({"backend": " "}, "the rendezvous backend must be a non-empty str, got ' '"),
        ({"run_id": ""}, "the run id must be a non-empty str, got ''"),
        ({"local_addr": ""}, "local_addr must be a host name or address, got ''"),
    ],
)
def test_parameters_refuse_bad_values(kwargs: dict[str, Any], message: str) -> None:
    args: dict[str, Any] = {
        "backend": "etcd",
        "endpoint": "localhost:2379",
        "run_id": "job",
        "min_nodes": 1,
        "max_nodes": 2,
    }
    args.update(kwargs)
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        RendezvousParameters(**args)
    assert str(info.value) == message


def test_create_handler_builds_a_c10d_handler_as_torchs_registry_does() -> None:
    """torch's API users (LocalElasticAgent's specs) get c10d from the same entry point."""
    pytest.importorskip("aetcd")
    from aioproc.rendezvous.c10d import C10dRendezvousHandler

    # is_host=false: a client of a store another agent runs, so no etcd binary is needed
    params = RendezvousParameters("c10d", "127.0.0.9:29555", "job", 1, 2, is_host="false")
    handler = create_handler(params)
    assert type(handler) is C10dRendezvousHandler
    assert handler.join_timeout == 600.0


@pytest.mark.parametrize(
    ("conf", "message"),
    [
        ({"lease_ttl": "0"}, "rdzv option lease_ttl must be a number of seconds >= 1, got '0'"),
        ({"join_timeout": "nan"}, "rdzv option join_timeout must be a number of seconds >= 0"),
        ({"timeout": "-1"}, "rdzv option timeout must be a number of seconds >= 0"),
        ({"cacert": "/ca.pem"}, "etcd rendezvous option(s) cacert: aioproc connects to etcd"),
        ({"protocol": "https"}, "etcd rendezvous option(s) protocol: aioproc connects to etcd"),
    ],
)
def test_etcd_options_are_checked_before_anything_starts(
    conf: dict[str, str], message: str
) -> None:
    pytest.importorskip("aetcd")
    params = RendezvousParameters("etcd", "localhost:2379", "job", 1, 2, **conf)
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        create_handler(params)
    assert str(info.value).startswith(message)


def test_etcd_options_it_does_not_use_are_accepted_with_one_debug_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """As torch's backends: ``is_host``, ``read_timeout`` and the like are not refused."""
    pytest.importorskip("aetcd")
    conf = {"is_host": "true", "read_timeout": "60", "timeout": "90", "protocol": "http"}
    params = RendezvousParameters("etcd", "localhost:2379", "job", 1, 2, **conf)
    with caplog.at_level(logging.DEBUG, logger="aioproc.rendezvous"):
        handler = create_handler(params)
    assert handler.join_timeout == 90.0  # torch's etcd backend: timeout is the join timeout
    assert handler.unused_options == ("is_host", "read_timeout")
    assert [r.getMessage() for r in caplog.records] == [
        "etcd rendezvous: option(s) is_host, read_timeout not used by this backend"
    ]
    both = RendezvousParameters("etcd", "localhost:2379", "j", 1, 2, timeout="90", join_timeout="5")
    assert create_handler(both).join_timeout == 5.0


def test_the_etcd_backend_without_aetcd_says_how_to_install_it() -> None:
    code = (
        "import sys; sys.modules['aetcd'] = None\n"
        "from aioproc.cli import main\n"
        "sys.exit(main(['run', '--nnodes', '1:2', '--rdzv-backend', 'etcd', "
        "'--rdzv-endpoint', 'localhost:2379', '--rdzv-id', 'j', 'x.py']))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=30, cwd=REPO_ROOT
    )
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[-1] == (
        "aioproc run: error: the etcd rendezvous backend needs the aetcd package: "
        "pip install 'aioproc[etcd]'"
    )


def test_one_host_imports_no_rendezvous_and_no_etcd_client() -> None:
    code = (
        "import sys\n"
        "from aioproc.cli import _make_run, build_parser\n"
        "_make_run(build_parser().parse_args(['run', '--nproc-per-node', '2', 'x.py']))\n"
        "import aioproc.rendezvous\n"  # the package itself loads no client either
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('aetcd', 'grpc')))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=30, cwd=REPO_ROOT
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "[]\n"


def test_info_assigns_global_ranks_as_torch_does() -> None:
    nodes = (
        RendezvousNode("a", "10.0.0.1", 4000, 3),
        RendezvousNode("b", "10.0.0.2", 4001, 1),
        RendezvousNode("c", "10.0.0.3", 4002, 2),
    )
    info = RendezvousInfo(round=2, group_rank=2, nodes=nodes)
    assert (info.world_size, info.group_world_size, info.base_global_rank) == (6, 3, 4)
    assert (info.master_addr, info.master_port) == ("10.0.0.1", 4000)


def test_info_takes_one_nodes_assignment_instead_of_every_node() -> None:
    """A backend may give a node its own figures alone (the etcd rendezvous does)."""
    assignment = RendezvousAssignment(
        group_world_size=1024,
        world_size=8192,
        base_global_rank=40,
        role="trainer",
        base_role_rank=24,
        role_world_size=4096,
        master_addr="10.0.0.1",
        master_port=29500,
    )
    info = RendezvousInfo(round=3, group_rank=5, assignment=assignment)
    assert info.nodes == ()
    assert (info.group_world_size, info.world_size, info.base_global_rank) == (1024, 8192, 40)
    assert (info.role, info.base_role_rank, info.role_world_size) == ("trainer", 24, 4096)
    assert (info.master_addr, info.master_port) == ("10.0.0.1", 29500)
    with pytest.raises(ValueError, match="needs the world's nodes or this node's assignment"):
        RendezvousInfo(round=0, group_rank=0)
    with pytest.raises(ValueError, match="group_rank 1024 is not a rank of 1024 node"):
        RendezvousInfo(round=0, group_rank=1024, assignment=assignment)
    with pytest.raises(ValueError, match="group_rank 3 is not a rank of 3 node"):
        RendezvousInfo(
            round=0,
            group_rank=3,
            nodes=tuple(RendezvousNode(f"n{i}", "h", 1, 1) for i in range(3)),
        )


def test_static_takes_torchs_rank_option_for_the_node_rank() -> None:
    """torch's launcher passes a fixed world's node rank as ``rank``; aioproc run, ``node_rank``."""
    from aioproc.rendezvous.static import StaticRendezvousHandler

    torch_style = RendezvousParameters("static", "10.0.0.1:29501", "job", 2, 2, rank="1")
    handler = create_handler(torch_style)
    assert isinstance(handler, StaticRendezvousHandler)
    assert (handler.node_rank, handler.master_addr, handler.master_port) == (1, "10.0.0.1", 29501)
    assert not handler.elastic
    with pytest.raises(ValueError, match=re.escape("got '2'")):
        create_handler(RendezvousParameters("static", "10.0.0.1:29501", "job", 2, 2, rank="2"))


def test_static_two_nodes_meet_at_the_master(tmp_path: Any) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    out = str(tmp_path)
    procs = [
        _cli(
            "--nnodes=2",
            f"--node-rank={rank}",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
            "--nproc-per-node=2",
            "--rdzv-id=static1",
            f"--log-dir={out}/logs{rank}",
            WORKER,
            env={"MH_OUT": out, "MH_HOST": f"node{rank}"},
        )
        for rank in (0, 1)
    ]
    try:
        results = [p.communicate(timeout=40) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert [p.returncode for p in procs] == [0, 0], results
    recs = []
    for path in glob.glob(os.path.join(out, "*.json")):
        with open(path) as f:
            recs.append(json.load(f))
    recs.sort(key=lambda r: int(r["env"]["RANK"]))
    assert [(r["host"], r["env"]["RANK"], r["env"]["LOCAL_RANK"]) for r in recs] == [
        ("node0", "0", "0"),
        ("node0", "1", "1"),
        ("node1", "2", "0"),
        ("node1", "3", "1"),
    ]
    for r in recs:
        assert r["env"]["WORLD_SIZE"] == "4" and r["env"]["GROUP_WORLD_SIZE"] == "2"
        assert (r["env"]["MASTER_ADDR"], r["env"]["MASTER_PORT"]) == ("127.0.0.1", port)
        assert r["env"]["GROUP_RANK"] == r["host"][-1]
        assert r["peers"] == [0, 1, 2, 3]
        assert pid_gone(r["pid"])
