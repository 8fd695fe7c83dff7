"""Every torchrun 2.13 flag under ``aioproc run``, with torchrun's meaning, and its PET_ variable.

``TORCHRUN_FLAGS`` is torch 2.13.0's ``torch/distributed/run.py`` parser,
pinned here so the comparison runs everywhere; where torch can be run
(this interpreter, or the one named in ``AIOPROC_TORCH_PYTHON``), the real
``torchrun --help`` is compared too, and the pinned list with it.  The
flags' behaviour is checked as a user sees it: the workers' environment and
output, files, exit codes and messages.  Accelerators and NUMA nodes this
machine lacks are made up (a fake ``nvidia-smi``, a fake ``/sys``); the
real binding is checked on a machine with a GPU by ``--numa-binding`` runs
elsewhere.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from helpers import free_port, loop_name

from aioproc._cli import devices
from aioproc._cli.args import _build_parsers
from aioproc.cli import build_parser, parse_nproc

CHILDREN = Path(__file__).parent / "children"
ENV_SCRIPT = str(CHILDREN / "cli_env.py")
LIMIT = 60
CLI = [sys.executable, "-m", "aioproc"]

# torch 2.13.0, torch/distributed/run.py, get_args_parser(): each option's
# strings, its dest, and whether torch's env/check_env action gives it a
# PET_<DEST> default (--logs-specs and --numa-binding have none in torch;
# aioproc reads PET_ for them too).
TORCHRUN_FLAGS: list[tuple[tuple[str, ...], str, bool]] = [
    (("--nnodes",), "nnodes", True),
    (("--nproc-per-node", "--nproc_per_node"), "nproc_per_node", True),
    (("--rdzv-backend", "--rdzv_backend"), "rdzv_backend", True),
    (("--rdzv-endpoint", "--rdzv_endpoint"), "rdzv_endpoint", True),
    (("--rdzv-id", "--rdzv_id"), "rdzv_id", True),
    (("--rdzv-conf", "--rdzv_conf"), "rdzv_conf", True),
    (("--standalone",), "standalone", True),
    (("--max-restarts", "--max_restarts"), "max_restarts", True),
    (("--monitor-interval", "--monitor_interval"), "monitor_interval", True),
    (("--start-method", "--start_method"), "start_method", True),
    (("--event-log-handler", "--event_log_handler"), "event_log_handler", True),
    (("--role",), "role", True),
    (("-m", "--module"), "module", True),
    (("--no-python", "--no_python"), "no_python", True),
    (("--run-path", "--run_path"), "run_path", True),
    (("--log-dir", "--log_dir"), "log_dir", True),
    (("-r", "--redirects"), "redirects", True),
    (("-t", "--tee"), "tee", True),
    (("--local-ranks-filter", "--local_ranks_filter"), "local_ranks_filter", True),
    (
        ("--duplicate-stdout-filters", "--duplicate_stdout_filters"),
        "duplicate_stdout_filters",
        True,
    ),
    (
        ("--duplicate-stderr-filters", "--duplicate_stderr_filters"),
        "duplicate_stderr_filters",
        True,
    ),
    (("--node-rank", "--node_rank"), "node_rank", True),
    (("--master-addr", "--master_addr"), "master_addr", True),
    (("--master-port", "--master_port"), "master_port", True),
    (("--local-addr", "--local_addr"), "local_addr", True),
    (("--logs-specs", "--logs_specs"), "logs_specs", False),
    (("--numa-binding", "--numa_binding"), "numa_binding", False),
    (("--signals-to-handle", "--signals_to_handle"), "signals_to_handle", True),
    (("--shutdown-timeout", "--shutdown_timeout"), "shutdown_timeout", True),
    (("--virtual-local-rank", "--virtual_local_rank"), "virtual_local_rank", True),
]


def torch_python() -> str | None:
    named = os.environ.get("AIOPROC_TORCH_PYTHON")
    if named:
        return named
    return sys.executable if importlib.util.find_spec("torch") is not None else None


TORCH_PYTHON = torch_python()
needs_torch = pytest.mark.skipif(TORCH_PYTHON is None, reason="torch is not installed")


def cli_env(**extra: str) -> dict[str, str]:
    """The command's environment: ours without torchrun's variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_"))}
    env.pop("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", None)
    env.pop("PYTHON_EXEC", None)
    env.update(AIOPROC_LOOP=loop_name(), OMP_NUM_THREADS="1", **extra)
    return env


