"""The rendezvous backends as a contract: one registry, and a backend of another package.

``children/file_rendezvous.py`` is a backend that lives outside aioproc (hosts
meet in a directory), as a third party's would: it implements
``RendezvousHandler`` and nothing of aioproc names it.  The tests install it
as a package would, by writing a distribution's metadata with an entry point
in the ``aioproc.rendezvous_backends`` group on ``PYTHONPATH``; ``aioproc run
--rdzv-backend file`` then runs a job of two agents through it.  The
registry's own tests use registries of their own, so the process-wide one
keeps only what aioproc registers.
"""

from __future__ import annotations

import glob
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import _LOOP_FACTORIES
from helpers import CHILDREN_DIR, REPO_ROOT, import_child, pid_gone

from aioproc.agent import WorkerSpec
from aioproc.rendezvous import (
    ENTRY_POINT_GROUP,
    RendezvousHandler,
    RendezvousHandlerRegistry,
    RendezvousParameters,
    create_handler,
    rendezvous_handler_registry,
)
from aioproc.rendezvous.static import StaticRendezvousHandler

pytestmark = pytest.mark.timeout(60)

WORKER = os.path.join(CHILDREN_DIR, "mh_worker.py")
FILE_BACKEND = "file_rendezvous:FileRendezvousHandler"


