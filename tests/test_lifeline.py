"""The guardian: one per supervisor process, told of groups early, swept by token."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import child_pids
from proc_utils import Fifo, still_alive_after

import aioproc
from aioproc import _lifeline

CHILDREN = Path(__file__).parent / "children"
GRANDCHILD = str(CHILDREN / "grandchild.py")


def guardians() -> list[int]:
    """Guardian shells among this process's children."""
    found = []
    for pid in child_pids():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"aioproc-guardian" in argv:
            found.append(pid)
    return found


async def test_one_guardian_serves_every_group_and_leaves_with_the_last(tmp_path: Path) -> None:
    async with Fifo(tmp_path / "fifo") as fifo:
        groups = [
            await aioproc.start_processes(
                f"g{i}", sys.executable, {0: (GRANDCHILD, fifo.path, "wait")}, {0: {}}
            )
            for i in range(3)
        ]
        try:
            await fifo.pid_pairs(3)
            assert guardians() == [_lifeline.current_pid()]
            await groups[0].close(timeout=5)
            await groups[1].close(timeout=5)
            assert guardians() == [_lifeline.current_pid()]  # the third group still runs
        finally:
            for pc in groups:
                await pc.close(timeout=5)
    assert guardians() == []
    assert _lifeline.current_pid() is None


async def test_a_killed_guardian_is_replaced_and_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with Fifo(tmp_path / "fifo") as fifo:
        async with aioproc.start_processes(
            "g", sys.executable, {0: (GRANDCHILD, fifo.path, "wait")}, {0: {}}
        ) as pc:
            await fifo.pid_pairs(1)
            guardian = _lifeline._current
            assert guardian is not None
            first = guardian.popen.pid
            os.kill(first, signal.SIGKILL)
            # the replacement is started by a callback of this same future
            await asyncio.wait_for(asyncio.shield(guardian.watcher.future), 5)
            replacement = _lifeline.current_pid()
            assert replacement not in (None, first)
            # it stays up (and, once exec has completed, shows as a guardian)
            assert await still_alive_after([replacement], 0.5) == {replacement}
            assert guardians() == [replacement]
            assert f"guardian process (pid {first}) died" in caplog.text
            await pc.close(timeout=5)
    assert guardians() == []


SUPERVISOR = textwrap.dedent(
    """
    import asyncio, os, sys
    import aioproc
    from aioproc import _lifeline, _spawn

    fifo, grandchild, mode = sys.argv[1:4]

    if mode == "unregistered":
        # the supervisor dies in the window between exec and registration
        # (held as during the start, the guardian is never dismissed)
        _spawn._lifeline.register = lambda pgid: None
        _spawn._lifeline.register_from_thread = lambda pgid: None
        _spawn._lifeline.unhold = lambda: None

    async def main():
        pc = await aioproc.start_processes(
            "sup", sys.executable, {0: (grandchild, fifo, "wait")}, {0: {}}
        )
        print("started", flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main())
    """
)


@pytest.mark.parametrize("mode", ["registered", "unregistered"])
async def test_supervisor_sigkill_kills_worker_and_grandchild(tmp_path: Path, mode: str) -> None:
    """Also a worker the guardian was never told of: the token sweep finds it."""
    async with Fifo(tmp_path / "fifo") as fifo:
        sup = subprocess.Popen(
            [sys.executable, "-c", SUPERVISOR, fifo.path, GRANDCHILD, mode],
            stdout=subprocess.PIPE,
            env={**os.environ, "TMPDIR": str(tmp_path)},  # a SIGKILLed run keeps its logs
        )
        try:
            ((worker, grandchild),) = await fifo.pid_pairs(1)
            os.kill(sup.pid, signal.SIGKILL)
            sup.wait()
            assert await still_alive_after([worker, grandchild], 5) == set()
        finally:
            if sup.poll() is None:
                sup.kill()
                sup.wait()
            assert sup.stdout is not None
            sup.stdout.close()


TWICE = textwrap.dedent(
    """
    import asyncio, subprocess, sys
    from aioproc import _lifeline

    async def main():
        stranger = subprocess.Popen(["sleep", "1000"], start_new_session=True)
        kept = subprocess.Popen(["sleep", "1000"], start_new_session=True)
        # the spawning thread and then the loop both register a group
        _lifeline.register_from_thread(stranger.pid)
        _lifeline.register(stranger.pid)
        _lifeline.register(kept.pid)
        # the group is forgotten once, before its leader is reaped
        _lifeline.forget(stranger.pid)
        print(stranger.pid, kept.pid, flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main())
    """
)


