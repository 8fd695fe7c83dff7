"""The ``Recorder``: aioproc's metrics, and the hooks that move them.

Every metric aioproc exports is declared once in ``CATALOGUE``, with its
type, help text, labels and, where torch.distributed.elastic records the
same thing, torch's name for it; the reference page's table is that list.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NoReturn

from .families import EXPIRED, Counter, Expiry, Gauge, Histogram, Registry
from .hooks import OUTCOMES, POOL_OUTCOMES, STREAMS, NullRecorder, outcome_of

__all__ = [
    "CATALOGUE",
    "DURATION_BUCKETS",
    "EXPIRED",
    "KEEP_FINISHED",
    "POOL_BUCKETS",
    "MetricInfo",
    "Recorder",
    "outcome_of",
]

DURATION_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
"""Upper bounds (seconds) for group starts and stops and rendezvous rounds: a
spawn takes tens of milliseconds, a stop up to its grace period (30 s by
default) and more, a rendezvous up to its join timeout."""

POOL_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    60.0,
)
"""Upper bounds (seconds) for pool calls: a round trip to a warm worker takes
a fraction of a millisecond, a real call whatever its function takes."""

KEEP_FINISHED = 100
"""How many finished groups keep series of their own by default (``Recorder(keep_finished=)``)."""

_RUN_OUTCOMES = frozenset({"succeeded", "failed", "stopped"})
_ROUND_OUTCOMES = frozenset({"succeeded", "failed"})


@dataclass(frozen=True)
class MetricInfo:
    """One metric aioproc exports, as the reference documents it."""

    name: str
    type: str
    documentation: str
    labels: tuple[str, ...]
    torch: str = ""
    """torch.distributed.elastic's name for the same measure, when it has one."""


_GROUP = ("group", "role")

CATALOGUE: tuple[MetricInfo, ...] = (
    MetricInfo(
        "aioproc_groups_started_total",
        "counter",
        "Worker groups whose workers all started.",
        _GROUP,
        "LocalElasticAgent._start_workers.success (torchelastic's @prof)",
    ),
    MetricInfo("aioproc_groups_running", "gauge", "Worker groups started and not over.", _GROUP),
    MetricInfo(
        "aioproc_groups_exited_total",
        "counter",
        "Worker groups over, by outcome.",
        (*_GROUP, "outcome"),
        "workers.{role}.succeeded / .failed (put once per monitor poll there; once per group here)",
    ),
    MetricInfo("aioproc_workers_started_total", "counter", "Worker processes started.", _GROUP),
    MetricInfo(
        "aioproc_workers_running", "gauge", "Worker processes started and not reaped.", _GROUP
    ),
    MetricInfo(
        "aioproc_workers_exited_total",
        "counter",
        "Worker processes reaped, by outcome.",
        (*_GROUP, "outcome"),
    ),
    MetricInfo(
        "aioproc_restarts_total",
        "counter",
        "Restarts of a failed worker group by its agent.",
        _GROUP,
        "SimpleElasticAgent._restart_workers.success (torchelastic's @prof)",
    ),
    MetricInfo(
        "aioproc_remaining_restarts",
        "gauge",
        "Restarts the agent has left.",
        _GROUP,
        "workers.{role}.remaining_restarts",
    ),
    MetricInfo(
        "aioproc_runs_total",
        "counter",
        "Agent runs finished, by outcome and whether they used a restart.",
        (*_GROUP, "outcome", "retried"),
        "workers.{role}.run_total (the sum); run_success_with_retries (outcome=succeeded, "
        "retried=true), run_success_no_retries, run_failed_with_retries, run_failed_no_retries",
    ),
    MetricInfo(
        "aioproc_group_start_seconds",
        "histogram",
        "Seconds from a group's start, once it has its Capacity slots, to its last worker started.",
        _GROUP,
        "LocalElasticAgent._start_workers.duration.ms (milliseconds there)",
    ),
    MetricInfo(
        "aioproc_group_queue_seconds",
        "histogram",
        "Seconds a group waited for its Capacity slots before its start (0 without a Capacity).",
        _GROUP,
    ),
    MetricInfo(
        "aioproc_group_stop_seconds",
        "histogram",
        "Seconds from a stop's first signal to its last worker reaped, whatever caused the stop.",
        _GROUP,
        "LocalElasticAgent._stop_workers.duration.ms (milliseconds there)",
    ),
    MetricInfo(
        "aioproc_output_lines_total",
        "counter",
        "Lines workers wrote to a tee'd stream.",
        (*_GROUP, "stream"),
    ),
    MetricInfo(
        "aioproc_output_bytes_total",
        "counter",
        "Bytes workers wrote to a tee'd stream.",
        (*_GROUP, "stream"),
    ),
    MetricInfo(
        "aioproc_output_backpressure_seconds_total",
        "counter",
        "Seconds a stream's reading was paused because a consumer fell behind.",
        (*_GROUP, "stream"),
    ),
    MetricInfo(
        "aioproc_pool_calls_total",
        "counter",
        "Pool calls finished, by outcome.",
        ("pool", "outcome"),
    ),
    MetricInfo(
        "aioproc_pool_call_seconds",
        "histogram",
        "Seconds from a pool call to its result, waiting for a worker included.",
        ("pool",),
    ),
    MetricInfo("aioproc_capacity_slots", "gauge", "Slots a Capacity has.", ("capacity",)),
    MetricInfo(
        "aioproc_capacity_slots_in_use",
        "gauge",
        "Slots of a Capacity held by groups, pools and agents.",
        ("capacity",),
    ),
    MetricInfo(
        "aioproc_capacity_waiting",
        "gauge",
        "Requests waiting for a Capacity's slots.",
        ("capacity",),
    ),
    MetricInfo(
        "aioproc_rendezvous_rounds_total",
        "counter",
        "Rendezvous rounds, by outcome.",
        ("role", "backend", "outcome"),
        "SimpleElasticAgent._rendezvous.success / .failure (torchelastic's @prof)",
    ),
    MetricInfo(
        "aioproc_rendezvous_seconds",
        "histogram",
        "Seconds a rendezvous round took.",
        ("role", "backend"),
        "SimpleElasticAgent._rendezvous.duration.ms (milliseconds there)",
    ),
)
"""Every metric a ``Recorder`` exports, in the order it renders them."""

