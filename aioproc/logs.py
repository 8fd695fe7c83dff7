"""Where worker output and error files go: ``Std``, ``LogsSpecs`` and friends.

A ``LogsSpecs`` turns the per-rank environments of one process group into a
``LogsDest``: for every local rank, the file its stdout and stderr go to, the
files to tee to the console, and the path of its error.json.  The supervisor
calls ``reify`` once per group start (every restart), before any worker runs.

``DefaultLogsSpecs`` lays the tree out exactly as torchelastic does, so tools
that read torchrun's logs read ours::

    <root_log_dir>/                  log_dir, or a fresh aioproc_* temp dir
      <run_id>_<random>/             made once per spec, shared by all attempts
        attempt_<restart_count>/     wiped and remade by every reify
          filtered_stdout.log        lines matching the supervisor's filters
          filtered_stderr.log
          <local_rank>/
            stdout.log               if redirects | tee has Std.OUT for the rank
            stderr.log               if redirects | tee has Std.ERR for the rank
            error.json               written by the worker if it fails

In the private temp dir (no ``log_dir``), a rank whose streams all stay on
the console gets no ``<local_rank>/`` dir: its error file is
``attempt_<restart_count>/error_<local_rank>.json``.  Such a dir would hold
nothing but a failed worker's error file, and on some file systems (ext4
mounted with ``discard``) making and removing it costs about as much as
starting a small binary worker.  A given ``log_dir`` always has torch's layout.
An empty string as a stdout/stderr destination means "the console"; tee is a
redirect to the file plus a copy of it on the console.  ``log_dir=os.devnull``
writes no files at all.  This module is synchronous and stdlib-only: it runs
before any worker exists, and the child side may import it.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import IntFlag

from ._base.checks import check_log_dir, check_path_name
from ._child.errorfile import ERROR_FILE_ENV

__all__ = ["DefaultLogsSpecs", "LogsDest", "LogsPlan", "LogsSpecs", "Std", "to_map"]

logger = logging.getLogger(__name__)

RUN_ID_ENV = "TORCHELASTIC_RUN_ID"
RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"
# torchelastic's fallback when the agent did not set a run id (unit tests).
DEFAULT_RUN_ID = "test_run_id"

_CONSOLE = ""  # a destination of "" means: leave the stream on the console
_VALUE_RE = re.compile(r"[0-3]")
_PAIR_RE = re.compile(r"([0-9]+)\s*:\s*([0-3])")
_STD_FORMAT = (
    "expected a single value 0-3 (e.g. '3') or comma-separated "
    "<local_rank>:<value> pairs with values 0-3 (e.g. '0:3,1:0')"
)


class Std(IntFlag):
    """Which standard streams a setting applies to (a bit mask)."""

    NONE = 0
    OUT = 1
    ERR = 2
    ALL = OUT | ERR

    @classmethod
    def from_str(cls, vm: str) -> Std | dict[int, Std]:
        """Parse a command-line value such as ``"3"`` or ``"0:3,1:0"``.

        Accepts everything torchrun accepts, plus whitespace around items and
        local ranks above 9.

        Args:
            vm: a single value ``0``-``3`` applying to every rank, or
                comma-separated ``<local_rank>:<value>`` pairs.

        Returns:
            ``Std`` for a single value, else a ``{local_rank: Std}`` dict.

        Raises:
            ValueError: ``vm`` is malformed or names a local rank twice.
        """
        if not isinstance(vm, str):
            raise TypeError(f"Std.from_str() takes a str, got {vm!r}")
        text = vm.strip()
        if _VALUE_RE.fullmatch(text):
            return cls(int(text))
        mapping: dict[int, Std] = {}
        for item in text.split(","):
            match = _PAIR_RE.fullmatch(item.strip())
            if match is None:
                raise ValueError(f"invalid Std value {vm!r} (bad item {item!r}): {_STD_FORMAT}")
            rank = int(match[1])
            # torch silently keeps the last of duplicates; a typo should not win quietly.
            if rank in mapping:
                raise ValueError(
                    f"invalid Std value {vm!r}: local rank {rank} is given twice; {_STD_FORMAT}"
                )
            mapping[rank] = cls(int(match[2]))
        return mapping


def to_map(val_or_map: Std | dict[int, Std], local_world_size: int) -> dict[int, Std]:
    """Expand a setting into one ``Std`` per local rank ``0..local_world_size-1``.

    A ``Std`` applies to every rank; a mapping gives ``Std.NONE`` to the ranks
    it leaves out.  Ranks outside the range are ignored, as in torch, so one
    spec serves groups of any size.

    Args:
        val_or_map: a ``Std`` or a ``{local_rank: Std}`` mapping.
        local_world_size: the number of local ranks.

    Returns:
        A new dict with exactly the keys ``range(local_world_size)``.
    """
    if isinstance(val_or_map, Std):
        return dict.fromkeys(range(local_world_size), val_or_map)
    return {rank: val_or_map.get(rank, Std.NONE) for rank in range(local_world_size)}


@dataclass
class LogsDest:
    """Per-rank destinations produced by ``LogsSpecs.reify``.

    Attributes:
        stdouts: file each rank's stdout goes to; ``""`` leaves it on the console.
        stderrs: file each rank's stderr goes to; ``""`` leaves it on the console.
        tee_stdouts: for ranks whose stdout is also shown on the console, the
            file it is written to (a rank absent here is not tee'd).
        tee_stderrs: the same for stderr.
        error_files: each rank's error.json path (the worker creates it).
        filtered_stdout: file for tee'd stdout lines that match the
            supervisor's duplicate filters (created only when there are filters).
        filtered_stderr: the same for stderr.
    """

    stdouts: dict[int, str] = field(default_factory=dict)
    stderrs: dict[int, str] = field(default_factory=dict)
    tee_stdouts: dict[int, str] = field(default_factory=dict)
    tee_stderrs: dict[int, str] = field(default_factory=dict)
    error_files: dict[int, str] = field(default_factory=dict)
    filtered_stdout: str = ""
    filtered_stderr: str = ""


@dataclass
class LogsPlan:
    """One start of a group as its ``LogsSpecs`` plans it (``LogsSpecs.plan``).

    Attributes:
        dest: the ranks' destinations, as ``reify`` returns them.
        rank_dirs: ``{local_rank: dir}`` that ``plan`` left for the caller
            to make, each before anything of its rank is opened or started
            (the supervisor makes them in rank order while the first
            workers start); empty when everything is made.
        temp_root: the private temporary directory the tree lives in, which
            ``prune`` removes once empty; ``None`` for a directory the user
            gave.  The supervisor has it tidied if it dies.
    """

    dest: LogsDest
    rank_dirs: dict[int, str] = field(default_factory=dict)
    temp_root: str | None = None


class LogsSpecs(ABC):
    """Decides where each worker's output and error file go.

    Args:
        log_dir: base directory for the log tree.
        redirects: streams to write to files instead of the console: one
            ``Std`` for every rank, or a ``{local_rank: Std}`` mapping.
        tee: streams to write to files and also show on the console, in the
            same form as ``redirects``.
        local_ranks_filter: if given, only these ranks reach the console.
    """

    def __init__(
        self,
        log_dir: str | None = None,
        redirects: Std | dict[int, Std] = Std.NONE,
        tee: Std | dict[int, Std] = Std.NONE,
        local_ranks_filter: set[int] | None = None,
    ) -> None:
        self._root_log_dir = log_dir
        self._redirects = redirects
        self._tee = tee
        self._local_ranks_filter = local_ranks_filter

    @property
    def redirects(self) -> Std | dict[int, Std]:
        """Streams written to files instead of the console."""
        return self._redirects

    @property
    def tee(self) -> Std | dict[int, Std]:
        """Streams written to files and also shown on the console."""
        return self._tee

    @property
    def local_ranks_filter(self) -> set[int] | None:
        """Ranks shown on the console (``None`` or empty: all)."""
        return self._local_ranks_filter

    @abstractmethod
    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        """Build the destinations for one start of a process group.

        Args:
            envs: each local rank's environment (ranks ``0..n-1``); an
                implementation may add entries, such as the error file path.

        Returns:
            The destinations for every rank in ``envs``.
        """

    @property
    @abstractmethod
    def root_log_dir(self) -> str:
        """The directory the log tree lives in."""

    def validate(self, envs: Mapping[int, Mapping[str, str]]) -> None:  # noqa: B027
        """Raise if ``reify(envs)`` would reject these envs; create nothing.

        The supervisor calls it before anything of a group is started (and
        before ``reify``), so bad input fails with nothing to undo.  The
        default accepts everything (an optional hook, not abstract).

        Args:
            envs: each local rank's environment, ranks ``0..n-1``.
        """

    @property
    def run_log_dir(self) -> str:
        """This run's directory of logs, ``""`` when none (was) made or kept.

        Named in results and failure summaries.  The default is ``""``.
        """
        return ""

    def prune(self) -> None:  # noqa: B027 (an optional hook, not abstract)
        """Tidy what this spec created; called when a process group is closed.

        The supervisor calls it after the group's workers are gone and their
        output is flushed.  The default does nothing.
        """

    @property
    def makes_temp_root(self) -> bool:
        """True when reading ``root_log_dir`` now makes a private temporary directory.

        The supervisor asks before each start: it then has the guardian
        ready before the directory exists, so that a supervisor killed at
        any moment leaves no empty tree behind.  The default is False.
        """
        return False

    def plan(self, envs: dict[int, dict[str, str]]) -> LogsPlan:
        """Plan one start of a process group: what ``reify`` does, some of it left to the caller.

        The supervisor calls this, off the event loop, instead of
        ``reify``.  An implementation may leave the per-rank directories to
        the caller (``LogsPlan.rank_dirs``), which makes each one before its
        rank starts, and names the private temporary directory it keeps its
        tree in (``LogsPlan.temp_root``).  The default is ``reify(envs)``
        with nothing left over.

        Args:
            envs: each local rank's environment, as for ``reify``.

        Returns:
            The plan for every rank in ``envs``.
        """
        return LogsPlan(self.reify(envs))


class DefaultLogsSpecs(LogsSpecs):
    """torchelastic's log layout (see the module docstring).

    Args:
        log_dir: base directory, created on first use if missing.  ``None``
            (or ``""``) makes a private ``aioproc_*`` temp dir on first use,
            which ``prune`` may remove again; ``os.devnull`` writes no files.
        redirects: streams to write to files instead of the console.
        tee: streams to write to files and also show on the console.
        local_ranks_filter: if given and not empty, only these ranks reach the
            console; the others' tee'd streams still go to their files and
            their other streams are discarded.

    Raises:
        NotADirectoryError: ``log_dir``, or the directory it would be created
            in, exists and is not a directory.
        ValueError: ``log_dir`` contains a NUL byte.
        TypeError: an argument has the wrong type.
    """

    def __init__(
        self,
        log_dir: str | os.PathLike[str] | None = None,
        redirects: Std | dict[int, Std] = Std.NONE,
        tee: Std | dict[int, Std] = Std.NONE,
        local_ranks_filter: set[int] | frozenset[int] | None = None,
    ) -> None:
        # Check everything before creating anything, so bad input leaves no trace.
        super().__init__(
            check_log_dir(log_dir),
            _check_std("redirects", redirects),
            _check_std("tee", tee),
            _check_ranks_filter(local_ranks_filter),
        )
        self._ephemeral_root: str | None = None
        self._run_log_dir: str | None = None

    @property
    def root_log_dir(self) -> str:
        """The given ``log_dir``, or the temp dir made for it on first use."""
        if self._root_log_dir is None:
            self._root_log_dir = self._ephemeral_root = tempfile.mkdtemp(prefix="aioproc_")
        return self._root_log_dir

    @property
    def run_log_dir(self) -> str:
        """``<root_log_dir>/<run_id>_<random>`` once made and while it exists, else ``""``."""
        run_dir = self._run_log_dir
        return run_dir if run_dir is not None and os.path.isdir(run_dir) else ""

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        """Create ``attempt_<restart_count>/<rank>/`` dirs and return the ranks' paths.

        The run id and restart count come from rank 0's ``TORCHELASTIC_RUN_ID``
        and ``TORCHELASTIC_RESTART_COUNT``.  Sets ``TORCHELASTIC_ERROR_FILE`` in
        every rank's env (``envs`` is modified in place, as in torch).

        Args:
            envs: each local rank's environment, ranks ``0..n-1``.

        Returns:
            The destinations for every rank; all paths are absolute.

        Raises:
            ValueError, NotADirectoryError: as ``validate``; nothing is created.
        """
        dest, rank_dirs = self._reify_deferred(envs)
        for path in rank_dirs.values():
            os.mkdir(path)
        return dest

    @property
    def makes_temp_root(self) -> bool:
        """True while no ``log_dir`` was given and the temp dir is not made (yet, or again)."""
        return self._root_log_dir is None

    def plan(self, envs: dict[int, dict[str, str]]) -> LogsPlan:
        """``reify`` without making the rank dirs: they are left to the caller, in rank order.

        The supervisor makes them while the first workers start: thousands
        of ``mkdir`` next to each other cost milliseconds each on some file
        systems.  A subclass with a ``reify`` of its own gets it called.

        Args:
            envs: each local rank's environment, ranks ``0..n-1``.

        Returns:
            The destinations, the rank dirs still to make and the private
            temp dir (``None`` for a given ``log_dir``).
        """
        if type(self).reify is DefaultLogsSpecs.reify:
            dest, rank_dirs = self._reify_deferred(envs)
        else:  # a subclass's own layout: it makes everything itself
            dest, rank_dirs = self.reify(envs), {}
        return LogsPlan(dest, rank_dirs, self._ephemeral_root)

    def _reify_deferred(self, envs: dict[int, dict[str, str]]) -> tuple[LogsDest, dict[int, str]]:
        """``reify`` without making the rank dirs: returns them, to be made in rank order."""
        self.validate(envs)
        nprocs = len(envs)
        env0 = envs[0] if nprocs else {}
        redirects = to_map(self._redirects, nprocs)
        tee = to_map(self._tee, nprocs)

        if self._root_log_dir == os.devnull:
            return self._reify_devnull(envs, tee), {}

        run_id = env0.get(RUN_ID_ENV, DEFAULT_RUN_ID)
        restart_count = env0.get(RESTART_COUNT_ENV, "0")
        attempt_dir = os.path.join(self._make_run_log_dir(run_id), f"attempt_{restart_count}")
        # A repeated restart count starts from a clean attempt, as in torch.
        shutil.rmtree(attempt_dir, ignore_errors=True)
        os.makedirs(attempt_dir)

        dest = LogsDest(
            filtered_stdout=os.path.join(attempt_dir, "filtered_stdout.log"),
            filtered_stderr=os.path.join(attempt_dir, "filtered_stderr.log"),
        )
        rank_dirs: dict[int, str] = {}
        # In the temp dir a rank that writes no stream file gets no dir of its
        # own: on some file systems a mkdir and its rmdir cost a fraction of a
        # millisecond each, as much as starting the worker (see the docstring).
        flat = self._ephemeral_root is not None and self._root_log_dir == self._ephemeral_root
        for rank in range(nprocs):
            rank_dir = os.path.join(attempt_dir, str(rank))
            # tee is a redirect plus a copy on the console, so it implies the file.
            to_file = redirects[rank] | tee[rank]
            stdout = os.path.join(rank_dir, "stdout.log") if to_file & Std.OUT else _CONSOLE
            stderr = os.path.join(rank_dir, "stderr.log") if to_file & Std.ERR else _CONSOLE
            if self._on_console(rank):
                if tee[rank] & Std.OUT:
                    dest.tee_stdouts[rank] = stdout
                if tee[rank] & Std.ERR:
                    dest.tee_stderrs[rank] = stderr
            else:
                # Filtered out: tee'd streams still reach their files, the rest is dropped.
                stdout = stdout or os.devnull
                stderr = stderr or os.devnull
            dest.stdouts[rank] = stdout
            dest.stderrs[rank] = stderr
            if flat and not to_file:
                error_file = os.path.join(attempt_dir, f"error_{rank}.json")
            else:
                rank_dirs[rank] = rank_dir
                error_file = os.path.join(rank_dir, "error.json")
            dest.error_files[rank] = error_file
            envs[rank][ERROR_FILE_ENV] = error_file
        return dest, rank_dirs

    def validate(self, envs: Mapping[int, Mapping[str, str]]) -> None:
        """Check what becomes a path before anything is created.

        The run id and the restart count of rank 0 name directories
        (``<run_id>_<random>/attempt_<restart_count>``): a path separator,
        ``.``, ``..`` or a NUL byte in them would put the logs elsewhere.  The
        log dir is checked again: it may have become a file since.

        Raises:
            ValueError: a bad run id or restart count.
            NotADirectoryError: ``log_dir`` is no longer usable as a directory.
        """
        if self._root_log_dir == os.devnull:
            return
        check_log_dir(self._root_log_dir)
        env0 = envs[0] if envs else {}
        check_path_name(f"run id ({RUN_ID_ENV})", env0.get(RUN_ID_ENV, DEFAULT_RUN_ID))
        check_path_name(f"restart count ({RESTART_COUNT_ENV})", env0.get(RESTART_COUNT_ENV, "0"))

    def prune(self) -> None:
        """Remove empty files and dirs from the temp dir this spec made.

        Does nothing for a ``log_dir`` the user gave.  Files with content (and
        the dirs holding them) are kept, and named by the group's result
        (``log_dir``, ``stdouts``, ``stderrs``) and failure summary; if
        nothing is left, the temp dir goes too and the next ``reify`` makes a
        fresh one.
        """
        root = self._ephemeral_root
        if root is None:
            return
        _prune_tree(root)
        if not os.path.lexists(root):
            # Never recreate a deleted name in a shared temp dir: start afresh.
            self._root_log_dir = self._ephemeral_root = self._run_log_dir = None

    def __repr__(self) -> str:
        return (
            f"DefaultLogsSpecs(log_dir={self._root_log_dir!r}, redirects={self._redirects!r}, "
            f"tee={self._tee!r}, local_ranks_filter={self._local_ranks_filter!r})"
        )

    def _make_run_log_dir(self, run_id: str) -> str:
        """Return ``<root>/<run_id>_<random>``, made on the first call only."""
        if self._run_log_dir is None:
            # Absolute, so the error file path in the env works from any worker cwd.
            root = os.path.abspath(self.root_log_dir)
            os.makedirs(root, exist_ok=True)
            self._run_log_dir = tempfile.mkdtemp(prefix=f"{run_id}_", dir=root)
            logger.info("log directory set to: %s", self._run_log_dir)
        return self._run_log_dir

    def _on_console(self, rank: int) -> bool:
        # As in torch, an empty filter means no filtering.
        return not self._local_ranks_filter or rank in self._local_ranks_filter

    def _reify_devnull(self, envs: dict[int, dict[str, str]], tee: dict[int, Std]) -> LogsDest:
        # torch's devnull layout: streams stay on the console, tee and error
        # files point at devnull and no error file env is given.  Unlike torch,
        # local_ranks_filter still applies, and the filtered logs go to devnull
        # rather than to an impossible path under it.
        # Unlike torch, tee'd streams still go through the pipe to the sinks
        # (prefixed lines, OutputStream, ...); only their file is devnull.
        dest = LogsDest(filtered_stdout=os.devnull, filtered_stderr=os.devnull)
        for rank in range(len(envs)):
            shown = self._on_console(rank)
            dest.stdouts[rank] = _CONSOLE if shown else os.devnull
            dest.stderrs[rank] = _CONSOLE if shown else os.devnull
            if shown:
                if tee[rank] & Std.OUT:
                    dest.stdouts[rank] = dest.tee_stdouts[rank] = os.devnull
                if tee[rank] & Std.ERR:
                    dest.stderrs[rank] = dest.tee_stderrs[rank] = os.devnull
            dest.error_files[rank] = os.devnull
            envs[rank][ERROR_FILE_ENV] = ""
        return dest


def _prune_tree(path: str) -> None:
    """Remove the empty files and dirs under the dir ``path``, then ``path`` if empty.

    An empty dir (the rank dir of a worker that wrote no file, the usual
    case) goes in one ``rmdir``, without being listed first: a group of
    1024 workers is pruned in a third of the system calls of ``os.walk``.
    Symlinks are never followed, nor removed.
    """
    try:
        os.rmdir(path)
        return
    except OSError:
        pass  # not empty (or gone, or not ours to remove)
    try:
        with os.scandir(path) as it:
            entries = list(it)
    except OSError:
        return
    for entry in entries:
        try:
            if entry.is_dir(follow_symlinks=False):
                _prune_tree(entry.path)
            elif (
                entry.is_file(follow_symlinks=False)
                and entry.stat(follow_symlinks=False).st_size == 0
            ):
                os.unlink(entry.path)
        except OSError:
            continue  # vanished meanwhile or not ours to remove: leave it
    try:
        os.rmdir(path)
    except OSError:
        pass  # still holds logs (or is gone already)


def _is_rank(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_std(name: str, value: object) -> Std | dict[int, Std]:
    if isinstance(value, Std):
        return value
    if isinstance(value, Mapping) and all(
        _is_rank(rank) and isinstance(std, Std) for rank, std in value.items()
    ):
        return dict(value)  # a copy: later changes by the caller do not leak in
    hint = " (parse strings with Std.from_str)" if isinstance(value, str) else ""
    raise TypeError(
        f"{name} must be a Std or a dict of local_rank (int >= 0) -> Std, got {value!r}{hint}"
    )


def _check_ranks_filter(value: object) -> set[int] | None:
    if value is None:
        return None
    if isinstance(value, (set, frozenset)) and all(_is_rank(rank) for rank in value):
        return set(value)
    raise TypeError(
        f"local_ranks_filter must be a set of local ranks (ints >= 0) or None, got {value!r}"
    )
