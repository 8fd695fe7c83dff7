"""Coroutine workers: ``async def`` runs on a loop of its own in the worker.

The runner every worker uses (``aioproc._child.aio``) first, in fresh
interpreters where signals are involved; then groups of coroutine workers
through ``run``/``start_processes`` on both start methods, their stop by
SIGTERM/SIGINT/SIGHUP (cancellation, then death by that signal), the
barrier from coroutines, the agent and the cluster runner.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import inspect
import json
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from helpers import CHILDREN_DIR, REPO_ROOT, envs, import_child, loop_name, pid_gone, python
from proc_utils import Fifo, still_alive_after

import aioproc
import aioproc.cluster
import aioproc.testing
from aioproc import ChildFailedError, DefaultLogsSpecs, ForcedKillWarning, SignalException, Std
from aioproc._child import aio
from aioproc._func import template as _template
from aioproc.agent import LocalElasticAgent, WorkerSpec

sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))
import soak_cancel

# ------------------------------------------------------------------ the runner


def run_child(code: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """Run ``code`` (dedented) in a fresh interpreter; its output and status."""
    return subprocess.run(
        python(textwrap.dedent(code)), capture_output=True, text=True, timeout=timeout
    )


async def _coro_fn() -> None: ...


def _sync_fn() -> None: ...


class _Callable:
    async def method(self) -> None: ...

    async def __call__(self) -> None: ...


def test_coroutine_functions_are_told_apart_without_inspect() -> None:
    assert aio.is_coroutine_function(_coro_fn)
    assert aio.is_coroutine_function(functools.partial(functools.partial(_coro_fn)))
    assert aio.is_coroutine_function(_Callable().method)
    assert not aio.is_coroutine_function(_sync_fn)
    assert not aio.is_coroutine_function(functools.partial(_sync_fn))
    assert not aio.is_coroutine_function(len)
    # as inspect says: an object with an async __call__ is told by what it returns
    assert not aio.is_coroutine_function(_Callable())
    coro = _Callable()()
    assert aio.is_coroutine(coro)
    coro.close()
    assert not aio.is_coroutine(asyncio.sleep)


@pytest.mark.parametrize("kind", ["asyncio", "uvloop"])
def test_run_returns_the_value_on_a_fresh_loop_of_the_kind_asked_and_closes_it(
    kind: str,
) -> None:
    loops: list[asyncio.AbstractEventLoop] = []

    async def main(x: int) -> tuple[int, str]:
        loop = asyncio.get_running_loop()
        loops.append(loop)
        assert asyncio.get_event_loop() is loop
        await asyncio.sleep(0)
        return x * 2, type(loop).__module__

    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    value, module = aio.run(main(21), loop=kind)
    assert value == 42
    assert module.split(".")[0] == kind
    assert loops[0].is_closed()
    # the handlers the runner installed are gone: the ones before are back
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


def test_run_raises_what_the_coroutine_raised_with_its_own_frames_first() -> None:
    async def inner() -> None:
        raise KeyError("deep")

    async def main() -> None:
        await inner()

    with pytest.raises(KeyError, match="deep") as info:
        aio.run(main())
    # as the worker's boot code sees it: from the frame that called run() on
    tb = info.value.__traceback__
    assert tb is not None and tb.tb_frame.f_code.co_name.startswith("test_")
    tb = aio.user_traceback(tb.tb_next)
    assert tb is not None
    names = []
    while tb is not None:
        names.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    assert names == ["main", "inner"]


def test_run_cancels_what_is_left_and_shuts_down_async_generators() -> None:
    seen: list[str] = []

    async def agen() -> Any:
        try:
            yield 1
            yield 2
        finally:
            seen.append("agen closed")

    async def left() -> None:
        try:
            await asyncio.sleep(60)
        finally:
            seen.append("left cancelled")

    async def main() -> str:
        gen = agen()
        await gen.__anext__()  # left suspended
        asyncio.get_running_loop().create_task(left())
        await asyncio.sleep(0)
        return "done"

    assert aio.run(main()) == "done"
    assert sorted(seen) == ["agen closed", "left cancelled"]


def test_an_invalid_loop_is_a_value_error_naming_it_and_the_coroutine_is_closed() -> None:
    coro = _coro_fn()
    with pytest.raises(
        ValueError, match="worker_loop must be one of 'asyncio', 'uvloop', got 'tokio'"
    ):
        aio.run(coro, loop="tokio")
    assert coro.cr_frame is None  # closed: no "never awaited" warning (warnings are errors)


def test_a_missing_uvloop_is_an_import_error_that_says_what_to_do() -> None:
    proc = run_child(
        """
        import sys
        sys.modules["uvloop"] = None  # not importable
        from aioproc._child import aio
        async def main(): pass
        try:
            aio.run(main(), loop="uvloop")
        except ImportError as e:
            print(e)
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert "worker_loop='uvloop', but uvloop cannot be imported here" in proc.stdout
    assert "use worker_loop='asyncio'" in proc.stdout


