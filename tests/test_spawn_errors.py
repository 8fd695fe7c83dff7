"""Start and failure errors name their cause: fd limits and full disks.

* Under a low fd limit a start fails with ``EMFILE`` whose message names
  ``RLIMIT_NOFILE`` and how to raise it, never with the ``EBADF`` glibc's
  ``posix_spawn`` gives for an inherited fd above the soft limit (which
  used to break every binary start, fds to spare or not).  A supervisor in a
  child process lowers its own limit (``SUPERVISOR``).
* A worker whose redirected log is on a full disk fails without any trace
  of why (its traceback went to the same disk): the failure summary names
  the disk instead of suggesting ``@record``.  The disk is a small tmpfs,
  mounted for the test (root only; skipped elsewhere).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import REPO_ROOT, loop_name, python, result_of

import aioproc
from aioproc import ChildFailedError, DefaultLogsSpecs, Std

LIMIT = 30  # seconds: bound on any single wait in these tests
FD_LIMIT = 64  # the child supervisor's soft RLIMIT_NOFILE
HIGH_FD = FD_LIMIT + 100  # an inheritable fd above it, as a parent that allowed more leaves

SUPERVISOR = r"""
import asyncio, json, os, resource, sys, time
import aioproc
from aioproc import DefaultLogsSpecs, Std

loop, log_dir, kind, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
limit, high = int(sys.argv[5]), int(sys.argv[6])

def nap():
    time.sleep(60)

def live_children():
    # this process's live children other than its guardian, as command lines
    from aioproc._base.children import child_pids

    left = []
    for pid in child_pids():
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if stat[stat.rindex(b")") + 2 :][:1] != b"Z" and b"aioproc-guardian" not in cmd:
            left.append(cmd.replace(b"\0", b" ").decode())
    return left

async def main():
    fd = os.open(os.devnull, os.O_RDONLY)
    os.dup2(fd, high, inheritable=True)
    os.close(fd)
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    if kind == "binary":
        code = "import time; time.sleep(60)" if n > 2 else "pass"
        entry, args = sys.executable, {r: ("-S", "-c", code) for r in range(n)}
    else:
        entry, args = nap, {r: () for r in range(n)}
    started = []
    try:
        async with aioproc.start_processes(
            "w", entry, args, {r: {} for r in range(n)},
            DefaultLogsSpecs(log_dir=log_dir, tee=Std.ALL),
            on_event=lambda e: e.kind == "started" and started.append(e.pid),
        ) as pc:
            result = await pc.wait()
    except OSError as e:
        gone = [pid for pid in started if not os.path.exists(f"/proc/{pid}")]
        return {
            "errno": e.errno, "error": str(e), "started": len(started), "gone": len(gone),
            "left": live_children(),
        }
    return {"failed": result.is_failed()}

runner = asyncio.run
if loop == "uvloop":
    import uvloop
    runner = uvloop.run
print("RESULT " + json.dumps(runner(main())))
"""


async def supervise(tmp_path: Path, kind: str, n: int) -> dict[str, Any]:
    """Run ``SUPERVISOR`` starting ``n`` ``kind`` workers; its RESULT dict."""
    if os.sysconf("SC_OPEN_MAX") <= HIGH_FD:
        pytest.skip(f"the fd limit ({os.sysconf('SC_OPEN_MAX')}) leaves no room for fd {HIGH_FD}")
    proc = await asyncio.create_subprocess_exec(
        *python(SUPERVISOR),
        loop_name(),
        str(tmp_path / "logs"),
        kind,
        str(n),
        str(FD_LIMIT),
        str(HIGH_FD),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": REPO_ROOT},
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), LIMIT)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    return result_of(proc.returncode, out.decode(), err.decode())


async def test_an_inherited_fd_above_a_lowered_fd_limit_does_not_break_starts(
    tmp_path: Path,
) -> None:
    """Before: every binary start failed with EBADF, with fds to spare."""
    assert await supervise(tmp_path, "binary", 2) == {"failed": False}


@pytest.mark.parametrize("kind", ["binary", "function"])
async def test_running_out_of_fds_is_emfile_naming_the_limit_to_raise(
    tmp_path: Path, kind: str
) -> None:
    """Before: EBADF ("Bad file descriptor") for binaries; a bare EMFILE otherwise."""
    result = await supervise(tmp_path, kind, FD_LIMIT)
    assert result["errno"] == 24, result  # EMFILE
    error = result["error"]
    assert error.startswith(
        f"[Errno 24] Too many open files: this supervisor reached its limit of {FD_LIMIT} "
        "open fds (RLIMIT_NOFILE); raise it"
    ), error
    assert "ulimit -n" in error and "start fewer workers" in error, error
    # the workers started before the limit was reached (if any: it depends on
    # how many fds the loop and the start took first) are stopped and reaped
    assert (result["gone"], result["left"]) == (result["started"], []), result


# ------------------------------------------------------------- a full disk

NOISY = r"""
import sys
for i in range(100000):
    print(f"line {i} " + "x" * 100)
