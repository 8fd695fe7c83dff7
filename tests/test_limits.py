"""Resource limits, usage and placements (``aioproc._limits``), on this host's own kernel.

Each test that needs a cgroup runs once per cgroup version and skips,
saying why, where this process cannot make groups of that version (a
non-root user without a delegated subtree, a container without cgroupfs).
The children are plain interpreters started with ``posix_spawn``, held at
a gate (a byte on stdin) until the test has joined them to a placement, so
no limit arrives late; every one is killed and reaped at the end, passed or
failed.
"""

from __future__ import annotations

import errno
import math
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import aioproc
from aioproc import Limits, Usage
from aioproc._limits import cgroups, join
from aioproc._limits.cgroups import Host, discover
from aioproc._limits.placement import Placement, open_placement
from aioproc._limits.spec import format_bytes, parse_memory
from aioproc._limits.usage import TreeUsage, reap_with_usage, sample, usage_from_rusage

MiB = 1 << 20
HOST = discover()


class Child:
    """A Python child held at a gate until ``go()``; its stdout is collected at exit."""

    def __init__(self, code: str, env: dict[str, str] | None = None) -> None:
        gate_r, self._gate = os.pipe()
        self._out, out_w = os.pipe()
        prelude = "import os, sys\nos.read(0, 1)\n"
        try:
            self.pid = os.posix_spawn(
                sys.executable,
                [sys.executable, "-c", prelude + code],
                {**os.environ, **(env or {})},
                file_actions=[(os.POSIX_SPAWN_DUP2, gate_r, 0), (os.POSIX_SPAWN_DUP2, out_w, 1)],
            )
        finally:
            os.close(gate_r)
            os.close(out_w)
        self.reaped = False

    def go(self) -> None:
        """Let the child run its code."""
        if self._gate >= 0:
            os.write(self._gate, b"x")
            os.close(self._gate)
            self._gate = -1

    def wait(self) -> tuple[int, Usage, str]:
        """Reap it: exit code (``-N`` for signal N), usage and everything it printed."""
        self.go()
        code, usage = reap_with_usage(self.pid)
        self.reaped = True
        chunks = []
        while chunk := os.read(self._out, 65536):
            chunks.append(chunk)
        return code, usage, b"".join(chunks).decode()

    def cleanup(self) -> None:
        if not self.reaped:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
            self.reaped = True
        for fd in (self._gate, self._out):
            if fd >= 0:
                os.close(fd)
        self._gate = self._out = -1


@pytest.fixture
def spawn() -> Iterator[type[Child]]:
    """``spawn(code)`` starts a gated child; all are killed and reaped at teardown."""
    started: list[Child] = []

    class Tracked(Child):
        def __init__(self, code: str, env: dict[str, str] | None = None) -> None:
            super().__init__(code, env)
            started.append(self)

    yield Tracked
    for child in started:
        child.cleanup()


@pytest.fixture
def placements() -> Iterator[list[Placement]]:
    """Placements to close at teardown, so a failed test leaves no cgroup behind."""
    opened: list[Placement] = []
    yield opened
    for placement in opened:
        placement.close()


def cgroup_backend(version: int, *controllers: str) -> str:
    """``"cgroup1"``/``"cgroup2"``, or skip: this host cannot make such groups."""
    offered = set().union(*(h.controllers for h in HOST.hierarchies if h.version == version))
    if set(controllers) <= offered:
        return f"cgroup{version}"
    found = [f"v{h.version} {','.join(sorted(h.controllers))}" for h in HOST.hierarchies]
    pytest.skip(
        f"this process cannot make cgroup v{version} groups with {', '.join(controllers)} "
        f"(needs a writable delegated subtree or root; found {found or 'none'}; "
        f"notes: {'; '.join(HOST.notes) or 'none'})"
    )


VERSIONS = pytest.mark.parametrize("version", [1, 2], ids=["cgroup1", "cgroup2"])


# ------------------------------------------------------------------- Limits


