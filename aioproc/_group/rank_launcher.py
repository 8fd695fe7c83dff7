"""Launch one rank of a group: its streams, tees, prefix and process.

``RankLauncher`` holds what every rank of a ``PContext`` shares (name,
entrypoint, per-rank args and envs, sinks, prefixes, extra fds) and turns a
rank into a running ``Child``: log files opened, tee'd streams wired to their
sinks, then a function worker through the one launch path (``_func.launch``) or a
binary through ``spawn``.  It never reaches back into the supervisor: frames
go to the handler the supervisor passes in.
"""

from __future__ import annotations

import os
import string
import subprocess
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import IO, TYPE_CHECKING, Any, TypeAlias

from .._child import shm as _shm
from .._child.aio import is_coroutine_function
from .._child.channel import CALL, INIT
from .._child.template import IMPORT_AHEAD
from .._func.boot import CallEncoder, init_frame
from .._func.launch import launch_function
from .._func.pickling import function_ref
from .._func.script import ScriptCommand, script_commands
from .._limits.join import ENTER_SH
from .._metrics.hooks import NullRecorder
from .._output.tee import TeeProtocol
from .._proc.lifeline import SHELL
from .._proc.spawn import BinaryStart, Child, adopt, discard, spawn, spawn_binaries
from ..logs import LogsDest
from ..sinks import CallbackSink, ConsoleSink, FileSink, Sink

if TYPE_CHECKING:
    from .._func.template import Template

ROLE = "default"
"""The metrics role of a plain group (torch's ``DEFAULT_ROLE``)."""

SinkLike: TypeAlias = Sink | Callable[..., Any] | str | IO[str]
"""A sink, a callable taking an ``OutputLine``, a file path or an open text file."""


class _FilteredFileSink(FileSink):
    """torch's duplicate filters: lines containing a needle also go to a file."""

    def __init__(self, path: str, needles: Iterable[str]) -> None:
        super().__init__(path)
        self._needles = tuple(needles)

    def lines(self, rank: int, stream: str, prefix: str, lines: list[str]) -> None:
        hits = [line for line in lines if any(n in line for n in self._needles)]
        if hits:
            super().lines(rank, stream, prefix, hits)


