"""The pytest plugin (aioproc/pytest_plugin.py), run by pytest's own pytester.

Each test writes a small test file, runs pytest on it (in this process where
that is isolated enough, in a subprocess where it leaks or starts workers of
its own: the leak check, xdist, ``-s``), and checks what a user sees: the
outcome, the report's lines, and that the ranks' processes are gone.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import signal
import subprocess
import sys
import textwrap

import pytest
from helpers import REPO_ROOT, pid_gone

from aioproc import testing

PLUGIN = (
    "-p", "aioproc.pytest_plugin", "-p", "no:cacheprovider",
    "-o", "asyncio_default_fixture_loop_scope=function", "-ra",
    "-o", "timeout=30",  # an inner test that hangs fails in there (tests may override)
)  # fmt: skip


@pytest.fixture(autouse=True)
def subprocess_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """pytest runs in a subprocess: it imports this checkout's aioproc, and its
    guardian, groups and ranks are its own, never this process's."""
    monkeypatch.setenv("PYTHONPATH", REPO_ROOT)
    monkeypatch.setenv("COLUMNS", "200")  # summary lines in full
    monkeypatch.delenv("AIOPROC_LIFELINE", raising=False)


def write_test(pytester: pytest.Pytester, body: str, name: str = "test_it") -> None:
    pytester.makepyfile(**{name: textwrap.dedent(body)})


def pids_written(pytester: pytest.Pytester) -> list[int]:
    return [int(p.read_text()) for p in sorted(pytester.path.glob("pid_*"))]


def assert_all_gone(pids: list[int]) -> None:
    assert pids
    for pid in pids:
        assert pid_gone(pid), pid


def test_every_rank_runs_the_body_with_its_env_and_fixture_values(
    pytester: pytest.Pytester,
) -> None:
    write_test(
        pytester,
        """
        import json, os
        import pytest
        from aioproc.testing import rank, task, world_size

        @pytest.fixture
        def base():
            return 40

        @pytest.mark.aioproc(nprocs=3)
        @pytest.mark.parametrize("extra", [2])
        def test_sync(base, extra, tmp_path):
            env = [os.environ[k] for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR")]
            (tmp_path / f"rank{rank()}").write_text(f"{base + extra} {env} {world_size()}")
            open(f"pid_sync_{rank()}", "w").write(str(os.getpid()))

        @pytest.mark.aioproc(2)
        async def test_async(tmp_path):
            import asyncio
            await asyncio.sleep(0)
            (tmp_path / f"async{rank()}").write_text(os.environ["MASTER_PORT"])

        @pytest.mark.aioproc(cluster={"chief": 1, "worker": 2})
        def test_cluster(tmp_path):
            cluster = json.loads(os.environ["TF_CONFIG"])["cluster"]
            (tmp_path / f"task{rank()}").write_text(f"{task()} {sorted(cluster)} {world_size()}")

        def test_plain_tests_run_here():
            assert "RANK" not in os.environ

        class TestInAClass:
            @pytest.mark.aioproc(nprocs=2)
            def test_method(self, tmp_path):
                (tmp_path / f"method{rank()}").write_text(type(self).__name__)
        """,
    )
    result = pytester.runpytest_subprocess(*PLUGIN, "--basetemp", str(pytester.path / "tmp"))
    result.assert_outcomes(passed=5)
    tmp = pytester.path / "tmp"
    (method_dir,) = tmp.glob("test_method0")
    assert sorted(p.name for p in method_dir.iterdir()) == ["method0", "method1"]
    assert {p.read_text() for p in method_dir.iterdir()} == {"TestInAClass"}
    (sync_dir,) = tmp.glob("test_sync*0")
    assert sorted(p.read_text() for p in sync_dir.iterdir()) == [
        f"42 ['{r}', '3', '127.0.0.1'] 3" for r in range(3)
    ]
    (async_dir,) = tmp.glob("test_async*0")
    ports = {p.read_text() for p in async_dir.iterdir()}
    assert len(ports) == 1 and ports.pop().isdigit()  # one MASTER_PORT for all ranks
    (cluster_dir,) = tmp.glob("test_cluster*0")
    assert sorted(p.read_text() for p in cluster_dir.iterdir()) == [
        "('chief', 0) ['chief', 'worker'] 3",
        "('worker', 0) ['chief', 'worker'] 3",
        "('worker', 1) ['chief', 'worker'] 3",
    ]
    assert_all_gone(pids_written(pytester))


