"""``aioproc run``'s resource flags: limits, CPUs and metrics, as a user sees them.

``--memory-limit``, ``--cpu-limit`` and ``--pids-limit`` limit each rank on
its own; ``--cpu-affinity`` places the ranks; ``--metrics-port`` serves
Prometheus metrics while the run lasts.  A test that needs a cgroup skips,
saying why, where this process cannot make one; the rlimit fallback is run
by a command whose backends are narrowed to it.  The scripts the workers run
are written into the test's temp dir; a job that must stay up while the test
looks at it waits on named pipes the test holds, never on a sleep.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import loop_name, need_cgroup

LIMIT = 60.0
CLI = [sys.executable, "-m", "aioproc"]
# the same command with its limits narrowed to rlimits, as where no cgroup can be made
CLI_RLIMITS = [
    sys.executable,
    "-c",
    "import sys\n"
    "from aioproc._group import resources\n"
    "resources.BACKENDS = ('rlimit',)\n"
    "from aioproc.cli import main\n"
    "sys.exit(main())",
]
OOM_LINE = "  oom       : killed by the kernel's OOM killer: memory limit 64 MiB reached"

ALLOCATE = """\
import os
print("rank", os.environ["RANK"], "allocating", flush=True)
data = bytearray(256 << 20)
data[::4096] = b"x" * len(data[::4096])
print("allocated 256 MiB", flush=True)
"""


# Each rank prints "ready", then prints N lines for each number N the test
# writes to its pipe, and exits at the pipe's EOF.
GATED = """\
import os, sys
rank = os.environ["LOCAL_RANK"]
print("ready", flush=True)
with open(sys.argv[1] + rank) as gate:
    for n in gate:
        for i in range(int(n)):
            print("line", i, flush=True)
        print("printed", flush=True)
print("bye", flush=True)
"""

AFFINITY = "import os\nprint('cpus', sorted(os.sched_getaffinity(0)), flush=True)\n"


def cli_env() -> dict[str, str]:
    """The command's environment: ours without torchrun's variables, on the test's loop."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_"))}
    env.pop("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", None)
    env.update(AIOPROC_LOOP=loop_name(), OMP_NUM_THREADS="1")
    return env


def aioproc_run(
    tmp_path: Path, *args: str, cli: list[str] = CLI
) -> subprocess.CompletedProcess[str]:
    """``aioproc run args`` to its end; its logs go under ``tmp_path``."""
    return subprocess.run(
        [*cli, "run", "--log-dir", str(tmp_path / "logs"), *args],
        capture_output=True,
        text=True,
        timeout=LIMIT,
        env=cli_env(),
    )