STOPPED_CHILD = """
    import asyncio, os, signal, sys
    from aioproc._child import aio

    async def main():
        print("loop", type(asyncio.get_running_loop()).__module__, flush=True)
        try:
            os.kill(os.getpid(), getattr(signal, sys.argv[1]))
            await asyncio.sleep(60)
        finally:
            # a second signal while unwinding: ignored, the cleanup completes
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGINT)
            await asyncio.sleep(0.05)
            print("finally ran", flush=True)

    try:
        aio.run(main(), loop=sys.argv[2])
    except aio.Stopped as stopped:
        print("stopped by", stopped.signum, "cause", stopped.__cause__, flush=True)
        aio.die_by(stopped.signum)
    print("not reached", flush=True)
"""


@pytest.mark.parametrize("kind", ["asyncio", "uvloop"])
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT", "SIGHUP"])
def test_a_stop_signal_cancels_the_coroutine_then_the_process_dies_of_it(
    sig: str, kind: str
) -> None:
    proc = subprocess.run(
        [*python(textwrap.dedent(STOPPED_CHILD)), sig, kind],
        capture_output=True,
        text=True,
        timeout=30,
    )
    signum = getattr(signal, sig)
    assert proc.returncode == -signum, proc.stderr
    assert proc.stdout.splitlines()[1:] == ["finally ran", f"stopped by {signum} cause None"]
    assert proc.stdout.startswith(f"loop {kind}")
    assert proc.stderr == ""