def aioproc_run(
    tmp_path: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``aioproc run args`` as a user runs it; its logs go under ``tmp_path``."""
    log_dir = [] if any(a.startswith("--log-dir") for a in args) else ["--log-dir", str(tmp_path)]
    return subprocess.run(
        [*CLI, "run", *log_dir, *args],
        capture_output=True,
        text=True,
        timeout=LIMIT,
        env=cli_env(**(env or {})),
    )


def reports(out: str) -> dict[int, dict[str, Any]]:
    """cli_env.py's ``ENV {...}`` lines by the rank in their ``[default<rank>]:`` prefix."""
    found = {}
    for line in out.splitlines():
        m = re.match(r"\[\w+?(\d+)\]:ENV (\{.*\})$", line)
        if m:
            found[int(m[1])] = json.loads(m[2])
    return found


def usage_error(proc: subprocess.CompletedProcess[str]) -> str:
    """The one-line usage error of a command that started nothing."""
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr
    last = proc.stderr.splitlines()[-1]
    assert last.startswith("aioproc run: error: "), proc.stderr
    return last


def help_flags(help_text: str) -> set[str]:
    """The option strings ``--help`` shows: each option's own line, not its prose."""
    options = help_text.split("options:", 1)[1]
    flags: set[str] = set()
    for line in options.splitlines():
        if line.startswith("  -"):
            invocation = re.split(r"\s{2,}", line.strip())[0]
            flags.update(re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", invocation))
    return flags - {"-h", "--help"}


def run_options() -> dict[str, Any]:
    """``aioproc run``'s options: every spelling, to its action."""
    return dict(_build_parsers()[1]._option_string_actions)


# ------------------------------------------------------------ every flag


def test_every_torchrun_2_13_flag_is_accepted_in_both_spellings() -> None:
    accepted = run_options()
    missing = [s for strings, _, _ in TORCHRUN_FLAGS for s in strings if s not in accepted]
    assert missing == []
    # both spellings are one flag, as in torchrun
    for strings, _, _ in TORCHRUN_FLAGS:
        assert len({id(accepted[s]) for s in strings}) == 1, strings


def test_help_shows_every_torchrun_flag() -> None:
    proc = subprocess.run(
        [*CLI, "run", "--help"], capture_output=True, text=True, timeout=LIMIT, env=cli_env()
    )
    assert proc.returncode == 0, proc.stderr
    shown = help_flags(proc.stdout)
    dashed = [s for strings, _, _ in TORCHRUN_FLAGS for s in strings if "_" not in s]
    assert [s for s in dashed if s not in shown] == []


@needs_torch
def test_torchrun_help_has_no_flag_that_aioproc_run_lacks() -> None:
    assert TORCH_PYTHON is not None
    torchrun = subprocess.run(
        [TORCH_PYTHON, "-m", "torch.distributed.run", "--help"],
        capture_output=True,
        text=True,
        timeout=LIMIT,
    )
    assert torchrun.returncode == 0, torchrun.stderr
    theirs = help_flags(torchrun.stdout)
    ours = set(run_options())
    assert sorted(theirs - ours) == []
    # and the pinned list is torchrun's, where that torchrun is 2.13
    version = subprocess.run(
        [TORCH_PYTHON, "-c", "import torch; print(torch.__version__)"],
        capture_output=True,
        text=True,
        timeout=LIMIT,
    ).stdout
    if version.startswith("2.13."):
        assert theirs == {s for strings, _, _ in TORCHRUN_FLAGS for s in strings}


# --------------------------------------------------------- PET_ defaults

PET_CASES = [
    ("PET_NNODES", "1:2", ["--nnodes", "1:2"]),
    ("PET_NPROC_PER_NODE", "3", ["--nproc-per-node", "3"]),
    ("PET_RDZV_BACKEND", "etcd", ["--rdzv-backend", "etcd"]),
    ("PET_RDZV_ENDPOINT", "localhost:29400", ["--rdzv-endpoint", "localhost:29400"]),
    ("PET_RDZV_ID", "job7", ["--rdzv-id", "job7"]),
    ("PET_RDZV_CONF", "join_timeout=900", ["--rdzv-conf", "join_timeout=900"]),
    ("PET_STANDALONE", "1", ["--standalone"]),
    ("PET_MAX_RESTARTS", "2", ["--max-restarts", "2"]),
    ("PET_MONITOR_INTERVAL", "0.5", ["--monitor-interval", "0.5"]),
    ("PET_START_METHOD", "forkserver", ["--start-method", "forkserver"]),
    ("PET_EVENT_LOG_HANDLER", "console", ["--event-log-handler", "console"]),
    ("PET_ROLE", "trainer", ["--role", "trainer"]),
    ("PET_MODULE", "1", ["-m"]),
    ("PET_NO_PYTHON", "1", ["--no-python"]),
    ("PET_RUN_PATH", "1", ["--run-path"]),
    ("PET_LOG_DIR", os.devnull, ["--log-dir", os.devnull]),
    ("PET_REDIRECTS", "3", ["-r", "3"]),
    ("PET_TEE", "0:1,1:2", ["-t", "0:1,1:2"]),
    ("PET_LOCAL_RANKS_FILTER", "0,2", ["--local-ranks-filter", "0,2"]),
    ("PET_DUPLICATE_STDOUT_FILTERS", "a,,b,c", ["--duplicate-stdout-filters", "a,,b,c"]),
    ("PET_DUPLICATE_STDERR_FILTERS", "NCCL", ["--duplicate-stderr-filters", "NCCL"]),
    ("PET_NODE_RANK", "1", ["--node-rank", "1"]),
    ("PET_MASTER_ADDR", "10.1.2.3", ["--master-addr", "10.1.2.3"]),
    ("PET_MASTER_PORT", "29501", ["--master-port", "29501"]),
    ("PET_LOCAL_ADDR", "node1", ["--local-addr", "node1"]),
    ("PET_LOGS_SPECS", "default", ["--logs-specs", "default"]),
    ("PET_NUMA_BINDING", "socket", ["--numa-binding", "socket"]),
    ("PET_SIGNALS_TO_HANDLE", "SIGTERM,SIGUSR1", ["--signals-to-handle", "SIGTERM,SIGUSR1"]),
    ("PET_SHUTDOWN_TIMEOUT", "7", ["--shutdown-timeout", "7"]),
    ("PET_VIRTUAL_LOCAL_RANK", "1", ["--virtual-local-rank"]),
]


def parse(argv: list[str]) -> dict[str, Any]:
    return vars(build_parser().parse_args(["run", *argv, "script.py"]))


def test_every_torchrun_flag_has_its_pet_variable() -> None:
    assert {f"PET_{dest.upper()}" for _, dest, _ in TORCHRUN_FLAGS} == {e for e, _, _ in PET_CASES}


@pytest.mark.parametrize(("name", "value", "flags"), PET_CASES, ids=[c[0] for c in PET_CASES])
def test_pet_variable_is_the_flags_default(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str, flags: list[str]
) -> None:
    given = parse(flags)
    monkeypatch.setenv(name, value)
    assert parse([]) == given
    assert parse([]) != parse_without(monkeypatch, name)


def parse_without(monkeypatch: pytest.MonkeyPatch, name: str) -> dict[str, Any]:
    with monkeypatch.context() as m:
        m.delenv(name)
        return parse([])


def test_the_flag_wins_over_its_pet_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PET_NPROC_PER_NODE", "3")
    monkeypatch.setenv("PET_ROLE", "from-env")
    ns = parse(["--nproc_per_node=2", "--role", "trainer"])
    assert (ns["nproc_per_node"], ns["role"]) == (2, "trainer")


@pytest.mark.parametrize(("value", "on"), [("1", True), ("0", False), ("2", True), ("-1", True)])
def test_a_switchs_pet_variable_is_an_integer_as_torchrun_reads_it(
    monkeypatch: pytest.MonkeyPatch, value: str, on: bool
) -> None:
    monkeypatch.setenv("PET_STANDALONE", value)
    assert parse([])["standalone"] is on
    assert parse(["--standalone"])["standalone"] is True


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"PET_STANDALONE": "yes"},
            "argument --standalone: PET_STANDALONE='yes' (the default of this flag): "
            "expected an integer (0: off, 1: on), got 'yes'",
        ),
        (
            {"PET_NPROC_PER_NODE": "four"},
            "argument --nproc-per-node/--nproc_per_node: PET_NPROC_PER_NODE='four' (the "
            "default of this flag): expected a positive number of workers, or auto, cpu, gpu "
            "or xpu, got 'four'",
        ),
        ({"PET_MAX_RESTARTS": "-1"}, "PET_MAX_RESTARTS='-1' (the default of this flag)"),
        ({"PET_SHUTDOWN_TIMEOUT": "soon"}, "PET_SHUTDOWN_TIMEOUT='soon'"),
        ({"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "x"}, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT: expected"),
        ({"PET_NUMA_BINDING": "nodes"}, "PET_NUMA_BINDING='nodes'"),
    ],
)
def test_a_bad_pet_variable_is_a_usage_error_naming_it(
    tmp_path: Path, env: dict[str, str], message: str
) -> None:
    assert message in usage_error(aioproc_run(tmp_path, ENV_SCRIPT, env=env))