@pytest.mark.parametrize(
    ("value", "size"),
    [
        (4096, 4096),
        ("4096", 4096),
        ("512M", 512 * MiB),
        ("512MiB", 512 * MiB),
        ("2G", 2 << 30),
        ("1.5GiB", 3 << 29),
        ("100k", 100 << 10),
        ("1T", 1 << 40),
        (" 64 M ", 64 * MiB),
    ],
)
def test_memory_sizes_are_binary(value: int | str, size: int) -> None:
    assert parse_memory(value) == size
    assert Limits(memory=value).memory == size


@pytest.mark.parametrize(
    ("kwargs", "error", "text"),
    [
        ({"memory": "512MB"}, ValueError, r"'512MB'.*binary"),
        ({"memory": "lots"}, ValueError, "'lots'"),
        ({"memory": "-1M"}, ValueError, "'-1M'"),
        ({"memory": 0}, ValueError, "0"),
        ({"memory": 1.5}, TypeError, "1.5"),
        ({"memory": True}, TypeError, "True"),
        ({"cpus": 0}, ValueError, "0"),
        ({"cpus": 0.001}, ValueError, r"0\.001"),
        ({"cpus": math.nan}, ValueError, "nan"),
        ({"cpus": "2"}, TypeError, "'2'"),
        ({"pids": 0}, ValueError, "0"),
        ({"pids": 2.0}, TypeError, r"2\.0"),
        ({"pids": False}, TypeError, "False"),
    ],
)
def test_bad_limits_fail_at_construction_naming_the_value(
    kwargs: dict[str, object], error: type[Exception], text: str
) -> None:
    with pytest.raises(error, match=text):
        Limits(**kwargs)  # type: ignore[arg-type]


def test_limits_are_frozen_and_public() -> None:
    limits = aioproc.Limits(memory="1.5G", cpus=2, pids=64)
    assert (limits.memory, limits.cpus, limits.pids) == (3 << 29, 2.0, 64)
    assert type(limits.cpus) is float
    assert limits == Limits(memory=3 << 29, cpus=2.0, pids=64)
    assert bool(limits) and not Limits()
    with pytest.raises(AttributeError):
        limits.memory = 1  # type: ignore[misc]
    assert [format_bytes(n) for n in (100, 64 * MiB, 3 << 29)] == ["100 bytes", "64 MiB", "1.5 GiB"]


# -------------------------------------------------------------------- Usage


BURN = (
    "import time\nstart = time.process_time()\nwhile time.process_time() - start < 1.0:\n    pass\n"
)
ALLOCATE = "data = b'x' * ({mib} << 20)\nprint('survived', flush=True)\n"


def test_usage_of_a_child_burning_a_second_of_cpu(spawn: type[Child]) -> None:
    code, usage, _ = spawn(BURN).wait()
    assert code == 0
    assert isinstance(usage, aioproc.Usage)
    assert usage.cpu_time >= 0.8, usage
    assert usage.cpu_time == pytest.approx(usage.user_time + usage.system_time)
    assert usage.tree_cpu_time is None and usage.tree_max_memory is None


def test_a_live_sample_of_a_process_that_exited_unreaped_is_none() -> None:
    """Between its exit and its reap a worker is a zombie whose ``/proc`` figures are
    all 0: no sample, rather than a peak of 0 bytes."""
    import subprocess

    child = subprocess.Popen([sys.executable, "-c", ALLOCATE.format(mib=64)])
    try:
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
        assert sample(child.pid) is None
    finally:
        child.wait()
    assert sample(os.getpid()) is not None


def test_usage_of_a_child_allocating_200_mib(spawn: type[Child]) -> None:
    code, usage, out = spawn(ALLOCATE.format(mib=200)).wait()
    assert (code, out) == (0, "survived\n")
    assert usage.max_rss >= 200 * MiB, usage


def test_usage_from_rusage_converts_kib_and_takes_tree_figures(spawn: type[Child]) -> None:
    child = spawn("pass")
    child.go()
    _, _, rusage = os.wait4(child.pid, 0)
    child.reaped = True
    usage = usage_from_rusage(rusage, TreeUsage(cpu_time=1.5, max_memory=7))
    assert usage.max_rss == rusage.ru_maxrss * 1024
    assert (usage.tree_cpu_time, usage.tree_max_memory) == (1.5, 7)