def test_an_exception_raised_while_unwinding_is_the_cause_of_stopped() -> None:
    proc = run_child(
        """
        import asyncio, os, signal
        from aioproc._child import aio

        async def main():
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                await asyncio.sleep(60)
            finally:
                raise OSError("cleanup failed")

        try:
            aio.run(main())
        except aio.Stopped as stopped:
            print(repr(stopped.__cause__), stopped, flush=True)
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "OSError('cleanup failed') stopped by signal 15\n"


def test_a_coroutine_that_swallows_the_cancellation_is_still_stopped() -> None:
    proc = run_child(
        """
        import asyncio, os, signal
        from aioproc._child import aio

        async def main():
            try:
                os.kill(os.getpid(), signal.SIGHUP)
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                return "swallowed"

        try:
            print(aio.run(main()))
        except aio.Stopped as stopped:
            aio.die_by(stopped.signum)
        """
    )
    assert proc.returncode == -signal.SIGHUP
    assert proc.stdout == ""


# ------------------------------------------------------------------ groups


@pytest.fixture
def cf(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The coroutine worker functions, importable here and in the workers."""
    return import_child(monkeypatch, "group_coros")


@pytest.fixture
def sync_funcs(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return import_child(monkeypatch, "group_sync")


START_METHODS = ["spawn", "forkserver"]


@pytest.mark.parametrize("start_method", START_METHODS)
async def test_run_returns_each_workers_value_from_a_loop_of_its_own(
    cf: ModuleType, start_method: str
) -> None:
    result = await aioproc.run(
        cf.describe, 2, args=(20,), kwargs={"add": 2}, start_method=start_method
    )
    assert sorted(result.return_values) == [0, 1]
    for value in result.return_values.values():
        assert value["value"] == 42
        assert value["loop"] == "asyncio"  # the worker's, whatever the supervisor's loop
        assert value["current"] is True
    assert len({v["pid"] for v in result.return_values.values()}) == 2
    assert _template._templates == {}


@pytest.mark.parametrize("start_method", START_METHODS)
async def test_worker_loop_uvloop_gives_each_coroutine_worker_a_uvloop_loop(
    cf: ModuleType, start_method: str, tmp_path: Path
) -> None:
    specs = DefaultLogsSpecs(str(tmp_path / "logs"))
    result = await aioproc.run(
        cf.describe,
        2,
        args=(1,),
        worker_loop="uvloop",
        start_method=start_method,
        logs_specs=specs,
    )
    assert [v["loop"] for v in result.return_values.values()] == ["uvloop", "uvloop"]
    assert all(v["current"] for v in result.return_values.values())
    assert not list(tmp_path.rglob("error.json"))
    async with aioproc.start_processes(
        "uv", cf.describe, {0: (1,)}, {0: {}}, start_method=start_method, worker_loop="uvloop"
    ) as pc:
        assert pc.worker_loop == "uvloop"
        result = await pc.wait()
    assert result is not None and result.return_values[0]["loop"] == "uvloop"
    # a sync worker ignores the option
    result = await aioproc.run(os.getpid, 1, worker_loop="uvloop", start_method=start_method)
    assert isinstance(result.return_values[0], int)


async def test_an_invalid_worker_loop_is_a_value_error_before_anything_starts(
    cf: ModuleType,
) -> None:
    before = set(os.listdir("/proc"))
    with pytest.raises(ValueError, match="worker_loop must be 'asyncio' or 'uvloop', got 'tokio'"):
        await aioproc.run(cf.describe, 1, args=(1,), worker_loop="tokio")
    with pytest.raises(ValueError, match="got None"):
        aioproc.start_processes("x", cf.describe, {0: (1,)}, {0: {}}, worker_loop=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"WorkerSpec.worker_loop must be .*got 'trio'"):
        WorkerSpec(role="r", local_world_size=1, entrypoint=cf.describe, worker_loop="trio")
    with pytest.raises(ValueError, match=r"worker_loop must be .*got 'tokio'"):
        aioproc.cluster.ClusterRunner(cf.describe, {"worker": 1}, worker_loop="tokio")
    assert not {p for p in set(os.listdir("/proc")) - before if p.isdigit() and pid_alive(p)}


def pid_alive(pid: str) -> bool:
    """Whether ``pid`` is a child of this process still running."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1]) == os.getpid()
    except (OSError, ValueError, IndexError):
        return False


def test_worker_loop_uvloop_where_uvloop_is_missing_says_so_before_anything_starts() -> None:
    proc = run_child(
        """
        import sys
        sys.modules["uvloop"] = None  # not importable
        import importlib.util
        real = importlib.util.find_spec
        importlib.util.find_spec = lambda name, *a: None if name == "uvloop" else real(name, *a)
        import aioproc
        try:
            aioproc.start_processes("x", print, {0: ()}, {0: {}}, worker_loop="uvloop")
        except ValueError as e:
            print("ValueError:", e)
        """
    )
    assert "ValueError: worker_loop='uvloop' but uvloop is not installed" in proc.stdout, proc
    assert "pass worker_loop='asyncio'" in proc.stdout


@pytest.mark.parametrize("start_method", START_METHODS)
async def test_partials_methods_and_functions_returning_a_coroutine_run_too(
    cf: ModuleType, start_method: str
) -> None:
    result = await aioproc.run(cf.partial_describe, 1, args=(1,), start_method=start_method)
    assert result.return_values[0]["value"] == 7
    result = await aioproc.run(cf.Methods().method, 1, args=(1,), start_method=start_method)
    assert result.return_values == {0: 101}
    result = await aioproc.run(cf.coroutine_of, 1, args=(3,), start_method=start_method)
    assert result.return_values[0]["value"] == 7
    # a lambda around an async call: by value, and the coroutine it returns runs
    describe = cf.describe
    result = await aioproc.run(lambda: describe(4), 1, start_method=start_method)
    assert result.return_values[0]["value"] == 8


@pytest.mark.parametrize("start_method", START_METHODS)
async def test_a_coroutine_worker_runs_subprocesses_on_its_loop(
    cf: ModuleType, start_method: str
) -> None:
    result = await aioproc.run(cf.subprocess_output, 2, args=("hi",), start_method=start_method)
    assert result.return_values == {0: "hi 0", 1: "hi 0"}


@pytest.mark.parametrize("start_method", START_METHODS)
async def test_an_exception_travels_with_the_coroutines_own_traceback(
    cf: ModuleType, start_method: str, tmp_path: Path
) -> None:
    specs = DefaultLogsSpecs(str(tmp_path / "logs"), redirects=Std.ALL)
    with pytest.raises(ChildFailedError) as info:
        await aioproc.run(
            cf.fail, 1, args=("bad coroutine",), logs_specs=specs, start_method=start_method
        )
    remote = info.value.__cause__
    assert isinstance(remote, ValueError) and str(remote) == "bad coroutine"
    _, failure = info.value.get_first_failure()
    assert failure.exitcode == 1
    assert not failure.stopped
    # error.json has the worker's traceback: its coroutines' frames, not the runner's
    with open(failure.error_file) as f:
        error = json.load(f)
    tb = error["message"]["extraInfo"]["py_callstack"]
    assert frames(tb) == ["fail", "_inner"], tb
    assert tb.startswith("Traceback (most recent call last):")
    assert tb.rstrip().endswith("ValueError: bad coroutine")
    summary = str(info.value)
    assert "in fail\n" in summary and "in _inner\n" in summary
    assert "asyncio" not in summary and "_child" not in summary
    # the same text on the worker's stderr
    stderr = Path(failure.stderr_log).read_text()
    assert frames(stderr) == ["fail", "_inner"], stderr


def frames(text: str) -> list[str]:
    """The function names of a formatted traceback's frames, in order."""
    return re.findall(r'^\s*File ".*", line \d+, in (\S+)$', text, re.M)


async def test_record_on_an_async_def_keeps_it_a_coroutine_function_and_writes_error_json(
    cf: ModuleType, tmp_path: Path
) -> None:
    assert inspect.iscoroutinefunction(cf.recorded_fail)
    assert aio.is_coroutine_function(cf.recorded_fail)
    specs = DefaultLogsSpecs(str(tmp_path / "logs"), redirects=Std.ALL)
    with pytest.raises(ChildFailedError) as info:
        await aioproc.run(cf.recorded_fail, 1, args=("recorded",), logs_specs=specs)
    _, failure = info.value.get_first_failure()
    with open(failure.error_file) as f:
        error = json.load(f)
    assert error["message"]["message"] == "ValueError: recorded"
    assert frames(error["message"]["extraInfo"]["py_callstack"])[-2:] == ["recorded_fail", "_inner"]


async def test_a_sync_worker_loads_neither_asyncio_nor_the_coroutine_runner(
    sync_funcs: ModuleType,
) -> None:
    result = await aioproc.run(sync_funcs.loaded_modules, 1)
    assert result.return_values == {0: []}


# ------------------------------------------------------------------ the stop


def gone(pids: list[int]) -> bool:
    return all(pid_gone(pid) for pid in pids)


@pytest.mark.parametrize("start_method", START_METHODS)
async def test_leaving_the_group_cancels_every_coroutine_and_runs_its_finally(
    cf: ModuleType, start_method: str, tmp_path: Path
) -> None:
    notes = tmp_path / "notes"
    n = 3
    async with Fifo(tmp_path / "fifo") as fifo:
        async with aioproc.start_processes(
            "sleepers",
            cf.sleep_then_note,
            {r: (fifo.path, str(notes)) for r in range(n)},
            envs(n),
            start_method=start_method,
        ) as pc:
            ready = await fifo.lines(n)
            pids = sorted(pc.pids().values())
            assert sorted(int(line.split()[1]) for line in ready) == pids
            started = time.monotonic()
        took = time.monotonic() - started
    # the grace period is the default 30 s: the close did not wait for it
    assert took < 10, took
    assert sorted(notes.read_text().splitlines()) == [f"finally {pid}" for pid in pids]
    result = pc.poll()
    assert result is not None
    assert sorted(result.failures) == list(range(n))
    for failure in result.failures.values():
        assert failure.exitcode == -signal.SIGTERM
        assert failure.stopped
    assert gone(pids)
    assert _template._templates == {}


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGHUP], ids=lambda s: s.name)
async def test_a_translated_sigint_or_sighup_stops_coroutines_as_it_stops_sync_workers(
    cf: ModuleType, sync_funcs: ModuleType, sig: signal.Signals, tmp_path: Path
) -> None:
    """The signal torch's agent translates (``SignalException``) stops the group
    with that signal: the coroutine's cleanup runs, then the worker dies of it,
    the same exit code and the same "stopped" report as a sync worker's."""
    notes = tmp_path / "notes"
    outcomes = {}
    pids = {}
    for kind, fn, extra in (
        ("async", cf.sleep_then_note, (str(notes),)),
        ("sync", sync_funcs.sleep, ()),
    ):
        async with Fifo(tmp_path / f"fifo-{kind}") as fifo:
            with pytest.raises(SignalException):
                async with aioproc.start_processes(
                    kind, fn, {0: (fifo.path, *extra)}, envs(1)
                ) as pc:
                    await fifo.lines(1)
                    pids[kind] = pc.pids()[0]
                    raise SignalException(f"got {sig.name}", sig)
        result = pc.poll()
        assert result is not None
        failure = result.failures[0]
        outcomes[kind] = (failure.exitcode, failure.stopped, failure.signal_name())
        summary = ChildFailedError(kind, result.failures).format_msg()
        assert (
            f"exitcode  : {-sig} (pid: {pids[kind]}) ({sig.name}) (stopped by aioproc)" in summary
        )
        assert pid_gone(pids[kind])
    assert outcomes["async"] == outcomes["sync"] == (-sig, True, sig.name)
    assert notes.read_text().splitlines() == [f"finally {pids['async']}"]