def install(site: Path, **backends: str) -> Path:
    """A distribution in ``site`` declaring ``backends`` ``{name: "module:Class"}``."""
    info = site / "aioproc_test_backends-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: aioproc-test-backends\nVersion: 1.0\n"
    )
    lines = "".join(f"{name} = {where}\n" for name, where in backends.items())
    (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n{lines}")
    return site


def params(backend: str, endpoint: str = "", **conf: Any) -> RendezvousParameters:
    return RendezvousParameters(backend, endpoint, "job", 2, 2, local_addr="127.0.0.1", **conf)


# ------------------------------------------------------------- the registry


def test_a_registered_class_is_built_from_the_parameters(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    file_rendezvous = import_child(monkeypatch, "file_rendezvous")
    registry = RendezvousHandlerRegistry(entry_point_group=None)
    registry.register("file", file_rendezvous.FileRendezvousHandler)
    registry.register("file", file_rendezvous.FileRendezvousHandler)  # again: nothing changes
    handler = registry.create_handler(params("file", str(tmp_path)))
    assert type(handler) is file_rendezvous.FileRendezvousHandler
    assert isinstance(handler, RendezvousHandler)
    assert handler.get_run_id() == "job"
    assert registry.names() == ("file",)
    with pytest.raises(ValueError, match="unknown rendezvous backend") as info:
        registry.backend("zk")
    assert str(info.value) == (
        "unknown rendezvous backend 'zk'; registered: file (another package adds one with "
        "aioproc.rendezvous.register_backend)"
    )
    # the backend refuses its parameters in its own words
    with pytest.raises(ValueError, match="the file rendezvous needs a directory, got 'nowhere'"):
        registry.create_handler(params("file", "nowhere"))


def test_a_backend_named_by_where_it_lives_is_imported_when_first_used(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.syspath_prepend(CHILDREN_DIR)
    monkeypatch.delitem(sys.modules, "file_rendezvous", raising=False)
    registry = RendezvousHandlerRegistry(entry_point_group=None)
    registry.register("file", FILE_BACKEND, aliases=("dir",))
    assert "file_rendezvous" not in sys.modules  # naming a backend imports nothing
    assert registry.names() == ("file",)
    assert registry.names(aliases=True) == ("dir", "file")
    handler = registry.create_handler(params("dir", str(tmp_path)))  # an alias
    assert handler.get_backend() == "file"  # the backend it stands for
    assert "file_rendezvous" in sys.modules
    assert registry.backend("dir") is registry.backend("file") is type(handler)


@pytest.mark.parametrize(
    ("backend", "handler", "error", "message"),
    [
        (
            "mine",
            lambda params: None,
            TypeError,
            "rendezvous backend 'mine': expected a RendezvousHandler subclass "
            "(aioproc.rendezvous.RendezvousHandler) or 'module:Class', got <function",
        ),
        (
            "mine",
            object,
            TypeError,
            "rendezvous backend 'mine': expected a RendezvousHandler subclass "
            "(aioproc.rendezvous.RendezvousHandler) or 'module:Class', got <class 'object'>",
        ),
        (
            "mine",
            "no_colon_here",
            TypeError,
            "rendezvous backend 'mine': expected a RendezvousHandler subclass or "
            "'module:Class', got 'no_colon_here'",
        ),
        (
            "",
            StaticRendezvousHandler,
            ValueError,
            "a rendezvous backend's name must be a non-empty str, got ''",
        ),
        (
            " x ",
            StaticRendezvousHandler,
            ValueError,
            "a rendezvous backend's name must be a non-empty str, got ' x '",
        ),
        (
            "static",
            "elsewhere:Other",
            ValueError,
            "rendezvous backend 'static' is registered already: "
            "aioproc.rendezvous.static:StaticRendezvousHandler",
        ),
        (
            "etcd-v3",
            StaticRendezvousHandler,
            ValueError,
            "rendezvous backend 'etcd-v3' is registered already: another name of 'etcd'",
        ),
    ],
)
def test_registering_what_is_no_backend_or_a_taken_name_is_refused(
    backend: str, handler: Any, error: type[Exception], message: str
) -> None:
    before = rendezvous_handler_registry.names(aliases=True)
    with pytest.raises(error) as info:
        rendezvous_handler_registry.register(backend, handler)
    assert str(info.value).startswith(message), info.value
    assert rendezvous_handler_registry.names(aliases=True) == before


def test_an_unknown_backend_is_named_with_those_there_are() -> None:
    with pytest.raises(ValueError, match="unknown rendezvous backend") as info:
        create_handler(RendezvousParameters("zookeeper", "localhost:0", "job", 1, 2))
    assert str(info.value) == (
        "unknown rendezvous backend 'zookeeper'; registered: c10d, etcd, etcd-v3, static "
        "(another package adds one with an 'aioproc.rendezvous_backends' entry point, or with "
        "aioproc.rendezvous.register_backend)"
    )


def test_a_handler_that_says_it_is_another_backend_is_refused() -> None:
    """As torch's registry: ``get_backend()`` must be the name it was registered by."""
    registry = RendezvousHandlerRegistry(entry_point_group=None)
    registry.register("fixed", StaticRendezvousHandler)
    with pytest.raises(RuntimeError) as info:
        registry.create_handler(RendezvousParameters("fixed", "", "job", 1, 1, node_rank=0))
    assert str(info.value) == (
        "the rendezvous backend 'fixed' (aioproc.rendezvous.static:StaticRendezvousHandler) "
        "built a handler whose get_backend() is 'static'"
    )


def test_the_contract_is_enforced_on_a_backend_that_leaves_out_a_method() -> None:
    class Partial(RendezvousHandler):
        def get_backend(self) -> str:
            return "partial"

    with pytest.raises(TypeError, match="abstract method"):
        Partial()  # type: ignore[abstract]
    with pytest.raises(TypeError) as info:
        WorkerSpec("trainer", 1, "true", rdzv_handler=object())  # type: ignore[arg-type]
    assert str(info.value).startswith(
        "WorkerSpec.rdzv_handler must be an aioproc.rendezvous.RendezvousHandler"
    )


def test_the_builtin_backends_say_what_they_need() -> None:
    """What ``aioproc run`` reads of a backend instead of its name."""
    pytest.importorskip("aetcd")
    registry = rendezvous_handler_registry
    described = {
        name: (cls.elastic, cls.needs_endpoint, cls.needs_run_id, cls.hosts_store)
        for name in registry.names(aliases=True)
        for cls in [registry.backend(name)]
    }
    assert described == {
        "c10d": (True, True, False, True),
        "etcd": (True, True, True, False),
        "etcd-v3": (True, True, True, False),
        "static": (False, False, False, False),
    }


def test_an_installed_entry_point_is_found_by_name(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    site = install(tmp_path / "site", file=FILE_BACKEND, broken="file_rendezvous:POLL")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.syspath_prepend(CHILDREN_DIR)
    importlib.invalidate_caches()
    registry = RendezvousHandlerRegistry()  # the entry point group: aioproc.rendezvous_backends
    assert registry.names() == ("broken", "file")  # listed without loading them
    handler = registry.create_handler(params("file", str(tmp_path)))
    assert handler.get_backend() == "file"
    with pytest.raises(ValueError, match="not a RendezvousHandler subclass") as info:
        registry.backend("broken")
    assert str(info.value) == (
        "rendezvous backend 'broken', declared by the entry point "
        "aioproc.rendezvous_backends:broken as 'file_rendezvous:POLL', is 0.02, not a "
        "RendezvousHandler subclass (aioproc.rendezvous.RendezvousHandler)"
    )


# ------------------------------------------------------ aioproc run, two agents


def _agent(
    store: str, addr: str, out: str, site: Path, loop: str, *flags: str
) -> subprocess.Popen[str]:
    """``aioproc run`` of two workers for the host ``addr``, meeting the other in ``store``."""
    env = dict(
        os.environ,
        MH_OUT=out,
        MH_HOST=addr,
        AIOPROC_LOOP=loop,
        PYTHONPATH=os.pathsep.join([str(site), CHILDREN_DIR, REPO_ROOT]),
        LOGLEVEL="INFO",
    )
    command = [
        *(sys.executable, "-m", "aioproc", "run", "--nnodes", "2", "--nproc-per-node", "2"),
        *("--rdzv-backend", "file", "--rdzv-endpoint", store, "--rdzv-id", "job"),
        *("--local-addr", addr, "--no-live", *flags, WORKER),
    ]
    return subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO_ROOT
    )


@pytest.mark.parametrize("loop", list(_LOOP_FACTORIES))
def test_a_backend_of_another_package_runs_a_two_host_job(tmp_path: Path, loop: str) -> None:
    site = install(tmp_path / "site", file=FILE_BACKEND)
    store, out = tmp_path / "store", tmp_path / "out"
    store.mkdir()
    out.mkdir()
    agents = [_agent(str(store), f"127.0.0.{i}", str(out), site, loop) for i in (2, 3)]
    try:
        results = [(a.wait(timeout=45), a.communicate()[1]) for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
                a.communicate()
    assert [rc for rc, _ in results] == [0, 0], results
    for _, err in results:  # the agent said where it met the other
        assert "rendezvous completed: round 0: group rank " in err, err
        assert "of 2 nodes, world size 4" in err, err
    records = []
    for path in glob.glob(str(out / "*.json")):
        with open(path) as f:
            records.append(json.load(f))
    records.sort(key=lambda r: int(r["env"]["RANK"]))
    # every worker ran and wrote its record: ranks as torch assigns them, host by host
    assert [int(r["env"]["RANK"]) for r in records] == [0, 1, 2, 3]
    hosts = [r["host"] for r in records]
    assert hosts[0] == hosts[1] != hosts[2] == hosts[3]
    assert sorted(set(hosts)) == ["127.0.0.2", "127.0.0.3"]
    for r in records:
        env = r["env"]
        assert int(env["GROUP_RANK"]) == int(env["RANK"]) // 2
        assert int(env["LOCAL_RANK"]) == int(env["RANK"]) % 2
        assert (env["WORLD_SIZE"], env["GROUP_WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == (
            "4",
            "2",
            "2",
        )
        # group rank 0's address, published through the backend; the workers met there
        assert env["MASTER_ADDR"] == hosts[0]
        assert env["TORCHELASTIC_RUN_ID"] == "job"
        assert r["peers"] == [0, 1, 2, 3]
    assert all(pid_gone(r["pid"]) for r in records)
    # both hosts passed the exit barrier, and the one that counted them all closed the job
    round0 = store / "job" / "round-0"
    joined = []
    for name in sorted(f for f in os.listdir(round0) if f.endswith(".json")):
        with open(round0 / name) as f:
            joined.append(json.load(f)["node"])
    assert len(joined) == 2
    assert sorted(f for f in os.listdir(round0) if f.startswith("done-")) == sorted(
        f"done-{node}" for node in joined
    )
    with open(store / "job" / "closed") as f:
        assert json.load(f) == {"finished": True}


def test_a_backend_whose_entry_point_cannot_be_imported_is_a_usage_error(
    tmp_path: Path,
) -> None:
    site = install(tmp_path / "site", file="no_such_module:Handler")
    log_dir = tmp_path / "logs"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), REPO_ROOT]))
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "aioproc", "run", "--nnodes", "2", "--rdzv-backend", "file"),
            *("--rdzv-endpoint", str(tmp_path), "--log-dir", str(log_dir), WORKER),
        ],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
        cwd=REPO_ROOT,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines()[-1] == (
        "aioproc run: error: rendezvous backend 'file', declared by the entry point "
        "aioproc.rendezvous_backends:file as 'no_such_module:Handler', cannot be imported: "
        "No module named 'no_such_module'"
    ), proc.stderr
    assert "Traceback" not in proc.stderr
    assert not log_dir.exists()  # nothing started
    # an unknown name lists the installed backends too
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "aioproc", "run", "--nnodes", "2", "--rdzv-backend", "zk"),
            WORKER,
        ],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
        cwd=REPO_ROOT,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines()[-1] == (
        "aioproc run: error: --rdzv-backend 'zk' cannot join several nodes in aioproc; "
        "use c10d, etcd, file or static"
    ), proc.stderr
