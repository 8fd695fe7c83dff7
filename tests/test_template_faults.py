"""The forkserver template under faults: killed mid-fork, stopped, dead under a pool.

The template is the process most likely to die (it holds the preloaded
modules: the OOM killer's favourite) or to stall (swapping).  Whatever
happens to it, no worker it forked may run unsupervised: every worker is
either adopted by its group or killed and reaped before the start returns.
Survivors are found by the lifeline token every process forked for this
supervisor carries in its ``/proc/<pid>/environ``, zombies among this
process's children.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import CHILDREN_DIR, child_pids, loop_name, state
from proc_utils import still_alive_after

from aioproc import open_forkserver, open_pool, run, start_processes
from aioproc._func import template as _template
from aioproc._proc import lifeline as _lifeline

sys.path.insert(0, CHILDREN_DIR)
import fork_fault_funcs

SEED = int(os.environ.get("AIOPROC_FAULT_SEED", random.randrange(1 << 30)))
NPROCS = 64
KILLS = 10
"""Template kills per loop here; ``benchmarks/soak_faults.py`` does hundreds."""


def token_holders() -> set[int]:
    """Live processes whose exec environment carries this process's lifeline token.

    A forked worker's ``/proc/<pid>/environ`` is the template's, which
    carries it; so does every worker's own environment.
    """
    token = _lifeline.token().encode()
    found = set()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        for entry in env:
            key, _, value = entry.partition(b"=")
            if key == _lifeline.TOKEN_VAR.encode() and token in value.split(b":"):
                found.add(int(name))
    return found


async def survivors() -> set[int]:
    """Token holders still running after up to 5 s (killed ones take a moment to die)."""
    return await still_alive_after(sorted(token_holders()), 5) | token_holders()


def describe(pids: set[int]) -> str:
    out = []
    for pid in sorted(pids):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")[:60]
        except OSError:
            cmd = "?"
        out.append(f"{pid} [{state(pid) or 'gone'}] {cmd}")
    return ", ".join(out)


def kill_and_reap(pids: set[int]) -> None:
    """Clean up after a failed check, so the leak check reports the cause once."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pid in pids & child_pids():
        os.waitpid(pid, 0)


def reported(report: Path) -> set[int]:
    """Pids of the workers that ran the user's function."""
    if not report.exists():
        return set()
    return {int(line.split()[0]) for line in report.read_text().splitlines()}


async def test_template_killed_mid_fork_leaves_no_worker_nor_zombie(tmp_path: Path) -> None:
    """SIGKILL the template at random moments of a 64-worker fork: the start fails
    with a clear error (or succeeds, if all were forked), and once the group is
    closed no worker runs and none is left unreaped."""
    rng = random.Random(f"{SEED}-{loop_name()}")
    before = child_pids()
    problems: list[str] = []
    outcomes: dict[str, int] = {}
    for i in range(KILLS):
        report = tmp_path / f"report-{i}"
        count = 0
        kth = asyncio.Event()
        k = rng.randrange(NPROCS)

        def on_event(ev: Any, k: int = k, kth: asyncio.Event = kth) -> None:
            nonlocal count
            if ev.kind == "started":
                count += 1
                if count > k:
                    kth.set()

        server = await open_forkserver(["json"])
        whole_group = rng.random() < 0.5  # else the template alone, as the OOM killer does

        async def kill(
            pid: int = server.pid, whole_group: bool = whole_group, kth: asyncio.Event = kth
        ) -> None:
            if rng.random() < 0.5:
                await asyncio.sleep(rng.uniform(0, 0.4))
            else:
                await kth.wait()
                for _ in range(rng.randrange(4)):
                    await asyncio.sleep(0)
            if whole_group:
                os.killpg(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)

        killer = asyncio.ensure_future(kill())
        try:
            pc = await start_processes(
                "fork64",
                fork_fault_funcs.report_and_block,
                {r: (str(report),) for r in range(NPROCS)},
                {r: {} for r in range(NPROCS)},
                start_method="forkserver",
                preload=["json"],
                on_event=on_event,
            )
        except RuntimeError as e:
            outcomes["lost"] = outcomes.get("lost", 0) + 1
            expected = f"forkserver template (pid {server.pid}) failed while forking"
            if not isinstance(e, _template.TemplateLost) or expected not in str(e):
                problems.append(f"#{i}: unexpected {e!r}")
        else:
            outcomes["started"] = outcomes.get("started", 0) + 1
            await pc.close(signal.SIGKILL, 0)
        finally:
            await asyncio.wait({killer})
            await server.aclose()
        alive = await survivors()
        left = child_pids() - before
        if alive or left:
            problems.append(
                f"#{i}: running {describe(alive)}; unreaped {describe(left)}; "
                f"{len(reported(report))} ran the function"
            )
            kill_and_reap(alive | left)
    assert problems == [], f"seed {SEED}, {outcomes}:\n" + "\n".join(problems)