async def test_a_second_signal_during_the_cleanup_changes_nothing(
    cf: ModuleType, tmp_path: Path
) -> None:
    """The worker's cleanup sends itself SIGINT after the stop's SIGTERM: the
    cleanup completes and the worker still dies of SIGTERM."""
    notes = tmp_path / "notes"
    async with Fifo(tmp_path / "fifo") as fifo:
        async with aioproc.start_processes(
            "twice", cf.sleep_then_note, {0: (fifo.path, str(notes), signal.SIGINT)}, envs(1)
        ) as pc:
            await fifo.lines(1)
            pid = pc.pids()[0]
    result = pc.poll()
    assert result is not None
    assert result.failures[0].exitcode == -signal.SIGTERM
    assert result.failures[0].stopped
    assert notes.read_text() == f"finally {pid}\n"


async def test_a_coroutine_ignoring_cancellation_is_killed_at_the_end_of_the_grace_period(
    cf: ModuleType, tmp_path: Path
) -> None:
    async with Fifo(tmp_path / "fifo") as fifo:
        with pytest.warns(ForcedKillWarning, match=r"stubborn"):
            async with aioproc.start_processes(
                "stubborn", cf.ignore_cancellation, {0: (fifo.path,)}, envs(1), grace_period=1
            ) as pc:
                await fifo.lines(1)
                pid = pc.pids()[0]
                started = time.monotonic()
        took = time.monotonic() - started
    assert 1 <= took < 10, took
    result = pc.poll()
    assert result is not None
    assert result.failures[0].exitcode == -signal.SIGKILL
    assert pid_gone(pid)


