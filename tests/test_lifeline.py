"""The guardian: one per supervisor process, told of groups early, swept by token."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from helpers import child_pids, cmdline, parent_of, state
from proc_utils import Fifo, still_alive_after

import aioproc
from aioproc._proc import lifeline as _lifeline

CHILDREN = Path(__file__).parent / "children"
GRANDCHILD = str(CHILDREN / "grandchild.py")


def is_guardian(pid: int) -> bool:
    """Whether ``pid`` is a guardian shell: ``ps`` shows ``aioproc-guardian <pid>``."""
    return cmdline(pid).startswith(b"aioproc-guardian ")


def guardians() -> list[int]:
    """Guardian shells among this process's children."""
    found = []
    for pid in child_pids():
        if is_guardian(pid):
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
    from aioproc._proc import lifeline as _lifeline, spawn as _spawn

    fifo, grandchild, mode = sys.argv[1:4]

    if mode == "unregistered":
        # the supervisor dies in the window between exec and registration
        # (held as during the start, the guardian is never dismissed)
        _spawn._lifeline.register = lambda pgid: None
        _spawn._lifeline.register_from_thread = lambda pgid: None
        _spawn._lifeline.unhold = lambda: None

    async def main():
        worker_mode = "setsid" if mode == "setsid" else "wait"
        pc = await aioproc.start_processes(
            "sup", sys.executable, {0: (grandchild, fifo, worker_mode)}, {0: {}}
        )
        print("started", flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main())
    """
)


@pytest.mark.parametrize("mode", ["registered", "unregistered", "setsid"])
async def test_supervisor_sigkill_kills_worker_and_grandchild(tmp_path: Path, mode: str) -> None:
    """Also a worker the guardian was never told of (unregistered), and a
    grandchild in a session of its own (setsid), out of reach of every group
    signal: the token sweep finds them by the token in their environment."""
    async with Fifo(tmp_path / "fifo") as fifo:
        sup = subprocess.Popen(
            [sys.executable, "-c", SUPERVISOR, fifo.path, GRANDCHILD, mode],
            stdout=subprocess.PIPE,
            env={**os.environ, "TMPDIR": str(tmp_path)},  # a SIGKILLed run keeps its logs
        )
        left: set[int] = set()
        try:
            ((worker, grandchild),) = await fifo.pid_pairs(1)
            if mode == "setsid":
                assert os.getsid(grandchild) == grandchild != os.getpgid(worker)
            os.kill(sup.pid, signal.SIGKILL)
            sup.wait()
            left = await still_alive_after([worker, grandchild], 5)
            assert left == set()
        finally:
            if sup.poll() is None:
                sup.kill()
                sup.wait()
            assert sup.stdout is not None
            sup.stdout.close()
            for pid in left:  # the test started them, and they outlived the sweep
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


TWICE = textwrap.dedent(
    """
    import asyncio, subprocess, sys
    from aioproc._proc import lifeline as _lifeline

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


def all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def guardian_of(pid: int, supervisor: int) -> bool:
    """The guardian shell of ``supervisor``: its title names it."""
    return cmdline(pid) == f"aioproc-guardian {supervisor}\0".encode()


# ------------------------------------------------------------------ fences