def test_a_failing_rank_is_the_failure_named_by_rank_with_every_ranks_output(
    pytester: pytest.Pytester,
) -> None:
    write_test(
        pytester,
        """
        import os, sys, threading
        import pytest
        from aioproc.testing import barrier, rank

        @pytest.mark.aioproc(nprocs=2)
        def test_ranks_disagree():
            open(f"pid_{rank()}", "w").write(str(os.getpid()))
            print(f"out of rank {rank()}")
            print(f"err of rank {rank()}", file=sys.stderr)
            if rank() == 1:  # the barrier breaks once rank 0 has passed (returned):
                with pytest.raises(threading.BrokenBarrierError):
                    barrier()
                # rank 0's process waits for rank 1's end, as torch's workers wait
                check(rank())

        def check(value):
            assert value == 0
        """,
    )
    result = pytester.runpytest_subprocess(*PLUGIN, "-rA")
    result.assert_outcomes(failed=1)
    pid1 = pids_written(pytester)[1]
    result.stdout.fnmatch_lines(
        [
            "*_ test_ranks_disagree _*",
            f"rank 1 (pid {pid1}) failed: AssertionError: assert 1 == 0",
            "Traceback (most recent call last):",
            '  File "*test_it.py", line 14, in test_ranks_disagree',
            "    check(rank())",
            '  File "*test_it.py", line 17, in check',
            "    assert value == 0",
            "AssertionError: assert 1 == 0",
            "",
            "passed: rank 0",
            "*- Captured stdout rank 0 call -*",
            "out of rank 0",
            "*- Captured stderr rank 0 call -*",
            "err of rank 0",
            "*- Captured stdout rank 1 call -*",
            "out of rank 1",
            "*- Captured stderr rank 1 call -*",
            "err of rank 1",
            "*short test summary info*",
            "FAILED test_it.py::test_ranks_disagree - rank 1: AssertionError: assert 1 == 0",
        ]
    )
    # the rank's machinery is not in the failure's traceback
    failure = result.stdout.str().split("Captured stdout")[0]
    assert "rank_child.py" not in failure and "_child/boot.py" not in failure
    assert_all_gone(pids_written(pytester))


def test_a_segfaulting_rank_shows_its_stack_and_the_others_are_stopped(
    pytester: pytest.Pytester,
) -> None:
    os.mkfifo(pytester.path / "rank0_waits")
    write_test(
        pytester,
        """
        import ctypes, os, threading
        import pytest
        from aioproc.testing import rank

        @pytest.mark.aioproc(nprocs=2)
        def test_crash():
            open(f"pid_{rank()}", "w").write(str(os.getpid()))
            if rank() == 1:
                open("rank0_waits").close()  # returns once rank 0 is waiting
                crash_here()
            with open("rank0_waits", "w"):
                threading.Event().wait()  # until it is stopped

        def crash_here():
            ctypes.string_at(0)
        """,
    )
    result = pytester.runpytest_subprocess(*PLUGIN, "--tb=short")
    result.assert_outcomes(failed=1)
    pid0, pid1 = pids_written(pytester)
    result.stdout.fnmatch_lines(
        [
            f"rank 1 (pid {pid1}) was killed by SIGSEGV",
            "Fatal Python error: Segmentation fault",
            "Current thread 0x* (most recent call first):",
            '  File "*test_it.py", line 15 in crash_here',
            '  File "*test_it.py", line 10 in test_crash',
            "*",
            f"rank 0 (pid {pid0}) was killed by SIGTERM: stopped by aioproc after rank 1 failed",
            "*short test summary info*",
            f"FAILED test_it.py::test_crash - rank 1 (pid {pid1}) was killed by SIGSEGV",
        ]
    )
    assert_all_gone([pid0, pid1])


HANGING = """
import os, threading, time
import pytest
from aioproc.testing import rank

def wait_forever():
    threading.Event().wait()

@pytest.mark.aioproc(nprocs=3{timeout})
def test_hang():
    open(f"pid_{{rank()}}", "w").write(str(os.getpid()))
    if rank() > 0:
        wait_forever()
"""


@pytest.mark.parametrize(
    ("marker", "options", "seconds"),
    [(", timeout=3", (), "3"), ("", ("-o", "timeout=2.5"), "2.5")],
    ids=["marker", "pytest-timeout"],
)
def test_a_hanging_rank_times_out_with_every_ranks_stack_in_the_report(
    pytester: pytest.Pytester, marker: str, options: tuple[str, ...], seconds: str
) -> None:
    pytester.makepyfile(test_it=HANGING.format(timeout=marker))
    result = pytester.runpytest_subprocess(*PLUGIN, *options)
    result.assert_outcomes(failed=1)
    _, pid1, pid2 = pids_written(pytester)
    result.stdout.fnmatch_lines(
        [
            f"Timeout: 3 ranks, timed out after {seconds}s: rank 1, rank 2 still running; "
            "their stacks:",
            f"--- rank 1 (pid {pid1}) ---",
            "Current thread 0x* (most recent call first):",
            '  File "*test_it.py", line 6 in wait_forever',
            '  File "*test_it.py", line 12 in test_hang',
            "*",
            f"--- rank 2 (pid {pid2}) ---",
            "*",
            '  File "*test_it.py", line 6 in wait_forever',
            "*",
            "passed: rank 0",
            "*short test summary info*",
            f"FAILED test_it.py::test_hang - timed out after {seconds}s: "
            "rank 1, rank 2 still running",
        ]
    )
    # each rank's dump is of its one thread: aioproc runs none of its own there
    lines = result.stdout.lines
    for rank, pid in ((1, pid1), (2, pid2)):
        first = lines[lines.index(f"--- rank {rank} (pid {pid}) ---") + 1]
        assert first.startswith("Current thread 0x"), first
    assert_all_gone(pids_written(pytester))


def test_an_interrupted_run_still_stops_its_ranks(pytester: pytest.Pytester) -> None:
    """pytest-timeout's signal lands while the ranks run (their own timeout is
    off): the test fails with pytest-timeout's error and no rank survives it."""
    pytester.makepyfile(test_it=HANGING.format(timeout=", timeout=0"))
    result = pytester.runpytest_subprocess(
        *PLUGIN, "-o", "timeout=4", "-o", "timeout_method=signal"
    )
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["FAILED test_it.py::test_hang - Failed: Timeout (>4.0s) *"])
    pids = pids_written(pytester)
    assert len(pids) == 3
    assert_all_gone(pids)


