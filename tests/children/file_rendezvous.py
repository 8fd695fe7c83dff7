"""A rendezvous backend of another package: hosts meet in a directory they all see.

It lives outside aioproc, as a third party's backend does, and implements
``aioproc.rendezvous.RendezvousHandler`` alone.  The tests declare it as an
entry point (``file = file_rendezvous:FileRendezvousHandler`` in the
``aioproc.rendezvous_backends`` group) of a package they write, so that
``aioproc run --rdzv-backend file --rdzv-endpoint DIR`` finds it without
any import; or register it with ``register_backend``.

Under ``DIR/<run_id>/``: ``round-<r>/<time>-<node>.json`` is a host's join
of round r (its address, a port for MASTER_PORT, nproc and role); the round
completes once ``max_nodes`` hosts joined, ranked in the order they joined.
``round-<r>/done-<node>`` marks a host whose workers succeeded;
``failed`` and ``closed`` end the job.  A shared file system has no
notifications, so it looks again every ``POLL`` seconds (this backend is a
test's; aioproc's own never poll).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
from collections.abc import Callable, Mapping
from typing import Any

from aioproc.rendezvous import (
    RendezvousClosedError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousJobFailedError,
    RendezvousNode,
    RendezvousParameters,
    RendezvousTimeoutError,
    WorldChange,
)

POLL = 0.02


class FileRendezvousHandler(RendezvousHandler):
    """Hosts meet in ``params.endpoint``, a directory; ``max_nodes`` of them per round."""

    endpoint_help = "DIR (a directory every host sees)"

    def __init__(self, params: RendezvousParameters) -> None:
        if not os.path.isdir(params.endpoint):
            raise ValueError(f"the file rendezvous needs a directory, got {params.endpoint!r}")
        self._params = params
        self._dir = os.path.join(params.endpoint, params.run_id)
        self.join_timeout = params.get_seconds("join_timeout", 60.0)
        self.addr = params.local_addr or "127.0.0.1"
        self.node_id = f"{self.addr}_{os.getpid()}"
        self._round = -1
        self._nodes: tuple[RendezvousNode, ...] = ()
        self._nproc = 1
        self._role = "default"

    def __repr__(self) -> str:
        return f"<FileRendezvousHandler {self._dir} node {self.node_id} round {self._round}>"

    def get_backend(self) -> str:
        return "file"

    def get_run_id(self) -> str:
        return self._params.run_id

    def is_closed(self) -> bool:
        return os.path.exists(self._path("closed"))

    async def set_closed(self) -> None:
        _write(self._path("closed"), {"finished": False})

    def num_nodes_waiting(self) -> int:
        return 0

    def session(
        self,
        local_world_size: int,
        lease_renewed: Callable[[float], None] | None = None,
        role: str = "default",
    ) -> _Session:
        self._nproc, self._role = local_world_size, role
        return _Session(self._dir)

    async def next_rendezvous(self) -> RendezvousInfo:
        self._round += 1
        folder = self._path(f"round-{self._round}")
        os.makedirs(folder, exist_ok=True)
        with socket.socket() as s:  # MASTER_PORT, should this host be group rank 0
            s.bind((self.addr, 0))
            port = s.getsockname()[1]
        me = {"node": self.node_id, "addr": self.addr, "port": port}
        _write(
            os.path.join(folder, f"{time.time_ns():020d}-{self.node_id}.json"),
            {**me, "nproc": self._nproc, "role": self._role},
        )
        deadline = time.monotonic() + self.join_timeout
        while True:
            self._raise_if_over()
            joins = sorted(f for f in os.listdir(folder) if f.endswith(".json"))
            if len(joins) >= self._params.max_nodes:
                break
            if time.monotonic() > deadline:
                raise RendezvousTimeoutError(
                    f"{len(joins)} of {self._params.max_nodes} hosts joined {folder} within "
                    f"{self.join_timeout:g} s"
                )
            await asyncio.sleep(POLL)
        records = [_read(os.path.join(folder, f)) for f in joins[: self._params.max_nodes]]
        self._nodes = tuple(
            RendezvousNode(r["node"], r["addr"], r["port"], r["nproc"], r["role"]) for r in records
        )
        rank = [n.node_id for n in self._nodes].index(self.node_id)
        return RendezvousInfo(self._round, rank, self._nodes)

    async def wait_for_change(self) -> WorldChange:
        following = self._path(f"round-{self._round + 1}")
        while True:
            self._raise_if_over()
            if os.path.isdir(following) and os.listdir(following):
                return WorldChange("a host joined the next round")
            await asyncio.sleep(POLL)

    async def exit_barrier(self, timeout: float) -> WorldChange | None:
        folder = self._path(f"round-{self._round}")
        _write(os.path.join(folder, f"done-{self.node_id}"), {})
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._raise_if_over(finished_ok=True)
            if len([f for f in os.listdir(folder) if f.startswith("done-")]) >= len(self._nodes):
                break
            await asyncio.sleep(POLL)
        _write(self._path("closed"), {"finished": True})
        return None

    async def report_failure(self, failure: Mapping[str, Any]) -> None:
        _write(self._path("failed"), {**failure, "host": self.addr})

    async def shutdown(self) -> bool:
        await self.set_closed()
        return True

    def _path(self, name: str) -> str:
        return os.path.join(self._dir, name)

    def _raise_if_over(self, finished_ok: bool = False) -> None:
        if os.path.exists(self._path("failed")):
            failure = _read(self._path("failed"))
            raise RendezvousJobFailedError(f"the job failed on {failure['host']}", failure)
        if os.path.exists(self._path("closed")):
            finished = bool(_read(self._path("closed"))["finished"])
            if not (finished and finished_ok):
                raise RendezvousClosedError("the job is over", finished=finished)


class _Session:
    def __init__(self, folder: str) -> None:
        self._folder = folder

    async def __aenter__(self) -> None:
        os.makedirs(self._folder, exist_ok=True)

    async def __aexit__(self, *exc: object) -> None:
        return None


def _write(path: str, record: Mapping[str, Any]) -> None:
    """Whole or not at all: the others list the folder (a hidden name until complete)."""
    folder, name = os.path.split(path)
    hidden = os.path.join(folder, f".{name}.tmp")
    with open(hidden, "w") as f:
        json.dump(dict(record), f)
    os.rename(hidden, path)


def _read(path: str) -> dict[str, Any]:
    with open(path) as f:
        record: dict[str, Any] = json.load(f)
    return record