async def test_a_fence_kills_its_groups_when_its_deadline_passes_with_the_loop_wedged(
    tmp_path: Path,
) -> None:
    """Only the fence's groups die, by the guardian's hand: this loop is blocked."""
    fence = _lifeline.Fence()
    groups: list[aioproc.PContext] = []
    try:
        async with Fifo(tmp_path / "fifo") as fifo:
            with fence.scope():
                groups.append(
                    await aioproc.start_processes(
                        "fenced", sys.executable, {0: (GRANDCHILD, fifo.path, "wait")}, {0: {}}
                    )
                )
            groups.append(
                await aioproc.start_processes(
                    "free", sys.executable, {0: (GRANDCHILD, fifo.path, "wait")}, {0: {}}
                )
            )
            pairs = dict(await fifo.pid_pairs(2))
            fenced_pid, free_pid = groups[0].pids()[0], groups[1].pids()[0]
            fence.renew(time.monotonic() + 0.3)
            time.sleep(1.5)  # a wedged loop: nothing here can stop anything
            assert await still_alive_after([fenced_pid, pairs[fenced_pid]], 0) == set()
            assert await still_alive_after([free_pid, pairs[free_pid]], 0) == {
                free_pid,
                pairs[free_pid],
            }
            result = await groups[0].wait(timeout=5)
            assert result is not None
            assert result.failures[0].signal_name() == "SIGKILL"
            assert await groups[1].wait(timeout=0.1) is None
    finally:
        fence.close()
        for pc in groups:
            await pc.close(timeout=5)


async def test_a_renewed_fence_kills_nothing_and_a_closed_one_is_disarmed(tmp_path: Path) -> None:
    fence = _lifeline.Fence()
    pc = None
    try:
        async with Fifo(tmp_path / "fifo") as fifo:
            with fence.scope():
                pc = await aioproc.start_processes(
                    "fenced", sys.executable, {0: (GRANDCHILD, fifo.path, "wait")}, {0: {}}
                )
            ((worker, grandchild),) = await fifo.pid_pairs(1)
            for _ in range(10):  # renewed well within the deadline, ten times
                fence.renew(time.monotonic() + 0.4)
                await asyncio.sleep(0.1)
            fence.close()
            time.sleep(0.8)  # past the last deadline, the loop blocked again
            assert await still_alive_after([worker, grandchild], 0) == {worker, grandchild}
            assert await pc.wait(timeout=0.1) is None
    finally:
        fence.close()
        if pc is not None:
            await pc.close(timeout=5)


async def test_the_lifeline_token_is_in_no_argv_and_not_in_the_guardians_environment(
    tmp_path: Path,
) -> None:
    """The token lets a process be swept: other users must not read it in /proc."""
    async with Fifo(tmp_path / "fifo") as fifo:
        async with aioproc.start_processes(
            "g", sys.executable, {0: (GRANDCHILD, fifo.path, "wait")}, {0: {}}
        ) as pc:
            await fifo.pid_pairs(1)
            guardian = _lifeline.current_pid()
            assert guardian is not None
            token = _lifeline.token().encode()
            assert token not in cmdline(guardian)
            with open(f"/proc/{guardian}/environ", "rb") as f:
                assert token not in f.read()
            assert token not in cmdline(pc.pids()[0])
            await pc.close(timeout=5)


def _lineage_holders(supervisor: int) -> set[int]:
    """Processes whose lifeline chain names ``supervisor``'s token (any depth)."""
    found = set()
    mark = f"{supervisor}-".encode()
    for pid in all_pids():
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        for entry in env:
            if entry.startswith(b"AIOPROC_LIFELINE="):
                chain = entry.split(b"=", 1)[1].split(b":")
                if any(t.startswith(mark) for t in chain):
                    found.add(pid)
    return found


def _guardians_in(root: Path) -> set[int]:
    """Guardians working in a directory under ``root`` (they keep their supervisor's)."""
    found = set()
    for pid in all_pids():
        if not is_guardian(pid):
            continue
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            continue
        if cwd == str(root) or cwd.startswith(str(root) + os.sep):
            found.add(pid)
    return found


def _empties(root: Path) -> list[str]:
    return [
        str(p)
        for p in sorted(root.rglob("*"))
        if (p.is_dir() and not any(p.iterdir())) or (p.is_file() and p.stat().st_size == 0)
    ]


NESTED = str(CHILDREN / "nested_supervisor.py")