# ------------------------------------------------------------------ warm start


async def test_forked_workers_get_no_event_loop_a_preloaded_module_left(cf: ModuleType) -> None:
    """``coro_loop_preload`` sets an event loop at import, in the template.  A
    fork must not inherit it (its fds are not the worker's): coroutine workers
    run on loops of their own, and the old ``get_event_loop()`` idiom of a sync
    worker gets a fresh loop, as in a spawned worker."""
    for fn, args in ((cf.describe, (1,)), (cf.legacy_loop, ())):
        result = await aioproc.run(
            fn, 2, args=args, start_method="forkserver", preload=["coro_loop_preload"]
        )
        assert [v["value"] for v in result.return_values.values()] == [2, 2]
    assert _template._templates == {}


async def test_a_template_imports_asyncio_once_at_its_first_coroutine_worker(
    cf: ModuleType, sync_funcs: ModuleType
) -> None:
    """Forks find asyncio imported (their start pays nothing for it) once the
    template forked a coroutine worker; a template that forks only sync
    workers never imports it."""

    async def sync_modules() -> list[str]:
        result = await aioproc.run(sync_funcs.loaded_modules, 1, start_method="forkserver")
        modules: list[str] = result.return_values[0]
        return modules

    async with aioproc.open_forkserver():
        assert await sync_modules() == []
        await aioproc.run(cf.describe, 1, args=(1,), start_method="forkserver")
        assert {"asyncio", "aioproc._child.aio"} <= set(await sync_modules())
    assert _template._templates == {}