def test_kubeflow_style_pet_variables_run_the_job(tmp_path: Path) -> None:
    """What a PyTorchJob sets, with no flag at all."""
    port = free_port()
    env = {
        "PET_NNODES": "1",
        "PET_NPROC_PER_NODE": "2",
        "PET_NODE_RANK": "0",
        "PET_MASTER_ADDR": "127.0.0.1",
        "PET_MASTER_PORT": str(port),
        "PET_RDZV_ID": "pytorchjob-7",
        "PET_TEE": "3",
    }
    proc = aioproc_run(tmp_path, ENV_SCRIPT, env=env)
    assert proc.returncode == 0, proc.stderr
    found = reports(proc.stdout)
    assert sorted(found) == [0, 1], proc.stdout
    for rank, rep in found.items():
        assert rep["RANK"] == str(rank) and rep["WORLD_SIZE"] == "2"
        assert rep["MASTER_PORT"] == str(port)
        assert rep["TORCHELASTIC_RUN_ID"] == "pytorchjob-7"


# ------------------------------------------------------- --nproc-per-node

FAKE_SMI = """\
#!/bin/sh
# nvidia-smi --query-gpu=uuid,pci.bus_id --format=csv,noheader, on a made-up host
cat <<'EOF'
GPU-aaaa1111, 00000000:1B:00.0
GPU-bbbb2222, 00000000:3D:00.0
GPU-cccc3333, 00000000:DB:00.0
EOF
"""


@pytest.fixture
def fake_gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Three NVIDIA GPUs behind a fake nvidia-smi, and no torch to ask."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text(FAKE_SMI)
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.defpath}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(devices, "_torch", lambda: None)
    return bin_dir


@pytest.mark.parametrize(
    ("visible", "gpus"),
    [
        (None, 3),
        ("2,0", 2),
        ("GPU-bbbb", 1),  # a UUID prefix
        ("0,7,1", 1),  # CUDA stops at the first device that does not exist
        ("1,1", 1),
        ("MIG-0123", 1),
    ],
)
def test_gpu_and_auto_count_the_gpus_cuda_would_show(
    fake_gpus: Path, monkeypatch: pytest.MonkeyPatch, visible: str | None, gpus: int
) -> None:
    if visible is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert parse_nproc("gpu") == parse_nproc("auto") == parse_nproc("GPU") == gpus


