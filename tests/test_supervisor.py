"""aioproc._supervisor: one GroupSpec, the crew's one stop, and a group's close vocabulary.

What users see of the crew behind ``PContext``: the group's options in one
spec with one default grace period; ``close()`` and ``aclose()`` that honour
the group's own grace period; a failure and the close after it being one
stop (the later close can only bring its end forward); the logs spec's
planning hook.  Binary workers that ignore SIGTERM (``children/grandchild.py``)
make every grace period observable; they report on a FIFO when ready.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import envs, pid_gone, release_fifo
from proc_utils import Fifo, still_alive_after

import aioproc
from aioproc import DefaultLogsSpecs, ForcedKillWarning, LogsDest, LogsPlan, LogsSpecs, PContext
from aioproc._supervisor.spec import DEFAULT_GRACE_PERIOD, GroupSpec
from aioproc.metrics import Recorder

CHILDREN = Path(__file__).parent / "children"
GRANDCHILD = str(CHILDREN / "grandchild.py")
# rank 0 of the failure tests: exits 3 once the test writes a byte to the FIFO in argv[1]
FAILS_WHEN_RELEASED = "import os, sys; os.read(os.open(sys.argv[1], os.O_RDONLY), 1); sys.exit(3)"


async def deaf_group(fifo: Fifo, n: int, **options: Any) -> aioproc.PContext:
    """``n`` binary workers that ignore SIGTERM, each with a ``sleep`` in its group; ready."""
    pc = await aioproc.start_processes(
        "deaf",
        sys.executable,
        {r: (GRANDCHILD, fifo.path, "ignore-term") for r in range(n)},
        envs(n),
        **options,
    )
    await fifo.pid_pairs(n)
    return pc


# ------------------------------------------------------------ the group spec


def test_one_default_grace_period_for_every_way_to_make_a_group() -> None:
    """The default is written once, in the spec; every entry point has that one."""
    assert DEFAULT_GRACE_PERIOD == 30.0
    field = {f.name: f for f in dataclasses.fields(GroupSpec)}["grace_period"]
    assert field.default == DEFAULT_GRACE_PERIOD
    for fn in (aioproc.start_processes, aioproc.run, aioproc.LocalElasticAgent.__init__):
        assert inspect.signature(fn).parameters["grace_period"].default == DEFAULT_GRACE_PERIOD
    pc = PContext("torch", "/bin/true", {0: ()}, {0: {}}, DefaultLogsSpecs())
    assert pc.grace_period == DEFAULT_GRACE_PERIOD


def test_a_spec_is_checked_once_into_its_one_form_and_derived_by_replace() -> None:
    spec = GroupSpec(
        "g",
        "/bin/true",
        {0: [], 1: ["x"]},  # type: ignore[dict-item]
        {0: {}, 1: {}},
        DefaultLogsSpecs(),
        grace_period=2,
        duplicate_stdout_filters=["a"],
        pass_fds=[],
        preload=[],
    )
    checked = spec.check()
    assert checked.args == {0: (), 1: ("x",)}
    assert checked.grace_period == 2.0 and isinstance(checked.grace_period, float)
    assert checked.duplicate_stdout_filters == ("a",)
    assert checked.pass_fds == () and checked.preload == ()
    assert checked.kwargs is None
    assert checked.check() == checked  # a checked spec passes its check again, unchanged
    assert len(checked.sinks or ()) == 1  # the group's own ConsoleSink, which it closes
    assert checked.close_sinks
    with pytest.raises(dataclasses.FrozenInstanceError):
        checked.grace_period = 5  # type: ignore[misc]
    # an attempt of the agent or a cluster task: the shared spec with its own ranks
    attempt = dataclasses.replace(checked, args={0: ("y",)}, envs={0: {"A": "1"}}).check()
    assert (attempt.args, attempt.envs, attempt.grace_period) == ({0: ("y",)}, {0: {"A": "1"}}, 2.0)


@pytest.mark.parametrize(
    ("option", "value", "needles"),
    [
        ("grace_period", -1, ["grace_period", "-1"]),
        ("grace_period", float("nan"), ["grace_period", "nan"]),
        ("sample_interval", 0, ["sample_interval", "0"]),
        ("pass_fds", "3", ["pass_fds", "'3'"]),
        ("duplicate_stderr_filters", "err", ["duplicate_stderr_filters", "'err'"]),
    ],
)
def test_bad_options_are_named_by_the_check(option: str, value: object, needles: list[str]) -> None:
    spec = GroupSpec("g", "/bin/true", {0: ()}, {0: {}}, DefaultLogsSpecs(), **{option: value})
    with pytest.raises((TypeError, ValueError)) as info:
        spec.check()
    for needle in needles:
        assert needle in str(info.value)


def test_pcontext_names_an_option_it_does_not_have() -> None:
    with pytest.raises(TypeError, match=r"\['grace', 'timeout'\]"):
        PContext("g", "/bin/true", {0: ()}, {0: {}}, DefaultLogsSpecs(), grace=1, timeout=2)


# --------------------------------------------------- close, aclose, grace period


@pytest.mark.timeout(40)
@pytest.mark.parametrize("verb", ["close", "aclose"])
async def test_close_without_a_grace_period_uses_the_groups(verb: str, tmp_path: Path) -> None:
    """Not torch's 30 s: the group's own ``grace_period`` (a wait of 30 s would time out)."""
    async with Fifo(tmp_path / "ready") as fifo:
        pc = await deaf_group(fifo, 2, grace_period=0.5)
        with pytest.warns(ForcedKillWarning, match=r"within 0\.5 s of SIGTERM"):
            await asyncio.wait_for(getattr(pc, verb)(), 20)
    result = pc.poll()
    assert result is not None
    assert {r: (f.exitcode, f.stopped) for r, f in result.failures.items()} == {
        0: (-signal.SIGKILL, True),
        1: (-signal.SIGKILL, True),
    }
    assert all(pid_gone(pid) for pid in pc.pids().values())


@pytest.mark.timeout(40)
@pytest.mark.parametrize(
    ("verb", "keyword"),
    [("close", "grace_period"), ("close", "timeout"), ("aclose", "grace_period")],
)
async def test_a_close_given_a_grace_period_uses_it(
    verb: str, keyword: str, tmp_path: Path
) -> None:
    """``grace_period=`` (and torch's ``timeout=``) override the group's for this close."""
    async with Fifo(tmp_path / "ready") as fifo:
        pc = await deaf_group(fifo, 1, grace_period=300)
        with pytest.warns(ForcedKillWarning, match=r"within 0\.3 s of SIGTERM"):
            await asyncio.wait_for(getattr(pc, verb)(**{keyword: 0.3}), 20)
    assert all(pid_gone(pid) for pid in pc.pids().values())


async def test_close_refuses_both_spellings_of_the_grace_period(tmp_path: Path) -> None:
    async with Fifo(tmp_path / "ready") as fifo:
        pc = await deaf_group(fifo, 1, grace_period=0.2)
        try:
            with pytest.raises(TypeError, match=r"grace_period=1 and timeout=2"):
                await pc.close(timeout=2, grace_period=1)
            assert pc.poll() is None  # nothing was stopped
            assert not any(pid_gone(pid) for pid in pc.pids().values())
            with pytest.raises(ValueError, match=r"close\(grace_period=\.\.\.\).*-1"):
                await pc.aclose(grace_period=-1)
            assert pc.poll() is None
        finally:
            with pytest.warns(ForcedKillWarning):
                await pc.aclose()


async def test_aclose_stops_the_group_and_is_idempotent() -> None:
    pc = await aioproc.start_processes("two", "sleep", {0: (1000,), 1: (1000,)}, envs(2))
    pids = pc.pids()
    await pc.aclose()
    result = pc.poll()
    assert result is not None
    assert {r: (f.exitcode, f.stopped) for r, f in result.failures.items()} == {
        0: (-signal.SIGTERM, True),
        1: (-signal.SIGTERM, True),
    }
    assert all(pid_gone(pid) for pid in pids.values())
    assert repr(pc) == "<PContext two nprocs=2 binary closed>"
    await pc.aclose()
    await pc.close()
    assert pc.poll() == result
    never = PContext("never", "/bin/true", {0: ()}, {0: {}}, DefaultLogsSpecs())
    await never.aclose()
    await never.aclose()
    assert repr(never) == "<PContext never nprocs=1 binary closed>"
    with pytest.raises(RuntimeError, match="was closed"):
        await never.start()


# ------------------------------------------------- a failure and its one stop


@pytest.fixture
def release(tmp_path: Path) -> Iterator[tuple[str, Any]]:
    path = str(tmp_path / "release")
    with release_fifo(path) as let_go:
        yield path, let_go


async def _failed_with_a_deaf_peer(
    fifo: Fifo, release: tuple[str, Any], **options: Any
) -> tuple[aioproc.PContext, asyncio.Event]:
    """Rank 0 exits 3 once released, after rank 1 (deaf to SIGTERM) is ready; the
    returned event is set once rank 0's exit is recorded (the stop began before)."""
    path, let_go = release
    recorded = asyncio.Event()

    def on_event(event: aioproc.context.WorkerEvent) -> None:
        if event.kind == "exited" and event.local_rank == 0:
            recorded.set()

    pc = await aioproc.start_processes(
        "failing",
        sys.executable,
        {0: ("-c", FAILS_WHEN_RELEASED, path), 1: (GRANDCHILD, fifo.path, "ignore-term")},
        envs(2),
        on_event=on_event,
        **options,
    )
    await fifo.pid_pairs(1)
    let_go(1)
    await asyncio.wait_for(recorded.wait(), 20)
    return pc, recorded


@pytest.mark.timeout(40)
async def test_a_close_during_a_failures_stop_brings_its_end_forward(
    tmp_path: Path, release: tuple[str, Any]
) -> None:
    """The failure asked for the group's stop (SIGTERM, a grace period of 300 s): a close
    with SIGKILL joins that stop and ends it now, instead of starting one of its own."""
    async with Fifo(tmp_path / "ready") as fifo:
        pc, _ = await _failed_with_a_deaf_peer(fifo, release, grace_period=300)
        assert pc.poll() is None  # rank 1 ignores the SIGTERM and holds the result back
        with pytest.warns(ForcedKillWarning, match="failing/1"):
            await asyncio.wait_for(pc.close(signal.SIGKILL), 20)
    result = pc.poll()
    assert result is not None
    assert {r: (f.exitcode, f.stopped) for r, f in result.failures.items()} == {
        0: (3, False),
        1: (-signal.SIGKILL, True),
    }
    assert all(pid_gone(pid) for pid in pc.pids().values())


@pytest.mark.timeout(40)
async def test_a_close_during_a_failures_stop_keeps_its_signal(
    tmp_path: Path, release: tuple[str, Any]
) -> None:
    """One stop, one signal: a later ``close(SIGINT)`` does not send SIGINT (which would
    end the deaf rank at once), it can only shorten the grace period of the SIGTERM."""
    async with Fifo(tmp_path / "ready") as fifo:
        pc, _ = await _failed_with_a_deaf_peer(fifo, release, grace_period=300)
        with pytest.warns(ForcedKillWarning, match=r"of SIGTERM.*failing/1"):
            await asyncio.wait_for(pc.close(signal.SIGINT, 0.3), 20)
    result = pc.poll()
    assert result is not None
    assert result.failures[1].exitcode == -signal.SIGKILL
    assert result.failures[1].stopped


class CountingRecorder(Recorder):
    def __init__(self) -> None:
        super().__init__()
        self.stops: list[tuple[str, str]] = []

    def group_stopped(self, group: str, role: str, seconds: float) -> None:
        self.stops.append((group, role))
        super().group_stopped(group, role, seconds)


@pytest.fixture
def recorder() -> Iterator[CountingRecorder]:
    mine = CountingRecorder()
    aioproc.metrics.enable(mine)
    try:
        yield mine
    finally:
        aioproc.metrics.disable()


@pytest.mark.timeout(40)
async def test_a_failure_and_the_close_after_it_are_one_stop(
    tmp_path: Path, release: tuple[str, Any], recorder: CountingRecorder
) -> None:
    """``wait()`` returns the failure once the one stop is over, and the metrics count
    that stop once; every process of the group is gone."""
    async with Fifo(tmp_path / "ready") as fifo:
        pc, _ = await _failed_with_a_deaf_peer(fifo, release, grace_period=0.3)
        with pytest.warns(ForcedKillWarning, match="failing/1"):
            result = await asyncio.wait_for(pc.wait(), 20)
        await pc.close()
    assert result is not None
    assert {r: (f.exitcode, f.stopped) for r, f in result.failures.items()} == {
        0: (3, False),
        1: (-signal.SIGKILL, True),
    }
    assert recorder.stops == [("failing", "default")]
    assert repr(pc) == "<PContext failing nprocs=2 binary closed>"
    assert await still_alive_after(list(pc.pids().values()), timeout=5) == set()


# ----------------------------------------------------- the logs spec's hook


class PlannedSpecs(LogsSpecs):
    """A logs spec of a user's own that leaves every rank dir to the supervisor."""

    def __init__(self, root: Path) -> None:
        super().__init__(str(root))
        self.root = root
        self.plans = 0
        self.pruned = 0

    @property
    def root_log_dir(self) -> str:
        return str(self.root)

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        raise AssertionError("the supervisor calls plan(), not reify()")

    def plan(self, envs: dict[int, dict[str, str]]) -> LogsPlan:
        self.plans += 1
        dirs = {r: str(self.root / f"rank{r}") for r in envs}
        dest = LogsDest(
            stdouts=dict.fromkeys(envs, ""),
            stderrs=dict.fromkeys(envs, ""),
            error_files={r: os.path.join(d, "error.json") for r, d in dirs.items()},
        )
        return LogsPlan(dest, rank_dirs=dirs)

    def prune(self) -> None:
        self.pruned += 1


async def test_a_logs_spec_can_leave_rank_dirs_to_the_supervisor(tmp_path: Path) -> None:
    """Each dir the plan leaves over exists before its rank starts (the worker writes in it)."""
    specs = PlannedSpecs(tmp_path)
    n = 20  # more than one unit of the launch
    result = await aioproc.run(
        "sh",
        n,
        args={
            r: ("-c", 'echo "rank $1" > "$0/made"', str(tmp_path / f"rank{r}"), str(r))
            for r in range(n)
        },
        logs_specs=specs,
    )
    assert result.failures == {}
    assert [(tmp_path / f"rank{r}" / "made").read_text() for r in range(n)] == [
        f"rank {r}\n" for r in range(n)
    ]
    assert (specs.plans, specs.pruned) == (1, 1)


async def test_a_default_logs_spec_with_its_own_reify_gets_it_called(tmp_path: Path) -> None:
    calls: list[int] = []

    class Counted(DefaultLogsSpecs):
        def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
            calls.append(len(envs))
            return super().reify(envs)

    result = await aioproc.run(
        "sh",
        2,
        args=("-c", 'test -d "$(dirname "$TORCHELASTIC_ERROR_FILE")"'),
        logs_specs=Counted(str(tmp_path)),
    )
    assert result.failures == {}
    assert calls == [2]


def _square(x: int) -> int:
    return x * x


async def test_a_closed_group_is_freed_without_the_garbage_collector() -> None:
    """No cycle runs through the crew: dropping a closed group frees its results (and
    their shared memory) at once, not at the next collection."""
    import gc
    import weakref

    gc.collect()
    gc.disable()
    try:
        pc = await aioproc.start_processes("freed", _square, {0: (3,), 1: (4,)}, envs(2))
        result = await pc.wait()
        assert result is not None and result.return_values == {0: 9, 1: 16}
        sup = weakref.ref(pc._sup)
        del pc, result
        assert sup() is None
    finally:
        gc.enable()
