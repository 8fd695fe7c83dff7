"""``aioproc.launcher``: torch's ``torch.distributed.launcher.api`` on aioproc's agent.

What a tool that switches its import sees: ``LaunchConfig`` with torch
2.13's fields and defaults (compared with torch's own where torch can be
run, else with the list pinned here), ``elastic_launch(config, fn)(*args)``
returning the workers' values by rank or raising ``ChildFailedError`` that
names the failed ranks, from plain code, from a thread beside a running
loop, on both loops; ``await launch(...)`` cancelled at random points
leaving nothing; bad input refused before anything starts; a node in a job
of two over every rendezvous backend (each node a process of its own, as a
tool's would be: the etcd client's gRPC runtime must stay out of the test
process); and a signal to a blocking caller stopping its workers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import inspect
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import CHILDREN_DIR, REPO_ROOT, free_port, loop_name, pid_gone, spin

import aioproc
from aioproc import DefaultLogsSpecs
from aioproc.errors import ChildFailedError
from aioproc.launcher import LaunchConfig, elastic_launch, launch, launch_agent

LIMIT = 60
NODE = os.path.join(CHILDREN_DIR, "launch_node.py")
CANCEL_ITERATIONS = 12  # per event loop
SEED = int(os.environ.get("AIOPROC_FAULT_SEED", random.randrange(1 << 30)))

REQUIRED = "<required>"
# torch 2.13.0, torch/distributed/launcher/api.py: LaunchConfig's fields, in order, with
# their defaults (a default_factory's value)
TORCH_LAUNCH_CONFIG: list[tuple[str, Any]] = [
    ("min_nodes", REQUIRED),
    ("max_nodes", REQUIRED),
    ("nproc_per_node", REQUIRED),
    ("logs_specs", None),
    ("run_id", ""),
    ("role", "default_role"),
    ("rdzv_endpoint", ""),
    ("rdzv_backend", "etcd"),
    ("rdzv_configs", {}),
    ("rdzv_timeout", -1),
    ("max_restarts", 3),
    ("monitor_interval", 0.1),
    ("start_method", "spawn"),
    ("log_line_prefix_template", None),
    ("metrics_cfg", {}),
    ("local_addr", None),
    ("event_log_handler", "null"),
    ("numa_options", None),
    ("signals_to_handle", "SIGTERM,SIGINT,SIGHUP,SIGQUIT"),
    ("duplicate_stdout_filters", None),
    ("duplicate_stderr_filters", None),
    ("virtual_local_rank", False),
    ("shutdown_timeout", None),
]
# the same file's entry points: (name, kind, default) of each parameter
TORCH_LAUNCH_SIGNATURES: dict[str, list[tuple[str, str, Any]]] = {
    "elastic_launch": [
        ("config", "POSITIONAL_OR_KEYWORD", REQUIRED),
        ("entrypoint", "POSITIONAL_OR_KEYWORD", REQUIRED),
        ("health_check_server", "POSITIONAL_OR_KEYWORD", None),
    ],
    "elastic_launch.__call__": [("args", "VAR_POSITIONAL", REQUIRED)],
    "launch_agent": [
        ("config", "POSITIONAL_OR_KEYWORD", REQUIRED),
        ("entrypoint", "POSITIONAL_OR_KEYWORD", REQUIRED),
        ("args", "POSITIONAL_OR_KEYWORD", REQUIRED),
        ("health_check_server", "POSITIONAL_OR_KEYWORD", None),
    ],
}


def torch_python() -> str | None:
    named = os.environ.get("AIOPROC_TORCH_PYTHON")
    if named:
        return named
    return sys.executable if importlib.util.find_spec("torch") is not None else None


TORCH_PYTHON = torch_python()
needs_torch = pytest.mark.skipif(TORCH_PYTHON is None, reason="torch is not installed")

# Run by torch's interpreter, in a process of its own (importing torch here
# would leave its threads in this one): prints what ``CODE`` computes as JSON.
_TORCH_PRELUDE = """\
import dataclasses, inspect, json, sys
REQUIRED = "<required>"
def default(value):
    return REQUIRED if value is inspect.Parameter.empty else value
def signature(fn):
    return [[p.name, p.kind.name, default(p.default)]
            for p in inspect.signature(fn).parameters.values()]