async def test_a_group_registered_twice_is_forgotten_by_one_forget(tmp_path: Path) -> None:
    """The guardian lists each group once: after ``forget`` it never kills that
    group's id (by then it may belong to a stranger), even when the thread that
    forked the group and the loop both registered it."""
    sup = subprocess.Popen(
        [sys.executable, "-c", TWICE], stdout=subprocess.PIPE, text=True, env=os.environ
    )
    assert sup.stdout is not None
    stranger = kept = 0
    try:
        stranger, kept = map(int, sup.stdout.readline().split())
        os.kill(sup.pid, signal.SIGKILL)
        sup.wait()
        assert await still_alive_after([kept], 5) == set(), "a registered group survived"
        assert await still_alive_after([stranger], 0.5) == {stranger}, (
            "the guardian killed a group it had been told to forget"
        )
    finally:
        if sup.poll() is None:
            sup.kill()
            sup.wait()
        sup.stdout.close()
        for pid in (stranger, kept):
            if pid:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


TIDY = textwrap.dedent(
    """
    import asyncio, sys
    import aioproc
    from aioproc import DefaultLogsSpecs, Std

    async def main():
        exited = asyncio.Event()

        def on_event(event):
            if event.kind == "exited" and event.local_rank == 0:
                exited.set()

        # rank 0 prints a line and exits; rank 1 stays (console output: no dir)
        pc = await aioproc.start_processes(
            "tidy",
            sys.executable,
            {0: ("-c", "print('kept 0')"), 1: ("-c", "import time; time.sleep(3600)")},
            {r: {} for r in range(2)},
            DefaultLogsSpecs(redirects=REDIRECTS),
            on_event=on_event,
        )
        await exited.wait()
        print("ready", pc.logs_specs.root_log_dir, pc.stdouts[0] or "-", pc.pids()[1], flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main())
    """
)


async def sigkill_after_rank_0(tmp_path: Path, redirects: str) -> tuple[Path, str]:
    """Run TIDY with ``redirects`` in TMPDIR=tmp_path and SIGKILL it once rank 0 has
    exited; return its temp root and rank 0's stdout file once rank 1 and the
    supervisor's guardian are gone."""
    sup = subprocess.Popen(
        [sys.executable, "-c", TIDY.replace("REDIRECTS", redirects)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    assert sup.stdout is not None
    try:
        # rank 0's line comes first when its output stays on the console
        line = next(line for line in sup.stdout if line.startswith("ready "))
        root, stdout_log, rank1 = line.split()[1:]
        assert Path(root).is_dir()
        guards = [p for p in all_pids() if guardian_of(p, sup.pid)]
        assert len(guards) == 1, guards
        os.kill(sup.pid, signal.SIGKILL)
        sup.wait()
        # the guardian prunes after its kill sweeps (~1.5 s), then exits
        assert await still_alive_after([int(rank1), *guards], 10) == set()
    finally:
        if sup.poll() is None:
            sup.kill()
            sup.wait()
        sup.stdout.close()
    return Path(root), stdout_log


async def test_a_sigkilled_supervisors_temp_log_dir_keeps_only_what_was_written(
    tmp_path: Path,
) -> None:
    """The guardian prunes the group's private temp dir as close() would: the
    stdout.log with content and its dirs stay, every empty file and dir goes."""
    root, stdout_log = await sigkill_after_rank_0(tmp_path, "{0: Std.ALL, 1: Std.NONE}")
    assert Path(stdout_log).read_text() == "kept 0\n"
    rank0 = Path(stdout_log).parent
    kept = [p for p in [*rank0.parents, rank0, Path(stdout_log)] if tmp_path in p.parents]
    assert sorted(tmp_path.rglob("*")) == sorted(kept)
    assert root in kept


async def test_a_sigkilled_supervisors_empty_temp_log_dir_is_removed(tmp_path: Path) -> None:
    root, stdout_log = await sigkill_after_rank_0(tmp_path, "Std.NONE")
    assert stdout_log == "-"  # rank 0's output went to the console
    assert not root.exists()
    assert list(tmp_path.iterdir()) == []


def cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def guardian_of(pid: int, supervisor: int) -> bool:
    """The guardian shell of ``supervisor``: its token starts with the supervisor's pid."""
    argv = cmdline(pid).split(b"\0")
    return b"aioproc-guardian" in argv and any(
        a.startswith(f"{supervisor}-".encode()) for a in argv
    )
