"""start_method="forkserver": workers forked from a preloaded template process.

Every promise of spawned workers is checked for forked ones, mostly by
running the same group both ways and comparing what the user sees.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from helpers import CHILDREN_DIR, REPO_ROOT, child_pids, loop_name, pid_gone
from proc_utils import Fifo, still_alive_after

from aioproc import (
    ChildFailedError,
    DefaultLogsSpecs,
    LocalElasticAgent,
    Std,
    WorkerSpec,
    open_forkserver,
    open_pool,
    open_worker,
    run,
    start_processes,
)
from aioproc._func import template as _template

sys.path.insert(0, CHILDREN_DIR)
sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))
import fork_funcs
from fault_worker import MARK_VAR
from soak_cancel import clean_up, describe, reported_pids, survivors

METHODS = ["spawn", "forkserver"]
SEED = int(os.environ.get("AIOPROC_FAULT_SEED", random.randrange(1 << 30)))


def no_template_left() -> None:
    assert _template._templates == {}


def collapse_supported() -> bool:
    """Whether this kernel has MADV_COLLAPSE (6.1+) and transparent huge pages on."""
    release = tuple(int(x) for x in re.findall(r"\d+", os.uname().release)[:2])
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            enabled = f.read()
    except OSError:
        return False
    return release >= (6, 1) and "[never]" not in enabled


def anon_huge_bytes(pid: int) -> int:
    """How much of ``pid``'s anonymous memory is mapped in transparent huge pages."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
    return 0


@pytest.mark.parametrize("method", METHODS)
async def test_results_and_session_of_forked_workers(method: str) -> None:
    result = await run(fork_funcs.ident, 4, {r: (r,) for r in range(4)}, start_method=method)
    for rank, (x, pid, ppid, sid, pgid) in result.return_values.items():
        assert x == rank
        assert ppid == os.getpid()  # the supervisor's own child, forked or spawned
        assert sid == pgid == pid  # leads a session and a group of its own
    no_template_left()


async def test_forked_workers_have_the_name_of_spawned_ones() -> None:
    """``ps`` shows a forked worker under the interpreter's name, as a spawned one;
    the template, while it runs, under a name of its own."""
    names = {}
    for method in METHODS:
        result = await run(fork_funcs.process_name, 2, (), start_method=method)
        names[method] = set(result.return_values.values())
    assert names["spawn"] == names["forkserver"] == {os.path.basename(sys.executable)[:15]}
    async with open_forkserver([]) as server:
        with open(f"/proc/{server.pid}/comm") as f:
            assert re.fullmatch(r"aioproc-[0-9a-f]{7}", f.read().rstrip("\n"))


async def test_a_preload_that_names_the_process_names_the_workers_not_the_template() -> None:
    """A preloaded module that names its process (as ``setproctitle`` does) names the
    workers forked after it, as a fork of that process would be named; the template
    keeps the name its abandoned forks are found by."""
    async with open_forkserver(["fork_rename_mod"]) as server:
        with open(f"/proc/{server.pid}/comm") as f:
            assert re.fullmatch(r"aioproc-[0-9a-f]{7}", f.read().rstrip("\n"))
        result = await run(
            fork_funcs.process_name,
            2,
            (),
            start_method="forkserver",
            preload=["fork_rename_mod"],
        )
    assert set(result.return_values.values()) == {"renamed-by-mod"}


async def test_exceptions_equal_spawned_ones() -> None:
    errors = []
    for method in METHODS:
        with pytest.raises(ChildFailedError) as info:
            await run(fork_funcs.fail, 1, ("bad value 7",), start_method=method)
        shutil.rmtree(os.path.dirname(info.value.log_dir))  # the failed run's kept logs
        cause = info.value.__cause__
        assert type(cause) is ValueError
        errors.append((str(cause), info.value.failures[0].exitcode))
        assert "fail" in str(cause.__cause__)  # the worker's traceback text
    assert errors[0] == errors[1] == ("bad value 7", 1)