def script(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# ------------------------------------------------------------------- limits


def test_a_rank_past_its_memory_limit_is_killed_and_named_in_the_summary(tmp_path: Path) -> None:
    need_cgroup("memory")
    job = script(tmp_path, "allocate.py", ALLOCATE)
    proc = aioproc_run(tmp_path, "--nproc-per-node", "2", "--memory-limit", "64M", job)
    assert proc.returncode == 1, proc.stderr
    assert f"{job} FAILED" in proc.stderr
    root = proc.stderr.split("Root Cause (first observed failure):", 1)[1]
    assert "exitcode  : -9" in root and "(SIGKILL)" in root, proc.stderr
    assert OOM_LINE in root.splitlines(), proc.stderr
    # each rank had its own 64 MiB: neither reached 256 MiB
    assert "allocated" not in proc.stdout


def test_without_cgroups_the_memory_limit_fails_the_allocation(tmp_path: Path) -> None:
    job = script(tmp_path, "allocate.py", ALLOCATE)
    proc = aioproc_run(tmp_path, "--memory-limit", "64M", job, cli=CLI_RLIMITS)
    assert proc.returncode == 1, proc.stderr
    assert f"{job} FAILED" in proc.stderr
    assert "MemoryError" in proc.stderr  # the worker's own traceback, on the console
    assert "oom       :" not in proc.stderr  # an rlimit never kills
    assert "allocated" not in proc.stdout


def test_a_pids_limit_holds_each_rank_to_its_own_count(tmp_path: Path) -> None:
    need_cgroup("pids")
    job = str(Path(__file__).parent / "children" / "fork_bomb.py")
    proc = aioproc_run(tmp_path, "--nproc-per-node", "2", "--pids-limit", "16", "--tee", "1", job)
    assert proc.returncode == 0, proc.stderr
    counts = re.findall(r"^\[default(\d)\]:(\d+) (\d+)$", proc.stdout, re.M)
    assert sorted(rank for rank, _, _ in counts) == ["0", "1"], proc.stdout
    for _, forked, error in counts:
        # the worker itself counts among its 16; the other rank's processes do not
        assert 0 < int(forked) < 16 and int(error) == 11, proc.stdout  # EAGAIN


def test_round_robin_affinity_gives_each_rank_a_cpu_in_turn(tmp_path: Path) -> None:
    allowed = sorted(os.sched_getaffinity(0))
    job = script(tmp_path, "affinity.py", AFFINITY)
    n = 3
    proc = aioproc_run(
        tmp_path, "--nproc-per-node", str(n), "--cpu-affinity", "round-robin", "--tee", "1", job
    )
    assert proc.returncode == 0, proc.stderr
    seen = dict(re.findall(r"^\[default(\d)\]:cpus (\[.*\])$", proc.stdout, re.M))
    assert seen == {str(r): str([allowed[r % len(allowed)]]) for r in range(n)}, proc.stdout


def test_a_cpu_list_is_every_ranks_set(tmp_path: Path) -> None:
    first = min(os.sched_getaffinity(0))
    job = script(tmp_path, "affinity.py", AFFINITY)
    proc = aioproc_run(
        tmp_path, "--nproc-per-node", "2", "--cpu-affinity", str(first), "--tee", "1", job
    )
    assert proc.returncode == 0, proc.stderr
    seen = dict(re.findall(r"^\[default(\d)\]:cpus (\[.*\])$", proc.stdout, re.M))
    assert seen == {"0": f"[{first}]", "1": f"[{first}]"}, proc.stdout


# ------------------------------------------------------------------ metrics


async def scrape(url: str) -> str:
    """``GET url`` (``http://HOST:PORT/metrics``); the body."""
    m = re.fullmatch(r"http://(.+):(\d+)/metrics", url)
    assert m, url
    reader, writer = await asyncio.open_connection(m[1], int(m[2]))
    try:
        writer.write(b"GET /metrics HTTP/1.1\r\nHost: test\r\n\r\n")
        data = await asyncio.wait_for(reader.read(), LIMIT)
    finally:
        writer.close()
        await writer.wait_closed()
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 "), head
    return body.decode()


def value(text: str, name: str, **labels: str) -> float:
    """The sample ``name{labels}`` of a scrape (labels as rendered, in order), else 0."""
    shown = ",".join(f'{k}="{v}"' for k, v in labels.items())
    m = re.search(rf"^{name}\{{{re.escape(shown)}\}} (\S+)$", text, re.M)
    return float(m[1]) if m else 0.0


async def readline_until(stream: asyncio.StreamReader, pattern: str, seen: list[str]) -> str:
    """Read lines of ``stream`` into ``seen`` until one matches ``pattern``; that line."""
    while True:
        raw = await asyncio.wait_for(stream.readline(), LIMIT)
        assert raw, f"EOF before a line matching {pattern!r}: {seen}"
        line = raw.decode().rstrip("\n")
        seen.append(line)
        if re.search(pattern, line):
            return line


async def test_metrics_are_served_while_the_run_lasts(tmp_path: Path) -> None:
    job = script(tmp_path, "gated.py", GATED)
    gates = []
    for rank in range(2):
        path = tmp_path / f"gate{rank}"
        os.mkfifo(path)
        # held open for reading and writing: a rank's open never blocks, and
        # it reads EOF only when the test closes its end
        gates.append(os.open(path, os.O_RDWR))
    proc = await asyncio.create_subprocess_exec(
        *CLI,
        "run",
        "--log-dir",
        str(tmp_path / "logs"),
        "--nproc-per-node",
        "2",
        "--tee",
        "3",
        "--metrics-port",
        "0",
        job,
        str(tmp_path / "gate"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=cli_env(),
    )
    out: list[str] = []
    err: list[str] = []
    try:
        assert proc.stdout is not None and proc.stderr is not None
        said = await readline_until(proc.stderr, r"metrics at ", err)
        url = said.split("metrics at ", 1)[1]
        assert said == f"aioproc run: metrics at {url}"
        assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics")
        for _ in range(2):
            await readline_until(proc.stdout, r"^\[default\d\]:ready$", out)
        before = await scrape(url)
        group = {"group": "default", "role": "default"}
        assert value(before, "aioproc_workers_running", **group) == 2, before
        assert value(before, "aioproc_groups_running", **group) == 1, before
        lines_before = value(before, "aioproc_output_lines_total", **group, stream="stdout")
        assert lines_before >= 2  # the two "ready" lines
        for gate in gates:
            os.write(gate, b"5\n")
        for _ in range(2):
            await readline_until(proc.stdout, r"^\[default\d\]:printed$", out)
        after = await scrape(url)
        lines_after = value(after, "aioproc_output_lines_total", **group, stream="stdout")
        assert lines_after == lines_before + 12, after  # 5 lines and "printed", twice
        assert value(after, "aioproc_output_bytes_total", **group, stream="stdout") > value(
            before, "aioproc_output_bytes_total", **group, stream="stdout"
        )
    finally:
        for gate in gates:
            os.close(gate)  # EOF: the ranks exit
        rest_out, rest_err = await asyncio.wait_for(proc.communicate(), LIMIT)
    out.extend(rest_out.decode().splitlines())
    assert proc.returncode == 0, "\n".join(err) + rest_err.decode()
    assert out.count("[default0]:bye") == 1 and out.count("[default1]:bye") == 1
    with pytest.raises(ConnectionRefusedError):  # the run is over: nothing listens there any more
        await scrape(url)


def test_a_metrics_port_in_use_is_a_usage_error_and_starts_nothing(tmp_path: Path) -> None:
    import socket

    job = script(tmp_path, "affinity.py", AFFINITY)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = aioproc_run(tmp_path, "--metrics-port", str(port), "--tee", "1", job)
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.splitlines()[-1]
    assert last.startswith(f"aioproc run: error: --metrics-port {port}: cannot listen on "), last
    assert "cpus" not in proc.stdout  # no worker ran


# --------------------------------------------------------------- bad values


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--memory-limit", "64MB"],
            "argument --memory-limit: '64MB' is not a size such as '512M', '2G' or '1.5GiB' "
            "(units are binary: write 'M' or 'MiB', not 'MB')",
        ),
        (["--memory-limit", "0"], "argument --memory-limit: memory must be a positive size"),
        (["--memory-limit", "lots"], "argument --memory-limit: 'lots' is not a size"),
        (["--cpu-limit", "0"], "argument --cpu-limit: expected a finite number >= 0.01, got '0'"),
        (["--cpu-limit", "nan"], "argument --cpu-limit: expected a finite number >= 0.01"),
        (["--pids-limit", "0"], "argument --pids-limit: expected an integer >= 1, got '0'"),
        (["--pids-limit", "1.5"], "argument --pids-limit: expected an integer >= 1, got '1.5'"),
        (
            ["--cpu-affinity", "first"],
            "argument --cpu-affinity: expected a CPU list such as '0-3,8', 'round-robin' or "
            "'numa:<node>', got 'first'",
        ),
        (["--cpu-affinity", "0-100000"], "argument --cpu-affinity: '0-100000': CPU "),
        (["--cpu-affinity", "numa:4096"], "argument --cpu-affinity: 'numa:4096': "),
        (["--metrics-port", "70000"], "argument --metrics-port: expected a TCP port (1-65535)"),
        (["--metrics-port", "-1"], "argument --metrics-port: expected an integer >= 0"),
        (
            ["--cpu-affinity", "0", "--numa-binding", "node"],
            "--cpu-affinity 0 and --numa-binding node cannot be used together",
        ),
    ],
)
def test_bad_values_exit_2_naming_the_flag_and_value(
    tmp_path: Path, args: list[str], message: str
) -> None:
    job = script(tmp_path, "affinity.py", AFFINITY)
    proc = aioproc_run(tmp_path, *args, "--tee", "1", job)
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.splitlines()[-1]
    assert last.startswith("aioproc run: error: ") and message in last, last
    assert "cpus" not in proc.stdout  # nothing started
    assert not (tmp_path / "logs").exists() or not any((tmp_path / "logs").iterdir())