def test_skips_and_bad_markers(pytester: pytest.Pytester) -> None:
    write_test(
        pytester,
        """
        import threading
        import pytest
        from aioproc.testing import rank

        @pytest.fixture
        def lock():
            return threading.Lock()

        @pytest.mark.aioproc(nprocs=2)
        def test_skipped_by_a_rank():
            if rank() == 1:
                pytest.skip("needs two GPUs")

        @pytest.mark.aioproc(nprocs=0)
        def test_no_ranks():
            pass

        @pytest.mark.aioproc(nprocs=2, gpus=1)
        def test_unknown_argument():
            pass

        @pytest.mark.aioproc(nprocs=2)
        def test_unpicklable_fixture(lock):
            pass
        """,
    )
    result = pytester.runpytest_subprocess(*PLUGIN, "-rs", "--tb=line")
    result.assert_outcomes(skipped=1, failed=3)
    result.stdout.fnmatch_lines_random(
        [
            "SKIPPED [[]1[]] test_it.py:9: rank 1: needs two GPUs",
            "E   ValueError: aioproc nprocs must be a positive int, got 0",
            "E   TypeError: @pytest.mark.aioproc got unknown arguments ['gpus']",
            "E   TypeError: @pytest.mark.aioproc sends fixture values to the ranks, and these "
            "cannot be pickled: 'lock' (lock: *",
        ]
    )


def test_dash_s_streams_each_ranks_output_live_with_its_prefix(pytester: pytest.Pytester) -> None:
    write_test(
        pytester,
        """
        import sys
        import pytest
        from aioproc.testing import rank

        @pytest.mark.aioproc(nprocs=2)
        def test_talk():
            print(f"hello {rank()}")
            print(f"oops {rank()}", file=sys.stderr)
        """,
    )
    result = pytester.runpytest_subprocess(*PLUGIN, "-s")
    result.assert_outcomes(passed=1)
    # (the first may follow pytest's "test_it.py " on its line)
    assert sorted(re.findall(r"\[rank \d\] .*", result.stdout.str())) == [
        "[rank 0] hello 0",
        "[rank 1] hello 1",
    ]
    assert sorted(line for line in result.errlines if line.startswith("[rank")) == [
        "[rank 0] oops 0",
        "[rank 1] oops 1",
    ]


ANYIO_ASYNCIO_ONLY = """
pytestmark = pytest.mark.anyio

@pytest.fixture
def anyio_backend():
    return "asyncio"  # aioproc runs on asyncio loops (under trio it says so)
"""

GROUP_TESTS = """
import os, sys
import pytest
{mark}

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]

def echo(text):
    print(text)
    return text * 2

async def test_group_returns_values(aioproc_group):
    pc = await aioproc_group(echo, 2, args={{0: ("a",), 1: ("b",)}})
    result = await pc.wait()
    assert result.return_values == {{0: "aa", 1: "bb"}}

async def test_group_left_running_is_closed_at_teardown(aioproc_group):
    pc = await aioproc_group(sys.executable, 2, args=("-c", "import time; time.sleep(60)"))
    for rank, pid in pc.pids().items():
        open(f"pid_{{rank}}", "w").write(str(pid))

async def test_failing_test_still_closes(aioproc_group):
    pc = await aioproc_group(sys.executable, 1, args=("-c", "import time; time.sleep(60)"))
    open("pid_failing", "w").write(str(pc.pids()[0]))
    assert False, "the test fails"

async def test_pool(aioproc_pool):
    pool = await aioproc_pool(2)
    pids = await pool.run(os.getpid)
    open("pid_pool", "w").write(" ".join(map(str, pids)))
    assert await pool.submit(echo, "x") == "xx"

def sleep_forever():
    import time
    time.sleep(60)

async def test_cluster_left_running_is_stopped_at_teardown(aioproc_cluster):
    runner = await aioproc_cluster(sleep_forever, {{"chief": 1, "worker": 2}}, stream_output=False)
    pids = [runner.get_process_id(t, i) for t, i in [("chief", 0), ("worker", 0), ("worker", 1)]]
    open("pid_cluster", "w").write(" ".join(map(str, pids)))

async def test_cluster_returns_values(aioproc_cluster):
    spec = {{"chief": 1, "worker": 1}}
    runner = await aioproc_cluster(echo, spec, args=("c",), stream_output=False)
    assert (await runner.join(60)).return_value == ["cc", "cc"]
"""


@pytest.mark.parametrize(
    "mode",
    [
        ("-o", "asyncio_mode=strict", "-p", "no:anyio"),
        ("-o", "asyncio_mode=auto", "-p", "no:anyio"),
        ("-p", "no:asyncio", "-p", "anyio"),
    ],
    ids=["asyncio-strict", "asyncio-auto", "anyio"],
)
def test_group_and_pool_fixtures_close_what_they_started(
    pytester: pytest.Pytester, mode: tuple[str, ...]
) -> None:
    if "anyio" in mode:
        mark = ANYIO_ASYNCIO_ONLY
    elif "asyncio_mode=strict" in mode:
        mark = "pytestmark = pytest.mark.asyncio"
    else:
        mark = ""
    write_test(pytester, GROUP_TESTS.format(mark=mark))
    result = pytester.runpytest_subprocess(*PLUGIN, *mode, "--aioproc-leakcheck")
    result.assert_outcomes(passed=5, failed=1)
    result.stdout.fnmatch_lines(["*AssertionError: the test fails*"])
    pids = [int(p) for f in pytester.path.glob("pid_*") for p in f.read_text().split()]
    assert len(pids) == 8
    assert_all_gone(pids)