# ------------------------------------------------------------------ the barrier


async def test_abarrier_meets_every_worker_while_each_loop_keeps_running(
    cf: ModuleType, tmp_path: Path
) -> None:
    path = tmp_path / "arrivals"
    result = await aioproc.run(cf.meet, 3, args={r: (str(path), r, 3) for r in range(3)})
    # every worker saw all three arrivals after its first wait, and its other
    # task kept turning while it waited
    assert all(turns > 0 for turns in result.return_values.values()), result.return_values


async def test_the_blocking_barrier_on_a_running_loop_is_an_error_naming_abarrier(
    cf: ModuleType,
) -> None:
    result = await aioproc.run(cf.blocking_barrier, 1)
    assert "await aioproc.cluster.abarrier()" in result.return_values[0]
    assert "barrier() was called on a running event loop" in result.return_values[0]


async def test_abarrier_breaks_when_a_worker_leaves_without_reaching_it(cf: ModuleType) -> None:
    result = await aioproc.run(cf.leave_or_wait, 2, args={0: (0,), 1: (1,)}, name="leave")
    assert result.return_values == {
        0: "left",
        1: "broken: barrier broken: leave/0 exited with code 0 without reaching it",
    }


async def test_abarrier_outside_a_worker_is_tfs_value_error() -> None:
    with pytest.raises(ValueError, match="barrier is not defined"):
        await aioproc.cluster.abarrier()
    with pytest.raises(RuntimeError, match="only inside a function worker"):
        await aioproc.testing.abarrier()


# ------------------------------------------------------------------ no orphans

SUPERVISOR = textwrap.dedent(
    """
    import asyncio, sys
    sys.path.insert(0, sys.argv[1])
    import aioproc, group_coros

    async def main(fifo, start_method):
        async with aioproc.start_processes(
            "doomed",
            group_coros.ignore_cancellation,
            {r: (fifo,) for r in range(3)},
            {r: {} for r in range(3)},
            start_method=start_method,
        ) as pc:
            await pc.wait()

    asyncio.run(main(sys.argv[2], sys.argv[3]))
    """
)


@pytest.mark.parametrize("start_method", START_METHODS)
async def test_sigkill_of_the_supervisor_leaves_no_coroutine_worker(
    start_method: str, tmp_path: Path
) -> None:
    async with Fifo(tmp_path / "fifo") as fifo:
        sup = subprocess.Popen(
            [sys.executable, "-c", SUPERVISOR, CHILDREN_DIR, fifo.path, start_method],
            env={**os.environ, "TMPDIR": str(tmp_path)},  # a SIGKILLed run keeps its logs
        )
        pids: list[int] = []
        left: set[int] = set()
        try:
            pids = [int(line.split()[1]) for line in await fifo.lines(3)]
            os.kill(sup.pid, signal.SIGKILL)
            sup.wait()
            left = await still_alive_after(pids, 5)
            assert left == set()
        finally:
            if sup.poll() is None:
                sup.kill()
                sup.wait()
            for pid in left:  # the test's own workers, which outlived the guardian
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