def test_devices_are_numbered_as_cuda_sees_them(
    fake_gpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    assert devices.cuda_devices() == [
        devices.Gpu("GPU-cccc3333", "0000:db:00.0"),
        devices.Gpu("GPU-aaaa1111", "0000:1b:00.0"),
    ]


@pytest.mark.parametrize("visible", ["-1", "", None])
def test_gpu_without_gpus_is_an_error_and_auto_counts_the_cpus(
    fake_gpus: Path, monkeypatch: pytest.MonkeyPatch, visible: str | None
) -> None:
    if visible is None:  # no driver at all
        monkeypatch.setenv("PATH", str(fake_gpus.parent))
        monkeypatch.setattr(devices, "_NVIDIA_PROC", str(fake_gpus / "none"))
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert parse_nproc("auto") == parse_nproc("cpu") == len(os.sched_getaffinity(0))
    with pytest.raises(Exception, match="'gpu': no CUDA GPU found"):
        parse_nproc("gpu")
    with pytest.raises(Exception, match="'xpu': counting Intel XPUs needs torch"):
        parse_nproc("xpu")


def fake_torch(cuda: int = 0, xpu: int = 0, other: int = 0) -> SimpleNamespace:
    """What ``--nproc-per-node`` asks of torch: its device modules' answers."""

    def device(n: int) -> SimpleNamespace:
        return SimpleNamespace(is_available=lambda: n > 0, device_count=lambda: n)

    return SimpleNamespace(
        cuda=device(cuda),
        xpu=device(xpu),
        accelerator=device(cuda or xpu or other),
        npu=device(other),
        _C=SimpleNamespace(_get_privateuse1_backend_name=lambda: "npu"),
    )


@pytest.mark.parametrize(
    ("torch", "value", "count"),
    [
        (fake_torch(cuda=4), "gpu", 4),
        (fake_torch(cuda=4), "auto", 4),
        (fake_torch(xpu=2), "xpu", 2),
        (fake_torch(xpu=2), "auto", 2),
        (fake_torch(other=3), "npu", 3),  # torch's custom device, by its name
        (fake_torch(), "auto", len(os.sched_getaffinity(0))),
    ],
)
def test_with_torch_devices_are_counted_by_torch(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    torch: SimpleNamespace,
    value: str,
    count: int,
) -> None:
    monkeypatch.setattr(devices, "_torch", lambda: torch)
    device_extension(tmp_path, monkeypatch)  # what gives torch a custom device's name
    assert parse_nproc(value) == count


def device_extension(where: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An installed torch device extension, as ``import torch`` finds one: an
    entry point of the ``torch.backends`` group (torch_npu's, say)."""
    info = where / "fake_npu-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-npu\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[torch.backends]\nnpu = fake_npu:_autoload\n")
    monkeypatch.syspath_prepend(str(where))


def test_a_custom_device_name_needs_a_device_extension(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """torch renames its custom device only through an extension: without one
    installed, ``npu`` is an unknown word, told without asking torch."""
    asked: list[str] = []

    def torch() -> SimpleNamespace:
        asked.append("torch")
        return fake_torch(other=3)

    monkeypatch.setattr(devices, "_torch", torch)
    with pytest.raises(Exception, match="or auto, cpu, gpu or xpu, got 'npu'"):
        parse_nproc("npu")
    assert asked == []
    monkeypatch.setenv("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")  # torch would not load it
    device_extension(tmp_path, monkeypatch)
    with pytest.raises(Exception, match="got 'npu'"):
        parse_nproc("npu")
    assert asked == []
    monkeypatch.delenv("TORCH_DEVICE_BACKEND_AUTOLOAD")
    assert parse_nproc("npu") == 3
    assert asked == ["torch"]


FAKE_TORCH = """\
import os, sys
with open(os.environ["TORCH_IMPORTED"], "a") as f:
    f.write("imported\\n")
class _Device:
    def is_available(self): return False
    def device_count(self): return 0
cuda = xpu = accelerator = _Device()
"""
# Whether torch was imported, whatever ended the command: a hook that notes
# every import of it, then the command as ``python -m aioproc`` runs it.
TORCH_WATCH = """\
import runpy, sys
class Watch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            print("TORCH IMPORTED", file=sys.stderr)
        return None
sys.meta_path.insert(0, Watch())
sys.argv = ["aioproc", *sys.argv[1:]]
runpy.run_module("aioproc", run_name="__main__")
"""


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--nproc-per-node", "two"], {}, "or auto, cpu, gpu or xpu, got 'two'"),
        (["--nproc-per-node", "tpu"], {}, "got 'tpu'"),
        (["--nproc-per-node", "0"], {}, "expected a positive number of workers, got '0'"),
        ([], {"PET_NPROC_PER_NODE": "two"}, "PET_NPROC_PER_NODE='two' (the default of this flag)"),
        (["--nproc-per-node", "2", "--max-restarts", "x"], {}, "--max-restarts"),
    ],
    ids=["a-word", "an-unknown-device", "zero", "pet-variable", "another-flag"],
)
@pytest.mark.parametrize("torch", ["fake", pytest.param("real", marks=needs_torch)])
def test_usage_errors_never_import_torch(
    tmp_path: Path, args: list[str], env: dict[str, str], message: str, torch: str
) -> None:
    """Importing torch takes seconds: a usage error is told without it, with a
    torch installed (a stand-in that notes its import, or the real one)."""
    imported = tmp_path / "imported"
    extra = dict(env, TORCH_IMPORTED=str(imported))
    if torch == "fake":
        (tmp_path / "torch").mkdir()
        (tmp_path / "torch" / "__init__.py").write_text(FAKE_TORCH)
        extra["PYTHONPATH"] = os.pathsep.join([str(tmp_path), *sys.path])
    python = sys.executable if torch == "fake" else TORCH_PYTHON
    assert python is not None
    proc = subprocess.run(
        [python, "-c", TORCH_WATCH, "run", *args, ENV_SCRIPT],
        capture_output=True,
        text=True,
        timeout=LIMIT,
        env=cli_env(**extra),
    )
    assert message in usage_error(proc)
    assert "TORCH IMPORTED" not in proc.stderr
    assert not imported.exists()


def test_nproc_gpu_asks_torch_when_it_is_installed(tmp_path: Path) -> None:
    """The control of the test above: ``gpu`` does ask torch (the stand-in),
    whose answer is the error."""
    imported = tmp_path / "imported"
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text(FAKE_TORCH)
    proc = subprocess.run(
        [sys.executable, "-c", TORCH_WATCH, "run", "--nproc-per-node", "gpu", ENV_SCRIPT],
        capture_output=True,
        text=True,
        timeout=LIMIT,
        env=cli_env(
            TORCH_IMPORTED=str(imported),
            PYTHONPATH=os.pathsep.join([str(tmp_path), *sys.path]),
        ),
    )
    assert "'gpu': CUDA is not available" in usage_error(proc)
    assert "TORCH IMPORTED" in proc.stderr
    assert imported.read_text() == "imported\n"


@pytest.mark.parametrize(
    ("value", "message"),
    [("gpu", "CUDA is not available"), ("xpu", "no XPU is available"), ("tpu", "got 'tpu'")],
)
def test_with_torch_a_missing_device_is_torchruns_error(
    monkeypatch: pytest.MonkeyPatch, value: str, message: str
) -> None:
    monkeypatch.setattr(devices, "_torch", lambda: fake_torch())
    with pytest.raises(Exception, match=message):
        parse_nproc(value)


def test_nproc_gpu_runs_one_worker_per_gpu(tmp_path: Path, fake_gpus: Path) -> None:
    env = {"PATH": os.environ["PATH"], "CUDA_VISIBLE_DEVICES": "0,2"}
    if sys.executable == TORCH_PYTHON:
        pytest.skip("torch counts the GPUs here, not the fake nvidia-smi")
    proc = aioproc_run(tmp_path, "--nproc-per-node", "gpu", "--tee", "3", ENV_SCRIPT, env=env)
    assert proc.returncode == 0, proc.stderr
    assert sorted(reports(proc.stdout)) == [0, 1]


def test_nproc_gpu_without_a_gpu_starts_nothing(tmp_path: Path) -> None:
    proc = aioproc_run(
        tmp_path, "--nproc-per-node", "gpu", ENV_SCRIPT, env={"CUDA_VISIBLE_DEVICES": "-1"}
    )
    assert "argument --nproc-per-node/--nproc_per_node: 'gpu': " in usage_error(proc)


# -------------------------------------------------- --virtual-local-rank

SHOW_DEVICE = [
    "--no-python",
    "sh",
    "-c",
    'echo "RANK=$RANK LOCAL_RANK=$LOCAL_RANK CVD=$CUDA_VISIBLE_DEVICES"',
]


@pytest.mark.parametrize(
    ("visible", "expected"),
    [("3,5", ["3", "5"]), (None, ["0", "1"]), (" 7 , 4 ", ["7", "4"])],
)
def test_virtual_local_rank_gives_each_worker_its_own_gpu_as_device_0(
    tmp_path: Path, visible: str | None, expected: list[str]
) -> None:
    env = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    proc = aioproc_run(
        tmp_path, "--nproc-per-node", "2", "--tee", "3", "--virtual-local-rank", *SHOW_DEVICE,
        env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.splitlines()) == [
        f"[default{r}]:RANK={r} LOCAL_RANK=0 CVD={expected[r]}" for r in (0, 1)
    ]


def test_without_virtual_local_rank_workers_see_every_gpu(tmp_path: Path) -> None:
    proc = aioproc_run(
        tmp_path, "--nproc-per-node", "2", "--tee", "3", *SHOW_DEVICE,
        env={"CUDA_VISIBLE_DEVICES": "3,5"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.splitlines()) == [
        f"[default{r}]:RANK={r} LOCAL_RANK={r} CVD=3,5" for r in (0, 1)
    ]


def test_virtual_local_rank_with_too_few_visible_gpus_starts_nothing(tmp_path: Path) -> None:
    proc = aioproc_run(
        tmp_path, "--nproc-per-node", "3", "--virtual_local_rank", *SHOW_DEVICE,
        env={"CUDA_VISIBLE_DEVICES": "3,5"},
    )  # fmt: skip
    assert usage_error(proc) == (
        "aioproc run: error: virtual local rank: local rank 2 has no GPU of its own: "
        "CUDA_VISIBLE_DEVICES='3,5' names 2"
    )


# ------------------------------------------------------------- --run-path

RUN_PATH_SCRIPT = """\
import os, sys
print(f"ARGV={sys.argv} NAME={__name__} RANK={os.environ['RANK']}")
if "fail" in sys.argv:
    raise RuntimeError(f"rank {os.environ['RANK']} failed on purpose")
"""


@pytest.mark.parametrize(
    ("flags", "env"),
    [
        (["--run-path"], {}),
        (["--run_path", "--no-python"], {}),  # --run-path takes precedence, as in torchrun
        ([], {"PET_RUN_PATH": "1"}),
        (["--run-path", "--start-method", "fork"], {}),  # forked from the template
    ],
    ids=["flag", "over-no-python", "PET", "fork"],
)
def test_run_path_runs_the_script_as_main_in_function_workers(
    tmp_path: Path, flags: list[str], env: dict[str, str]
) -> None:
    script = tmp_path / "train.py"
    script.write_text(RUN_PATH_SCRIPT)
    proc = aioproc_run(
        tmp_path / "logs", "--nproc-per-node", "2", "--tee", "3", *flags, str(script), "a",
        env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.splitlines()) == [
        f"[default{r}]:ARGV={[str(script), 'a']} NAME=__main__ RANK={r}" for r in (0, 1)
    ]


def test_run_path_failure_reports_the_workers_traceback(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(RUN_PATH_SCRIPT)
    proc = aioproc_run(tmp_path / "logs", "--run-path", str(script), "fail")
    assert proc.returncode == 1, proc.stderr
    assert "RuntimeError: rank 0 failed on purpose" in proc.stderr
    assert f"{script}" in proc.stderr  # the script's frame in the traceback


def test_run_path_needs_an_existing_script(tmp_path: Path) -> None:
    proc = aioproc_run(tmp_path, "--run-path", str(tmp_path / "nope.py"))
    assert "--run-path needs an existing script" in usage_error(proc)


# ----------------------------------------------------- other torchrun flags


def test_duplicate_filters_copy_matching_tee_lines_to_the_attempts_file(tmp_path: Path) -> None:
    script = tmp_path / "say.py"
    script.write_text(
        "import sys\nprint('apple pie')\nprint('plain, water')\nprint('orange, juice')\n"
        "print('NCCL WARN bad', file=sys.stderr)\nprint('fine', file=sys.stderr)\n"
    )
    logs = tmp_path / "logs"
    proc = aioproc_run(
        tmp_path, "--log-dir", str(logs), "--run-id", "job", "--tee", "3",
        "--duplicate-stdout-filters", "apple,orange,, juice",
        "--duplicate_stderr_filters=NCCL", str(script),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    (attempt,) = logs.glob("job_*/attempt_0")
    assert (attempt / "filtered_stdout.log").read_text().splitlines() == [
        "[default0]:apple pie",
        "[default0]:orange, juice",
    ]
    assert (attempt / "filtered_stderr.log").read_text() == "[default0]:NCCL WARN bad\n"


def test_event_log_handler_console_prints_torchs_events(tmp_path: Path) -> None:
    script = tmp_path / "fail.py"
    script.write_text("import os, sys\nsys.exit(3 if os.environ['RANK'] == '1' else 0)\n")
    proc = aioproc_run(
        tmp_path, "--nproc-per-node", "2", "--event-log-handler", "console", "--rdzv-id", "ev",
        str(script),
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    events = [json.loads(line) for line in proc.stderr.splitlines() if line.startswith('{"name"')]
    seen = [(e["name"], e["source"], e["metadata"]["global_rank"]) for e in events]
    assert sorted(seen[:2], key=str) == [
        ("torchelastic.worker.status.START", "WORKER", 0),
        ("torchelastic.worker.status.START", "WORKER", 1),
    ]
    assert seen[2:] == [
        ("torchelastic.worker.status.TERMINATED", "WORKER", 0),
        ("torchelastic.worker.status.FAILED", "WORKER", 1),
        ("torchelastic.worker.status.SUCCEEDED", "AGENT", None),
    ]
    failed = events[3]["metadata"]
    assert list(failed) == [
        "run_id", "global_rank", "group_rank", "worker_id", "role", "hostname", "state",
        "total_run_time", "rdzv_backend", "raw_error", "metadata", "agent_restarts",
        "duration_ms",
    ]  # fmt: skip
    assert failed["run_id"] == "ev" and failed["state"] == "FAILED"
    assert json.loads(failed["metadata"])["exit_code"] == [3]


@pytest.mark.parametrize("name", ["null", "dynamic_rendezvous"])
def test_event_log_handlers_that_drop_events_print_nothing(tmp_path: Path, name: str) -> None:
    proc = aioproc_run(tmp_path, "--event-log-handler", name, ENV_SCRIPT)
    assert proc.returncode == 0, proc.stderr
    assert "torchelastic" not in proc.stderr


def test_unknown_event_log_handler_starts_nothing(tmp_path: Path) -> None:
    proc = aioproc_run(tmp_path, "--event-log-handler", "scuba", ENV_SCRIPT)
    assert "--event-log-handler 'scuba': no such event handler" in usage_error(proc)


PLUGIN = """\
import os
from aioproc.logs import DefaultLogsSpecs


class Marked(DefaultLogsSpecs):
    def reify(self, envs):
        dest = super().reify(envs)
        with open(os.path.join(self.root_log_dir, "marked-by-plugin"), "w") as f:
            f.write(str(sorted(envs)))
        return dest
"""


def install_plugin(where: Path, entry: str) -> dict[str, str]:
    """A distribution with a ``torchrun.logs_specs`` entry point, found on PYTHONPATH."""
    where.mkdir()
    (where / "marked_logs.py").write_text(PLUGIN)
    info = where / "marked_logs-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: marked-logs\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[torchrun.logs_specs]\n{entry}\n")
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(where), os.environ.get("PYTHONPATH")]))}