CANCELLED_TESTS = """
import asyncio, os, sys
import pytest
{mark}

async def test_cancelled_mid_test(aioproc_group, aioproc_pool, aioproc_cluster):
    pc = await aioproc_group(sys.executable, 1, args=("-c", "import time; time.sleep(60)"))
    pool = await aioproc_pool(1)
    runner = await aioproc_cluster(sleep_forever, {{"worker": 1}}, stream_output=False)
    pids = [pc.pids()[0], *(await pool.run(os.getpid)), runner.get_process_id("worker", 0)]
    open("pid_cancelled", "w").write(" ".join(map(str, pids)))
    asyncio.current_task().cancel()
    await asyncio.sleep(30)

def sleep_forever():
    import time
    time.sleep(60)
"""


@pytest.mark.parametrize(
    "mode",
    [
        ("-o", "asyncio_mode=strict", "-p", "no:anyio"),
        ("-o", "asyncio_mode=auto", "-p", "no:anyio"),
    ],
    ids=["asyncio-strict", "asyncio-auto"],
)
def test_fixtures_close_what_they_started_when_the_test_is_cancelled(
    pytester: pytest.Pytester, mode: tuple[str, ...]
) -> None:
    """The test's task is cancelled: it fails with CancelledError, and the
    teardown still closes everything, so the leak check finds nothing.
    (Under anyio's plugin the test's task is anyio's runner task: cancelling
    it leaves anyio unable to run any async fixture's teardown.)"""
    mark = "pytestmark = pytest.mark.asyncio" if "asyncio_mode=strict" in mode else ""
    write_test(pytester, CANCELLED_TESTS.format(mark=mark))
    result = pytester.runpytest_subprocess(*PLUGIN, *mode, "--aioproc-leakcheck")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["FAILED test_it.py::test_cancelled_mid_test - *CancelledError*"])
    assert "leaked" not in result.stdout.str(), result.stdout.str()
    pids = [int(p) for p in (pytester.path / "pid_cancelled").read_text().split()]
    assert len(pids) == 3
    assert_all_gone(pids)


@pytest.mark.parametrize("autoload", [True, False], ids=["entry-points", "explicit-p"])
def test_strict_mode_fixtures_raise_no_deprecation_warning(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, autoload: bool
) -> None:
    """In strict mode pytest-asyncio warns about async fixtures not made with
    its decorator: the factories give it none, whether pytest-asyncio came in
    by its entry point or by ``-p pytest_asyncio.plugin``."""
    write_test(
        pytester,
        """
        import sys
        import pytest

        @pytest.mark.asyncio
        async def test_all_three(aioproc_group, aioproc_pool, aioproc_cluster):
            pc = await aioproc_group(sys.executable, 1, args=("-c", "pass"))
            assert not (await pc.wait()).is_failed()
            pool = await aioproc_pool(1)
            assert await pool.submit(len, "abc") == 3
            runner = await aioproc_cluster(len, {"worker": 1}, args=("ab",), stream_output=False)
            assert (await runner.join(60)).return_value == [2]
        """,
    )
    extra: tuple[str, ...] = ()
    if not autoload:
        monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
        extra = ("-p", "pytest_asyncio.plugin", "-p", "pytest_timeout")
    result = pytester.runpytest_subprocess(
        *PLUGIN, *extra, "-o", "asyncio_mode=strict", "-W", "error::pytest.PytestDeprecationWarning"
    )
    result.assert_outcomes(passed=1)


def test_a_test_interrupted_while_awaiting_still_closes_its_groups(
    pytester: pytest.Pytester,
) -> None:
    """pytest-timeout's signal interrupts the test's await (the group still
    runs): teardown closes the group on the test's loop all the same."""
    write_test(
        pytester,
        """
        import asyncio, sys
        import pytest

        @pytest.mark.asyncio
        async def test_stuck(aioproc_group, aioproc_pool):
            pc = await aioproc_group(sys.executable, 2, args=("-c", "import time; time.sleep(60)"))
            pool = await aioproc_pool(1)
            pids = [*pc.pids().values(), *pool.pids()]
            open("pids", "w").write(" ".join(map(str, pids)))
            await asyncio.Event().wait()
        """,
    )
    result = pytester.runpytest_subprocess(
        *PLUGIN, "-o", "timeout=3", "-o", "timeout_method=signal", "--aioproc-leakcheck"
    )
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["FAILED test_it.py::test_stuck - Failed: Timeout (>3.0s) *"])
    pids = [int(p) for p in (pytester.path / "pids").read_text().split()]
    assert len(pids) == 3
    assert_all_gone(pids)


ASYNC_BODIES = """
import asyncio, os
import pytest
from aioproc.testing import rank

def library():
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        import trio
        trio.lowlevel.current_task()  # raises outside trio too
        return "trio"
    return "asyncio"

@pytest.mark.aioproc(nprocs=2)
async def test_unmarked(tmp_path):
    (tmp_path / f"r{rank()}").write_text(type(asyncio.get_running_loop()).__module__)

@pytest.mark.asyncio
@pytest.mark.aioproc(nprocs=2)
async def test_asyncio_marked(tmp_path):
    (tmp_path / f"r{rank()}").write_text(library())

@pytest.mark.anyio
@pytest.mark.aioproc(nprocs=2)
async def test_anyio(anyio_backend, tmp_path):
    (tmp_path / f"r{rank()}").write_text(library())
"""