class RankLauncher:
    """Starts the ranks of one group (see the module docstring)."""

    def __init__(
        self,
        name: str,
        entrypoint: Callable[..., Any] | str,
        args: Mapping[int, tuple[Any, ...]],
        envs: Mapping[int, Mapping[str, str]],
        *,
        kwargs: Mapping[int, Mapping[str, Any]] | None = None,
        sinks: list[Sink],
        prefixes: Mapping[int, str] | str | None,
        pass_fds: tuple[int, ...],
        loop: str = "asyncio",
    ) -> None:
        self.name = name
        self.loop = loop
        """The event loop a coroutine function runs on in each worker (``init_frame``)."""
        self.entrypoint = entrypoint
        self.args = args
        self.envs = envs
        self.kwargs = kwargs or {}
        self.sinks = sinks
        self.filter_sinks: dict[str, Sink] = {}
        self._template = prefixes if isinstance(prefixes, str) else None
        self._prefixes = dict(prefixes) if isinstance(prefixes, Mapping) else {}
        self.pass_fds = pass_fds
        self.role = ROLE  # the metrics role: the agent's spec names it
        self._environ: dict[str, str] | None = None
        # ranks whose binary is this interpreter running a script: a forkserver
        # template can run those itself (see _script)
        self.scripts: dict[int, ScriptCommand] = script_commands(entrypoint, args)
        self._ref = None if isinstance(entrypoint, str) else function_ref(entrypoint)
        self.modules: tuple[str, ...] = () if self._ref is None else (self._ref[0],)
        """The module the function lives in: a template reads its code once (and
        imports asyncio once for a coroutine function: ``IMPORT_AHEAD``)."""
        if not isinstance(entrypoint, str) and is_coroutine_function(entrypoint):
            self.modules += IMPORT_AHEAD
        self._segments: dict[int, list[_shm.Segment]] = {}
        self.joins: dict[int, Callable[[int], None]] = {}
        """``{rank: placement.join}`` for ranks with limits (see ``_group.resources``)."""
        self.entries: dict[int, dict[str, str]] = {}
        """``{rank: variables}`` of the binary ranks that enter their cgroups themselves."""
        self.recorder: NullRecorder | None = None
        """The metrics recorder the tees count output to, when metrics are on."""

    def add_filters(self, dest: LogsDest, filters: Mapping[str, tuple[str, ...]]) -> None:
        """torch's duplicate filters: matching lines also go to the attempt's files."""
        for stream, path in (("stdout", dest.filtered_stdout), ("stderr", dest.filtered_stderr)):
            if filters[stream] and path:
                self.filter_sinks[stream] = _FilteredFileSink(path, filters[stream])

    def payloads(self, *, lifeline: bool = True) -> dict[int, list[bytes]]:
        """Encode the INIT and CALL frames of every rank, before anything starts.

        ``lifeline``: whether each worker reads its channel with a thread of
        its own (see ``_boot.init_frame``).

        Large arguments are written to shared memory now (see ``_child.shm``); the
        launcher keeps those memfds until the rank is launched, or until
        ``discard_segments`` for ranks that never are.
        """
        if isinstance(self.entrypoint, str):
            return {}
        init = init_frame(lifeline=lifeline, loop=self.loop)
        encoder = CallEncoder(self.entrypoint, self._ref)
        out: dict[int, list[bytes]] = {}
        try:
            for rank in range(len(self.args)):
                segments: list[_shm.Segment] | None = [] if _shm.AVAILABLE else None
                try:
                    kwargs = self.kwargs.get(rank, {})
                    out[rank] = [init, *encoder.encode(self.args[rank], kwargs, segments)]
                except TypeError as e:
                    if "arguments for" not in str(e):
                        raise
                    raise TypeError(
                        f"args or kwargs for local rank {rank} cannot be pickled: {e}"
                    ) from e
                if segments:
                    self._segments[rank] = segments
        except BaseException:
            self.discard_segments()
            raise
        return out

    def discard_segments(self) -> None:
        """Close the memfds of ranks not launched (the group is closing)."""
        segments, self._segments = self._segments, {}
        for held in segments.values():
            for segment in held:
                segment.close()

    def prefix(self, rank: int) -> str:
        """torch's default ``[{name}{rank}]:``, a per-rank override or a template."""
        template = self._prefixes.get(rank, self._template)
        if template is None:
            return f"[{self.name}{rank}]:"
        return string.Template(template).safe_substitute(
            role_name=self.name,
            rank=self.envs[rank].get("RANK", str(rank)),
            local_rank=str(rank),
        )

    def _env(self, rank: int) -> dict[str, str]:
        if self._environ is None:
            # one snapshot per group: os.environ decodes every entry on each read
            self._environ = dict(os.environ)
        return {**self._environ, **self.envs[rank]}

    def _streams(
        self, rank: int, dest: LogsDest, files: list[Any], tees: dict[str, TeeProtocol]
    ) -> dict[str, Any]:
        """Open ``rank``'s log files: ``{"stdout": ..., "stderr": ...}`` for ``spawn``.

        A redirected stream's file is appended to ``files`` (the caller
        closes it once the child has its copy); a tee'd one goes to a pipe
        read by the protocol put in ``tees``, which owns its file.
        """
        streams: dict[str, Any] = {}
        for key, path, tee_map in (
            ("stdout", dest.stdouts.get(rank, ""), dest.tee_stdouts),
            ("stderr", dest.stderrs.get(rank, ""), dest.tee_stderrs),
        ):
            if not path:
                streams[key] = None
                continue
            sinks = list(self.sinks) if rank in tee_map else []
            if key in self.filter_sinks:
                sinks.append(self.filter_sinks[key])
            # a local open(); the tee owns it or the caller closes it
            f = open(path, "wb", buffering=0)  # noqa: SIM115
            if sinks:
                streams[key] = subprocess.PIPE
                tees[key] = TeeProtocol(
                    f,
                    rank,
                    key,
                    self.prefix(rank),
                    sinks,
                    worker=f"{self.name}/{rank}",
                    metrics=(
                        None if self.recorder is None else (self.recorder, self.name, self.role)
                    ),
                )
            else:
                streams[key] = f
                files.append(f)
        return streams

    async def launch(
        self,
        rank: int,
        dest: LogsDest,
        payload: list[bytes] | None,
        on_frame: Callable[[int, bytearray], None],
        template: Template | None = None,
    ) -> Child:
        """Start ``rank``; raises what the launch raises, with nothing left open.

        A function worker is forked from ``template`` when one is given, and
        so is a binary that is this interpreter running a script (the
        template's worker runs the script itself).

        Cancellation: see ``spawn``: the half-started worker's group is killed.
        """
        env = self._env(rank)
        label = f"{self.name}/{rank}"
        files: list[Any] = []
        tees: dict[str, TeeProtocol] = {}
        try:
            streams = self._streams(rank, dest, files, tees)
            if payload is not None:
                init, *call = payload
                segments = self._segments.pop(rank, [])
                try:
                    return await launch_function(
                        label,
                        env,
                        on_frame=on_frame,
                        frames=[(INIT, [init]), (CALL, call)],
                        stdout=streams["stdout"],
                        stderr=streams["stderr"],
                        pass_fds=self.pass_fds,
                        tee_out=tees.get("stdout"),
                        tee_err=tees.get("stderr"),
                        template=template,
                        segments=segments,
                        one_shot=True,
                        join=self.joins.get(rank),
                        modules=self.modules,
                    )
                finally:
                    for segment in segments:
                        segment.close()
            script = self.scripts.get(rank)
            if template is not None and script is not None:
                from .._func.fork import spawn_forked

                return await spawn_forked(
                    template,
                    label,
                    env,
                    stdout=streams["stdout"],
                    stderr=streams["stderr"],
                    pass_fds=self.pass_fds,
                    channel_fd=None,
                    channel=None,
                    tee_out=tees.get("stdout"),
                    tee_err=tees.get("stderr"),
                    script=script,
                    join=self.joins.get(rank),
                )
            argv, env = self._binary(rank, env)
            return await spawn(
                label,
                argv,
                env,
                stdout=streams["stdout"],
                stderr=streams["stderr"],
                stdin=None,
                pass_fds=self.pass_fds,
                tee_out=tees.get("stdout"),
                tee_err=tees.get("stderr"),
                join=self.joins.get(rank),
            )
        except BaseException:
            for t in tees.values():
                t.close_unconnected()
            raise
        finally:
            for f in files:
                f.close()  # the child has its own copy

    def _binary(self, rank: int, env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
        """The argv and environment of binary ``rank``.

        A rank with cgroups runs through a shell that enters them, then
        execs the program: the parent's ``join`` would land only after the
        program has run (and forked) for a moment.
        """
        argv = [str(self.entrypoint), *map(str, self.args[rank])]
        entry = self.entries.get(rank)
        if entry is None:
            return argv, env
        return [SHELL, "-c", ENTER_SH, "aioproc-enter", *argv], {**env, **entry}

    async def launch_binaries(
        self, ranks: Sequence[int], dest: LogsDest
    ) -> tuple[dict[int, Child], Exception | None]:
        """Start the binary workers of ``ranks``, in order, in one batch (``spawn_binaries``).

        Returns the workers started, and the error that stopped the batch
        (the ranks after the failed one are not started), if any.
        Their output is not read until ``Child.release_output()``: the caller
        announces each one's start first.

        Cancellation: the batch's workers are killed with their groups.
        """
        files: list[Any] = []
        tees: list[dict[str, TeeProtocol]] = []
        starts: list[BinaryStart] = []
        children: dict[int, Child] = {}
        error: Exception | None = None
        try:
            for rank in ranks:
                rank_tees: dict[str, TeeProtocol] = {}
                tees.append(rank_tees)
                try:
                    streams = self._streams(rank, dest, files, rank_tees)
                except OSError as e:
                    error = e  # this rank's log file: start the ones before it
                    break
                argv, env = self._binary(rank, self._env(rank))
                starts.append(
                    BinaryStart(
                        argv,
                        env,
                        streams["stdout"],
                        streams["stderr"],
                        self.joins.get(rank),
                    )
                )
            procs, failed = await spawn_binaries(starts, self.pass_fds)
            error = failed or error
            pending = list(zip(ranks, procs, tees, strict=False))
            try:
                while pending:
                    rank, proc, rank_tees = pending.pop(0)
                    try:
                        # connects the tee pipes; kills the worker if that fails
                        children[rank] = await adopt(
                            f"{self.name}/{rank}",
                            proc,
                            None,
                            rank_tees.get("stdout"),
                            rank_tees.get("stderr"),
                            hold=True,  # read once its start is announced
                        )
                    except Exception as e:
                        error = error or e
                        break
            except BaseException:
                for child in children.values():
                    child.abandon()  # never reported as started: not ours to keep
                children.clear()
                raise
            finally:
                for _, proc, _ in pending:
                    discard(proc)
        finally:
            for f in files:
                f.close()  # the children have their own copies
            for rank, rank_tees in zip(ranks, tees, strict=False):
                if rank not in children:
                    for t in rank_tees.values():
                        t.close_unconnected()
        return children, error


def make_sinks(sinks: Sequence[SinkLike] | None) -> list[Sink]:
    """Sinks from what users pass (default: one ``ConsoleSink``)."""
    if sinks is None:
        return [ConsoleSink()]
    if isinstance(sinks, (str, Sink)) or not isinstance(sinks, Sequence):
        raise TypeError(f"sinks must be a list of sinks, got {sinks!r}")
    out: list[Sink] = []
    for sink in sinks:
        if isinstance(sink, Sink):
            out.append(sink)
        elif isinstance(sink, str) or hasattr(sink, "write"):
            out.append(FileSink(sink))  # type: ignore[arg-type]
        elif callable(sink):
            out.append(CallbackSink(sink))
        else:
            raise TypeError(
                f"unsupported sink {sink!r}: expected a Sink, a callable, a path or a text file"
            )
    return out