@VERSIONS
def test_the_cgroup_counts_the_tree(
    version: int, spawn: type[Child], placements: list[Placement]
) -> None:
    backend = cgroup_backend(version, "memory", "cpuacct")
    placement = open_placement(Limits(), "usage", backends=[backend])
    placements.append(placement)
    assert placement.mechanisms == {}  # no limit: groups only to count
    child = spawn(BURN + ALLOCATE.format(mib=200))
    placement.join(child.pid)
    code, usage, _ = child.wait()
    tree = placement.usage()
    assert code == 0
    assert tree.cpu_time is not None and tree.cpu_time >= 0.8, tree
    assert tree.max_memory is not None and tree.max_memory >= 200 * MiB, tree
    placement.close()
    assert placement.usage() == tree  # kept after close
    combined = usage_from_rusage_of(usage, tree)
    assert combined.tree_cpu_time == tree.cpu_time


def usage_from_rusage_of(usage: Usage, tree: TreeUsage) -> Usage:
    """``usage`` with the tree's figures, as the launcher would build it."""
    return Usage(
        usage.cpu_time,
        usage.user_time,
        usage.system_time,
        usage.max_rss,
        tree.cpu_time,
        tree.max_memory,
    )


# ------------------------------------------------------------------- memory


@VERSIONS
def test_a_child_past_its_memory_limit_is_oom_killed_and_named(
    version: int, spawn: type[Child], placements: list[Placement]
) -> None:
    backend = cgroup_backend(version, "memory")
    placement = open_placement(Limits(memory="64M"), "oom", backends=[backend])
    placements.append(placement)
    assert placement.mechanisms["memory"].startswith(
        "memory.limit_in_bytes=67108864 (64 MiB) via cgroup v1 memory controller at /"
        if version == 1
        else "memory.max=67108864 (64 MiB) via cgroup v2 at /"
    ), placement.mechanisms
    assert placement.oom_killed() is None
    child = spawn(ALLOCATE.format(mib=256))
    placement.join(child.pid)
    code, _, out = child.wait()
    assert (code, out) == (-signal.SIGKILL, "")
    assert placement.oom_kills() == 1
    assert placement.oom_killed() == (
        "killed by the kernel's OOM killer: memory limit 64 MiB reached"
    )
    placement.close()
    assert placement.oom_killed() is not None  # kept after close


def test_rlimit_memory_makes_the_allocation_fail(
    spawn: type[Child], placements: list[Placement]
) -> None:
    placement = open_placement(Limits(memory="64M"), "rlimit", backends=["rlimit"])
    placements.append(placement)
    assert placement.cgroups == ()
    assert placement.mechanisms["memory"].startswith("RLIMIT_DATA=67108864 per process")
    child = spawn(
        "try:\n" + "    data = b'x' * (256 << 20)\nexcept MemoryError:\n    sys.exit(3)\n"
    )
    placement.join(child.pid)
    code, _, _ = child.wait()
    assert code == 3
    assert placement.oom_killed() is None  # an rlimit never kills


def test_a_child_enters_its_rlimits_by_itself(spawn: type[Child]) -> None:
    with open_placement(Limits(memory="64M", pids=50), "self", backends=["rlimit"]) as placement:
        env = placement.child_env()
        assert env == {"AIOPROC_RLIMITS": "DATA=67108864,NPROC=50"}
        child = spawn(
            "from aioproc._limits.join import enter\n"
            "import resource\n"
            "enter()\n"
            "data, nproc = resource.RLIMIT_DATA, resource.RLIMIT_NPROC\n"
            "leftover = 'AIOPROC_RLIMITS' in os.environ\n"
            "print(resource.getrlimit(data), resource.getrlimit(nproc), leftover)\n",
            env,
        )
        code, _, out = child.wait()
    assert (code, out) == (0, "(67108864, 67108864) (50, 50) False\n")


@VERSIONS
def test_a_child_enters_its_cgroups_by_itself(
    version: int, spawn: type[Child], placements: list[Placement]
) -> None:
    backend = cgroup_backend(version, "memory")
    placement = open_placement(Limits(memory="1G"), "self", backends=[backend])
    placements.append(placement)
    env = placement.child_env()
    assert set(env) == {"AIOPROC_CGROUP_PROCS"}
    child = spawn(
        "from aioproc._limits.join import enter\nenter()\nprint(open('/proc/self/cgroup').read())",
        env,
    )
    code, _, out = child.wait()
    assert code == 0
    for path in placement.cgroups:
        assert f":{path.name}\n" in out.replace("/", ":"), (path, out)