_BY_NAME = {info.name: info for info in CATALOGUE}


def _reject(value: str, allowed: Iterable[str], what: str) -> NoReturn:
    raise ValueError(f"{what} must be one of {', '.join(allowed)}, got {value!r}")


class Recorder(NullRecorder):
    """Records aioproc's metrics: the hooks of ``NullRecorder``, each moving its metrics.

    Build one and make it the process's with ``aioproc.metrics.enable()``,
    or pass it to ``serve()``, ``render()`` or ``register()``.  The hooks,
    and where the launcher calls each, are documented on ``NullRecorder``.
    They run on the loop's thread and cost one or two dict updates;
    reading (rendering, a scrape) may happen on any thread.

    Args:
        group_label: maps a group's name to the value of its ``group``
            label: a scheduler that names every job differently keeps the
            series few with ``lambda name: name.rsplit("-", 1)[0]`` or
            ``lambda name: ""``.  None: the name itself.
        duration_buckets: the bucket bounds of the group start, queue and
            stop and rendezvous histograms (seconds).
        pool_buckets: the bucket bounds of the pool call histogram (seconds).
        keep_finished: how many finished groups keep series of their own
            (``KEEP_FINISHED``, 100); older ones are folded into their
            role's ``group="(expired)"`` series (``EXPIRED``).  A group is
            finished once none of its groups and workers runs; running
            groups always keep theirs.  0 keeps none.

    Raises:
        TypeError: ``keep_finished`` is not an int.
        ValueError: ``keep_finished`` is negative.
    """

    enabled = True

    def __init__(
        self,
        *,
        group_label: Callable[[str], str] | None = None,
        duration_buckets: Iterable[float] = DURATION_BUCKETS,
        pool_buckets: Iterable[float] = POOL_BUCKETS,
        keep_finished: int = KEEP_FINISHED,
    ) -> None:
        if not isinstance(keep_finished, int) or isinstance(keep_finished, bool):
            raise TypeError(f"keep_finished must be an int, got {keep_finished!r}")
        if keep_finished < 0:
            raise ValueError(f"keep_finished must be 0 or more, got {keep_finished!r}")
        self._group_label = group_label
        self.registry = Registry()
        """The recorder's metrics; a caller may register its own beside them."""
        durations = tuple(duration_buckets)
        # made in CATALOGUE's order, which is the order they render in; each hook
        # holds its metrics directly, so recording looks nothing up by name
        self._groups_started = self._counter("aioproc_groups_started_total")
        self._groups_running = self._gauge("aioproc_groups_running")
        self._groups_exited = self._counter("aioproc_groups_exited_total")
        self._workers_started = self._counter("aioproc_workers_started_total")
        self._workers_running = self._gauge("aioproc_workers_running")
        self._workers_exited = self._counter("aioproc_workers_exited_total")
        self._restarts = self._counter("aioproc_restarts_total")
        self._remaining = self._gauge("aioproc_remaining_restarts")
        self._runs = self._counter("aioproc_runs_total")
        self._start_seconds = self._histogram("aioproc_group_start_seconds", durations)
        self._queue_seconds = self._histogram("aioproc_group_queue_seconds", durations)
        self._stop_seconds = self._histogram("aioproc_group_stop_seconds", durations)
        self._lines = self._counter("aioproc_output_lines_total")
        self._bytes = self._counter("aioproc_output_bytes_total")
        self._paused = self._counter("aioproc_output_backpressure_seconds_total")
        self._pool_calls = self._counter("aioproc_pool_calls_total")
        self._pool_seconds = self._histogram("aioproc_pool_call_seconds", pool_buckets)
        self._capacity_slots = self._gauge("aioproc_capacity_slots")
        self._capacity_in_use = self._gauge("aioproc_capacity_slots_in_use")
        self._capacity_waiting = self._gauge("aioproc_capacity_waiting")
        self._rounds = self._counter("aioproc_rendezvous_rounds_total")
        self._round_seconds = self._histogram("aioproc_rendezvous_seconds", durations)
        outcomes = tuple((o,) for o in OUTCOMES)
        streams = tuple((s,) for s in STREAMS)
        runs = tuple((o, r) for o in sorted(_RUN_OUTCOMES) for r in ("true", "false"))
        self._expiry = Expiry(
            keep_finished,
            folded=[
                (self._groups_started, [()]),
                (self._groups_exited, outcomes),
                (self._workers_started, [()]),
                (self._workers_exited, outcomes),
                (self._restarts, [()]),
                (self._runs, runs),
                (self._start_seconds, [()]),
                (self._queue_seconds, [()]),
                (self._stop_seconds, [()]),
                (self._lines, streams),
                (self._bytes, streams),
                (self._paused, streams),
            ],
            dropped=[
                (self._groups_running, [()]),
                (self._workers_running, [()]),
                (self._remaining, [()]),
            ],
        )
        # the expiry's dict itself, read by the hot hooks (output) without a hop
        self._running = self._expiry.running

    def _counter(self, name: str) -> Counter:
        info = _BY_NAME[name]
        return self.registry.counter(name, info.documentation, info.labels)

    def _gauge(self, name: str) -> Gauge:
        info = _BY_NAME[name]
        return self.registry.gauge(name, info.documentation, info.labels)

    def _histogram(self, name: str, buckets: Iterable[float]) -> Histogram:
        info = _BY_NAME[name]
        return self.registry.histogram(name, info.documentation, info.labels, buckets)

    def __repr__(self) -> str:
        return f"<Recorder of {len(self.registry.collect())} metrics>"

    def group_started(self, group: str, role: str, seconds: float) -> None:
        if self._group_label is not None:
            group = self._group_label(group)
        key = (group, role)
        self._groups_started._add(key, 1.0)
        self._groups_running._add(key, 1.0)
        self._start_seconds._observe(key, seconds)
        self._expiry.started(key)

    def group_queued(self, group: str, role: str, seconds: float) -> None:
        if self._group_label is not None:
            group = self._group_label(group)
        key = (group, role)
        self._queue_seconds._observe(key, seconds)
        if key not in self._running:
            self._expiry.touched(key)

    def group_exited(self, group: str, role: str, outcome: str) -> None:
        if outcome not in OUTCOMES:
            _reject(outcome, OUTCOMES, "outcome")
        if self._group_label is not None:
            group = self._group_label(group)
        self._groups_running._add((group, role), -1.0)
        self._groups_exited._add((group, role, outcome), 1.0)
        self._expiry.ended((group, role))

    def group_stopped(self, group: str, role: str, seconds: float) -> None:
        if self._group_label is not None:
            group = self._group_label(group)
        key = (group, role)
        self._stop_seconds._observe(key, seconds)
        if key not in self._running:
            self._expiry.touched(key)

    def worker_started(self, group: str, role: str) -> None:
        if self._group_label is not None:
            group = self._group_label(group)
        key = (group, role)
        self._workers_started._add(key, 1.0)
        self._workers_running._add(key, 1.0)
        self._expiry.started(key)

    def worker_exited(self, group: str, role: str, outcome: str) -> None:
        if outcome not in OUTCOMES:
            _reject(outcome, OUTCOMES, "outcome")
        if self._group_label is not None:
            group = self._group_label(group)
        self._workers_running._add((group, role), -1.0)
        self._workers_exited._add((group, role, outcome), 1.0)
        self._expiry.ended((group, role))

    def restarted(self, group: str, role: str, remaining: int | None = None) -> None:
        if self._group_label is not None:
            group = self._group_label(group)
        key = (group, role)
        self._restarts._add(key, 1.0)
        if remaining is not None:
            self._remaining._set(key, float(remaining))
        if key not in self._running:
            self._expiry.touched(key)

    def run_finished(self, group: str, role: str, outcome: str, restarts: int) -> None:
        if outcome not in _RUN_OUTCOMES:
            _reject(outcome, sorted(_RUN_OUTCOMES), "a run's outcome")
        if self._group_label is not None:
            group = self._group_label(group)
        retried = "true" if restarts > 0 else "false"
        self._runs._add((group, role, outcome, retried), 1.0)
        if (group, role) not in self._running:
            self._expiry.touched((group, role))

    def output(self, group: str, role: str, stream: str, lines: int, nbytes: int) -> None:
        if stream not in STREAMS:
            _reject(stream, STREAMS, "stream")
        if self._group_label is not None:
            group = self._group_label(group)
        key = (group, role, stream)
        self._bytes._add(key, nbytes)
        # the hot hook: only a new series (a last chunk read after the group
        # expired) needs the expiry to know its group
        if self._lines._add(key, lines) and (group, role) not in self._running:
            self._expiry.touched((group, role))

    def backpressure(self, group: str, role: str, stream: str, seconds: float) -> None:
        if stream not in STREAMS:
            _reject(stream, STREAMS, "stream")
        if self._group_label is not None:
            group = self._group_label(group)
        if self._paused._add((group, role, stream), seconds) and (group, role) not in self._running:
            self._expiry.touched((group, role))

    def pool_call(self, pool: str, outcome: str, seconds: float) -> None:
        if outcome not in POOL_OUTCOMES:
            _reject(outcome, POOL_OUTCOMES, "a pool call's outcome")
        self._pool_calls._add((pool, outcome), 1.0)
        self._pool_seconds._observe((pool,), seconds)

    def capacity(self, name: str, total: int, in_use: int, waiting: int) -> None:
        key = (name,)
        self._capacity_slots._set(key, total)
        self._capacity_in_use._set(key, in_use)
        self._capacity_waiting._set(key, waiting)

    def rendezvous_round(self, role: str, backend: str, outcome: str, seconds: float) -> None:
        if outcome not in _ROUND_OUTCOMES:
            _reject(outcome, sorted(_ROUND_OUTCOMES), "a rendezvous round's outcome")
        self._rounds._add((role, backend, outcome), 1.0)
        self._round_seconds._observe((role, backend), seconds)
