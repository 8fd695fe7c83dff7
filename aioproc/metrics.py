"""Metrics for services and schedulers: what every group, worker and pool does.

Off by default, and free while off: importing ``aioproc`` does not import
this module, and the launcher's hooks cost one attribute check per event
until a recorder is enabled::

    import aioproc.metrics

    recorder = aioproc.metrics.enable()  # the process-wide Recorder
    async with aioproc.metrics.serve("127.0.0.1", 9464) as server:  # GET /metrics
        ...

(or ``server = await serve(...)``, then ``await server.aclose()``).  A
service that already runs an HTTP server mounts the page on it instead of
opening a second port: ``make_asgi_app()`` (Starlette, FastAPI, any ASGI
server) or ``make_aiohttp_handler()``::

    app.mount("/metrics", aioproc.metrics.make_asgi_app())  # FastAPI, Starlette
    app.router.add_get("/metrics", aioproc.metrics.make_aiohttp_handler())  # aiohttp

A host service that already exports with ``prometheus_client`` registers
aioproc's metrics into its own registry instead (``pip install
'aioproc[metrics]'``)::

    aioproc.metrics.enable()
    aioproc.metrics.register(registry)  # a CollectorRegistry; None: the default one

**Why not prometheus_client for the page.**  ``serve()``, the ASGI app,
the aiohttp handler and ``render()`` need no extra: they write
Prometheus's text format 0.0.4 themselves (``_metrics/text.py``, about a
hundred lines), the same bytes ``prometheus_client.generate_latest``
writes (a test compares them).  ``generate_latest`` renders a whole
registry in one call, so a large page would hold the loop for all of it,
where aioproc's writer hands out a series at a time and the exporters give
the loop a turn every 2 ms of rendering; it would also copy every sample
into its own family objects first, and make an optional package a
dependency of every supervisor.  Its HTTP server runs on a thread per
connection, without a cap, and rendering there contends with the loop for
the GIL.  ``prometheus_client`` stays what it is good at: the registry of
a host that already uses it (``register()``).

**The server** (``serve()``, ``aioproc run --metrics-port``) answers at
most ``max_connections`` clients at once (64): at the cap a new
connection replaces the oldest one still sending its request head, or is
answered 503 when all are being answered; it holds at most the cap's
sockets plus 16 (connections being replaced), and past that does not
accept at all (the kernel queues the rest), so a crowd of half-open
connections never costs the supervisor more than 81 fds (its listening
socket included).  A client has 10 s to send its request head, 30 s to
take the response, and is cut off (reset) after 5 s without progress
either way; ``aclose()`` gives the responses under way a grace period
(1 s) and then drops them, read or not.

**Series of finished groups expire.**  Every group labels a score of
series; a scheduler that names every job differently would grow the page
for ever.  A ``(group, role)`` keeps series of its own while anything of
it runs and while it is one of the last ``keep_finished`` finished ones
(``Recorder(keep_finished=100)``); then its counters and histograms are
added into the series of its role labelled ``group="(expired)"``
(``EXPIRED``), and its gauges are removed.  ``sum by (role)`` over a
counter or a histogram's buckets keeps counting every group; a dashboard
by ``group`` shows the running and the recent ones.  A group that runs
again (an agent's restart) gets fresh series: a counter reset, which
``rate()`` and ``increase()`` handle.  ``Recorder(group_label=...)`` maps
names to fewer values before any of this.

**The hooks.**  The launcher reads the recorder in force
(``aioproc._metrics.hooks.current``, a ``NullRecorder`` until ``enable()``)
once when a group, pool or agent opens, and before each hook checks its
``enabled`` attribute.  The hooks and where the launcher calls them:

- ``worker_started(group, role)``: a worker's ``"started"`` event (its pid
  is known and watched), once per worker start, restarts included;
- ``worker_exited(group, role, outcome)``: its ``"exited"`` event, once per
  start (``outcome_of(returncode, stopped=...)`` names the outcome);
- ``group_queued(group, role, seconds)``: the group has its ``Capacity``
  slots, after waiting ``seconds`` for them (0 without a ``Capacity``);
- ``group_started(group, role, seconds)``: the group's start, after its
  last worker started (timed from ``group_queued``: a wait for slots is
  never start time);
- ``group_exited(group, role, outcome)``: when the group's result is final
  (``wait()``/``poll()`` returns it, or a close stopped the group);
- ``group_stopped(group, role, seconds)``: the end of every stop that
  signalled workers (a ``close()``, or the stop of the other ranks after a
  failure), from the first signal to the last reap;
- ``restarted(group, role, remaining)``: the agent schedules a restart;
- ``run_finished(group, role, outcome, restarts)``: ``LocalElasticAgent.run()``
  returns (torch's ``_record_metrics``);
- ``output(group, role, stream, lines, nbytes)``: the tee splits a chunk it
  read from a pipe into lines (once per chunk);
- ``backpressure(group, role, stream, seconds)``: flow control resumes (or
  closes) a stream it had paused because a consumer fell behind;
- ``pool_call(pool, outcome, seconds)``: a pool call's result reaches its
  caller;
- ``rendezvous_round(role, backend, outcome, seconds)``: the agent's
  rendezvous returns or raises.

Who calls them: ``start_processes`` and ``run`` call the group, worker,
output and backpressure hooks (with role ``"default"``; an agent's
attempts are groups named after the spec's role); pools call
``pool_call``; ``LocalElasticAgent`` calls ``restarted`` (a failure's
restart, and the one a lost host costs), ``run_finished`` (once per
``run()``; a run that raised counts as ``"stopped"`` after a signal or a
cancellation, else as ``"failed"``) and, over several hosts,
``rendezvous_round`` (a round cut short by ``stop()`` is not counted).
``aioproc run --metrics-port PORT`` enables the recorder and serves it with
``serve()`` for the run's duration.

**The metrics.**  Where torch.distributed.elastic records the same thing,
aioproc keeps its meaning under a Prometheus name (torch's ``put_metric``
names, and the names its ``@prof`` decorator puts, ``Class.method.success``,
``.failure`` and ``.duration.ms``; torch's durations are milliseconds,
aioproc's seconds):

- ``aioproc_groups_started_total`` (counter): ``LocalElasticAgent._start_workers.success``
- ``aioproc_groups_exited_total`` (counter, by outcome): ``workers.{role}.succeeded``,
  ``workers.{role}.failed``
- ``aioproc_restarts_total`` (counter): ``SimpleElasticAgent._restart_workers.success``
- ``aioproc_remaining_restarts`` (gauge): ``workers.{role}.remaining_restarts``
- ``aioproc_runs_total`` (counter, by outcome and retried): ``workers.{role}.run_total``
  and ``workers.{role}.run_{success,failed}_{with,no}_retries``
- ``aioproc_group_start_seconds`` (histogram): ``LocalElasticAgent._start_workers.duration.ms``
- ``aioproc_group_stop_seconds`` (histogram): ``LocalElasticAgent._stop_workers.duration.ms``
- ``aioproc_rendezvous_rounds_total`` (counter, by outcome):
  ``SimpleElasticAgent._rendezvous.success``, ``.failure``
- ``aioproc_rendezvous_seconds`` (histogram): ``SimpleElasticAgent._rendezvous.duration.ms``

and, with no torch counterpart: ``aioproc_groups_running``,
``aioproc_workers_started_total``, ``aioproc_workers_running``,
``aioproc_workers_exited_total`` (by outcome), ``aioproc_group_queue_seconds``,
``aioproc_output_lines_total``,
``aioproc_output_bytes_total`` and ``aioproc_output_backpressure_seconds_total``
(by stream), ``aioproc_pool_calls_total`` (by outcome) and
``aioproc_pool_call_seconds``.  ``CATALOGUE`` lists them all with their labels.

torch's ``workers.{role}.run_success_with_retries`` is
``aioproc_runs_total{outcome="succeeded",retried="true"}``, its
``run_failed_no_retries`` ``{outcome="failed",retried="false"}``, and its
``run_total`` the sum over both labels.  torch puts ``workers.{role}.succeeded``
and ``.failed`` once per monitor poll; aioproc polls nothing and counts
each group once, when it is over.  torch's ``workers.{role}.flakiness`` is
not exported: it is ``aioproc_restarts_total`` over the restarts allowed.

Labels stay few: ``group`` (the name given to ``start_processes``; a
``Recorder(group_label=...)`` maps job names that are all different to a
few values), ``role``, ``stream``, ``outcome``, ``pool``, ``backend``;
never a pid or a rank.

**OpenTelemetry** is not supported, on purpose.  Its SDK is a dependency
tree of its own (API, SDK, an exporter) with a meter provider and a
periodic reader thread to set up, and it would either duplicate every
value in OTel instruments or register observable callbacks that re-read
this registry; OTel's own Prometheus exporter goes through
``prometheus_client`` anyway.  A service that uses OpenTelemetry scrapes
``serve()``'s endpoint with the OpenTelemetry Collector's Prometheus
receiver, which keeps aioproc free of the SDK.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from ._base import public_module
from ._base.resource import OpenResource
from ._metrics import hooks as _hooks
from ._metrics.apps import MetricsApp
from ._metrics.apps import aiohttp_handler as _aiohttp_handler
from ._metrics.families import Counter, Gauge, Histogram, Registry
from ._metrics.hooks import OUTCOMES, POOL_OUTCOMES, STREAMS, NullRecorder
from ._metrics.recorder import (
    CATALOGUE,
    DURATION_BUCKETS,
    EXPIRED,
    KEEP_FINISHED,
    POOL_BUCKETS,
    MetricInfo,
    Recorder,
    outcome_of,
)
from ._metrics.server import MAX_CONNECTIONS, MetricsServer
from ._metrics.server import start as _start_server
from ._metrics.text import CONTENT_TYPE
from ._metrics.text import render as _render

if TYPE_CHECKING:
    from aiohttp import web
    from prometheus_client.registry import Collector, CollectorRegistry

__all__ = [
    "CATALOGUE",
    "CONTENT_TYPE",
    "Counter",
    "DURATION_BUCKETS",
    "EXPIRED",
    "Gauge",
    "Histogram",
    "KEEP_FINISHED",
    "MAX_CONNECTIONS",
    "MetricInfo",
    "MetricsApp",
    "MetricsServer",
    "NullRecorder",
    "OUTCOMES",
    "POOL_BUCKETS",
    "POOL_OUTCOMES",
    "Recorder",
    "Registry",
    "STREAMS",
    "disable",
    "enable",
    "get_recorder",
    "is_enabled",
    "make_aiohttp_handler",
    "make_asgi_app",
    "outcome_of",
    "register",
    "render",
    "serve",
]

# defined in the wing, imported from here
public_module(
    __name__,
    Counter,
    Gauge,
    Histogram,
    MetricInfo,
    MetricsApp,
    MetricsServer,
    NullRecorder,
    Recorder,
    Registry,
    outcome_of,
)


def enable(recorder: Recorder | None = None) -> Recorder:
    """Make ``recorder`` the process-wide recorder, and return it.

    Groups, pools and agents opened from then on record into it; those
    already open keep the recorder they started with.

    Args:
        recorder: the recorder to use; None: the one already enabled, or a
            new ``Recorder()``.

    Returns:
        The recorder in force.

    Raises:
        TypeError: ``recorder`` is not a ``Recorder``.
    """
    if recorder is None:
        if isinstance(_hooks.current, Recorder):
            return _hooks.current
        recorder = Recorder()
    elif not isinstance(recorder, Recorder):
        raise TypeError(f"enable() takes an aioproc.metrics.Recorder, got {recorder!r}")
    _hooks.current = recorder
    return recorder


def disable() -> Recorder | None:
    """Turn metrics off: the process-wide recorder records nothing again.

    Returns:
        The recorder that was in force, or None if metrics were off.
    """
    previous = _hooks.current
    _hooks.current = _hooks.DEFAULT
    return previous if isinstance(previous, Recorder) else None


def get_recorder() -> NullRecorder:
    """The process-wide recorder: the ``Recorder`` enabled, else a ``NullRecorder``."""
    return _hooks.current


def is_enabled() -> bool:
    """Whether a recorder is enabled for the process."""
    return _hooks.current.enabled


def _registry(recorder: Recorder | Registry | None) -> Registry | None:
    if recorder is None:
        current = _hooks.current
        return current.registry if isinstance(current, Recorder) else None
    if isinstance(recorder, Registry):
        return recorder
    if isinstance(recorder, Recorder):
        return recorder.registry
    raise TypeError(f"expected an aioproc.metrics.Recorder or Registry, got {recorder!r}")


def render(recorder: Recorder | Registry | None = None) -> str:
    """The metrics in Prometheus's text format 0.0.4 (``CONTENT_TYPE``).

    Args:
        recorder: whose metrics; None: the process-wide recorder's (an empty
            text while metrics are off).

    Returns:
        The text, every family with its ``# HELP`` and ``# TYPE`` lines.
    """
    registry = _registry(recorder)
    return "" if registry is None else _render(registry.collect())


def register(
    registry: CollectorRegistry | None = None, *, recorder: Recorder | None = None
) -> Collector:
    """Export aioproc's metrics through ``prometheus_client`` (the ``metrics`` extra).

    The collector reads the recorder at each scrape, so the host's registry
    always shows the values ``render()`` shows.  Unregister it with
    ``registry.unregister(collector)``.

    Args:
        registry: the host service's ``CollectorRegistry``; None:
            ``prometheus_client.REGISTRY``.
        recorder: whose metrics; None: the process-wide recorder at each
            scrape (nothing while metrics are off).

    Returns:
        The collector registered.

    Raises:
        ModuleNotFoundError: prometheus_client is not installed.
        ValueError: the registry already has metrics of these names.
    """
    # imported here: prometheus_client is optional, and serve() does without it
    from ._metrics import prom

    if recorder is not None:
        fixed = _registry(recorder)
        return prom.register(lambda: fixed, registry)
    return prom.register(lambda: _registry(None), registry)


def _source(recorder: Recorder | None) -> Callable[[], Registry | None]:
    """What an exporter reads at each request; checks ``recorder`` now."""
    if recorder is None:
        return lambda: _registry(None)
    fixed = _registry(recorder)
    return lambda: fixed


def serve(
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    recorder: Recorder | None = None,
    max_connections: int = MAX_CONNECTIONS,
) -> OpenResource[MetricsServer]:
    """Serve ``GET /metrics`` over HTTP on the running loop, without prometheus_client.

    ``async with serve(host, port) as server:`` closes the server when the
    block exits; ``server = await serve(host, port)`` leaves that to
    ``await server.aclose()``.  ``server.port`` says the port.  Other paths
    answer 404; a connection serves one request.  What a client can cost
    the supervisor is bounded: see the module's "The server".

    Args:
        host: the address to listen on; the default takes no traffic from
            other machines; ``""``: every interface, IPv4 and IPv6 (one
            dual-stack socket where the system has IPv6).
        port: the port; 0: one the system chooses (``server.port`` says which).
        recorder: whose metrics; None: the process-wide recorder at each
            request (an empty page while metrics are off).
        max_connections: clients served at once (``MAX_CONNECTIONS``, 64).

    Returns:
        An ``OpenResource``: awaited, or used with ``async with``.

    Raises:
        TypeError: ``recorder`` is no ``Recorder``, ``host`` no str, or
            ``port`` or ``max_connections`` no int (raised by the call,
            before anything listens).
        ValueError: ``port`` is not 0-65535, or ``max_connections`` is
            under 1.
        OSError: the address cannot be bound (in use, not local), when
            awaited.

    Cancellation: cancelling the open before it returns leaves no
    socket open; ``aclose()`` closes every connection within its grace
    period, shielded.
    """
    source = _source(recorder)  # a TypeError now rather than at the first scrape
    if not isinstance(host, str):
        raise TypeError(f"serve() host must be a str, got {host!r}")
    for name, value, low, high in (
        ("port", port, 0, 65535),
        ("max_connections", max_connections, 1, None),
    ):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"serve() {name} must be an int, got {value!r}")
        if value < low or (high is not None and value > high):
            bound = f"{low}-{high}" if high is not None else f"{low} or more"
            raise ValueError(f"serve() {name} must be {bound}, got {value!r}")

    async def close(server: MetricsServer, exc: BaseException | None) -> None:
        await server.aclose()

    return OpenResource(
        lambda: _start_server(source, host, port, max_connections), close, "serve(...)"
    )


def make_asgi_app(*, recorder: Recorder | None = None) -> MetricsApp:
    """The metrics page as an ASGI application, to mount on the service's own server.

    ``app.mount("/metrics", make_asgi_app())`` in FastAPI or Starlette, or
    the whole application of an ASGI server.  It answers ``GET`` and
    ``HEAD`` on every path it is given (other methods: 405), rendering a
    slice at a time as ``serve()`` does; the host's server keeps its own
    connection limits and timeouts.

    Args:
        recorder: whose metrics; None: the process-wide recorder at each
            request (an empty page while metrics are off).

    Returns:
        The ASGI 3 application.

    Raises:
        TypeError: ``recorder`` is not a ``Recorder``.
    """
    return MetricsApp(_source(recorder))


def make_aiohttp_handler(
    *, recorder: Recorder | None = None
) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """The metrics page as an aiohttp handler: ``app.router.add_get("/metrics", handler)``.

    It renders a slice at a time as ``serve()`` does; ``add_get`` routes
    ``HEAD`` to it too.  aiohttp is imported by this call, not before.

    Args:
        recorder: whose metrics; None: the process-wide recorder at each
            request (an empty page while metrics are off).

    Returns:
        The request handler.

    Raises:
        TypeError: ``recorder`` is not a ``Recorder``.
        ModuleNotFoundError: aiohttp is not installed.
    """
    return _aiohttp_handler(_source(recorder))