def test_logs_specs_entry_point_decides_where_the_logs_go(tmp_path: Path) -> None:
    env = install_plugin(tmp_path / "site", "marked = marked_logs:Marked")
    logs = tmp_path / "logs"
    proc = aioproc_run(
        tmp_path, "--logs-specs", "marked", "--log-dir", str(logs), "--nproc-per-node", "2",
        ENV_SCRIPT, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert (logs / "marked-by-plugin").read_text() == "[0, 1]"


@pytest.mark.parametrize(
    ("entry", "name", "message"),
    [
        ("marked = marked_logs:Marked", "other", "no entry point 'other' in group "
         "'torchrun.logs_specs' (installed: default, marked)"),
        ("broken = no_such_module:X", "broken", "--logs-specs 'broken': cannot load "
         "'no_such_module:X': ModuleNotFoundError"),
        ("notspecs = marked_logs:os", "notspecs", "is not a LogsSpecs class"),
    ],
)  # fmt: skip
def test_bad_logs_specs_starts_nothing(tmp_path: Path, entry: str, name: str, message: str) -> None:
    env = install_plugin(tmp_path / "site", entry)
    proc = aioproc_run(tmp_path / "logs", "--logs-specs", name, ENV_SCRIPT, env=env)
    assert message in usage_error(proc)


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
def test_a_torch_logs_specs_class_lays_out_the_logs(tmp_path: Path) -> None:
    """torch's own DefaultLogsSpecs, loaded as a plugin: aioproc drives it."""
    env = install_plugin(
        tmp_path / "site", "torchs = torch.distributed.elastic.multiprocessing.api:DefaultLogsSpecs"
    )
    logs = tmp_path / "logs"
    proc = aioproc_run(
        tmp_path, "--logs-specs", "torchs", "--log-dir", str(logs), "--rdzv-id", "tj",
        "--redirects", "1", ENV_SCRIPT, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    (out,) = logs.glob("tj_*/attempt_0/0/stdout.log")
    assert out.read_text().startswith("ENV {")


def test_start_method_fork_runs_the_script_as_torchrun_does(tmp_path: Path) -> None:
    proc = aioproc_run(tmp_path, "--start-method", "fork", "--nproc-per-node", "2", ENV_SCRIPT)
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.splitlines()) == 2


def test_python_exec_names_the_interpreter(tmp_path: Path) -> None:
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\necho "via PYTHON_EXEC"\nexec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    proc = aioproc_run(tmp_path / "logs", ENV_SCRIPT, env={"PYTHON_EXEC": str(wrapper)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == "via PYTHON_EXEC"


# ---------------------------------------------------------- --numa-binding


def make_sysfs(root: Path, gpu_nodes: dict[str, str]) -> None:
    """Two NUMA nodes on one socket, 4 cores x 2 threads each, 2 L3 caches a node.

    Node 0: cores 0-3 (threads 0-3 and 8-11); node 1: cores 4-7 (4-7, 12-15).
    ``gpu_nodes``: each GPU's PCI address to its ``numa_node`` file's text.
    """

    def write(path: str, text: str) -> None:
        file = root / path
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text(text + "\n")

    write("devices/system/node/possible", "0-1")
    write("devices/system/node/node0/cpulist", "0-3,8-11")
    write("devices/system/node/node1/cpulist", "4-7,12-15")
    for cpu in range(16):
        core = cpu % 8
        base = f"devices/system/cpu/cpu{cpu}"
        write(f"{base}/topology/thread_siblings_list", f"{core},{core + 8}")
        write(f"{base}/topology/physical_package_id", "0")
        pair = core // 2 * 2  # two cores share an L3
        write(f"{base}/cache/index0/type", "Instruction")
        write(f"{base}/cache/index0/level", "1")
        write(f"{base}/cache/index0/shared_cpu_list", f"{core},{core + 8}")
        write(f"{base}/cache/index3/type", "Unified")
        write(f"{base}/cache/index3/level", "3")
        write(f"{base}/cache/index3/shared_cpu_list", f"{pair}-{pair + 1},{pair + 8}-{pair + 9}")
    for pci, node in gpu_nodes.items():
        write(f"bus/pci/devices/{pci}/numa_node", node)


@pytest.fixture
def numa_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Four GPUs, two on each NUMA node (the first one's node file says -1: node 0)."""
    pcis = ["0000:1b:00.0", "0000:3d:00.0", "0000:9a:00.0", "0000:db:00.0"]
    make_sysfs(tmp_path / "sys", dict(zip(pcis, ["-1", "0", "1", "1"], strict=True)))
    monkeypatch.setattr(devices, "_SYS", str(tmp_path / "sys"))
    monkeypatch.setattr(devices, "_allowed_cpus", lambda: set(range(16)))
    gpus = [devices.Gpu(f"GPU-{i}", pci) for i, pci in enumerate(pcis)]
    monkeypatch.setattr(devices, "cuda_devices", lambda: gpus)


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("node", ["0-3,8-11", "0-3,8-11", "4-7,12-15", "4-7,12-15"]),
        ("socket", ["0-15"] * 4),
        ("exclusive", ["0-1,8-9", "2-3,10-11", "4-5,12-13", "6-7,14-15"]),
        ("core-complex", ["0-1,8-9", "2-3,10-11", "4-5,12-13", "6-7,14-15"]),
    ],
)
def test_numa_modes_bind_each_rank_near_its_gpu_as_torch_does(
    numa_host: None, mode: str, expected: list[str]
) -> None:
    cpus, note = devices.numa_cpus(mode, 4)
    assert [devices.ranges(cpus[rank]) for rank in range(4)] == expected
    assert note == ""


def test_numa_ranks_without_a_gpu_are_named_and_left_alone(numa_host: None) -> None:
    cpus, note = devices.numa_cpus("node", 6)
    assert sorted(cpus) == [0, 1, 2, 3]
    assert note == (
        "local rank(s) 4, 5 not bound: no GPU of that index with a known NUMA node "
        "(4 GPU(s) visible)"
    )


def test_numa_exclusive_with_more_gpus_than_cores_is_an_error(
    numa_host: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(devices, "_allowed_cpus", lambda: {0, 8, 4})  # one core a node
    with pytest.raises(ValueError, match="NUMA node 0 has 1 physical cores for 2 GPUs"):
        devices.numa_cpus("exclusive", 2)


def test_numa_without_numa_information_is_a_no_op(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(devices, "_SYS", str(tmp_path / "no-sys"))
    assert devices.numa_cpus("node", 2) == (
        {},
        "this machine exposes no NUMA information (no /sys/devices/system/node)",
    )


def test_bind_sets_the_affinity_of_every_thread_of_a_running_process() -> None:
    code = "import threading, time; threading.Thread(target=time.sleep, args=(30,)).start(); "
    code += "print(flush=True); time.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline() == b"\n"
        cpu = min(os.sched_getaffinity(0))
        devices.bind(child.pid, frozenset({cpu}))
        threads = os.listdir(f"/proc/{child.pid}/task")
        assert len(threads) == 2
        assert all(os.sched_getaffinity(int(tid)) == {cpu} for tid in threads)
    finally:
        child.kill()
        child.wait()
        assert child.stdout is not None
        child.stdout.close()
    devices.bind(child.pid, frozenset({cpu}))  # gone: nothing to do, nothing raised


def test_numa_binding_without_a_gpu_says_so_once_and_runs(tmp_path: Path) -> None:
    proc = aioproc_run(
        tmp_path, "--numa-binding", "node", "--nproc-per-node", "2", ENV_SCRIPT,
        env={"CUDA_VISIBLE_DEVICES": "-1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines()[0] == (
        "aioproc run: --numa-binding node: no worker is bound: no CUDA GPU found: the "
        "binding follows each rank's GPU"
    )
    assert len(proc.stdout.splitlines()) == 2


def test_numa_binding_value_is_one_of_torchs_modes(tmp_path: Path) -> None:
    proc = aioproc_run(tmp_path, "--numa_binding=nodes", ENV_SCRIPT)
    assert usage_error(proc).endswith(
        "argument --numa-binding/--numa_binding: expected one of node, socket, exclusive, "
        "core-complex, got 'nodes'"
    )


def test_devices_module_stays_out_of_help() -> None:
    """``aioproc run --help`` imports neither the device probes nor torch."""
    code = textwrap.dedent(
        """
        import sys
        from aioproc.cli import main
        try:
            main(["run", "--help"])
        except SystemExit:
            pass
        print(sorted(m for m in sys.modules if m in ("torch", "aioproc._cli.devices",
              "aioproc._cli.torchrun", "aioproc.logs")))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=LIMIT, env=cli_env()
    )
    assert proc.stdout.splitlines()[-1] == "[]", proc.stderr


def test_worker_spec_carries_virtual_local_rank_as_torchs(monkeypatch: pytest.MonkeyPatch) -> None:
    from aioproc.agent import WorkerSpec

    with pytest.raises(TypeError, match="virtual_local_rank must be a bool, got 'yes'"):
        WorkerSpec("trainer", 2, "true", virtual_local_rank="yes")  # type: ignore[arg-type]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-a,GPU-b")
    spec = WorkerSpec("trainer", 2, "true", virtual_local_rank=True)
    assert [spec.visible_device(r) for r in (0, 1)] == ["GPU-a", "GPU-b"]
    with pytest.raises(ValueError, match="local rank 2 has no GPU of its own"):
        WorkerSpec("trainer", 3, "true", virtual_local_rank=True)