# --------------------------------------------------------------------- pids

FORK_BOMB = (Path(__file__).parent / "children" / "fork_bomb.py").read_text()


@VERSIONS
def test_a_pids_limit_stops_a_fork_bomb_in_the_child_only(
    version: int, spawn: type[Child], placements: list[Placement]
) -> None:
    backend = cgroup_backend(version, "pids")
    placement = open_placement(Limits(pids=16), "bomb", backends=[backend])
    placements.append(placement)
    assert placement.mechanisms["pids"].startswith(f"pids.max=16 via cgroup v{version} ")
    child = spawn(FORK_BOMB)
    placement.join(child.pid)
    code, _, out = child.wait()
    forked, error = out.split()
    assert code == 0
    assert int(forked) == 15, out  # the child itself is the 16th
    assert error == str(errno.EAGAIN)
    # the test process was never limited: it still forks freely
    others = [spawn("pass") for _ in range(20)]
    assert all(other.wait()[0] == 0 for other in others)


def test_rlimit_nproc_says_it_is_per_user() -> None:
    with open_placement(Limits(pids=16), "nproc", backends=["rlimit"]) as placement:
        assert (
            f"counts every process and thread of uid {os.getuid()}" in placement.mechanisms["pids"]
        )


# ---------------------------------------------------------------------- cpu


@VERSIONS
def test_half_a_cpu_halves_a_busy_child(
    version: int, spawn: type[Child], placements: list[Placement]
) -> None:
    backend = cgroup_backend(version, "cpu")
    placement = open_placement(Limits(cpus=0.5), "cpu", backends=[backend])
    placements.append(placement)
    child = spawn(
        "import time\n"
        "wall, cpu = time.monotonic(), time.process_time()\n"
        "while time.monotonic() - wall < 1.0:\n"
        "    pass\n"
        "print((time.process_time() - cpu) / (time.monotonic() - wall))\n"
    )
    placement.join(child.pid)
    code, _, out = child.wait()
    assert code == 0
    assert float(out) < 0.75, out  # about 0.5: the quota is 50 ms per 100 ms


def test_no_cpu_quota_without_cgroups() -> None:
    with open_placement(Limits(memory="1G", cpus=1.5), "laptop", host=Host()) as placement:
        assert placement.unenforced == ("cpus",)
        assert placement.mechanisms["cpus"].startswith("not enforced: no cgroup could be made")
        assert placement.mechanisms["cpus"].endswith("rlimits have no CPU quota")
        assert placement.mechanisms["memory"].startswith("RLIMIT_DATA=")


# -------------------------------------------------------------------- close


@VERSIONS
def test_close_moves_survivors_out_and_leaves_no_directory(
    version: int, spawn: type[Child], placements: list[Placement]
) -> None:
    backend = cgroup_backend(version, "memory")
    placement = open_placement(Limits(memory="1G", pids=100), "close", backends=[backend])
    placements.append(placement)
    dirs = placement.cgroups
    assert dirs and all(path.is_dir() for path in dirs)
    survivor = spawn("pass")
    placement.join(survivor.pid)
    own = Path(f"/proc/{survivor.pid}/cgroup").read_text()
    assert any(path.name in own for path in dirs)
    placement.close()
    assert not any(path.exists() for path in dirs)
    assert not any(path.name in Path(f"/proc/{survivor.pid}/cgroup").read_text() for path in dirs)
    assert Path(f"/proc/{survivor.pid}/cgroup").read_text() == Path("/proc/self/cgroup").read_text()
    placement.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        placement.join(survivor.pid)
    assert "closed" in repr(placement)


@VERSIONS
def test_joining_a_process_that_already_exited_is_no_error(
    version: int, spawn: type[Child], placements: list[Placement]
) -> None:
    backend = cgroup_backend(version, "memory")
    placement = open_placement(Limits(memory="1G"), "late", backends=[backend])
    placements.append(placement)
    child = spawn("pass")
    child.go()
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # a zombie now
    placement.join(child.pid)
    assert child.wait()[0] == 0


