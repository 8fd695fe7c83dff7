"""Parent side of ``@pytest.mark.aioproc``: run a test body on N ranks, judge, report.

The test body runs in a group of fresh function workers (``_plugin.rank_child``),
each with torch's rendezvous environment (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``) or TensorFlow's ``TF_CONFIG``. Each rank
writes its own ``stdout.log``/``stderr.log`` (read back into the report's
sections), or, under ``-s``, tees them to the console with a rank prefix.
The group runs on a private event loop: the caller is pytest's synchronous
``pytest_pyfunc_call``, whatever plugin would have run the body otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pytest

from .._cluster.tfconfig import free_ports, worker_slots
from . import rank_child as _pytest_rank

MARKER = "aioproc"
GRACE_PERIOD = 5.0
"""Seconds a rank gets between its stop signal and SIGKILL."""

_MARKER_KWARGS = frozenset({"nprocs", "cluster", "timeout"})


@dataclass(frozen=True)
class Ranks:
    """A parsed ``@pytest.mark.aioproc``: who runs the body, and for how long."""

    labels: list[str]
    envs: list[dict[str, str]]
    timeout: float | None


def parse_marker(marker: pytest.Mark, default_timeout: float | None) -> Ranks:
    """Check the marker's arguments and build each rank's label and environment.

    Raises:
        TypeError, ValueError: an unknown argument, or a bad ``nprocs``,
            ``cluster`` or ``timeout``, named with its value.
    """
    kwargs = dict(marker.kwargs)
    if marker.args:
        if len(marker.args) > 1 or "nprocs" in kwargs:
            raise TypeError(f"@pytest.mark.aioproc takes one nprocs, got {marker.args!r}")
        kwargs["nprocs"] = marker.args[0]
    unknown = sorted(set(kwargs) - _MARKER_KWARGS)
    if unknown:
        raise TypeError(f"@pytest.mark.aioproc got unknown arguments {unknown}")
    timeout = kwargs.get("timeout", default_timeout)
    if timeout is not None:
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            raise TypeError(f"aioproc timeout must be a number of seconds, got {timeout!r}")
        if timeout <= 0:
            timeout = None  # pytest-timeout's convention: 0 disables
    if ("nprocs" in kwargs) == ("cluster" in kwargs):
        raise TypeError("@pytest.mark.aioproc needs exactly one of nprocs= or cluster=")
    if "nprocs" in kwargs:
        nprocs = kwargs["nprocs"]
        if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs <= 0:
            raise ValueError(f"aioproc nprocs must be a positive int, got {nprocs!r}")
        (port,) = free_ports(1)
        common = {
            "WORLD_SIZE": str(nprocs),
            "LOCAL_WORLD_SIZE": str(nprocs),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        envs = [{**common, "RANK": str(r), "LOCAL_RANK": str(r)} for r in range(nprocs)]
        return Ranks([f"rank {r}" for r in range(nprocs)], envs, timeout)
    cluster = kwargs["cluster"]
    if not isinstance(cluster, Mapping):
        raise TypeError(f"aioproc cluster must be a dict of task counts, got {cluster!r}")
    slots = worker_slots(cluster, MARKER, {})
    size = str(len(slots))
    envs = [
        {**env, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": size}
        for r, (_, env) in enumerate(slots)
    ]
    return Ranks([f"{task} (rank {r})" for r, (task, _) in enumerate(slots)], envs, timeout)


class RanksFailed(Exception):
    """One or more ranks of a test failed; ``str()`` is the whole report."""

    def __init__(self, text: str, summary: str) -> None:
        super().__init__(text)
        self.text = text
        self.summary = summary


class RankSkipped(pytest.skip.Exception):  # type: ignore[name-defined,misc]
    """Every rank passed, and one called ``pytest.skip``: the test is skipped."""


@dataclass
class _Outcome:
    result: Any
    remote: dict[int, BaseException | None]
    timed_out: bool


def check_picklable(kwargs: Mapping[str, Any]) -> None:
    """Raise ``TypeError`` naming every fixture value that cannot reach the ranks."""
    import cloudpickle

    bad = []
    for name, value in kwargs.items():
        try:
            cloudpickle.dumps(value)
        except Exception as e:
            bad.append(f"{name!r} ({type(value).__name__}: {e})")
    if bad:
        raise TypeError(
            "@pytest.mark.aioproc sends fixture values to the ranks, and these cannot be "
            f"pickled: {', '.join(bad)}"
        )


def _picklable_or_none(value: Any) -> Any:
    import cloudpickle

    try:
        cloudpickle.dumps(value)
    except Exception:
        return None
    return value


def run_ranks(item: pytest.Function, ranks: Ranks, call: _pytest_rank.RankCall) -> None:
    """Run ``call`` on every rank; return if all passed, else raise.

    Raises:
        RanksFailed: a rank failed or the timeout expired (the report).
        pytest.skip.Exception: every rank passed and one of them skipped.
    """
    live = item.config.getoption("capture") == "no"
    top = tempfile.mkdtemp(prefix="aioproc-pytest-")
    try:
        loop = asyncio.new_event_loop()
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                task = loop.create_task(_supervise(ranks, call, top, live))
                try:
                    outcome = loop.run_until_complete(task)
                except BaseException:
                    # interrupted from outside the loop (Ctrl-C, pytest-timeout's
                    # signal): the group's cleanup still runs before we leave
                    task.cancel()
                    with contextlib.suppress(BaseException):
                        loop.run_until_complete(task)
                    raise
        finally:
            loop.close()
        for w in caught:
            if w.category.__name__ == "ForcedKillWarning":
                continue  # said in the report, per rank
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        if not live:
            _add_sections(item, ranks, outcome.result)
        _judge(item, ranks, outcome)
    finally:
        shutil.rmtree(top, ignore_errors=True)


async def _supervise(ranks: Ranks, call: _pytest_rank.RankCall, top: str, live: bool) -> _Outcome:
    """Start the ranks, wait for them (or the timeout), and collect what they did.

    Cancellation: leaving the ``async with`` stops every rank (SIGTERM, then
    SIGKILL after ``GRACE_PERIOD``) and reaps it, shielded, before the
    cancellation goes on.
    """
    from ..logs import DefaultLogsSpecs, Std
    from ..runner import start_processes

    n = len(ranks.labels)
    if live:
        specs = DefaultLogsSpecs(log_dir=top, tee=Std.ALL)
        prefixes: dict[int, str] | None = {r: f"[{ranks.labels[r]}] " for r in range(n)}
    else:
        specs = DefaultLogsSpecs(log_dir=top, redirects=Std.ALL)
        prefixes = None
    async with start_processes(
        "pytest",
        _pytest_rank.main,
        {r: (call,) for r in range(n)},
        {r: ranks.envs[r] for r in range(n)},
        specs,
        prefixes,
        grace_period=GRACE_PERIOD,
    ) as pc:
        if ranks.timeout is None:
            result = await pc.wait()
        else:
            result = await pc.wait(timeout=ranks.timeout)
        timed_out = result is None
        if timed_out:
            # every rank still running dumps its stacks, then dies of the signal
            await pc.close(death_sig=_pytest_rank.DUMP_SIGNAL, timeout=GRACE_PERIOD)
            result = pc.poll()
        assert result is not None
        remote = {r: pc.remote_exception(r) for r in result.failures}
    return _Outcome(result, remote, timed_out)


def _read(path: str | None) -> str:
    if not path:
        return ""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _add_sections(item: pytest.Function, ranks: Ranks, result: Any) -> None:
    for r, label in enumerate(ranks.labels):
        for stream, paths in (("stdout", result.stdouts), ("stderr", result.stderrs)):
            text = _read(paths.get(r))
            if text:
                item.add_report_section("call", f"{stream} {label}", text)


_STACK_START = re.compile(r"^(Current thread|Thread) 0x[0-9a-f]+ ", re.M)
_FATAL = re.compile(r"^Fatal Python error: ", re.M)


def _stack_dump(stderr: str) -> str:
    """faulthandler's dump at the end of a rank's stderr, or ''."""
    match = _FATAL.search(stderr) or _STACK_START.search(stderr)
    return stderr[match.start() :].rstrip() if match else ""


def trim_traceback(text: str, path: str) -> str:
    """Drop the frames above the test's own file (the rank's machinery, the loop)."""
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    marker = f'  File "{path}"'
    while i < len(lines):
        out.append(lines[i])
        if lines[i] == "Traceback (most recent call last):":
            j = i + 1
            end = j
            while end < len(lines) and lines[end].startswith(" "):
                end += 1
            firsts = [k for k in range(j, end) if lines[k].startswith(marker)]
            if firsts:
                i = firsts[0]
                continue
        i += 1
    return "\n".join(out)


def _describe_exit(failure: Any) -> str:
    if failure.exitcode < 0:
        return f"was killed by {failure.signal_name()}"
    return f"exited with code {failure.exitcode}"


def _judge(item: pytest.Function, ranks: Ranks, outcome: _Outcome) -> None:
    from .._errors.summary import ChildFailedError

    result = outcome.result
    path = str(item.path)
    if not result.failures:
        skips = [(r, v[1]) for r, v in sorted(result.return_values.items()) if v]
        if skips:
            raise RankSkipped(f"{ranks.labels[skips[0][0]]}: {skips[0][1]}")
        return
    n = len(ranks.labels)
    blocks: list[str] = []
    if outcome.timed_out:
        timeout = ranks.timeout
        running = sorted(result.failures)
        names = ", ".join(ranks.labels[r] for r in running)
        summary = f"timed out after {timeout:g}s: {names} still running"
        blocks.append(f"Timeout: {n} ranks, {summary}; their stacks:")
        for r in running:
            stderr = _read(result.stderrs.get(r))
            dump = _stack_dump(stderr) or "(no stack dump: the rank did not die of the signal)"
            blocks.append(f"--- {ranks.labels[r]} (pid {result.failures[r].pid}) ---\n{dump}")
        passed = [ranks.labels[r] for r in range(n) if r not in result.failures]
        if passed:
            blocks.append(f"passed: {', '.join(passed)}")
        raise RanksFailed("\n".join(blocks), summary)
    root, _ = ChildFailedError("pytest", result.failures).get_first_failure()
    order = [root, *sorted(r for r in result.failures if r != root)]
    summary = ""
    for r in order:
        failure = result.failures[r]
        label = ranks.labels[r]
        exc = outcome.remote.get(r)
        if failure.stopped:
            blocks.append(
                f"{label} (pid {failure.pid}) {_describe_exit(failure)}: stopped by aioproc "
                f"after {ranks.labels[root]} failed"
            )
            continue
        if exc is not None:
            head = f"{label} (pid {failure.pid}) failed: {type(exc).__name__}: {exc}"
            tb = str(exc.__cause__) if exc.__cause__ is not None else ""
            body = trim_traceback(tb.rstrip(), path)
            line = f"{label}: {type(exc).__name__}: {exc}".splitlines()[0]
        else:
            head = f"{label} (pid {failure.pid}) {_describe_exit(failure)}"
            body = _stack_dump(_read(result.stderrs.get(r)))
            line = head
        summary = summary or line
        blocks.append(f"{head}\n{body}".rstrip())
    passed = [ranks.labels[r] for r in range(n) if r not in result.failures]
    if passed:
        blocks.append(f"passed: {', '.join(passed)}")
    raise RanksFailed("\n\n".join(blocks), summary)


def rank_call(item: pytest.Function) -> _pytest_rank.RankCall:
    """What each rank needs to run ``item``: where the body is, its fixture values."""
    module = item.module
    assert module is not None
    kwargs = {name: item.funcargs[name] for name in item._fixtureinfo.argnames}
    check_picklable(kwargs)
    anyio_backend = item.funcargs.get("anyio_backend")
    # pytest-asyncio's loop factory for this run (its loop-factory hook
    # parametrises tests with it): the ranks' async bodies use the same loop
    callspec = getattr(item, "callspec", None)
    loop_factory = callspec.params.get("_asyncio_loop_factory") if callspec else None
    qualname = item.originalname
    cls = getattr(item, "cls", None)
    if cls is not None:
        qualname = f"{cls.__qualname__}.{qualname}"
    return _pytest_rank.RankCall(
        module=module.__name__,
        path=os.fspath(module.__file__ or item.path),
        qualname=qualname,
        kwargs=kwargs,
        loop_factory=_picklable_or_none(loop_factory),
        anyio_backend=anyio_backend,
    )