@pytest.mark.timeout(120)
async def test_nested_supervisors_sigkilled_at_random_moments_leave_nothing(
    tmp_path: Path,
) -> None:
    """An outer supervisor whose worker supervises two workers of its own, SIGKILLed
    at random moments of its life: every process below it dies, whichever guardian
    acts first, and both levels' temp log dirs keep only what has content."""
    import random

    uvloop = "uvloop" in type(asyncio.get_running_loop()).__module__
    rng = random.Random(os.getpid())
    rounds, per_round = 2, 6
    async with Fifo(tmp_path / "fifo") as fifo:
        for r in range(rounds):
            sups = []
            try:
                for i in range(per_round):
                    tmp = tmp_path / f"t{r}-{i}"
                    tmp.mkdir()
                    env = {**os.environ, "TMPDIR": str(tmp)}
                    env["AIOPROC_LOOP"] = "uvloop" if uvloop else "asyncio"
                    sups.append(
                        subprocess.Popen(
                            [sys.executable, NESTED, "outer", GRANDCHILD, fifo.path],
                            env=env,
                            cwd=tmp,  # how this test tells their guardians from others'
                        )
                    )
                # from before the inner supervisor exists to well after its workers run
                for sup in sorted(sups, key=lambda _: rng.random()):
                    await asyncio.sleep(rng.uniform(0.0, 0.35))
                    os.kill(sup.pid, signal.SIGKILL)
                for sup in sups:
                    sup.wait()
                deadline = time.monotonic() + 10
                while True:
                    left = set().union(*(_lineage_holders(s.pid) for s in sups))
                    orphans = _guardians_in(tmp_path)
                    if not left and not orphans:
                        break
                    assert time.monotonic() < deadline, (left, orphans)
                    await asyncio.sleep(0.05)  # the guardians' sweeps run for ~1.5 s
            finally:
                for sup in sups:
                    if sup.poll() is None:
                        sup.kill()
                        sup.wait()
        assert [e for t in tmp_path.glob("t*") for e in _empties(t)] == []