_DIE_NAMED = (
    "import os, sys\n"
    "fd = os.open('/proc/self/comm', os.O_WRONLY)\n"
    "os.write(fd, sys.argv[1].encode())\n"
    "os.setsid()\n"
    "os._exit(0)\n"
)
"""A child that takes the name in ``argv[1]``, makes a session of its own and exits."""


async def test_a_fork_killed_as_it_made_its_own_session_is_still_swept() -> None:
    """A kill of the template's group can catch a fork just as it makes a session of
    its own: it dies a zombie whose session and environment no longer name the
    template.  The sweep after the template's death finds it by the process name
    the template gave it (what ``ps`` shows) and reaps it; a dead child of ours
    with another name is left to whoever started it."""
    before = child_pids()
    server = await open_forkserver(["json"])
    spawned: list[int] = []
    try:
        template = server._template
        assert template is not None
        with open(f"/proc/{server.pid}/comm", "rb") as f:
            name = f.read().rstrip(b"\n")
        assert name.startswith(b"aioproc-"), name
        for argv1 in (name.decode(), "not-a-fork"):
            argv = [sys.executable, "-c", _DIE_NAMED, argv1]
            spawned.append(os.posix_spawn(sys.executable, argv, dict(os.environ)))
        fork, other = spawned
        os.kill(server.pid, signal.SIGKILL)
        for pid in (fork, other, server.pid):  # dead, not reaped
            await asyncio.to_thread(os.waitid, os.P_PID, pid, os.WEXITED | os.WNOWAIT)
        assert (state(fork), state(other)) == ("Z", "Z")
        assert await asyncio.to_thread(template._sweep) == 1
        assert state(fork) == "", "the fork was not reaped"
        assert state(other) == "Z", "a child that is no fork of the template was reaped"
    finally:
        for pid in spawned:
            if pid in child_pids():
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
        await server.aclose()
    assert child_pids() - before == set()