# -------------------------------------------------------- discovery, no kernel


def test_a_delegated_cgroup2_tree_gets_its_files_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Against a fake cgroup2 mount: the files a real kernel would read are written."""
    # cgroupfs makes a group's files with the group; a plain directory does not
    monkeypatch.setattr(cgroups, "_write", lambda path, value: path.write_text(value))
    (tmp_path / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (tmp_path / "cgroup.subtree_control").write_text("")
    host = discover(
        cgroup_text="0::/\n",
        mountinfo_text=f"30 1 0:26 / {tmp_path} rw,relatime - cgroup2 cgroup2 rw\n",
        environ={},
    )
    assert [(h.version, sorted(h.controllers)) for h in host.hierarchies] == [
        (2, ["cpu", "cpuacct", "memory", "pids"])
    ]
    placement = open_placement(Limits(memory="2G", cpus=1.5, pids=32), "fake/0", host=host)
    try:
        (group,) = placement.cgroups
        assert group.parent == tmp_path and group.name.endswith("-fake_0")
        assert (tmp_path / "cgroup.subtree_control").read_text() == "+cpu +memory +pids"
        assert (group / "memory.max").read_text() == str(2 << 30)
        assert (group / "cpu.max").read_text() == "150000 100000"
        assert (group / "pids.max").read_text() == "32"
        assert placement.mechanisms["memory"] == (
            f"memory.max={2 << 30} (2 GiB) via cgroup v2 at {group}"
        )
        (group / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
        (group / "cpu.stat").write_text("usage_usec 2500000\nuser_usec 2000000\n")
        (group / "memory.peak").write_text(f"{300 * MiB}\n")
        assert placement.oom_killed() == (
            "killed by the kernel's OOM killer: memory limit 2 GiB reached"
        )
        assert placement.usage() == TreeUsage(cpu_time=2.5, max_memory=300 * MiB)
        assert placement.child_env() == {"AIOPROC_CGROUP_PROCS": str(group / "cgroup.procs")}
    finally:
        # a real kernel removes its interface files with the directory
        for path in list(Path(tmp_path).glob("aioproc-*/*")):
            path.unlink()
        placement.close()
    assert not list(tmp_path.glob("aioproc-*"))


def test_discovery_reads_v1_mounts_under_this_process_group(tmp_path: Path) -> None:
    """A container's view: the mount's root is this process's own group."""
    (tmp_path / "cpu").mkdir()
    (tmp_path / "memory").mkdir()
    mountinfo = (
        f"40 1 0:30 /docker/abc {tmp_path}/cpu rw - cgroup cgroup rw,cpu,cpuacct\n"
        f"41 1 0:31 /docker/abc {tmp_path}/memory rw - cgroup cgroup rw,memory\n"
        f"42 1 0:32 /elsewhere {tmp_path}/pids rw - cgroup cgroup rw,pids\n"
        f"43 1 0:33 / {tmp_path}/unified rw - cgroup2 cgroup2 rw\n"
    )
    own = "5:pids:/docker/abc\n4:memory:/docker/abc/x\n3:cpu,cpuacct:/docker/abc\n0::/\n"
    host = discover(own, mountinfo, environ={})
    assert host.hierarchies == (
        cgroups.Hierarchy(1, frozenset({"cpu", "cpuacct"}), tmp_path / "cpu", tmp_path / "cpu"),
    )
    notes = "\n".join(host.notes)
    assert f"cgroup v1 pids at {tmp_path}/pids: this process's group is outside the mount" in notes
    assert f"{tmp_path}/memory/x is not writable" in notes  # it does not exist
    assert f"cgroup v2 at {tmp_path}/unified: offers none of memory, cpu, pids" in notes


def test_open_placement_checks_its_arguments() -> None:
    with pytest.raises(TypeError, match="'64M'"):
        open_placement("64M", "x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cgroup3"):
        open_placement(Limits(), "x", backends=["cgroup3"])


def test_join_env_round_trip() -> None:
    settings = {"DATA": 1 << 30, "NPROC": 16}
    assert join.decode_rlimits(join.encode_rlimits(settings)) == settings
    with pytest.raises(ValueError, match="BOGUS=1"):
        join.decode_rlimits("BOGUS=1")
