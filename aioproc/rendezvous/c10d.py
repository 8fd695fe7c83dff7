"""torchrun's c10d rendezvous: the etcd rendezvous, in a store one of the agents hosts.

``aioproc run --rdzv-backend c10d --rdzv-endpoint HOST[:PORT]`` works as
torchrun's: the agent on HOST serves the rendezvous's store on PORT (29400
by default) and every agent, that one included, meets in it.  torch's
store is a TCP store inside the hosting agent; aioproc's is an etcd server
the hosting agent runs as a supervised child (``_etcd_server``), and the
meeting is the etcd rendezvous (``rendezvous.etcd``), with its semantics:
elastic rounds, host loss, fencing, the exit barrier.

Which agent hosts is decided as torch decides it (``rendezvous._c10d``):
``is_host=true``/``false`` says so; otherwise an agent hosts when HOST names
its machine.  Several agents on that machine all try, as in torch: the
first to bind the port hosts, the others find it taken and join as clients.
Every other agent retries the endpoint until ``join_timeout`` while the
host starts.

The hosting agent is the job's single point of failure, as in torch: the
store dies with it.  When it ends normally it keeps the store up until the
other agents have left it (at most ``close_timeout``), so they all see how
the job ended; when it is killed, the other agents lose their leases within
five sixths of ``lease_ttl``, stop their workers and fail, naming the
endpoint.  The guardian kills the server with a SIGKILLed agent, and a
janitor removes the server's data.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Mapping
from typing import Any, TypeVar

import anyio

from ._c10d import (
    StoreNotEtcdError,
    c10d_options,
    etcd_missing,
    find_etcd,
    matches_machine_hostname,
    not_etcd,
)
from ._etcd_server import EmbeddedEtcd, EtcdStartError
from .api import (
    RendezvousConnectionError,
    RendezvousError,
    RendezvousInfo,
    RendezvousLeaseLostError,
    RendezvousParameters,
    WorldChange,
)
from .etcd import EtcdRendezvousHandler

__all__ = ["C10dRendezvousHandler"]

logger = logging.getLogger("aioproc.rendezvous")

T = TypeVar("T")


class C10dRendezvousHandler(EtcdRendezvousHandler):
    """The etcd rendezvous in a store that this agent hosts, or another agent hosts.

    Build it with ``create_handler(RendezvousParameters("c10d", ...))``:
    the endpoint is ``HOST[:PORT]`` of the hosting agent.  Building it
    decides whether this agent hosts the store (resolving names, so before
    the event loop runs), and finds the etcd binary if it does.  A hosting
    agent starts its etcd server when its session opens and stops it when
    the session ends, after the other agents have left it.  The hosting
    agent is the job's single point of failure (as torch's c10d host is):
    if it dies, every other agent fails, naming the endpoint.

    Options: those of ``_c10d.c10d_options``; ``data_dir`` is where a
    hosted server keeps its data directory (the run's log dir with
    ``aioproc run``; else the temp dir).

    Raises:
        ValueError: a bad option or endpoint, or this agent hosts the store
            and no etcd binary is installed (the message says how to get one).
        ImportError: aetcd is not installed (says how to install it).

    Attributes:
        endpoint: ``HOST:PORT`` of the store.
        hosting: whether this agent serves the store right now.
    """

    endpoint_help = (
        "HOST[:PORT] (the host whose agent serves the rendezvous; port 29400 by default)"
    )
    needs_run_id = False  # torchrun's default id, "none": the store is the job's own
    hosts_store = True

    def __init__(self, params: RendezvousParameters) -> None:
        options = c10d_options(params)
        hosting = options.is_host
        if hosting is None:
            hosting = matches_machine_hostname(options.host)
        binary = find_etcd() if hosting else None
        # built first: a bad option or a missing client is told before a missing binary
        super().__init__(options.etcd_params)
        if hosting and binary is None:
            raise ValueError(etcd_missing(options.endpoint))
        self._options = options
        self.endpoint = options.endpoint
        self._server = (
            EmbeddedEtcd(binary, options.host, options.port, options.data_dir) if binary else None
        )
        self._hosted: EmbeddedEtcd | None = None
        self._closed_once = False  # the endpoint closed a probe's connection the last time
        self._vet = self._vet_endpoint

    def __repr__(self) -> str:
        state = f"round {self._info.round}" if self._info is not None else "not joined"
        hosting = ", hosting the store" if self.hosting else ""
        return (
            f"<C10dRendezvousHandler {self.get_run_id()} at {self.endpoint} "
            f"node {self.addr} {state}{hosting}>"
        )

    @property
    def hosting(self) -> bool:
        return self._hosted is not None

    def get_backend(self) -> str:
        return "c10d"

    def session(self, *args: Any, **kwargs: Any) -> Any:
        """The etcd rendezvous's session (same arguments), in a store this agent may host.

        Entering it starts the store first when this agent hosts it (see
        ``_host_store``); leaving it stops the store last.
        """
        return _C10dSession(self, super().session(*args, **kwargs))

    # torch's API: the etcd rendezvous's, with errors that name the store

    async def next_rendezvous(self) -> RendezvousInfo:
        return await self._explained(super().next_rendezvous())

    async def wait_for_change(self) -> WorldChange:
        return await self._explained(super().wait_for_change())

    async def exit_barrier(self, timeout: float) -> WorldChange | None:
        return await self._explained(super().exit_barrier(timeout))

    async def report_failure(self, failure: Mapping[str, Any]) -> None:
        await self._explained(super().report_failure(failure))

    async def _explained(self, call: Awaitable[T]) -> T:
        """``await call``; a lost store is said to be the c10d store, at its endpoint."""
        try:
            return await call
        except RendezvousConnectionError as e:
            if self._hosted is not None or isinstance(e, StoreNotEtcdError):
                raise
            raise RendezvousConnectionError(
                f"{e} (the c10d rendezvous store, served by the agent on "
                f"{self._options.host}: is it running?)"
            ) from e
        except RendezvousLeaseLostError as e:
            server = self._hosted
            if server is None:
                raise RendezvousLeaseLostError(
                    f"lost the c10d rendezvous store at {self.endpoint}: the agent hosting it "
                    f"ended or cannot be reached, and the job cannot go on without it; {e}"
                ) from e
            why = server.exited()
            if why is None:
                raise  # the store runs: this agent itself lost touch (stopped, starved)
            raise RendezvousLeaseLostError(
                f"the c10d rendezvous store this agent hosts at {self.endpoint} (etcd) "
                f"exited ({why}); the job cannot go on without it; {e}"
            ) from e

    # the store

    async def _vet_endpoint(self, left: float) -> None:
        """While this agent connects to a store it does not host: is the endpoint etcd at all?

        Called by the session after a call that failed as if the store were
        not up yet, with the seconds left before ``join_timeout``.  Whatever
        else holds the endpoint's port keeps every agent from serving the
        store there, so waiting for it would only wait out ``join_timeout``.

        Raises:
            StoreNotEtcdError: something that is not etcd holds the endpoint
                (named, with what it did).
        """
        if self._hosted is not None:
            return  # this agent's own etcd serves it
        options = self._options
        verdict = await not_etcd(options.host, options.port, left)
        kind = verdict[0] if verdict is not None else None
        closed_before, self._closed_once = self._closed_once, kind == "closed"
        if verdict is None or (kind == "closed" and not closed_before):
            return  # an etcd being stopped closes what it had not served: ask again
        raise StoreNotEtcdError(
            f"the c10d rendezvous endpoint {self.endpoint} is held by something that is not "
            f"etcd: {verdict[1]}; no agent can serve the rendezvous store there (stop what "
            f"listens on port {options.port}, or choose another port)"
        )

    async def _host_store(self) -> None:
        """Start the store if this agent hosts it; return once it serves the endpoint.

        An agent that inferred it hosts (``is_host`` not given) and finds the
        port taken joins as a client: another agent on this machine hosts
        (torch's fallback).

        Raises:
            RendezvousConnectionError: the store could not be started (etcd's
                error named), within ``join_timeout``.

        Cancellation: a server being started is stopped (shielded, bounded).
        """
        server = self._server
        if server is None:
            return
        try:
            await server.start(self.join_timeout)
        except EtcdStartError as e:
            if e.endpoint_taken and self._options.is_host is None:
                logger.info(
                    "c10d rendezvous: %s is served already (another agent on this machine "
                    "hosts the store): joining it",
                    self.endpoint,
                )
                return
            raise RendezvousConnectionError(
                f"could not host the c10d rendezvous store at {self.endpoint}: {e}"
            ) from e
        except OSError as e:
            raise RendezvousConnectionError(
                f"could not host the c10d rendezvous store at {self.endpoint}: {e}"
            ) from e
        self._hosted = server

    async def _wait_for_others(self) -> None:
        """Before the store stops: wait until the other agents have left it.

        They leave once they know how the job ended (their sessions revoke
        their leases; a dead agent's lease expires), so stopping the store
        earlier could cut one off before it saw the end.  Bounded by
        ``close_timeout``; woken by the deletions of their liveness keys.
        """
        keys = self._keys
        if keys.session is None:
            return
        store = keys.store()
        others = 0
        store.watch_departures(store.control.revision + 1)  # from before the first count
        try:
            with anyio.move_on_after(self.close_timeout):
                while True:
                    seen = store.version
                    others = await keys.count("nodes/") - 1  # this agent's key is one
                    if others <= 0:
                        return
                    await store.changed(seen)
        except RendezvousError as e:  # this agent's lease is gone: nobody to wait for
            logger.debug("c10d rendezvous: not waiting for the other agents: %s", e)
            return
        finally:
            await store.unwatch_departures()
        logger.warning(
            "c10d rendezvous: %d other agent(s) still use the store at %s after %g s "
            "(close_timeout): stopping it",
            others,
            self.endpoint,
            self.close_timeout,
        )

    async def _release_store(self) -> None:
        """Stop the store this agent hosts, if it does.

        Cancellation: shielded and bounded (``EmbeddedEtcd.stop``).
        """
        server, self._hosted = self._hosted, None
        if server is not None:
            await server.stop()


class _C10dSession:
    """A c10d session: the store hosted (if it is this agent's) around the etcd session."""

    def __init__(self, handler: C10dRendezvousHandler, inner: Any) -> None:
        self._handler = handler
        self._inner = inner

    async def __aenter__(self) -> C10dRendezvousHandler:
        """Host the store if this agent does, then open the etcd session in it.

        Cancellation: a store already started is stopped (shielded,
        bounded) before the cancellation propagates.
        """
        h = self._handler
        unused = h._options.unused
        if unused:
            logger.debug(
                "c10d rendezvous: option(s) %s not used by aioproc's c10d backend",
                ", ".join(unused),
            )
        await h._host_store()
        try:
            await h._explained(self._inner.__aenter__())
        except BaseException:
            await h._release_store()
            raise
        return h

    async def __aexit__(self, *exc: Any) -> None:
        """Close the etcd session, then stop the store if this agent hosts it.

        A hosting agent first waits for the other agents to leave the
        store (at most ``close_timeout``).

        Cancellation: the caller shields it; every step is bounded.
        """
        h = self._handler
        try:
            if h.hosting:
                await h._wait_for_others()
        finally:
            try:
                await self._inner.__aexit__(*exc)
            finally:
                await h._release_store()