# ------------------------------------------------------------------ cancellation soak

SOAK_ITERATIONS = 150  # per supervisor loop: 300 in all
SOAK_SECONDS = 75.0  # per supervisor loop, at most: the soak stops early on a slow machine
SOAK_SEED = int(os.environ.get("AIOPROC_FAULT_SEED", random.randrange(1 << 30)))


async def _cancelled_run(rng: random.Random, cf: ModuleType, mark: str) -> str:
    """``run()`` of two coroutine workers, cancelled at a random moment; its outcome."""
    fn, args = rng.choice(
        [(cf.sleep_forever, ()), (cf.sleep_forever, (0.02,)), (cf.describe, (1,))]
    )
    start_method = "forkserver" if rng.random() < 0.25 else "spawn"
    task = asyncio.create_task(
        aioproc.run(
            fn,
            2,
            args=args,
            envs={r: {soak_cancel.MARK_VAR: mark} for r in range(2)},
            start_method=start_method,
            grace_period=5,
        )
    )
    if rng.random() < 0.5:
        await asyncio.sleep(rng.uniform(0, 0.5))
    else:
        for _ in range(rng.randrange(40)):
            await asyncio.sleep(0)
    task.cancel()
    try:
        await asyncio.wait_for(asyncio.shield(task), 30)
    except asyncio.CancelledError:
        if not task.cancelled():
            raise  # this test itself was cancelled
        return f"{fn.__name__} cancelled"
    return f"{fn.__name__} finished"


@pytest.mark.timeout(SOAK_SECONDS + 60)
async def test_cancelling_run_of_coroutine_workers_at_random_points_leaves_nothing(
    cf: ModuleType,
) -> None:
    rng = random.Random(f"{SOAK_SEED}-{loop_name()}")
    found = soak_cancel.Leftovers()
    deadline = time.monotonic() + SOAK_SECONDS
    with soak_cancel.private_tempdir("coro_soak_") as (_, tmp):
        await soak_cancel.warm_up()
        baseline = soak_cancel.Baseline(tmp)
        while found.iterations < SOAK_ITERATIONS and time.monotonic() < deadline:
            where = f"iteration {found.iterations}"
            mark = uuid.uuid4().hex
            outcome = await _cancelled_run(rng, cf, mark)
            found.outcomes[outcome] = found.outcomes.get(outcome, 0) + 1
            found.iterations += 1
            left = await soak_cancel.survivors(mark, ())
            if left:
                found.processes += len(left)
                found.details.append(
                    f"{where}: still running: {', '.join(map(soak_cancel.describe, left))}"
                )
                await soak_cancel.clean_up(mark, left)
            baseline.count(found, where)
    assert _template._templates == {}
    assert found.total() == 0, (
        f"seed {SOAK_SEED} on {loop_name()}: {found.summary()}\n" + "\n".join(found.details)
    )
    # both kinds of moment were hit: cancelled runs, and runs that finished first
    assert any(key.endswith("cancelled") for key in found.outcomes), found.outcomes
    assert found.iterations >= 50, found.summary()


# ------------------------------------------------------------------ the pytest plugin's ranks

PLUGIN = ("-p", "aioproc.pytest_plugin", "-p", "no:cacheprovider", "-o", "timeout=60")