def field_default(f):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return REQUIRED
"""


def torch_json(code: str, **env: str) -> Any:
    """What ``code`` (run by torch's interpreter after the prelude) prints, as JSON."""
    assert TORCH_PYTHON is not None
    proc = subprocess.run(
        [TORCH_PYTHON, "-c", _TORCH_PRELUDE + code],
        capture_output=True,
        text=True,
        timeout=LIMIT,
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def field_default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return REQUIRED


def signature(fn: Any) -> list[tuple[str, str, Any]]:
    return [
        (p.name, p.kind.name, REQUIRED if p.default is inspect.Parameter.empty else p.default)
        for p in inspect.signature(fn).parameters.values()
    ]


def our_signatures() -> dict[str, list[tuple[str, str, Any]]]:
    return {
        "elastic_launch": signature(elastic_launch),
        "elastic_launch.__call__": signature(elastic_launch.__call__)[1:],  # less self
        "launch_agent": signature(launch_agent),
    }


def config(tmp_path: Path, nproc: int = 2, **fields: Any) -> LaunchConfig:
    """A one-node config whose logs go under ``tmp_path``."""
    fields.setdefault("logs_specs", DefaultLogsSpecs(log_dir=str(tmp_path / "logs")))
    return LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id="job", **fields)


def children() -> set[int]:
    """This process's child processes."""
    found: set[int] = set()
    for tid in os.listdir(f"/proc/{os.getpid()}/task"):
        try:
            with open(f"/proc/{os.getpid()}/task/{tid}/children") as f:
                found.update(int(p) for p in f.read().split())
        except FileNotFoundError:
            continue
    return found


@pytest.fixture(params=["asyncio", "uvloop"])
def blocking_loop(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The loop a blocking launch makes for itself (``AIOPROC_LOOP``), one test per loop."""
    chosen = [n.strip() for n in os.environ.get("AIOPROC_TEST_LOOPS", "").split(",") if n.strip()]
    if chosen and request.param not in chosen:
        pytest.skip(f"AIOPROC_TEST_LOOPS={','.join(chosen)}")
    monkeypatch.setenv("AIOPROC_LOOP", request.param)
    return str(request.param)


# ------------------------------------------------------------------ workers


def rank_and_double(x: int) -> tuple[int, int, str]:
    return int(os.environ["RANK"]), 2 * x, os.environ["ROLE_NAME"]


def fail_on_rank_one(x: int) -> int:
    if os.environ["RANK"] == "1":
        raise ValueError(f"rank one refuses {x}")
    return x


def fail_on_rank_one_while_others_run(x: int) -> int:
    if os.environ["RANK"] != "1":
        time.sleep(30)  # stopped by the failure
    raise ValueError(f"rank one refuses {x}")


def environment() -> dict[str, str | None]:
    keys = ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_SIGNALS_TO_HANDLE", "MASTER_ADDR", "MASTER_PORT")
    return {key: os.environ.get(key) for key in keys}


def sleeper(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


SCRIPT = """\
import os, sys
out = sys.argv[1]
with open(os.path.join(out, os.environ["RANK"]), "w") as f:
    f.write(" ".join([os.environ["WORLD_SIZE"], *sys.argv[2:]]))
sys.exit(int(os.environ.get("FAIL_RANK_EXIT", "0")) if os.environ["RANK"] == "1" else 0)
"""


# --------------------------------------------------------- torch's shapes


def test_launch_config_has_torchs_fields_and_defaults_pinned() -> None:
    ours = [(f.name, field_default(f)) for f in dataclasses.fields(LaunchConfig)]
    assert ours == TORCH_LAUNCH_CONFIG


@needs_torch
def test_launch_config_has_torchs_fields_and_defaults() -> None:
    theirs = torch_json(
        "from torch.distributed.launcher.api import LaunchConfig\n"
        "print(json.dumps([[f.name, field_default(f)] "
        "for f in dataclasses.fields(LaunchConfig)]))"
    )
    assert [tuple(x) for x in theirs] == TORCH_LAUNCH_CONFIG


def test_entry_points_have_torchs_signatures_pinned() -> None:
    assert our_signatures() == TORCH_LAUNCH_SIGNATURES


@needs_torch
def test_entry_points_have_torchs_signatures() -> None:
    theirs = torch_json(
        "from torch.distributed.launcher.api import elastic_launch, launch_agent\n"
        "print(json.dumps({'elastic_launch': signature(elastic_launch),"
        " 'elastic_launch.__call__': signature(elastic_launch.__call__)[1:],"
        " 'launch_agent': signature(launch_agent)}))"
    )
    assert {k: [tuple(p) for p in v] for k, v in theirs.items()} == TORCH_LAUNCH_SIGNATURES


def test_construction_fills_in_what_torchs_does(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    plain = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1)
    assert plain.rdzv_configs == {"timeout": 900}
    assert type(plain.logs_specs) is DefaultLogsSpecs
    assert plain.shutdown_timeout == 30
    legacy = LaunchConfig(1, 1, 1, rdzv_timeout=12, rdzv_configs={"timeout": 5, "x": "y"})
    assert legacy.rdzv_configs == {"timeout": 12, "x": "y"}
    named = LaunchConfig(1, 1, 1, rdzv_configs={"timeout": 5})
    assert named.rdzv_configs == {"timeout": 5}
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "7")
    assert LaunchConfig(1, 1, 1).shutdown_timeout == 7
    assert LaunchConfig(1, 1, 1, shutdown_timeout=2).shutdown_timeout == 2
    with pytest.raises(ValueError, match=r"shutdown_timeout must be >= 0 seconds, got -1"):
        LaunchConfig(1, 1, 1, shutdown_timeout=-1)
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "soon")
    with pytest.raises(ValueError, match=r"TORCH_ELASTIC_SHUTDOWN_TIMEOUT.*'soon'"):
        LaunchConfig(1, 1, 1)


def test_the_public_names_are_the_modules_own() -> None:
    assert LaunchConfig.__module__ == elastic_launch.__module__ == "aioproc.launcher"
    assert aioproc.launcher.__all__ == ["LaunchConfig", "elastic_launch", "launch", "launch_agent"]
    assert "<elastic_launch" in repr(elastic_launch(LaunchConfig(1, 1, 1), print))


# ----------------------------------------------------------- blocking forms


def test_a_function_returns_each_ranks_value(tmp_path: Path, blocking_loop: str) -> None:
    values = elastic_launch(config(tmp_path), rank_and_double)(21)
    assert values == {0: (0, 42, "default_role"), 1: (1, 42, "default_role")}
    assert launch_agent(config(tmp_path, 3, role="trainer"), rank_and_double, [1]) == {
        r: (r, 2, "trainer") for r in range(3)
    }


def test_a_failing_function_raises_child_failed_error_naming_the_rank(
    tmp_path: Path, blocking_loop: str
) -> None:
    with pytest.raises(ChildFailedError) as caught:
        elastic_launch(config(tmp_path, max_restarts=1), fail_on_rank_one)(7)
    error = caught.value
    rank, root = error.get_first_failure()
    assert (rank, root.local_rank) == (1, 1)
    assert error.name == "fail_on_rank_one"
    text = str(error)
    assert "fail_on_rank_one FAILED" in text
    assert "ValueError: rank one refuses 7" in text
    # two attempts: the restart ran, and failed the same way
    assert (tmp_path / "logs").is_dir()
    attempts = sorted(p.name for p in next((tmp_path / "logs").iterdir()).iterdir())
    assert attempts == ["attempt_0", "attempt_1"]


def test_a_python_script_runs_as_torch_runs_it(tmp_path: Path, blocking_loop: str) -> None:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    values = elastic_launch(config(tmp_path), sys.executable)(
        "-u", str(script), str(out), "--flag", "${local_rank}"
    )
    assert values == {0: None, 1: None}
    assert {p.name: p.read_text() for p in out.iterdir()} == {"0": "2 --flag 0", "1": "2 --flag 1"}


def test_a_failing_script_is_named_by_its_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, blocking_loop: str
) -> None:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setenv("FAIL_RANK_EXIT", "5")
    with pytest.raises(ChildFailedError) as caught:
        elastic_launch(config(tmp_path, max_restarts=0), sys.executable)("-u", str(script), out)
    assert caught.value.name == str(script)  # torch's name: the script, not the interpreter
    rank, root = caught.value.get_first_failure()
    assert (rank, root.exitcode) == (1, 5)
    assert f"{script} FAILED" in str(caught.value)


def test_a_program_runs_with_its_arguments(tmp_path: Path, blocking_loop: str) -> None:
    out = tmp_path / "touched"
    values = elastic_launch(config(tmp_path, 1), "touch")(str(out))
    assert values == {0: None}
    assert out.is_file()


def test_a_config_without_run_id_gets_a_random_one_as_torchs_does(
    tmp_path: Path, blocking_loop: str
) -> None:
    cfg = config(tmp_path, 1)
    cfg.run_id = ""
    values = elastic_launch(cfg, environment)()
    assert cfg.run_id.isdigit()
    assert values[0]["TORCHELASTIC_RUN_ID"] == cfg.run_id
    # torch hands the list it handles to the workers
    assert values[0]["TORCHELASTIC_SIGNALS_TO_HANDLE"] == "SIGTERM,SIGINT,SIGHUP,SIGQUIT"


def test_static_on_one_node_gives_the_workers_its_master(
    tmp_path: Path, blocking_loop: str
) -> None:
    port = free_port()
    cfg = config(tmp_path, 1, rdzv_backend="static", rdzv_endpoint=f"localhost:{port}")
    assert elastic_launch(cfg, environment)()[0]["MASTER_ADDR"] == "localhost"
    assert elastic_launch(cfg, environment)()[0]["MASTER_PORT"] == str(port)


async def test_blocking_from_a_thread_beside_a_running_loop(tmp_path: Path) -> None:
    ticks = 0
    stop = asyncio.Event()

    async def tick() -> None:
        nonlocal ticks
        while not stop.is_set():
            await asyncio.sleep(0.01)
            ticks += 1

    ticker = asyncio.create_task(tick())
    try:
        values = await asyncio.to_thread(elastic_launch(config(tmp_path), sleeper), 0.5)
    finally:
        stop.set()
        await ticker
    assert values == {0: 0.5, 1: 0.5}
    assert ticks >= 10  # this loop ran on while the launch blocked its thread


def test_blocking_from_two_threads_at_once(tmp_path: Path, blocking_loop: str) -> None:
    results: dict[str, Any] = {}

    def one(name: str) -> None:
        results[name] = elastic_launch(config(tmp_path / name), rank_and_double)(len(name))

    threads = [threading.Thread(target=one, args=(name,)) for name in ("a", "bb")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(LIMIT)
    assert results == {
        "a": {0: (0, 2, "default_role"), 1: (1, 2, "default_role")},
        "bb": {0: (0, 4, "default_role"), 1: (1, 4, "default_role")},
    }


async def test_blocking_in_a_loops_thread_is_refused_before_anything_starts(
    tmp_path: Path,
) -> None:
    before = children()
    with pytest.raises(RuntimeError, match=r"await aioproc\.launcher\.launch\(config"):
        elastic_launch(config(tmp_path), rank_and_double)(1)
    assert children() == before
    assert not (tmp_path / "logs").exists()


# ------------------------------------------------------------ the awaitable


async def test_launch_returns_each_ranks_value(tmp_path: Path) -> None:
    assert await launch(config(tmp_path), rank_and_double, 3) == {
        0: (0, 6, "default_role"),
        1: (1, 6, "default_role"),
    }


async def test_launch_raises_child_failed_error(tmp_path: Path) -> None:
    with pytest.raises(ChildFailedError) as caught:
        await launch(config(tmp_path, 3, max_restarts=0), fail_on_rank_one_while_others_run, 2)
    assert caught.value.get_first_failure()[0] == 1
    assert "ValueError: rank one refuses 2" in str(caught.value)
    # the ranks the failure stopped are listed too, as torch 2.13 lists them
    assert set(caught.value.failures) == {0, 1, 2}
    assert all(caught.value.failures[r].stopped for r in (0, 2))


async def test_launch_cancelled_at_random_points_leaves_nothing() -> None:
    """No process, fd or temp dir outlives a cancelled launch, wherever it is cancelled.

    The default logs go to a private temp dir: a leftover there is a leak.
    """
    rng = random.Random(f"{SEED}-{loop_name()}")
    tmp = tempfile.gettempdir()
    before_children, before_temps = children(), set(os.listdir(tmp))
    problems = []
    for i in range(CANCEL_ITERATIONS):
        cfg = LaunchConfig(1, 1, 2, run_id=f"cancel{i}")
        task = asyncio.ensure_future(launch(cfg, sleeper, 30))
        if i % 3 == 0:
            turns = rng.randrange(0, 40)
            await spin(turns)  # inside the start, one step of the loop at a time
            when = f"after {turns} loop turns"
        else:
            delay = rng.uniform(0, 0.8)
            await asyncio.sleep(delay)  # the random moment of the cancellation
            when = f"after {delay:.3f} s"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        left = children() - before_children
        temps = set(os.listdir(tmp)) - before_temps
        if left or temps:
            problems.append(f"#{i} cancelled {when}: processes {left}, temp entries {temps}")
    assert problems == [], f"seed {SEED} on {loop_name()}:\n" + "\n".join(problems)


async def test_launch_checks_every_field_before_anything_starts(tmp_path: Path) -> None:
    before = children()
    cases: list[tuple[dict[str, Any], type[Exception], str]] = [
        ({"nproc_per_node": 0}, ValueError, r"nproc_per_node must be an int >= 1, got 0"),
        ({"min_nodes": 3, "max_nodes": 2}, ValueError, r"max_nodes \(2\) must be >= min_nodes"),
        ({"start_method": "thread"}, ValueError, r"start_method must be one of .* 'thread'"),
        ({"signals_to_handle": "SIGTERM,SIGFOO"}, ValueError, r"'SIGFOO' is not a signal"),
        ({"signals_to_handle": "SIGKILL"}, ValueError, r"'SIGKILL' cannot be caught"),
        ({"numa_options": "everywhere"}, ValueError, r"numa_options .* 'everywhere'"),
        ({"event_log_handler": "nowhere"}, ValueError, r"'nowhere': no such event handler"),
        ({"max_restarts": -1}, ValueError, r"max_restarts must be an int >= 0, got -1"),
        ({"logs_specs": object()}, TypeError, r"logs_specs must be an aioproc LogsSpecs"),
        ({"run_id": "a/b"}, ValueError, r"'a/b'"),
        ({"role": ""}, TypeError, r"role must be a non-empty str"),
        (
            {"max_nodes": 2, "rdzv_backend": "static", "rdzv_endpoint": "host"},
            ValueError,
            r"static rendezvous needs the master's HOST:PORT, got 'host'",
        ),
        (
            {"max_nodes": 2, "rdzv_backend": "etcd", "rdzv_endpoint": ""},
            ValueError,
            r"etcd needs --rdzv-endpoint",
        ),
        (
            {"max_nodes": 2, "rdzv_backend": "zeus"},
            ValueError,
            r"'zeus'",
        ),
    ]
    for fields, kind, message in cases:
        cfg = LaunchConfig(**{"min_nodes": 1, "max_nodes": 1, "nproc_per_node": 1, **fields})
        with pytest.raises(kind, match=message):
            await launch(cfg, rank_and_double, 1)
        assert cfg.run_id == fields.get("run_id", ""), "a refused launch changed its config"
    with pytest.raises(TypeError, match=r"entrypoint must be a function or a program, got 3"):
        await launch(LaunchConfig(1, 1, 1), 3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"expected an aioproc.launcher.LaunchConfig"):
        await launch({"nproc_per_node": 1}, rank_and_double)  # type: ignore[arg-type]
    assert children() == before


# ------------------------------------------------------ nodes and signals


def node(*argv: str, out: Path | None = None) -> subprocess.Popen[str]:
    """``launch_node.py argv``: a process launching one node, as a tool's process does."""
    env = {**os.environ, "PYTHONPATH": REPO_ROOT, "OMP_NUM_THREADS": "1"}
    env["AIOPROC_LOOP"] = loop_name()
    if out is not None:
        env["LAUNCH_NODE_OUT"] = str(out)
    return subprocess.Popen(
        [sys.executable, NODE, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def two_nodes(backend: str, endpoint: str, confs: tuple[dict[str, Any], dict[str, Any]]) -> list:
    """Two nodes of one job, two workers each; each node's return values."""
    run_id = f"launch-{backend}-{loop_name()}-{os.getpid()}"
    nodes = [node(backend, endpoint, run_id, "2", "2", json.dumps(conf)) for conf in confs]
    values = []
    try:
        for proc in nodes:
            out, err = proc.communicate(timeout=LIMIT)
            assert proc.returncode == 0, f"{backend} node exited {proc.returncode}:\n{err}"
            line = [x for x in out.splitlines() if x.startswith("VALUES ")][-1]
            values.append(json.loads(line[len("VALUES ") :]))
    finally:
        for proc in nodes:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return values


def assert_one_world(values: list[dict[str, dict[str, str]]], run_id_prefix: str) -> None:
    """Ranks 0-3 of one world of 4 over two nodes, each node its group rank's two."""
    by_node = [{int(rank): env for rank, env in node_values.items()} for node_values in values]
    groups = sorted(next(iter(v.values()))["GROUP_RANK"] for v in by_node)
    assert groups == ["0", "1"]
    everyone = [env for v in by_node for env in v.values()]
    assert sorted(int(env["RANK"]) for env in everyone) == [0, 1, 2, 3]
    for v in by_node:
        group = int(next(iter(v.values()))["GROUP_RANK"])
        assert sorted(v) == [2 * group, 2 * group + 1]  # the values come keyed by global rank
    assert {env["WORLD_SIZE"] for env in everyone} == {"4"}
    assert {env["GROUP_WORLD_SIZE"] for env in everyone} == {"2"}
    assert len({(env["MASTER_ADDR"], env["MASTER_PORT"]) for env in everyone}) == 1
    assert all(env["TORCHELASTIC_RUN_ID"].startswith(run_id_prefix) for env in everyone)


@pytest.fixture
def etcd_server(tmp_path: Path) -> Any:
    pytest.importorskip("aetcd", reason="aetcd not installed: pip install 'aioproc[etcd]'")
    from test_rendezvous_etcd import ETCD, Etcd

    if ETCD is None:
        pytest.skip("no etcd binary: apt-get install etcd-server")
    (tmp_path / "etcd").mkdir()
    server = Etcd(str(tmp_path / "etcd" / "data"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.timeout(120)
async def test_two_nodes_meet_through_etcd(etcd_server: Any) -> None:
    conf = {"last_call_timeout": 1, "join_timeout": 30}
    values = await asyncio.to_thread(two_nodes, "etcd", etcd_server.endpoint, (conf, conf))
    assert_one_world(values, "launch-etcd")


@pytest.mark.timeout(120)
async def test_two_nodes_meet_through_c10d() -> None:
    pytest.importorskip("aetcd", reason="aetcd not installed: pip install 'aioproc[etcd]'")
    from aioproc.rendezvous._c10d import find_etcd

    if find_etcd() is None:
        pytest.skip("no etcd binary for the c10d store: apt-get install etcd-server")
    endpoint = f"127.0.0.1:{free_port()}"
    host = {"is_host": "true", "last_call_timeout": 1, "join_timeout": 30}
    guest = {**host, "is_host": "false"}
    values = await asyncio.to_thread(two_nodes, "c10d", endpoint, (host, guest))
    assert_one_world(values, "launch-c10d")


@pytest.mark.timeout(120)
async def test_two_nodes_of_a_static_job() -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    values = await asyncio.to_thread(two_nodes, "static", endpoint, ({"rank": 0}, {"rank": 1}))
    assert_one_world(values, "launch-static")
    assert values[0]["0"]["MASTER_ADDR"] == "127.0.0.1"
    assert values[0]["0"]["MASTER_PORT"] == endpoint.rpartition(":")[2]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
async def test_a_signal_to_a_blocking_caller_stops_its_workers(
    tmp_path: Path, sig: signal.Signals
) -> None:
    """torch's launcher in the main thread: the workers are stopped, SignalException raised."""
    proc = node("c10d", "localhost:0", "sig", "1", "2", "{}", "hold", out=tmp_path)
    try:
        deadline = time.monotonic() + LIMIT
        while len(list(tmp_path.glob("*.pid"))) < 2:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the workers never started"
            await asyncio.sleep(0.05)
        pids = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
        proc.send_signal(sig)
        out, err = await asyncio.to_thread(proc.communicate, timeout=LIMIT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 3, err
    assert f"SIGNAL {sig.name}" in out
    assert all(pid_gone(pid) for pid in pids)