async def test_a_stopped_template_and_a_cancelled_start(tmp_path: Path) -> None:
    """A template that does not answer (stopped): a start cancelled after 2 s returns
    at once, not after the fork timeout, and the template was given up: killed,
    it forks nothing when continued."""
    report = tmp_path / "report"
    before = child_pids()
    async with open_forkserver(["json"]) as server:
        os.kill(server.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(
                    start_processes(
                        "stopped",
                        fork_fault_funcs.report_and_block,
                        {r: (str(report),) for r in range(4)},
                        {r: {} for r in range(4)},
                        start_method="forkserver",
                        preload=["json"],
                    ),
                    2,
                )
            took = time.monotonic() - t0
        finally:
            os.kill(server.pid, signal.SIGCONT)
        assert took < 3, f"the cancelled start took {took:.1f} s"
        assert state(server.pid) == "Z"  # killed: it will fork nothing more
        assert await survivors() == set()
        # the template is reaped when its lease is given back; the guardian knows it till then
        assert child_pids() - before == {server.pid, _lifeline.current_pid()}
    assert child_pids() - before == set()
    assert reported(report) == set()  # no worker ran the function


async def test_a_stopped_template_times_out_and_is_killed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a deadline of the caller's, the fork timeout gives the template up:
    the start fails naming it, and nothing it forked is left."""
    monkeypatch.setattr(_template, "FORK_TIMEOUT", 1.0)
    report = tmp_path / "report"
    before = child_pids()
    async with open_forkserver(["json"]) as server:
        os.kill(server.pid, signal.SIGSTOP)
        try:
            with pytest.raises(_template.TemplateLost) as info:
                await start_processes(
                    "stopped",
                    fork_fault_funcs.report_and_block,
                    {r: (str(report),) for r in range(4)},
                    {r: {} for r in range(4)},
                    start_method="forkserver",
                    preload=["json"],
                )
        finally:
            os.kill(server.pid, signal.SIGCONT)
        assert str(info.value).startswith(
            f"forkserver template (pid {server.pid}) failed while forking workers "
            "(it did not answer within 1 s); it was killed"
        )
        assert state(server.pid) == "Z"
        assert await survivors() == set()
    assert child_pids() - before == set()
    assert reported(report) == set()


async def test_groups_starting_when_their_template_dies_start_on_a_new_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Two groups' starts are under way (sent, or queued) when the template they share
    is SIGKILLed: both start every rank on a fresh template, each rank's function runs
    once, and the dead template left nothing."""
    n = 8
    before = child_pids()
    async with open_forkserver(["json"]) as server:
        os.kill(server.pid, signal.SIGSTOP)  # answers nothing: the requests wait
        starts = [
            asyncio.ensure_future(
                start_processes(
                    name,
                    fork_fault_funcs.ident,
                    {r: (r,) for r in range(n)},
                    {r: {} for r in range(n)},
                    start_method="forkserver",
                    preload=["json"],
                )
            )
            for name in ("first", "second")
        ]
        # some requests are sent by now, the others queued: either kind is tried again
        await asyncio.sleep(0.2)
        assert not any(start.done() for start in starts)
        os.kill(server.pid, signal.SIGKILL)
        groups = await asyncio.wait_for(asyncio.gather(*starts), 30)
        for pc in groups:
            async with pc:
                result = await asyncio.wait_for(pc.wait(), 30)
            assert result is not None and not result.is_failed(), result
            values = result.return_values
            # each rank's function ran once, in the worker of that rank
            assert [x for x, _, _ in values.values()] == list(range(n))
            assert {pid for _, pid, _ in values.values()} == set(pc.pids().values())
            assert {ppid for _, _, ppid in values.values()} == {os.getpid()}
    lost = [r.getMessage() for r in caplog.records if "tried once more" in r.getMessage()]
    assert len(lost) == 1, lost  # once for the dead template, not once per worker
    assert lost[0].startswith(f"forkserver template (pid {server.pid}) failed while forking")
    assert await survivors() == set()
    assert child_pids() - before == set()


async def test_a_start_whose_second_template_dies_too_raises_naming_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The template is SIGKILLed with the start's requests unanswered, and so
    is the fresh one its retry takes: the start raises, naming the second,
    and neither template left a worker or a zombie behind."""
    n = 4
    before = child_pids()
    fresh: list[int] = []
    acquire = _template.acquire

    async with open_forkserver(["json"]) as server:

        async def acquire_and_kill(*args: Any, **kwargs: Any) -> _template.Template:
            template = await acquire(*args, **kwargs)
            if template.pid != server.pid and not fresh:
                # the retry's template: killed before its first fork
                fresh.append(template.pid)
                os.kill(template.pid, signal.SIGKILL)
            return template

        monkeypatch.setattr(_template, "acquire", acquire_and_kill)
        os.kill(server.pid, signal.SIGSTOP)  # answers nothing: the requests wait
        start = asyncio.ensure_future(
            start_processes(
                "twice",
                fork_fault_funcs.ident,
                {r: (r,) for r in range(n)},
                {r: {} for r in range(n)},
                start_method="forkserver",
                preload=["json"],
            )
        )
        await asyncio.sleep(0.2)
        assert not start.done()
        os.kill(server.pid, signal.SIGKILL)
        with pytest.raises(RuntimeError) as raised:
            await asyncio.wait_for(start, 30)
    assert len(fresh) == 1
    assert f"pid {fresh[0]}" in str(raised.value)
    assert await survivors() == set()
    assert child_pids() - before == set()


async def test_a_forkserver_pool_takes_a_fresh_template_when_its_own_died() -> None:
    """Every call after the template was SIGKILLed succeeds, on workers forked
    from a new template (the one another group started, if there is one)."""
    async with open_pool(
        2, start_method="forkserver", preload=["json"], max_calls_per_worker=1
    ) as pool:
        key = (os.getpid(), ("json",))
        first = _template._templates[key].pid
        os.kill(first, signal.SIGKILL)
        results = [await pool.submit(fork_fault_funcs.ident, i) for i in range(3)]
        assert [x for x, _, _ in results] == [0, 1, 2]
        assert all(ppid == os.getpid() for _, _, ppid in results)
        # A start that raced the kill (the template not dead yet when it was
        # sent) was forked by a template its retry took for itself alone; the
        # pool takes a live one for good at its next start at the latest.
        await pool._supply.live_template()
        assert pool._supply.template is _template._templates[key]
        second = _template._templates[key].pid
        assert second != first
        # killed again, and another group starts a fresh one: the pool shares it
        os.kill(second, signal.SIGKILL)
        assert await still_alive_after([second], 5) == set()
        async with open_forkserver(["json"]) as other:
            results += await pool.run(fork_fault_funcs.ident, (3,))
            results += [await pool.submit(fork_fault_funcs.ident, 4)]
            assert _template._templates[key] is other._template
        assert [x for x, _, _ in results] == [0, 1, 2, 3, 3, 4]
    assert _template._templates == {}


async def test_a_child_of_a_preloaded_module_dies_with_the_template(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "spawned"
    monkeypatch.setenv("AIOPROC_TEST_SPAWN_LOG", str(log))
    async with open_forkserver(["fork_spawner_mod"]) as server:
        (helper,) = map(int, log.read_text().split())
        with open(f"/proc/{helper}/stat", "rb") as f:
            pgid = int(f.read().rsplit(b")", 1)[1].split()[2])
        assert pgid == server.pid  # in the template's group, not a child of ours
    try:
        assert await still_alive_after([helper], 5) == set()
    finally:
        kill_and_reap({helper})


THREAD_VARS = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "BLIS_NUM_THREADS",
    "NUMEXPR_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
)


async def test_thread_pools_are_one_thread_while_preloading_unless_set(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """As torchrun does for its workers: a preloaded numpy or torch starts no
    thread pool in the template (it would make it unsafe to fork).  What the
    user set is kept, and the workers' own environment is what they were given."""
    for var in THREAD_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MKL_NUM_THREADS", "3")
    monkeypatch.setattr(_template, "_thread_vars_logged", set())
    caplog.set_level(logging.INFO, "aioproc")
    result = await run(
        fork_fault_funcs.thread_vars,
        2,
        ("fork_threads_mod",),
        start_method="forkserver",
        preload=["fork_threads_mod"],
    )
    for seen, own in result.return_values.values():
        assert seen == {var: "3" if var == "MKL_NUM_THREADS" else "1" for var in THREAD_VARS}
        assert own == {var: "3" if var == "MKL_NUM_THREADS" else None for var in THREAD_VARS}
    unset = ", ".join(v for v in THREAD_VARS if v != "MKL_NUM_THREADS")
    assert [r.getMessage() for r in caplog.records if r.name == "aioproc"] == [
        f"forkserver template: {unset} set to 1 while preloading ['fork_threads_mod'], as "
        "torchrun does for its workers (set them to choose): forked workers start with one "
        "thread per native thread pool"
    ]