"""


def noisy() -> None:
    for i in range(100000):
        print(f"line {i} " + "x" * 100)


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs mounted for the test, unmounted whatever happens."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root and mount(8)")
    mnt = tmp_path / "disk"
    mnt.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
        timeout=LIMIT,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True, timeout=LIMIT)


@pytest.mark.parametrize("kind", ["binary", "function"])
async def test_a_full_disk_under_a_redirected_log_is_named_in_the_summary(
    full_disk: Path, kind: str
) -> None:
    """Before: the hint suggested @record; nothing said the disk was full."""
    entry: Any = sys.executable if kind == "binary" else noisy
    args = ("-c", NOISY) if kind == "binary" else ()
    with pytest.raises(ChildFailedError) as caught:
        await asyncio.wait_for(
            aioproc.run(
                entry,
                nprocs=1,
                args=args,
                name="noisy",
                logs_specs=DefaultLogsSpecs(log_dir=full_disk / "logs", redirects=Std.ALL),
            ),
            LIMIT,
        )
    summary = str(caught.value)
    failure = caught.value.failures[0]
    assert failure.exitcode == 1
    assert (
        f"  hint      : the disk holding {failure.stderr_log} is full (ENOSPC, 0 bytes free): "
        "the worker could not write its own log there"
    ) in summary, summary
    assert "@aioproc.record" not in summary
    if kind == "function":
        # the worker told the supervisor what failed; no half-written error file
        assert failure.error_file == "<N/A>"
        assert "OSError: [Errno 28] No space left on device" in summary, summary


class Counter(aioproc.Sink):
    """Counts the lines of each stream, and checks they come in order."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def lines(self, rank: int, stream: str, prefix: str, lines: list[str]) -> None:
        n = self.counts.get(stream, 0)
        for i, line in enumerate(lines, n):
            assert line.startswith(f"line {i} "), (i, line[:20])
        self.counts[stream] = n + len(lines)


async def test_a_full_disk_under_a_teed_log_costs_the_sinks_no_line(
    full_disk: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The worker writes into the tee's pipe, never to the disk: its log file
    stops at the disk's size, one warning names it, the sinks get every line
    and the worker succeeds."""
    counter = Counter()
    result = await asyncio.wait_for(
        aioproc.run(
            sys.executable,
            nprocs=1,
            args=("-c", NOISY),
            name="noisy",
            logs_specs=DefaultLogsSpecs(log_dir=full_disk / "logs", tee=Std.OUT),
            sinks=[counter],
        ),
        LIMIT,
    )
    assert result.return_values == {0: None}
    assert counter.counts == {"stdout": 100000}
    path = result.stdouts[0]
    with open(path) as f:
        kept = f.read()
    # the file holds the stream's start, as much as the disk took
    assert 0 < len(kept) <= 256 * 1024
    assert kept == "".join(f"line {i} " + "x" * 100 + "\n" for i in range(2500))[: len(kept)]
    warnings = [r.getMessage() for r in caplog.records if "could not write" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(f"could not write the stdout log of rank 0 to {path}: ")
    assert "No space left on device" in warnings[0]