def supervisor_env(tmp_path: Path) -> dict[str, str]:
    """A child supervisor's environment: its temp dirs under ``tmp_path``, and
    ``AIOPROC_LOOP`` naming this test's loop, which the supervisor runs too."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    if "uvloop" in type(asyncio.get_running_loop()).__module__:
        env["AIOPROC_LOOP"] = "uvloop"
    return env


async def test_an_outer_sweep_alone_reaches_the_workers_of_a_nested_supervisor(
    tmp_path: Path,
) -> None:
    """The inner guardian cannot act (stopped): the outer one's sweep still finds the
    inner workers and their children, and the inner guardian, continued, tidies up."""
    env = supervisor_env(tmp_path)
    inner_guardian = 0
    async with Fifo(tmp_path / "fifo") as fifo:
        sup = subprocess.Popen(
            [sys.executable, NESTED, "outer", GRANDCHILD, fifo.path], env=env, cwd=tmp_path
        )
        try:
            pairs = await fifo.pid_pairs(2)
            inner = {ppid(w) for w, _ in pairs}
            assert len(inner) == 1
            (inner_guardian,) = (g for g in _guardians_in(tmp_path) if ppid(g) in inner)
            (outer_guardian,) = (g for g in _guardians_in(tmp_path) if ppid(g) == sup.pid)
            os.kill(inner_guardian, signal.SIGSTOP)
            os.kill(sup.pid, signal.SIGKILL)
            sup.wait()
            everyone = [pid for pair in pairs for pid in pair] + list(inner)
            assert await still_alive_after(everyone, 5) == set()
            os.kill(inner_guardian, signal.SIGCONT)
            # both guardians prune their temp dirs after their sweeps, then exit
            assert await still_alive_after([inner_guardian, outer_guardian], 5) == set()
        finally:
            if sup.poll() is None:
                sup.kill()
                sup.wait()
            if inner_guardian:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(inner_guardian, signal.SIGKILL)
                    os.kill(inner_guardian, signal.SIGCONT)
    assert [e for e in _empties(tmp_path) if "aioproc_" in e] == []


EOF_SUPERVISOR = textwrap.dedent(
    """
    import asyncio, os, sys
    sys.path.insert(0, sys.argv[2])
    import aioproc
    import fork_funcs

    async def main():
        async with aioproc.open_pool(2) as pool:
            pids = await pool.run(os.getpid)
            pc = await aioproc.start_processes(
                "busy", fork_funcs.say_running_then_sleep, {0: (sys.argv[1], 1.0)}, {0: {}}
            )
            print(*pids, flush=True)
            await asyncio.sleep(3600)

    if os.environ.get("AIOPROC_LOOP") == "uvloop":
        import uvloop
        uvloop.run(main())
    else:
        asyncio.run(main())
    """
)


async def test_function_workers_exit_on_their_channels_eof_with_the_guardian_stopped(
    tmp_path: Path,
) -> None:
    """The supervisor is SIGKILLed while its guardian cannot act (stopped): idle
    pool workers exit as their control channel reaches EOF, and a group's
    function worker as soon as its function returns, before anyone sweeps."""
    env = supervisor_env(tmp_path)
    guardian = 0
    async with Fifo(tmp_path / "fifo") as fifo:
        sup = subprocess.Popen(
            [sys.executable, "-c", EOF_SUPERVISOR, fifo.path, str(CHILDREN)],
            stdout=subprocess.PIPE,
            env=env,
            cwd=tmp_path,
        )
        assert sup.stdout is not None
        try:
            (line,) = await fifo.lines(1)
            busy = int(line.split()[1])
            idle = [int(p) for p in (await asyncio.to_thread(sup.stdout.readline)).split()]
            assert len(idle) == 2
            (guardian,) = (g for g in _guardians_in(tmp_path) if parent_of(g) == sup.pid)
            os.kill(guardian, signal.SIGSTOP)
            os.kill(sup.pid, signal.SIGKILL)
            sup.wait()
            assert await still_alive_after([*idle, busy], 5) == set()
            assert state(guardian) == "T"  # stopped all along: nobody swept them
            os.kill(guardian, signal.SIGCONT)
            assert await still_alive_after([guardian], 5) == set()
        finally:
            if sup.poll() is None:
                sup.kill()
                sup.wait()
            sup.stdout.close()
            if guardian:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(guardian, signal.SIGCONT)


def ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as f:
        return int(f.read().rsplit(b")", 1)[1].split()[1])


async def test_a_stopped_guardian_never_blocks_the_loop_and_is_replaced(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Enough registrations to fill the pipe of a guardian that does not read
    (SIGSTOP): the loop goes on, and a replacement knows every group."""
    async with Fifo(tmp_path / "fifo") as fifo:
        async with aioproc.start_processes(
            "g", sys.executable, {0: (GRANDCHILD, fifo.path, "wait")}, {0: {}}
        ) as pc:
            ((worker, grandchild),) = await fifo.pid_pairs(1)
            stopped = _lifeline.current_pid()
            assert stopped is not None
            os.kill(stopped, signal.SIGSTOP)
            try:
                other = subprocess.Popen(["sleep", "1000"], start_new_session=True)
                try:
                    for _ in range(10_000):  # ~140 KB of lines: over a pipe's 64 KiB
                        _lifeline.register(other.pid)
                        _lifeline.forget(other.pid)
                finally:
                    other.kill()
                    other.wait()
                assert await still_alive_after([stopped], 5) == set()
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(stopped, signal.SIGCONT)
            assert f"guardian process (pid {stopped}) does not read its pipe" in caplog.text
            replacement = _lifeline.current_pid()
            assert replacement not in (None, stopped)
            assert _lifeline.registered_groups() == {worker}
            assert await pc.wait(timeout=0.1) is None
            await pc.close(timeout=5)
    assert await still_alive_after([worker, grandchild], 5) == set()
