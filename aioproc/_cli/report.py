"""What ``aioproc run`` tells the user: agent events, its log, warnings, errors, log paths.

The agent's events become log lines (or notes above the live view);
``_configure_logging`` sends the command's log to stderr at ``LOGLEVEL``
and shows warnings in one line; ``_error`` prints ``aioproc run: ...``
messages, which never fail, even with stderr gone; ``_where_the_logs_are``
names the root cause's log files after a failure.  The logger keeps the
name ``aioproc.cli``, which its lines show.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, TextIO

from .values import PROG

if TYPE_CHECKING:
    from ..agent import AgentEvent
    from ..logs import LogsSpecs
    from .live import LiveView

logger = logging.getLogger("aioproc.cli")

LOG_LEVEL_ENV = "LOGLEVEL"  # torchrun's variable for its own log level


def _run_log_dir(logs_specs: LogsSpecs) -> str | None:
    return logs_specs.run_log_dir or None


def _where_the_logs_are(
    logs_specs: LogsSpecs, attempt: int, rank: int, local_rank: int, summary: str
) -> list[str]:
    """Lines naming the root cause's log files and the run's log dir, if not in ``summary``."""
    run_dir = _run_log_dir(logs_specs)
    if run_dir is None or not os.path.isdir(run_dir):
        return []
    rank_dir = os.path.join(run_dir, f"attempt_{attempt}", str(local_rank))
    files = []
    for name in ("stderr.log", "stdout.log"):
        path = os.path.join(rank_dir, name)
        if not _named(path, summary) and os.path.isfile(path):
            files.append(path)
    lines = []
    if files:
        lines.append(f"output of rank {rank}: {', '.join(files)}")
    if not _named(run_dir, summary):
        lines.append(f"logs of this run: {run_dir}")
    return lines


def _named(path: str, text: str) -> bool:
    """Whether ``text`` names ``path`` itself (not a file under it)."""
    return re.search(re.escape(path) + r"/?(?:[\s,;)]|$)", text, re.MULTILINE) is not None


def _describe_event(event: AgentEvent) -> tuple[int, str] | None:
    """A log level and line for the agent events a user should hear about."""
    from ..agent import events as ev

    role = f"[{event.role}]"
    if event.kind == ev.ATTEMPT_FAILED:
        if event.exitcode is not None and event.exitcode < 0:
            how = f"was killed by {event.signal}"
        else:
            how = f"exited with code {event.exitcode}"
        return (
            logging.WARNING,
            f"{role} worker group failed (attempt {event.attempt}): local_rank "
            f"{event.local_rank} (pid {event.pid}) {how}",
        )
    if event.kind == ev.RESTART_SCHEDULED:
        return logging.WARNING, f"{role} restarting the worker group: {event.message}"
    if event.kind == ev.WORLD_CHANGED:
        return logging.WARNING, f"{role} re-forming the world: {event.message}"
    if event.kind == ev.RENDEZVOUS_COMPLETED:
        return logging.INFO, f"{role} rendezvous completed: {event.message}"
    if event.kind == ev.GROUP_SUCCEEDED and event.message:
        return logging.INFO, f"{role} worker group succeeded: {event.message}"
    return None


def _show_on(view: LiveView) -> Callable[[AgentEvent], None]:
    def show(event: AgentEvent) -> None:
        view.on_event(event)
        said = _describe_event(event)
        if said is not None and said[0] >= logger.getEffectiveLevel():
            view.note(f"{PROG}: {said[1]}")

    return show


def _log_event(event: AgentEvent) -> None:
    said = _describe_event(event)
    if said is not None:
        logger.log(*said)


def _error(message: str) -> None:
    _print_stderr(f"{PROG} run: {message}")


def _one_line(text: str) -> str:
    return " ".join(text.split("\n"))


def _print_stderr(text: str) -> None:
    try:
        print(text, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass  # stderr is gone; the exit status still tells


class _StderrHandler(logging.Handler):
    """Writes to whatever ``sys.stderr`` is now (the live view redirects it)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:
            self.handleError(record)


def _show_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: TextIO | None = None,
    line: str | None = None,
) -> None:
    """Warnings (such as ``ForcedKillWarning``) as one line, without our source line."""
    _print_stderr(f"{PROG}: {category.__name__}: {message}")


def _configure_logging() -> Callable[[], None]:
    """Log to stderr at ``LOGLEVEL``; return a function undoing it."""
    previous_showwarning = warnings.showwarning
    warnings.showwarning = _show_warning
    root = logging.getLogger()
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s:%(name)s:%(message)s"))
    level = os.environ.get(LOG_LEVEL_ENV, "WARNING").upper()
    previous = root.level
    root.addHandler(handler)
    try:
        root.setLevel(level)
    except ValueError:
        root.setLevel(logging.WARNING)

    def restore() -> None:
        warnings.showwarning = previous_showwarning
        root.removeHandler(handler)
        root.setLevel(previous)

    return restore