UNMARKED = {"test_unmarked": "asyncio.unix_events"}
# anyio runs the body once per backend it has: asyncio, and trio where installed
ANYIO = {"test_anyio_asyncio_": "asyncio"}
if importlib.util.find_spec("trio") is not None:
    ANYIO["test_anyio_trio_"] = "trio"


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        (("-o", "asyncio_mode=strict"), {**UNMARKED, "test_asyncio_marked": "asyncio", **ANYIO}),
        (
            ("-o", "asyncio_mode=auto", "-p", "no:anyio", "-k", "not anyio"),
            {**UNMARKED, "test_asyncio_marked": "asyncio"},
        ),
        (("-p", "no:asyncio", "-k", "not asyncio_marked"), {**UNMARKED, **ANYIO}),
    ],
    ids=["asyncio-strict", "asyncio-auto", "anyio"],
)
def test_multi_rank_async_bodies_under_each_async_plugin(
    pytester: pytest.Pytester, mode: tuple[str, ...], expected: dict[str, str]
) -> None:
    pytester.makepyfile(test_it=ASYNC_BODIES)
    result = pytester.runpytest_subprocess(*PLUGIN, *mode, "--basetemp", str(pytester.path / "tmp"))
    result.assert_outcomes(passed=len(expected))
    found = {
        p.parent.name.rstrip("0123456789"): p.read_text()
        for p in (pytester.path / "tmp").glob("*[0-9]/r*")
    }
    assert found == expected


def test_ranks_run_async_bodies_on_the_loop_pytest_asyncio_chose(
    pytester: pytest.Pytester,
) -> None:
    """With pytest-asyncio's loop factories (this suite's asyncio + uvloop), each
    parametrised run's ranks use that run's loop."""
    pytest.importorskip("uvloop")
    pytester.makeconftest(
        """
        import asyncio, uvloop

        def pytest_asyncio_loop_factories(config, item):
            return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
        """
    )
    write_test(
        pytester,
        """
        import asyncio
        import pytest
        from aioproc.testing import rank

        @pytest.mark.aioproc(nprocs=2)
        async def test_loop(tmp_path):
            (tmp_path / f"r{rank()}").write_text(type(asyncio.get_running_loop()).__module__)
        """,
    )
    result = pytester.runpytest_subprocess(
        *PLUGIN, "-o", "asyncio_mode=auto", "--basetemp", str(pytester.path / "tmp")
    )
    result.assert_outcomes(passed=2)
    found = sorted(p.read_text() for p in (pytester.path / "tmp").glob("*[0-9]/r*"))
    assert found == ["asyncio.unix_events"] * 2 + ["uvloop"] * 2


def test_under_xdist(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    tmp = pytester.path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    write_test(
        pytester,
        """
        import os, threading
        import pytest
        from aioproc.testing import rank

        @pytest.mark.aioproc(nprocs=2)
        @pytest.mark.parametrize("i", range(3))
        def test_ranks(i):
            open(f"pid_{i}_{rank()}", "w").write(str(os.getpid()))

        @pytest.mark.aioproc(nprocs=2)
        def test_fails():
            if rank() == 0:
                threading.Event().wait()  # until rank 1's failure stops it
            assert rank() == 0
        """,
    )
    result = pytester.runpytest_subprocess(*PLUGIN, "-n", "2", "--aioproc-leakcheck")
    result.assert_outcomes(passed=3, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*rank 1 (pid *) failed: AssertionError: assert 1 == 0",
            '  File "*test_it.py", line 14, in test_fails',
            "    assert rank() == 0",
            "rank 0 (pid *) was killed by SIGTERM: stopped by aioproc after rank 1 failed",
        ]
    )
    assert_all_gone(pids_written(pytester))
    assert len(pids_written(pytester)) == 6
    # each worker's private temp dir, and the controller's, went before the run ended
    assert [p.name for p in tmp.iterdir() if not p.name.startswith("pytest-of-")] == []


WAITING = """
import os, threading

def test_waits_1():
    wait()

def test_waits_2():
    wait()

def wait():
    with open(os.environ["READY"], "w") as ready:
        ready.write("waiting\\n")
    threading.Event().wait(60)
"""