def test_help_lists_the_resource_flags_with_their_defaults() -> None:
    proc = subprocess.run(
        [*CLI, "run", "--help"], capture_output=True, text=True, timeout=LIMIT, env=cli_env()
    )
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    for flag, default in [
        ("--memory-limit SIZE", "(default: no limit)"),
        ("--cpu-limit CPUS", "(default: no limit)"),
        ("--pids-limit N", "(default: no limit)"),
        ("--cpu-affinity LIST|round-robin|numa:N", "(default: wherever this command may run)"),
        ("--metrics-port PORT", "(default: no metrics)"),
        ("--metrics-host HOST", "(default: 127.0.0.1)"),
    ]:
        assert flag in text, flag
        block = text.split(flag, 1)[1].split(" --", 1)[0]
        assert default in block, (flag, block)


def test_the_resource_flags_have_no_pet_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """aioproc's own flags, like ``--no-live``: torchrun sets no PET_ variable for them."""
    from aioproc.cli import build_parser

    monkeypatch.setenv("PET_MEMORY_LIMIT", "1G")
    monkeypatch.setenv("PET_METRICS_PORT", "9464")
    ns = build_parser().parse_args(["run", "x.py"])
    assert (ns.memory_limit, ns.cpu_limit, ns.pids_limit, ns.cpu_affinity) == (None,) * 4
    assert (ns.metrics_port, ns.metrics_host) == (None, "127.0.0.1")


def test_the_limits_reach_the_spec_one_per_rank() -> None:
    from aioproc import Limits
    from aioproc.cli import _make_run, build_parser

    ns = build_parser().parse_args(
        ["run", "--no-live", "--nproc-per-node", "3", "--memory-limit", "1.5G", "--cpu-limit",
         "0.5", "--pids-limit", "64", "--cpu-affinity", "round-robin", "x.py"]
    )  # fmt: skip
    run = _make_run(ns)
    one = Limits(memory="1.5G", cpus=0.5, pids=64)
    assert run.spec.limits == {0: one, 1: one, 2: one}
    assert run.spec.cpus == "round-robin"
    assert run.metrics is None