@pytest.mark.parametrize("method", METHODS)
async def test_exit_codes_and_signals_are_relayed_truly(method: str) -> None:
    async with start_processes(
        "codes",
        fork_funcs.exit_with,
        {0: (3,), 1: (0,)},
        {0: {}, 1: {}},
        start_method=method,
    ) as pc:
        result = await pc.wait()
    assert result is not None and result.failures[0].exitcode == 3
    async with start_processes(
        "sig", fork_funcs.kill_self, {0: ()}, {0: {}}, start_method=method
    ) as pc:
        result = await pc.wait()
    assert result is not None
    assert result.failures[0].exitcode == -signal.SIGKILL
    assert result.failures[0].signal_name() == "SIGKILL"


async def test_grandchildren_are_stopped_on_close(tmp_path: Path) -> None:
    async with Fifo(tmp_path / "report") as report:
        pc = await start_processes(
            "gc",
            fork_funcs.with_grandchild,
            {r: (report.path,) for r in range(3)},
            {r: {} for r in range(3)},
            start_method="forkserver",
        )
        try:
            pairs = await report.pid_pairs(3)
        finally:
            await pc.close(timeout=5)
    pids = [p for pair in pairs for p in pair]
    assert set(pc.pids().values()) == {w for w, _ in pairs}
    assert await still_alive_after(pids, 5) == set()


@pytest.mark.parametrize("method", METHODS)
async def test_log_files_and_error_file_as_with_spawn(method: str, tmp_path: Path) -> None:
    specs = DefaultLogsSpecs(str(tmp_path), redirects=Std.ALL)
    result = await run(fork_funcs.talk, 2, (3,), logs_specs=specs, start_method=method)
    for rank in range(2):
        assert Path(result.stdouts[rank]).read_text() == "".join(f"out {i}\n" for i in range(3))
        assert Path(result.stderrs[rank]).read_text() == "".join(f"err {i}\n" for i in range(3))
    specs = DefaultLogsSpecs(str(tmp_path / "fail"))
    with pytest.raises(ChildFailedError) as info:
        await run(fork_funcs.fail, 1, ("broken",), logs_specs=specs, start_method=method)
    failure = info.value.failures[0]
    assert failure.message["message"] == "ValueError: broken"
    assert os.path.isfile(failure.error_file)


async def test_tee_to_sinks_from_forked_workers(tmp_path: Path) -> None:
    lines: list[str] = []
    result = await run(
        fork_funcs.talk,
        2,
        (2,),
        logs_specs=DefaultLogsSpecs(log_dir=tmp_path, tee=Std.ALL),
        sinks=[lambda line: lines.append(f"{line.rank} {line.stream} {line.line}")],
        start_method="forkserver",
    )
    assert result.return_values == {0: "done", 1: "done"}
    expected = [f"{r} stdout out {i}" for r in range(2) for i in range(2)]
    expected += [f"{r} stderr err {i}" for r in range(2) for i in range(2)]
    assert sorted(lines) == sorted(expected)


async def test_env_cwd_and_fds_are_the_workers_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with open_forkserver():
        # changed after the template started: the worker must see the new state
        monkeypatch.setenv("AIOPROC_TEST_LATE", "late")
        monkeypatch.chdir(tmp_path)
        forked = await run(
            fork_funcs.environment_and_cwd, 1, envs={0: {"MINE": "1"}}, start_method="forkserver"
        )
        spawned = await run(fork_funcs.environment_and_cwd, 1, envs={0: {"MINE": "1"}})
    env, cwd, argv, fds = forked.return_values[0]
    s_env, s_cwd, s_argv, s_fds = spawned.return_values[0]
    assert env["AIOPROC_TEST_LATE"] == "late" and env["MINE"] == "1"
    assert set(env) == set(s_env)
    assert cwd == s_cwd == str(tmp_path)
    assert argv == s_argv == ["-c"]
    assert len(fds) == len(s_fds)  # stdio, the channel, the listing's own fd: nothing else