def test_an_interrupted_xdist_run_leaves_no_temp_dir(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C (SIGINT to the whole process group) while every xdist worker is
    in a test: the controller's and the workers' temp dirs all go."""
    tmp = pytester.path / "tmp"
    tmp.mkdir()
    ready = pytester.path / "ready"
    os.mkfifo(ready)
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setenv("READY", str(ready))
    pytester.makepyfile(test_it=WAITING)
    run = subprocess.Popen(
        [sys.executable, "-m", "pytest", *PLUGIN, "-n", "2", "--aioproc-leakcheck"],
        cwd=pytester.path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # a process group of its own, as a terminal's job
    )
    try:
        # read and write: the first test's line and close is no EOF for the second's
        with open(os.open(ready, os.O_RDWR)) as lines:
            assert [lines.readline(), lines.readline()] == ["waiting\n"] * 2
        made = sorted(p.name for p in tmp.iterdir() if p.name.startswith("aioproc-leakcheck-"))
        assert len(made) == 1, made  # the controller's, holding the workers'
        assert len(list((tmp / made[0]).iterdir())) == 2
        os.killpg(run.pid, signal.SIGINT)
        out, _ = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.communicate()
    assert run.returncode == 2, out.decode(errors="replace")  # interrupted
    assert [p.name for p in tmp.iterdir() if not p.name.startswith("pytest-of-")] == []


SHARED_TMP = """
import os, tempfile

def test_another_programs_dir():
    # another pytest run, or any program, making an aioproc dir in $TMPDIR meanwhile
    os.mkdir(os.path.join(os.environ["TMPDIR"], "aioproc_theirs"))

def test_its_own_dir():
    open(os.path.join(tempfile.mkdtemp(prefix="aioproc_"), "log"), "w").close()
"""


@pytest.mark.parametrize("mode", ["-n0", "-n2"], ids=["one-process", "xdist"])
def test_the_leak_check_counts_only_its_own_aioproc_temp_dirs(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """$TMPDIR is shared: an aioproc dir another program makes there is neither
    blamed on a test nor removed; one the test made is both."""
    tmp = pytester.path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    pytester.makepyfile(test_it=SHARED_TMP)
    result = pytester.runpytest_subprocess(*PLUGIN, "--aioproc-leakcheck", mode)
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(
        ["*test_it.py::test_its_own_dir leaked:", "- left in the temp dir *: [[]'aioproc_*']"]
    )
    assert "test_another_programs_dir leaked" not in result.stdout.str()
    assert [p.name for p in tmp.iterdir()] == ["aioproc_theirs"]


LEAKY = """
import os, subprocess, sys, threading
import pytest

def test_leaks_a_process():
    code = "import time; print('ready', flush=True); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    proc.stdout.readline()  # running its code, not still in exec
    proc.stdout.close()
    open("pid_leaked", "w").write(str(proc.pid))

def test_leaks_an_fd():
    fd = os.open(os.devnull, os.O_RDONLY)
    open("fd_leaked", "w").write(str(fd))

def test_leaks_a_thread():
    stop = threading.Event()
    threading.Thread(target=stop.wait, name="forgotten", daemon=True).start()

def test_leaves_a_group_open():
    import asyncio, aioproc
    code = "open('group_ready', 'w').close(); import time; time.sleep(60)"
    loop = asyncio.new_event_loop()  # never closed: nor is the group started on it
    pc = loop.run_until_complete(aioproc.start_processes(
        "left", sys.executable, {0: ("-c", code)}, {0: {}}
    ))
    open("group_ready").read()  # a FIFO: the worker runs its code, past exec
    open("pid_group", "w").write(str(pc.pids()[0]))

def test_clean():
    with open(os.devnull) as f:
        f.read()
"""


def test_leak_check_names_what_leaked_and_removes_it(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_it=LEAKY)
    os.mkfifo(pytester.path / "group_ready")
    result = pytester.runpytest_subprocess(
        *PLUGIN, "-o", "asyncio_mode=auto", "--aioproc-leakcheck"
    )
    result.assert_outcomes(passed=5, errors=4)
    leaked = int((pytester.path / "pid_leaked").read_text())
    fd = int((pytester.path / "fd_leaked").read_text())
    group = int((pytester.path / "pid_group").read_text())
    result.stdout.fnmatch_lines_random(
        [
            "*test_it.py::test_leaks_a_process leaked:",
            f"- child processes left behind: pid {leaked}: {sys.executable} -c import time; "
            "print('ready', flush=True); time.sleep(60)",
            "*test_it.py::test_leaks_an_fd leaked:",
            f"- file descriptors left open: {fd} -> /dev/null",
            "*test_it.py::test_leaks_a_thread leaked:",
            "- threads left running: <Thread(forgotten, started daemon *)>",
            "*test_it.py::test_leaves_a_group_open leaked:",
            # a face held only by the test's frame may be collected by then: named either way
            "- aioproc handles never closed (close each with aclose(), or leave its "
            "`async with`): *PContext*left*",
            f"- worker processes still running, killed: process group {group} led by pid "
            f"{group}: {sys.executable} -c open('group_ready', 'w').close(); import time; "
            "time.sleep(60)",
            "ERROR test_it.py::test_leaks_a_process - Failed: *",
        ]
    )
    assert "test_clean leaked" not in result.stdout.str()
    # the group's guardian is aioproc's: never blamed on the test
    children = {line for line in result.stdout.lines if "child processes left behind" in line}
    assert children == {
        f"- child processes left behind: pid {leaked}: {sys.executable} -c import time; "
        "print('ready', flush=True); time.sleep(60)"
    }
    assert_all_gone([leaked, group])


UNCLOSED = """
import asyncio, os, sys
import pytest
import aioproc
from aioproc.agent import LocalElasticAgent, WorkerSpec

SLEEP = ("-c", "import time; time.sleep(60)")

def pid(what, value):
    open(f"pid_{what}", "w").write(str(value))

async def test_a_group():
    pc = await aioproc.start_processes("trainer", sys.executable, {0: SLEEP}, {0: {}})
    pid("group", pc.pids()[0])

async def test_a_finished_group():
    pc = await aioproc.start_processes("quick", sys.executable, {0: ("-c", "pass")}, {0: {}})
    while pc.poll() is None:  # finished, never waited for nor closed
        await asyncio.sleep(0.01)

async def test_a_pool():
    pool = await aioproc.open_pool(1, name="squares")
    pid("pool", pool.pids()[0])

async def test_a_worker():
    w = await aioproc.open_worker(name="cache")
    pid("worker", w.pid)

async def test_an_agent():
    spec = WorkerSpec(role="ranker", local_world_size=1, entrypoint=sys.executable, args=SLEEP)
    agent = LocalElasticAgent(spec)
    run = asyncio.ensure_future(agent.run())  # never awaited, and the agent never stopped
    while not agent.pids():
        await asyncio.sleep(0.01)
    pid("agent", agent.pids()[0])

async def test_each_closed_its_own_way():
    pc = await aioproc.start_processes("waited", sys.executable, {0: ("-c", "pass")}, {0: {}})
    await pc.wait()  # a final result closes the group, as in torch
    pc = await aioproc.start_processes("closed", sys.executable, {0: SLEEP}, {0: {}})
    await pc.close()
    async with aioproc.start_processes("with", sys.executable, {0: ("-c", "pass")}, {0: {}}):
        pass
    pool = await aioproc.open_pool(1)
    await pool.aclose()
    async with aioproc.open_worker():
        pass
    spec = WorkerSpec(role="ran", local_world_size=1, entrypoint=sys.executable, args=("-c", ""))
    await LocalElasticAgent(spec).run()
    agent = LocalElasticAgent(
        WorkerSpec(role="stopped", local_world_size=1, entrypoint=sys.executable, args=SLEEP)
    )
    run = asyncio.ensure_future(agent.run())
    while not agent.pids():
        await asyncio.sleep(0.01)
    await agent.stop()
    await run
"""


@pytest.mark.parametrize("mode", ["-n0", "-n2"], ids=["one-process", "xdist"])
def test_unclosed_handles_fail_the_test_naming_each(pytester: pytest.Pytester, mode: str) -> None:
    """A group, pool, worker or agent a test opened and never closed fails it,
    named (its repr, or its type and name once collected), however the loop's
    shutdown stopped its processes; each is killed, and the next test starts clean."""
    pytester.makepyfile(test_it=UNCLOSED)
    result = pytester.runpytest_subprocess(
        *PLUGIN, "-o", "asyncio_mode=auto", "--aioproc-leakcheck", mode
    )
    result.assert_outcomes(passed=6, errors=5)
    never = "- aioproc handles never closed (close each with aclose(), or leave its `async with`): "
    result.stdout.fnmatch_lines_random(
        [
            "*test_it.py::test_a_group leaked:",
            never + "*PContext*trainer*",
            "*test_it.py::test_a_finished_group leaked:",
            never + "*PContext*quick*",
            "*test_it.py::test_a_pool leaked:",
            never + "*WorkerPool*'squares'*",
            "*test_it.py::test_a_worker leaked:",
            never + "*WorkerProcess*cache*",
            "*test_it.py::test_an_agent leaked:",
            never + "*LocalElasticAgent ranker x1*",
        ]
    )
    assert "test_each_closed_its_own_way leaked" not in result.stdout.str()
    assert_all_gone(pids_written(pytester))
    assert len(pids_written(pytester)) == 4


def test_leak_checks_child_list_keeps_a_child_whose_thread_exits_mid_scan(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A thread starts a child and exits while its threads' children are read,
    after the main thread's list was read: the child moves to the main thread's
    list, and the scan must still find it (it once missed it: a false report)."""
    import subprocess
    import threading

    from aioproc._base import children
    from aioproc._plugin import leakcheck

    started: list[subprocess.Popen[bytes]] = []
    release = threading.Event()

    def start_then_exit() -> None:
        started.append(subprocess.Popen(["/bin/sleep", "100"]))
        release.wait(10)

    thread = threading.Thread(target=start_then_exit)
    thread.start()
    while not started:
        release.wait(0.001)
    child = started[0]
    main = f"/proc/self/task/{os.getpid()}/children"
    real_open = open

    def exit_after_main(path: str, *args: object, **kw: object) -> object:
        f = real_open(path, *args, **kw)  # type: ignore[call-overload]
        if path == main and thread.is_alive():
            release.set()
            thread.join(10)  # the child is the main thread's now, read already
        return f

    try:
        monkeypatch.setattr(children, "open", exit_after_main, raising=False)
        found = leakcheck.child_pids()
    finally:
        release.set()
        thread.join(10)
        child.kill()
        child.wait()
    assert child.pid in found


def test_leak_check_is_opt_in_per_test_by_marker_or_fixture(pytester: pytest.Pytester) -> None:
    write_test(
        pytester,
        """
        import os
        import pytest

        def test_unchecked():
            open("fd_unchecked", "w").write(str(os.open(os.devnull, os.O_RDONLY)))

        @pytest.mark.aioproc_leakcheck
        def test_marked():
            os.open(os.devnull, os.O_RDONLY)

        def test_fixture(aioproc_leakcheck):
            os.open(os.devnull, os.O_RDONLY)
        """,
    )
    result = pytester.runpytest_subprocess(*PLUGIN)
    result.assert_outcomes(passed=3, errors=2)
    result.stdout.fnmatch_lines_random(
        [
            "ERROR test_it.py::test_marked - Failed: test_it.py::test_marked leaked:",
            "ERROR test_it.py::test_fixture - Failed: test_it.py::test_fixture leaked:",
        ]
    )


GONE_TMPDIR = """
import os, shutil, tempfile

def test_removes_its_tmpdir():
    shutil.rmtree(os.environ["TMPDIR"])  # as another program might
    tempfile.tempdir = None  # tempfile now falls back to the system's temp dir
    open("fallback", "w").write(tempfile.gettempdir())
    open(os.path.join(tempfile.gettempdir(), os.environ["CANARY"] + "-1"), "w").close()

def test_after_it():  # another program's file, in the system's temp dir meanwhile
    open(os.path.join(tempfile.gettempdir(), os.environ["CANARY"] + "-2"), "w").close()
"""


def test_all_mode_never_counts_another_dir_than_tmpdir(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``aioproc_leakcheck_tmpdir = all`` and $TMPDIR gone, the check says
    so, and never turns to the system's temp dir, where it would take (and
    remove) every other program's new files for the test's."""
    tmp = pytester.path / "tmp"
    tmp.mkdir()
    canary = f"aioproc-test-canary-{os.getpid()}-{id(tmp)}"
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setenv("CANARY", canary)
    pytester.makepyfile(test_it=GONE_TMPDIR)
    system_tmp: list[str] = []
    try:
        result = pytester.runpytest_subprocess(
            *PLUGIN, "--aioproc-leakcheck", "-o", "aioproc_leakcheck_tmpdir=all"
        )
        fallback = (pytester.path / "fallback").read_text()
        assert fallback != str(tmp)
        system_tmp = [os.path.join(fallback, f"{canary}-{i}") for i in (1, 2)]
        result.assert_outcomes(passed=2, errors=2)
        result.stdout.fnmatch_lines(
            [f"- the temp dir {tmp} ($TMPDIR) is gone: removed by another program? *"] * 2
        )
        assert "left in the temp dir" not in result.stdout.str()
        assert all(os.path.exists(p) for p in system_tmp)
    finally:
        for path in system_tmp:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def test_all_mode_needs_a_tmpdir(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TMPDIR")
    write_test(pytester, "def test_nothing():\n    pass\n")
    result = pytester.runpytest_subprocess(
        *PLUGIN, "--aioproc-leakcheck", "-o", "aioproc_leakcheck_tmpdir=all"
    )
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["ERROR: aioproc_leakcheck_tmpdir = 'all' counts every new entry of $TMPDIR, *"]
    )


def test_a_bad_tmpdir_mode_is_a_usage_error(pytester: pytest.Pytester) -> None:
    write_test(pytester, "def test_nothing():\n    pass\n")
    result = pytester.runpytest_subprocess(*PLUGIN, "-o", "aioproc_leakcheck_tmpdir=some")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["ERROR: aioproc_leakcheck_tmpdir must be 'aioproc' or 'all', got 'some'"]
    )


def test_plugin_is_inert_for_tests_that_do_not_use_it(pytester: pytest.Pytester) -> None:
    write_test(
        pytester,
        """
        import sys

        def test_nothing_of_aioproc_is_imported():
            assert [m for m in sys.modules if m.startswith("aioproc")] == [
                "aioproc", "aioproc.pytest_plugin"
            ]
        """,
    )
    result = pytester.runpytest_subprocess(*PLUGIN)
    result.assert_outcomes(passed=1)


def test_testing_helpers_outside_a_rank_say_so(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "TF_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match=re.escape("$RANK is not set: aioproc.testing")):
        testing.rank()
    with pytest.raises(RuntimeError, match=re.escape("$WORLD_SIZE is not set")):
        testing.world_size()
    with pytest.raises(RuntimeError, match=re.escape("$TF_CONFIG is not set")):
        testing.task()
    monkeypatch.setenv("RANK", "two")
    with pytest.raises(RuntimeError, match=re.escape("$RANK must be an integer, got 'two'")):
        testing.rank()
    monkeypatch.setenv("RANK", "2")
    assert testing.rank() == 2
    assert sys.modules["aioproc.testing"] is testing


def test_barrier_meets_every_rank_and_breaks_when_one_leaves(pytester: pytest.Pytester) -> None:
    write_test(
        pytester,
        """
        import os, threading
        import pytest
        from aioproc.testing import abarrier, barrier, rank

        @pytest.mark.aioproc(nprocs=3, timeout=60)
        def test_meet(tmp_path):
            (tmp_path / f"before{rank()}").write_text("")
            barrier()
            # nobody passes the barrier before every rank wrote its file
            assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("before")) == [
                "before0", "before1", "before2"
            ]
            barrier()  # reusable

        @pytest.mark.aioproc(nprocs=2, timeout=60)
        async def test_left(tmp_path):
            if rank() == 0:
                return  # ends without reaching the barrier
            with pytest.raises(RuntimeError, match="await aioproc.testing.abarrier()"):
                barrier()  # would block this rank's running loop
            with pytest.raises(threading.BrokenBarrierError) as info:
                await abarrier()
            (tmp_path.parent / "broken.txt").write_text(str(info.value))

        def test_outside_a_rank():
            with pytest.raises(RuntimeError, match="barrier"):
                barrier()
        """,
    )
    result = pytester.runpytest_subprocess(*PLUGIN)
    result.assert_outcomes(passed=3)
    broken = list(pytester.path.parent.rglob("broken.txt"))
    assert len(broken) == 1
    reason = broken[0].read_text()
    assert reason == "barrier broken: pytest/0 exited with code 0 without reaching it"