def test_a_ranks_async_body_is_stopped_by_cancellation_as_group_workers_are(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plugin runs an ``async def`` body on the same runner: when rank 1
    fails, rank 0's stop cancels its body, whose ``finally`` runs (it awaits
    there), and the rank dies of the SIGTERM, reported as stopped."""
    monkeypatch.setenv("PYTHONPATH", REPO_ROOT)
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.delenv("AIOPROC_LIFELINE", raising=False)
    pytester.makepyfile(
        test_it=textwrap.dedent(
            """
            import asyncio, os
            import pytest
            from aioproc.testing import abarrier, rank

            @pytest.mark.aioproc(nprocs=2)
            async def test_rank_one_fails(tmp_path):
                loop = type(asyncio.get_running_loop()).__module__
                (tmp_path / f"pid_{rank()}").write_text(f"{os.getpid()} {loop}")
                if rank() == 1:
                    await abarrier()  # rank 0 is in its try: block
                    raise AssertionError("rank 1 fails")
                try:
                    await abarrier()
                    await asyncio.sleep(60)
                finally:
                    await asyncio.sleep(0.01)
                    (tmp_path / "finally_0").write_text("ran")
            """
        )
    )
    result = pytester.runpytest_subprocess(*PLUGIN)
    result.assert_outcomes(failed=1)
    (tmp,) = {p.parent for p in pytester.path.rglob("pid_0")}
    pid0, loop0 = (tmp / "pid_0").read_text().split()
    assert loop0.startswith("asyncio")
    result.stdout.fnmatch_lines(
        [
            "*rank 1 (pid *) failed: AssertionError: rank 1 fails",
            f"rank 0 (pid {pid0}) was killed by SIGTERM: stopped by aioproc after rank 1 failed",
        ]
    )
    assert (tmp / "finally_0").read_text() == "ran"
    assert pid_gone(int(pid0))


# ------------------------------------------------------------------ the agent, the cluster runner


async def test_the_agent_runs_coroutine_entrypoints(cf: ModuleType, tmp_path: Path) -> None:
    spec = WorkerSpec(role="coro", local_world_size=3, entrypoint=cf.rank_sum, args=(1, 2))
    result = await LocalElasticAgent(spec).run()
    assert result.return_values == {0: (3, "asyncio"), 1: (4, "asyncio"), 2: (5, "asyncio")}
    spec = dataclasses.replace(spec, local_world_size=2, worker_loop="uvloop")
    result = await LocalElasticAgent(spec).run()
    assert result.return_values == {0: (3, "uvloop"), 1: (4, "uvloop")}
    spec = WorkerSpec(
        role="coro", local_world_size=1, entrypoint=cf.fail, args=("agent",), max_restarts=0
    )
    result = await LocalElasticAgent(spec, log_dir=str(tmp_path)).run()
    assert result.is_failed()
    failure = result.failures[0]
    assert failure.exitcode == 1 and not failure.stopped
    assert frames(failure.message["extraInfo"]["py_callstack"]) == ["fail", "_inner"]


async def test_the_cluster_runner_runs_coroutine_tasks(cf: ModuleType) -> None:
    spec = aioproc.cluster.create_cluster_spec(has_chief=True, num_workers=2)
    result = await aioproc.cluster.run(cf.task_and_loop, spec, stream_output=False)
    assert result.return_value == [
        ("chief", 0, "asyncio"),
        ("worker", 0, "asyncio"),
        ("worker", 1, "asyncio"),
    ]
    result = await aioproc.cluster.run(
        cf.task_and_loop, {"worker": 2}, stream_output=False, worker_loop="uvloop"
    )
    assert result.return_value == [("worker", 0, "uvloop"), ("worker", 1, "uvloop")]
    # the task run in this process: on a loop of its own in the runner's thread
    runner = aioproc.cluster.ClusterRunner(
        cf.task_and_loop, {"chief": 1, "worker": 1}, stream_output=False, worker_loop="uvloop"
    )
    try:
        assert await runner.start_in_process_as("chief", 0) == ("chief", 0, "uvloop")
        assert "TF_CONFIG" not in os.environ  # restored
        result = await runner.join()
        assert result.return_value == [("worker", 0, "uvloop")]
    finally:
        await runner.aclose()
    result = await aioproc.cluster.run(cf.cluster_meet, {"worker": 3}, stream_output=False)
    assert result.return_value == ["met", "met", "met"]
    with pytest.raises(ValueError, match="cluster task failed") as info:
        await aioproc.cluster.run(
            cf.fail, {"worker": 1}, args=("cluster task failed",), stream_output=False
        )
    cause = str(info.value.__cause__)
    assert frames(cause) == ["fail", "_inner"], cause