async def test_preload_is_imported_once_in_the_template(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "imports"
    monkeypatch.setenv("AIOPROC_TEST_IMPORT_LOG", str(log))
    async with open_forkserver(["fork_preload_mod"]) as server:
        assert repr(server) == f"<Forkserver pid={server.pid} preload=['fork_preload_mod'] open>"
        seen = []
        for _ in range(2):  # two groups, one template
            result = await run(
                fork_funcs.preload_info,
                3,
                ("fork_preload_mod",),
                start_method="forkserver",
                preload=["fork_preload_mod"],
            )
            seen.extend(result.return_values.values())
    assert len(seen) == 6
    for import_pid, pid, was_loaded, ppid in seen:
        assert import_pid == server.pid != pid
        assert was_loaded and ppid == os.getpid()
    assert log.read_text() == f"{server.pid}\n"
    assert repr(server).endswith("closed>")
    no_template_left()


async def test_preload_that_starts_a_thread_is_refused() -> None:
    with pytest.raises(RuntimeError) as info:
        await run(fork_funcs.ident, 2, (0,), start_method="forkserver", preload=["fork_thread_mod"])
    assert str(info.value) == (
        "forkserver preload: importing 'fork_thread_mod' started 1 thread(s) (sneaky-poller); "
        "the template must stay single-threaded (a forked worker would inherit locks those "
        "threads hold); the template cannot fork workers from it: import 'fork_thread_mod' "
        "in the workers instead, or use start_method='spawn'"
    )
    no_template_left()  # and the leak check finds no process


async def test_preload_that_fails_to_import_names_the_module() -> None:
    with pytest.raises(ImportError) as info:
        await run(fork_funcs.ident, 1, (0,), start_method="forkserver", preload=["fork_broken_mod"])
    assert str(info.value) == (
        "forkserver preload: importing 'fork_broken_mod' failed: "
        "LookupError: fork_broken_mod refuses to load"
    )
    assert info.value.name == "fork_broken_mod"
    assert "fork_broken_mod.py" in str(info.value.__cause__)  # the template's traceback
    no_template_left()


async def test_fork_is_refused_with_the_reason() -> None:
    reason = (
        "start_method='fork' is refused: forking this process would copy its running event loop"
    )
    with pytest.raises(ValueError, match=reason):
        start_processes("x", fork_funcs.ident, {0: (1,)}, {0: {}}, start_method="fork")
    with pytest.raises(ValueError, match=reason):
        await run(fork_funcs.ident, 1, (1,), start_method="fork")
    with pytest.raises(ValueError, match=reason):
        open_pool(1, start_method="fork")
    with pytest.raises(ValueError, match=reason):
        open_worker(start_method="fork")
    with pytest.raises(ValueError, match=reason):
        LocalElasticAgent(WorkerSpec("r", 1, fork_funcs.ident, (1,)), start_method="fork")
    with pytest.raises(ValueError, match="unknown start_method 'vfork'"):
        await run(fork_funcs.ident, 1, (1,), start_method="vfork")


async def test_bad_preload_fails_before_anything_starts() -> None:
    with pytest.raises(ValueError, match=r"preload=\['json'\] needs start_method='forkserver'"):
        await run(fork_funcs.ident, 1, (1,), preload=["json"])
    with pytest.raises(TypeError, match="preload must be a list of module names, got 'json'"):
        await run(fork_funcs.ident, 1, (1,), start_method="forkserver", preload="json")
    with pytest.raises(ValueError, match="preload: 'no such' is not a module name"):
        open_forkserver(["no such"])
    with pytest.raises(ValueError, match=r"preload: 'a\.\.b' is not a module name"):
        WorkerSpec("r", 1, fork_funcs.ident, preload=["a..b"])
    no_template_left()


async def test_binary_workers_are_spawned_under_forkserver() -> None:
    result = await run("/bin/sh", 1, ("-c", "exit 0"), start_method="forkserver")
    assert result.return_values == {0: None}
    # this interpreter, but not running a script: spawned too
    code = "import sys; sys.exit('aioproc' in sys.modules and 'json' in sys.modules)"
    result = await run(sys.executable, 1, ("-c", code), start_method="forkserver", preload=["json"])
    assert result.return_values == {0: None}
    no_template_left()


async def test_python_scripts_are_forked_under_forkserver(tmp_path: Path) -> None:
    """``sys.executable [-u] script`` runs in a worker forked from the preloaded template."""
    script = tmp_path / "script.py"
    script.write_text(
        "import os, sys\n"
        "print(os.getppid(), 'fork_preload_mod' in sys.modules, sys.argv[1:], flush=True)\n"
    )
    out = tmp_path / "out"
    for args in (("-u", str(script), "a"), (str(script), "b")):
        async with open_forkserver(["fork_preload_mod"]) as server:
            result = await run(
                sys.executable,
                1,
                args,
                start_method="forkserver",
                preload=["fork_preload_mod"],
                logs_specs=DefaultLogsSpecs(str(out), redirects=Std.ALL),
            )
            assert result.return_values == {0: None}
            ppid, loaded, argv = Path(result.stdouts[0]).read_text().split(" ", 2)
            # the supervisor's child, with the template's preload in sys.modules
            assert int(ppid) == os.getpid() and loaded == "True"
            assert argv == f"{[args[-1]]!r}\n"
            assert _template._templates[os.getpid(), ("fork_preload_mod",)].pid == server.pid
    no_template_left()


async def test_agent_restarts_reuse_the_template(tmp_path: Path) -> None:
    record = tmp_path / "attempts"
    spec = WorkerSpec(
        "flaky", 1, fork_funcs.flaky, (str(record),), max_restarts=2, preload=["fork_preload_mod"]
    )
    events: list[str] = []
    agent = LocalElasticAgent(
        spec,
        start_method="forkserver",
        on_event=lambda e: events.append(e.name),
        grace_period=2,
        log_dir=str(tmp_path / "logs"),  # the failed attempt's logs are kept
    )
    result = await agent.run()
    assert result.return_values.keys() == {0}
    pids = record.read_text().split()
    assert len(pids) == 2 and pids[0] == pids[1] == str(result.return_values[0])
    assert int(pids[0]) != os.getpid()
    no_template_left()


async def test_pool_and_worker_fork_from_the_template() -> None:
    async with open_pool(2, start_method="forkserver", preload=["fork_preload_mod"]) as pool:
        infos = await pool.run(fork_funcs.preload_info, ("fork_preload_mod",))
        template_pids = {info[0] for info in infos}
        assert len(template_pids) == 1 and infos[0][0] not in pool.pids()
        assert all(info[2] and info[3] == os.getpid() for info in infos)
    async with open_worker(start_method="forkserver", preload=["fork_preload_mod"]) as w:
        import_pid, pid, was_loaded, ppid = await w.call(
            fork_funcs.preload_info, "fork_preload_mod"
        )
        assert import_pid != pid == w.pid and was_loaded and ppid == os.getpid()
    no_template_left()


async def test_forkserver_aclose_is_idempotent_and_a_second_call_waits_for_the_first() -> None:
    server = await open_forkserver(["fork_preload_mod"])
    pid = server.pid
    assert repr(server) == f"<Forkserver pid={pid} preload=['fork_preload_mod'] open>"
    first = asyncio.ensure_future(server.aclose())
    await asyncio.sleep(0)  # the first call is giving the lease back
    await server.aclose()  # returns once the template is gone, as the first does
    assert pid_gone(pid)
    no_template_left()
    await first
    await server.aclose()
    assert repr(server) == f"<Forkserver pid={pid} preload=['fork_preload_mod'] closed>"


BLOCK_SCRIPT = os.path.join(CHILDREN_DIR, "cli_sleep.py")


@pytest.mark.parametrize("kind", ["function", "script"])
async def test_cancelling_a_forkserver_start_at_random_points_leaves_nothing(kind: str) -> None:
    rng = random.Random(SEED)
    before = child_pids()
    entrypoint: Any = fork_funcs.block if kind == "function" else sys.executable
    args = () if kind == "function" else ("-u", BLOCK_SCRIPT)
    for _ in range(20):
        task = asyncio.ensure_future(
            start_processes(
                "c",
                entrypoint,
                {r: args for r in range(4)},
                {r: {} for r in range(4)},
                start_method="forkserver",
                preload=["json"],
            ).__aenter__()
        )
        await asyncio.sleep(rng.uniform(0, 0.08))
        task.cancel()
        try:
            pc = await task
        except asyncio.CancelledError:
            pass
        else:
            await pc.close(signal.SIGKILL, 0)
        left = child_pids() - before
        assert not left, f"seed {SEED}: " + ", ".join(describe(p) for p in left)
        no_template_left()


async def test_supervisor_sigkilled_leaves_no_worker_nor_template(tmp_path: Path) -> None:
    rng = random.Random(f"{SEED}-{loop_name()}")
    problems = []
    for i in range(4):
        mark = uuid.uuid4().hex
        report = str(tmp_path / f"report-{i}")
        async with Fifo(tmp_path / f"status-{i}") as status:
            sup = subprocess.Popen(
                [
                    sys.executable,
                    os.path.join(CHILDREN_DIR, "fork_supervisor.py"),
                    loop_name(),
                    status.path,
                    report,
                ],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                env={**os.environ, "PYTHONPATH": f"{REPO_ROOT}:{CHILDREN_DIR}", MARK_VAR: mark},
            )
            try:
                assert await status.lines(1, timeout=30) == ["starting"]
                if i % 2:
                    assert await status.lines(1, timeout=30) == ["started"]
                await asyncio.sleep(rng.uniform(0, 0.2))
            finally:
                sup.kill()
                sup.wait(timeout=10)
        alive = await survivors(mark, reported_pids(report))
        if alive:
            problems.append(f"#{i}: " + ", ".join(describe(p) for p in sorted(alive)))
            await clean_up(mark, alive)
    assert problems == [], f"seed {SEED}:\n" + "\n".join(problems)


async def test_forked_workers_run_their_own_exit_hooks_not_the_templates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The template's atexit handlers and finalizers stay the template's (a
    spawned worker would not have them either); the worker's own run, and
    logging still flushes at exit."""
    exits = tmp_path / "exits"
    logged = tmp_path / "logged"
    monkeypatch.setenv("AIOPROC_TEST_EXIT_LOG", str(exits))
    async with open_forkserver(["fork_exit_hooks_mod"]) as server:
        result = await run(
            fork_funcs.register_exit_hooks,
            2,
            (str(logged),),
            start_method="forkserver",
            preload=["fork_exit_hooks_mod"],
        )
        pids = sorted(result.return_values.values())
        lines = sorted(exits.read_text().splitlines())
        assert lines == sorted(
            f"{what} {pid}" for pid in pids for what in ("worker-atexit", "worker-finalize")
        )
        assert sorted(logged.read_text().splitlines()) == [f"logged by {pid}" for pid in pids]
        assert server.pid not in pids


async def test_fork_requests_sent_together_are_answered_in_order(tmp_path: Path) -> None:
    """The template forks every queued request before awaiting the first: answers keep order."""
    from aioproc._base import offloop as _offloop
    from aioproc._func.script import script_commands
    from aioproc._proc import lifeline as _lifeline

    script = tmp_path / "quiet.py"
    script.write_text("")
    command = script_commands(sys.executable, {0: [str(script)]})[0]
    cwds = [str(tmp_path), str(tmp_path / "gone"), str(tmp_path), str(tmp_path)]
    results: list[int | OSError] = []
    async with open_forkserver() as server:
        template = server._template
        assert template is not None
        _lifeline.hold()
        try:
            with _offloop.helper() as pool:
                futures = [
                    template.submit(pool, [], [], None, dict(os.environ), cwd, command).future
                    for cwd in cwds
                ]
                for future in futures:
                    try:
                        results.append(await asyncio.wrap_future(future))
                    except OSError as e:
                        results.append(e)
        finally:
            for pid in [r for r in results if isinstance(r, int)]:
                assert os.waitpid(pid, 0)[1] == 0  # ran the empty script
                _lifeline.forget(pid)
            _lifeline.unhold()
    assert [type(r) for r in results] == [int, OSError, int, int]
    assert str(results[1]) == (
        "a worker forked by the template failed to start: FileNotFoundError: "
        f"[Errno 2] No such file or directory: '{tmp_path / 'gone'}'"
    )
    no_template_left()


async def test_a_large_template_forks_from_huge_pages_and_each_worker_keeps_its_copy() -> None:
    """A template that preloaded 48 MiB maps it in 2 MiB pages (where the kernel can),
    so that a fork copies ~24 page-table entries for it instead of ~12,000; every
    worker still finds the preload's memory as it was, whatever the others wrote."""
    async with open_forkserver(["fork_big_mod"]) as server:
        if collapse_supported():
            assert anon_huge_bytes(server.pid) >= 32 << 20
        seen: list[tuple[bool, bool, int]] = []
        for _ in range(2):  # the second group after the first one's writes
            result = await run(
                fork_funcs.scribble,
                4,
                {r: (r,) for r in range(4)},
                start_method="forkserver",
                preload=["fork_big_mod"],
            )
            seen.extend(result.return_values.values())
    assert [(intact, numbers) for intact, numbers, _ in seen] == [(True, True)] * 8
    pids = {pid for *_, pid in seen}
    assert len(pids) == 8 and server.pid not in pids
    no_template_left()


@pytest.mark.parametrize("kind", ["function", "script"])
async def test_a_forked_worker_runs_nothing_before_the_supervisor_knows_it(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A function worker's frames are queued before the fork request goes out, and
    a script worker has its script at once, but a forked worker waits at its gate
    until the supervisor has read its pid and the guardian knows it: held back
    there, it has run nothing of the user's; let through, it runs."""
    import threading

    gate = threading.Event()
    read_answer = _template.Template._read_answer
    loop = asyncio.get_running_loop()
    forked: asyncio.Future[int] = loop.create_future()

    def late_answer(self: _template.Template) -> Any:
        answer = read_answer(self)  # the worker is forked and set up
        loop.call_soon_threadsafe(lambda: forked.done() or forked.set_result(answer[1]))
        assert gate.wait(30), "the test never released the answer"
        return answer

    async with open_forkserver() as server, Fifo(tmp_path / "fifo") as fifo:
        monkeypatch.setattr(_template.Template, "_read_answer", late_answer)
        entrypoint: Any = fork_funcs.say_running
        args: tuple[str, ...] = (fifo.path,)
        if kind == "script":
            script = tmp_path / "say_running.py"
            script.write_text(
                "import os, sys\n"
                "with open(sys.argv[1], 'w') as f:\n"
                "    f.write(f'running {os.getpid()}\\n')\n"
            )
            entrypoint, args = sys.executable, ("-u", str(script), fifo.path)
        starting = asyncio.ensure_future(
            start_processes("early", entrypoint, {0: args}, {0: {}}, start_method="forkserver")
        )
        try:
            pid = await asyncio.wait_for(forked, 20)
            # a negative can only be watched for a while: the worker would say
            # "running" within milliseconds of its fork
            with pytest.raises(asyncio.TimeoutError):
                await fifo.lines(1, timeout=1.0)
            assert not starting.done()
        finally:
            gate.set()
        pc = await starting
        result = await pc.wait()
        assert result is not None and not result.is_failed()
        if kind == "function":
            assert result.return_values == {0: pid}
        assert pc.pids() == {0: pid}
        assert await fifo.lines(1) == [f"running {pid}"]
        assert server.pid != pid
    no_template_left()


_READ_ONCE = """\
import inspect, os, sys

print(f"imported in {{os.getpid()}}", flush=True)
IMPORTS = [os.getpid()]
VALUE = {value!r}


def where():
    mod = sys.modules[__name__]
    learned = [f._specs for f in sys.meta_path if type(f).__name__ == "_Modules"][0]
    return (
        VALUE,
        os.getpid(),
        IMPORTS,
        type(mod.__loader__).__name__,
        mod.__file__,
        inspect.getsource(where).splitlines()[0],
        __name__ in learned,
        "readonce_pkg" in learned,
        sys.modules["readonce_pkg"].FIRST_LINE,
    )
"""


async def test_the_template_reads_a_functions_module_once_and_each_worker_runs_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "readonce_pkg"
    package.mkdir()
    # the package reads its module's source through the module's loader (as a
    # plugin registry might) before importing it
    init = (
        "import importlib.util\n"
        "_spec = importlib.util.find_spec(__name__ + '.readonce_mod')\n"
        "FIRST_LINE = _spec.loader.get_source(_spec.name).splitlines()[0]\n"
    )
    (package / "__init__.py").write_text(init)
    module = package / "readonce_mod.py"
    module.write_text(_READ_ONCE.format(value="first"))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "readonce_pkg", raising=False)
    monkeypatch.delitem(sys.modules, "readonce_pkg.readonce_mod", raising=False)
    import readonce_pkg.readonce_mod as mod

    async with open_forkserver():
        for value in ("first", "second, and a longer file"):
            if value != "first":  # changed on disk while the template runs
                module.write_text(_READ_ONCE.format(value=value))
                mod = __import__("importlib").reload(mod)
            specs = DefaultLogsSpecs(str(tmp_path / value[:5]), redirects=Std.OUT)
            result = await run(mod.where, 3, logs_specs=specs, start_method="forkserver")
            for rank, got in result.return_values.items():
                seen, pid, imports, loader, file, line, learned, package_learned, first = got
                assert first == "import inspect, os, sys"
                assert seen == value  # the file as it is now, not as it was read first
                assert imports == [pid]  # its code ran in the worker, once
                # the worker's log has what the import printed
                assert Path(result.stdouts[rank]).read_text() == f"imported in {pid}\n"
                assert (loader, file, line) == ("SourceFileLoader", str(module), "def where():")
                assert learned and package_learned
        # another copy first on the supervisor's sys.path: the workers import that one
        shadow = tmp_path / "shadow" / "readonce_pkg"
        shadow.mkdir(parents=True)
        (shadow / "__init__.py").write_text(init)
        (shadow / "readonce_mod.py").write_text(_READ_ONCE.format(value="shadow"))
        monkeypatch.syspath_prepend(str(tmp_path / "shadow"))
        result = await run(mod.where, 2, start_method="forkserver")
        for seen, _, _, _, file, *_ in result.return_values.values():
            assert (seen, file) == ("shadow", str(shadow / "readonce_mod.py"))
    no_template_left()


async def test_the_template_compiles_a_script_once_and_again_once_it_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = tmp_path / "script.py"
    body = (
        "import sys\n"
        "runner = sys._getframe(1).f_locals  # _child.script.run_script's\n"
        "print({value!r}, runner['code'] is runner['codes'][__file__][1], __file__, flush=True)\n"
        "{last}\n"
    )
    monkeypatch.chdir(tmp_path)  # a relative script path, as `aioproc run script.py` gives
    async with open_forkserver():
        script.write_text(body.format(value="first", last="pass"))
        specs = DefaultLogsSpecs(str(tmp_path / "first"), redirects=Std.ALL)
        result = await run(
            sys.executable, 2, ("script.py",), start_method="forkserver", logs_specs=specs
        )
        for rank in range(2):
            shown = Path(result.stdouts[rank]).read_text()
            assert shown == f"first True {os.path.realpath(script)}\n"
        # changed while the template runs: the workers run the new text
        script.write_text(body.format(value="second", last="raise ValueError('from line 4')"))
        specs = DefaultLogsSpecs(str(tmp_path / "second"), redirects=Std.ALL)
        with pytest.raises(ChildFailedError) as info:
            await run(
                sys.executable, 1, ("script.py",), start_method="forkserver", logs_specs=specs
            )
        # the same size and modification time, rewritten in place, then renamed
        # into place (rsync -t, cp -p, an editor's save): the workers run the new text
        size, mtime = script.stat().st_size, script.stat().st_mtime_ns
        for value, how in (("third", "in place"), ("forth", "renamed")):
            text = body.format(
                value=value, last="pass".ljust(size - len(body.format(value=value, last="")))
            )
            target = script if how == "in place" else tmp_path / "new.py"
            target.write_text(text)
            os.utime(target, ns=(mtime, mtime))
            if how == "renamed":
                os.replace(target, script)
            assert (script.stat().st_size, script.stat().st_mtime_ns) == (size, mtime)
            specs = DefaultLogsSpecs(str(tmp_path / value), redirects=Std.ALL)
            result = await run(
                sys.executable, 1, ("script.py",), start_method="forkserver", logs_specs=specs
            )
            shown = Path(result.stdouts[0]).read_text()
            assert shown == f"{value} True {os.path.realpath(script)}\n", how
    failure = info.value.failures[0]
    assert failure.exitcode == 1
    [out] = (tmp_path / "second").rglob("stdout.log")
    [err_log] = (tmp_path / "second").rglob("stderr.log")
    assert out.read_text() == f"second True {os.path.realpath(script)}\n"
    err = err_log.read_text()
    assert f'File "{os.path.realpath(script)}", line 4, in <module>' in err
    assert "raise ValueError('from line 4')" in err and err.endswith("ValueError: from line 4\n")
    no_template_left()


async def test_a_script_or_module_gone_since_the_template_read_it_fails_as_without_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = tmp_path / "gone_script.py"
    script.write_text("print('ran')\n")
    module = tmp_path / "gone_mod.py"
    module.write_text("def f():\n    return 'ran'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "gone_mod", raising=False)
    import gone_mod

    async with open_forkserver():
        assert (await run(gone_mod.f, 1, start_method="forkserver")).return_values == {0: "ran"}
        specs = DefaultLogsSpecs(str(tmp_path / "first"), redirects=Std.ALL)
        result = await run(
            sys.executable, 1, (str(script),), start_method="forkserver", logs_specs=specs
        )
        assert Path(result.stdouts[0]).read_text() == "ran\n"
        script.unlink()
        module.unlink()
        specs = DefaultLogsSpecs(str(tmp_path / "second"), redirects=Std.ALL)
        with pytest.raises(ChildFailedError) as info:
            await run(
                sys.executable, 1, (str(script),), start_method="forkserver", logs_specs=specs
            )
        failure = info.value.failures[0]
        assert failure.exitcode == 2  # what python says of a script it cannot open
        [err] = (tmp_path / "second").rglob("stderr.log")
        assert err.read_text() == (
            f"{sys.executable}: can't open file {str(script)!r}: "
            "[Errno 2] No such file or directory\n"
        )
        with pytest.raises(ChildFailedError) as info:
            specs = DefaultLogsSpecs(str(tmp_path / "third"))
            await run(gone_mod.f, 1, start_method="forkserver", logs_specs=specs)
        message = info.value.failures[0].message["message"]
        assert "No module named 'gone_mod'" in message
    no_template_left()
