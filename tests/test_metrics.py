"""aioproc.metrics: the recorder's hooks, the text format, the HTTP server, prometheus_client.

The text format is checked twice: line by line for a known state, and by
``prometheus_client``'s own parser.  The server is scraped over a real
socket; the leak check around every test sees that closing it leaves no
fd behind.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import REPO_ROOT

import aioproc
import aioproc.metrics as metrics
from aioproc._metrics import hooks
from aioproc.metrics import Counter, Gauge, Histogram, Recorder, Registry

G = ("train", "default")  # the labels of a plain group named "train"


@pytest.fixture(autouse=True)
def _process_default_restored() -> Iterator[None]:
    """Every test leaves the process-wide recorder as it found it (off)."""
    before = hooks.current
    yield
    hooks.current = before


def _value(recorder: Recorder, name: str, *labels: str) -> float:
    metric = recorder.registry.get(name)
    assert isinstance(metric, (Counter, Gauge))
    return metric.value(labels)


# -- the recorder's hooks ---------------------------------------------------


def test_the_hooks_move_their_metrics() -> None:
    rec = Recorder()
    rec.group_queued("train", "default", 0.5)
    rec.worker_started("train", "default")
    rec.worker_started("train", "default")
    rec.group_started("train", "default", 0.04)
    assert _value(rec, "aioproc_workers_started_total", *G) == 2
    assert _value(rec, "aioproc_workers_running", *G) == 2
    assert _value(rec, "aioproc_groups_started_total", *G) == 1
    assert _value(rec, "aioproc_groups_running", *G) == 1

    rec.worker_exited("train", "default", "succeeded")
    rec.worker_exited("train", "default", "signalled")
    rec.group_exited("train", "default", "signalled")
    rec.group_stopped("train", "default", 1.5)
    assert _value(rec, "aioproc_workers_running", *G) == 0
    assert _value(rec, "aioproc_workers_exited_total", *G, "succeeded") == 1
    assert _value(rec, "aioproc_workers_exited_total", *G, "signalled") == 1
    assert _value(rec, "aioproc_groups_running", *G) == 0
    assert _value(rec, "aioproc_groups_exited_total", *G, "signalled") == 1

    rec.restarted("train", "trainer", remaining=2)
    rec.restarted("train", "trainer")  # no count given: the gauge keeps its value
    assert _value(rec, "aioproc_restarts_total", "train", "trainer") == 2
    assert _value(rec, "aioproc_remaining_restarts", "train", "trainer") == 2
    rec.run_finished("train", "trainer", "succeeded", restarts=2)
    rec.run_finished("train", "trainer", "failed", restarts=0)
    assert _value(rec, "aioproc_runs_total", "train", "trainer", "succeeded", "true") == 1
    assert _value(rec, "aioproc_runs_total", "train", "trainer", "failed", "false") == 1

    rec.output("train", "default", "stdout", 3, 120)
    rec.output("train", "default", "stdout", 1, 7)
    rec.output("train", "default", "stderr", 0, 5)
    rec.backpressure("train", "default", "stdout", 0.25)
    assert _value(rec, "aioproc_output_lines_total", *G, "stdout") == 4
    assert _value(rec, "aioproc_output_bytes_total", *G, "stdout") == 127
    assert _value(rec, "aioproc_output_bytes_total", *G, "stderr") == 5
    assert _value(rec, "aioproc_output_backpressure_seconds_total", *G, "stdout") == 0.25

    rec.pool_call("pool", "succeeded", 0.001)
    rec.pool_call("pool", "broken", 0.5)
    rec.rendezvous_round("trainer", "c10d", "succeeded", 2.0)
    assert _value(rec, "aioproc_pool_calls_total", "pool", "broken") == 1
    assert _value(rec, "aioproc_rendezvous_rounds_total", "trainer", "c10d", "succeeded") == 1

    histograms = {
        m.name: {key: (count, total) for key, _, total, count in m.samples()}
        for m in rec.registry.collect()
        if isinstance(m, Histogram)
    }
    assert histograms == {
        "aioproc_group_start_seconds": {G: (1, 0.04)},
        "aioproc_group_queue_seconds": {G: (1, 0.5)},
        "aioproc_group_stop_seconds": {G: (1, 1.5)},
        "aioproc_pool_call_seconds": {("pool",): (2, 0.501)},
        "aioproc_rendezvous_seconds": {("trainer", "c10d"): (1, 2.0)},
    }


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda r: r.worker_exited("g", "default", "crashed"), "outcome must be one of"),
        (lambda r: r.group_exited("g", "default", "ok"), "outcome must be one of"),
        (lambda r: r.output("g", "default", "stdin", 1, 1), "stream must be one of"),
        (lambda r: r.backpressure("g", "default", "tty", 1.0), "stream must be one of"),
        (lambda r: r.pool_call("p", "signalled", 1.0), "a pool call's outcome"),
        (lambda r: r.run_finished("g", "r", "signalled", 0), "a run's outcome"),
        (lambda r: r.rendezvous_round("r", "c10d", "stopped", 1.0), "rendezvous round's outcome"),
    ],
)
def test_an_unbounded_label_value_is_refused(call: object, message: str) -> None:
    """Outcomes and streams come from a fixed set: a typo never becomes a new series."""
    rec = Recorder()
    with pytest.raises(ValueError, match=message):
        call(rec)  # type: ignore[operator]
    assert metrics.render(rec).count("} ") == 0  # no sample was written


def test_group_label_maps_job_names_to_few_series() -> None:
    rec = Recorder(group_label=lambda name: name.rsplit("-", 1)[0])
    for job in ("etl-1", "etl-2", "etl-3"):
        rec.worker_started(job, "default")
        rec.worker_exited(job, "default", "succeeded")
    assert _value(rec, "aioproc_workers_exited_total", "etl", "default", "succeeded") == 3
    samples = rec.registry.get("aioproc_workers_started_total")
    assert isinstance(samples, Counter)
    assert samples.samples() == [(("etl", "default"), 3.0)]


@pytest.mark.parametrize(
    ("returncode", "stopped", "outcome"),
    [(0, False, "succeeded"), (0, True, "succeeded"), (3, False, "failed"),
     (-9, False, "signalled"), (-15, True, "stopped"), (1, True, "stopped")],
)  # fmt: skip
def test_outcome_of(returncode: int, stopped: bool, outcome: str) -> None:
    assert metrics.outcome_of(returncode, stopped=stopped) == outcome
    assert outcome in metrics.OUTCOMES


def test_the_catalogue_is_what_a_recorder_exports() -> None:
    rec = Recorder()
    exported = [(m.name, m.type, m.labelnames) for m in rec.registry.collect()]
    assert exported == [(i.name, i.type, i.labels) for i in metrics.CATALOGUE]
    for info in metrics.CATALOGUE:
        assert info.name.startswith("aioproc_")
        assert info.name.endswith("_total") == (info.type == "counter"), info.name
        assert not {"pid", "rank", "local_rank"} & set(info.labels), info.name


def test_the_reference_lists_every_metric() -> None:
    """The table of docs/reference/metrics.md names exactly the catalogue, with its labels."""
    page = (Path(REPO_ROOT) / "docs" / "reference" / "metrics.md").read_text()
    rows = re.findall(r"^\| `(aioproc_\w+)` \| (\w+) \| ([\w, ]+) \|", page, re.M)
    listed = [
        (name, kind, tuple(x.strip() for x in labels.split(","))) for name, kind, labels in rows
    ]
    assert listed == [(i.name, i.type, i.labels) for i in metrics.CATALOGUE]


# -- the metric families ----------------------------------------------------


def test_histogram_buckets_are_upper_bounds_inclusive() -> None:
    h = Histogram("job_seconds", "Job time.", ["job"], buckets=[0.1, 1.0, 10.0])
    assert h.buckets == (0.1, 1.0, 10.0, math.inf)
    for value in (0.0, 0.1, 0.10001, 1.0, 9.99, 10.0, 10.5, 1e9):
        h.observe(value, ["a"])
    h.observe(0.5, ["b"])
    [(key, cumulative, total, count), (key_b, cumulative_b, _, count_b)] = h.samples()
    # le=0.1: 0.0, 0.1; le=1: +0.10001, 1.0; le=10: +9.99, 10.0; +Inf: +10.5, 1e9
    assert (key, cumulative, count) == (("a",), [2, 4, 6, 8], 8)
    assert total == pytest.approx(0.0 + 0.1 + 0.10001 + 1.0 + 9.99 + 10.0 + 10.5 + 1e9)
    assert (key_b, cumulative_b, count_b) == (("b",), [0, 1, 1, 1], 1)


@pytest.mark.parametrize("buckets", [[], [1.0, 0.5], [1.0, 1.0], [float("nan")], [math.inf]])
def test_histogram_refuses_bad_buckets(buckets: list[float]) -> None:
    with pytest.raises(ValueError, match="increasing, distinct bucket bounds"):
        Histogram("h_seconds", "H.", buckets=buckets)


def test_families_check_names_and_label_values() -> None:
    with pytest.raises(ValueError, match="invalid metric name 'a-b'"):
        Counter("a-b", "bad")
    with pytest.raises(ValueError, match="invalid label name '__x'"):
        Gauge("g", "bad", ["__x"])
    with pytest.raises(ValueError, match="'le' is reserved"):
        Histogram("h", "bad", ["le"], buckets=[1])
    c = Counter("c_total", "C.", ["stream"])
    with pytest.raises(ValueError, match=r"c_total takes 1 label values \('stream',\)"):
        c.inc(1, ["stdout", "extra"])
    with pytest.raises(ValueError, match="can only go up"):
        c.inc(-1, ["stdout"])
    g = Gauge("g", "G.")
    g.set(3)
    g.dec(5)
    assert g.value() == -2
    registry = Registry()
    registry.register(c)
    with pytest.raises(ValueError, match="c_total is already registered"):
        registry.counter("c_total", "again")
    registry.unregister(c)
    assert registry.collect() == []


# -- the text format --------------------------------------------------------


def _small_state() -> Registry:
    registry = Registry()
    c = registry.counter("demo_lines_total", 'Lines\\"written"\nby workers.', ["group", "stream"])
    c.inc(3, ["a", "stdout"])
    c.inc(1.5, ['we"ird\\name\n', "stderr"])
    registry.gauge("demo_running", "Running now.").set(2)
    h = registry.histogram("demo_seconds", "Durations.", ["group"], buckets=[0.5, 2.5])
    h.observe(0.5, ["a"])
    h.observe(3, ["a"])
    registry.counter("demo_unused_total", "Never moved.", ["group"])
    return registry


EXPECTED_TEXT = """\
# HELP demo_lines_total Lines\\\\"written"\\nby workers.
# TYPE demo_lines_total counter
demo_lines_total{group="a",stream="stdout"} 3.0
demo_lines_total{group="we\\"ird\\\\name\\n",stream="stderr"} 1.5
# HELP demo_running Running now.
# TYPE demo_running gauge
demo_running 2.0
# HELP demo_seconds Durations.
# TYPE demo_seconds histogram
demo_seconds_bucket{group="a",le="0.5"} 1.0
demo_seconds_bucket{group="a",le="2.5"} 1.0
demo_seconds_bucket{group="a",le="+Inf"} 2.0
demo_seconds_count{group="a"} 2.0
demo_seconds_sum{group="a"} 3.5
# HELP demo_unused_total Never moved.
# TYPE demo_unused_total counter
"""


def test_text_format_lines_of_a_known_state() -> None:
    assert metrics.render(_small_state()) == EXPECTED_TEXT


def test_text_format_parses_with_prometheus_client() -> None:
    parser = pytest.importorskip("prometheus_client.parser")
    families = {f.name: f for f in parser.text_string_to_metric_families(EXPECTED_TEXT)}
    assert {n: f.type for n, f in families.items()} == {
        "demo_lines": "counter",
        "demo_running": "gauge",
        "demo_seconds": "histogram",
        "demo_unused": "counter",
    }
    assert families["demo_lines"].documentation == 'Lines\\"written"\nby workers.'
    lines = {s.labels["group"]: s.value for s in families["demo_lines"].samples}
    assert lines == {"a": 3.0, 'we"ird\\name\n': 1.5}
    hist = {(s.name, s.labels.get("le")): s.value for s in families["demo_seconds"].samples}
    assert hist == {
        ("demo_seconds_bucket", "0.5"): 1.0,
        ("demo_seconds_bucket", "2.5"): 1.0,
        ("demo_seconds_bucket", "+Inf"): 2.0,
        ("demo_seconds_count", None): 2.0,
        ("demo_seconds_sum", None): 3.5,
    }


def test_a_recorder_renders_every_family_and_parses() -> None:
    parser = pytest.importorskip("prometheus_client.parser")
    rec = Recorder()
    rec.worker_started("train", "default")
    rec.group_started("train", "default", 0.03)
    rec.pool_call("pool", "succeeded", 0.0007)
    text = metrics.render(rec)
    names = [f.name for f in parser.text_string_to_metric_families(text)]
    assert names == [re.sub("_total$", "", i.name) for i in metrics.CATALOGUE]
    assert (
        'aioproc_group_start_seconds_bucket{group="train",le="0.05",role="default"} 1.0\n' in text
    )
    assert 'aioproc_pool_call_seconds_bucket{le="0.0005",pool="pool"} 0.0\n' in text
    assert 'aioproc_pool_call_seconds_bucket{le="0.001",pool="pool"} 1.0\n' in text


def test_a_scrape_on_another_thread_sees_whole_series() -> None:
    """prometheus_client scrapes on its server's thread while the loop's thread records."""
    rec = Recorder()
    done = threading.Event()
    errors: list[BaseException] = []
    scrapes = 0

    def scrape() -> None:
        nonlocal scrapes
        try:
            while not done.is_set():
                text = metrics.render(rec)
                scrapes += 1
                for line in text.splitlines():
                    assert line.startswith("#") or re.fullmatch(r"\S+ \S+", line), line
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=scrape)
    thread.start()
    try:
        for n in range(3000):  # every call adds series: the dicts grow under the scrapes
            rec.worker_started(f"g{n}", "default")
            rec.group_started(f"g{n}", "default", n / 1000)
    finally:
        done.set()
        thread.join(10)
    assert errors == [] and scrapes > 0
    assert _value(rec, "aioproc_workers_started_total", "g2999", "default") == 1


@pytest.mark.parametrize(
    ("value", "text"),
    [(1, "1.0"), (0.25, "0.25"), (math.inf, "+Inf"), (-math.inf, "-Inf"), (math.nan, "NaN"),
     (12345678.0, "1.2345678e+07"), (1e-05, "1e-05")],
)  # fmt: skip
def test_floats_are_written_as_go_writes_them(value: float, text: str) -> None:
    from aioproc._metrics.text import format_float

    assert format_float(value) == text


# -- the process-wide default -----------------------------------------------


def test_disabled_default_records_nothing() -> None:
    assert not metrics.is_enabled()
    default = metrics.get_recorder()
    assert isinstance(default, metrics.NullRecorder) and not isinstance(default, Recorder)
    assert default.enabled is False
    default.worker_started("g", "default")
    default.worker_exited("g", "default", "not even checked")
    default.output("g", "default", "stdout", 1, 10)
    assert vars(default) == {}
    assert metrics.render() == ""
    assert repr(default) == "<NullRecorder: metrics are off>"


def test_enable_and_disable() -> None:
    rec = metrics.enable()
    assert metrics.is_enabled() and metrics.get_recorder() is rec is hooks.current
    assert metrics.enable() is rec  # enabling again keeps the recorder in force
    rec.worker_started("g", "default")
    assert 'aioproc_workers_started_total{group="g",role="default"} 1.0' in metrics.render()
    mine = Recorder()
    assert metrics.enable(mine) is mine is hooks.current
    assert metrics.disable() is mine
    assert metrics.disable() is None
    assert hooks.current is hooks.DEFAULT and metrics.render() == ""
    with pytest.raises(TypeError, match=r"enable\(\) takes an aioproc\.metrics\.Recorder"):
        metrics.enable(hooks.DEFAULT)  # type: ignore[arg-type]


def _imported_after(statement: str, setup: str = "") -> dict[str, list[str]]:
    code = (
        f"import json, sys\n{setup}\n"
        "before = set(sys.modules)\n"
        f"{statement}\n"
        "new = sorted(set(sys.modules) - before)\n"
        "watch = ('aioproc.metrics', 'aioproc._metrics', 'prometheus_client', 'asyncio')\n"
        "print(json.dumps({'new': new, 'watched': [m for m in watch if m in sys.modules]}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    result: dict[str, list[str]] = json.loads(out.stdout)
    return result


def test_importing_aioproc_imports_no_metrics() -> None:
    assert _imported_after("import aioproc")["watched"] == []


def test_the_launchers_import_is_one_small_module() -> None:
    """What the launcher imports (the hooks) loads nothing but itself and its package."""
    found = _imported_after("from aioproc._metrics import hooks", setup="import aioproc")
    assert found["new"] == ["aioproc._metrics", "aioproc._metrics.hooks"]


def test_aioproc_metrics_needs_no_prometheus_client() -> None:
    assert "prometheus_client" not in _imported_after("import aioproc.metrics")["watched"]


# -- bounded cardinality ------------------------------------------------------


def _finished(rec: Recorder, group: str, role: str = "default") -> None:
    """One group's whole life, as the launcher records it."""
    rec.group_queued(group, role, 0.001)
    rec.worker_started(group, role)
    rec.worker_started(group, role)
    rec.group_started(group, role, 0.02)
    rec.output(group, role, "stdout", 3, 90)
    rec.worker_exited(group, role, "succeeded")
    rec.worker_exited(group, role, "failed")
    rec.group_stopped(group, role, 0.5)
    rec.group_exited(group, role, "failed")


def _groups_in(text: str) -> set[str]:
    return set(re.findall(r'group="([^"]*)"', text))


def test_finished_groups_expire_into_their_roles_series() -> None:
    """10,000 jobs named apart: the page keeps the running, the last 100, and the rest summed."""
    rec = Recorder()
    rec.worker_started("server", "default")  # runs throughout: never expires
    for n in range(10_000):
        _finished(rec, f"job-{n}", "default" if n % 2 else "etl")
    text = metrics.render(rec)
    recent = {f"job-{n}" for n in range(9_900, 10_000)}
    assert _groups_in(text) == recent | {"server", metrics.EXPIRED}
    assert len(text) < 600_000, len(text)  # about 4.5 KB per group kept, not 45 MB for all

    def total(name: str, **where: str) -> float:
        metric = rec.registry.get(name)
        assert isinstance(metric, Counter)
        labels = metric.labelnames
        return sum(
            value
            for key, value in metric.samples()
            if all(key[labels.index(k)] == v for k, v in where.items())
        )

    # every group is still counted, whether its series are its own or its role's
    assert total("aioproc_groups_started_total") == 10_000
    assert total("aioproc_groups_exited_total", outcome="failed") == 10_000
    assert total("aioproc_workers_exited_total", role="etl", outcome="succeeded") == 5_000
    assert total("aioproc_output_lines_total", stream="stdout") == 30_000
    assert _value(rec, "aioproc_groups_started_total", metrics.EXPIRED, "etl") == 4_950
    assert _value(rec, "aioproc_workers_started_total", metrics.EXPIRED, "default") == 9_900
    for name in ("aioproc_group_start_seconds", "aioproc_group_queue_seconds"):
        histogram = rec.registry.get(name)
        assert isinstance(histogram, Histogram)
        counts = {key: count for key, _, _, count in histogram.samples()}
        assert sum(counts.values()) == 10_000
        assert counts[(metrics.EXPIRED, "etl")] == 4_950
    stops = rec.registry.get("aioproc_group_stop_seconds")
    assert isinstance(stops, Histogram)
    sums = {key: total for key, _, total, _ in stops.samples()}
    assert sums[(metrics.EXPIRED, "default")] == pytest.approx(4_950 * 0.5)
    # a gauge of something over says nothing: the expired groups have none
    running = rec.registry.get("aioproc_workers_running")
    assert isinstance(running, Gauge)
    assert {key[0] for key, _ in running.samples()} == recent | {"server"}
    assert _value(rec, "aioproc_workers_running", "server", "default") == 1


def test_an_event_after_expiry_starts_fresh_series_that_expire_again() -> None:
    rec = Recorder(keep_finished=2)
    _finished(rec, "a")
    _finished(rec, "b")
    rec.restarted("a", "default", remaining=3)  # "a" is most recent again: "b" is next to go
    _finished(rec, "c")
    assert _groups_in(metrics.render(rec)) == {"a", "c", metrics.EXPIRED}
    rec.output("b", "default", "stderr", 1, 10)  # late output of an expired group
    assert _groups_in(metrics.render(rec)) == {"b", "c", metrics.EXPIRED}
    assert _value(rec, "aioproc_output_bytes_total", "b", "default", "stderr") == 10
    _finished(rec, "d")
    _finished(rec, "e")
    assert _groups_in(metrics.render(rec)) == {"d", "e", metrics.EXPIRED}
    assert _value(rec, "aioproc_output_bytes_total", metrics.EXPIRED, "default", "stderr") == 10
    assert _value(rec, "aioproc_restarts_total", metrics.EXPIRED, "default") == 1
    assert _value(rec, "aioproc_groups_started_total", metrics.EXPIRED, "default") == 3


def test_a_running_group_keeps_its_series_whatever_finishes_around_it() -> None:
    rec = Recorder(keep_finished=0)
    rec.worker_started("long", "default")
    rec.group_started("long", "default", 0.1)
    for n in range(50):
        _finished(rec, f"short-{n}")
    assert _groups_in(metrics.render(rec)) == {"long", metrics.EXPIRED}
    rec.worker_exited("long", "default", "succeeded")  # one of two things of it still runs
    assert "long" in _groups_in(metrics.render(rec))
    rec.group_exited("long", "default", "succeeded")
    assert _groups_in(metrics.render(rec)) == {metrics.EXPIRED}
    assert _value(rec, "aioproc_groups_started_total", metrics.EXPIRED, "default") == 51


@pytest.mark.parametrize(
    ("keep", "error", "message"),
    [(-1, ValueError, "keep_finished must be 0 or more, got -1"),
     (1.5, TypeError, "keep_finished must be an int, got 1.5"),
     (True, TypeError, "keep_finished must be an int, got True")],
)  # fmt: skip
def test_keep_finished_is_checked(keep: object, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        Recorder(keep_finished=keep)  # type: ignore[arg-type]


# -- the launcher's figures ------------------------------------------------------


def _histogram(rec: Recorder, name: str, group: str) -> tuple[float, float]:
    """(count, sum) of a histogram's series for ``group``."""
    metric = rec.registry.get(name)
    assert isinstance(metric, Histogram)
    for key, _, total, count in metric.samples():
        if key == (group, "default"):
            return count, total
    return 0.0, 0.0


async def test_a_queued_groups_start_time_excludes_its_wait_for_slots() -> None:
    rec = metrics.enable(Recorder())
    capacity = aioproc.Capacity(1)
    specs = aioproc.DefaultLogsSpecs(os.devnull)
    holder = await aioproc.start_processes(
        "holder", "sleep", {0: ("30",)}, {0: {}}, specs, capacity=capacity
    )
    try:
        queued = asyncio.ensure_future(
            aioproc.run("/bin/true", 1, name="queued", logs_specs=specs, capacity=capacity)
        )
        while capacity.waiting == 0:
            await asyncio.sleep(0.01)
        held = 1.0  # the queue wait this test makes: the holder's slot is kept this long
        await asyncio.sleep(held)
        await holder.close()
        result = await asyncio.wait_for(queued, 30)
    finally:
        await holder.close()
    assert not result.is_failed()
    queue_count, queue_seconds = _histogram(rec, "aioproc_group_queue_seconds", "queued")
    start_count, start_seconds = _histogram(rec, "aioproc_group_start_seconds", "queued")
    assert queue_count == start_count == 1
    assert queue_seconds >= held
    # the start is a spawn (tens of ms); with the wait it was over a second
    assert start_seconds < held, (start_seconds, queue_seconds)
    assert _histogram(rec, "aioproc_group_queue_seconds", "holder") == (
        1,
        pytest.approx(0, abs=0.5),
    )


async def test_the_stop_after_a_failure_is_timed() -> None:
    """aioproc stops the other ranks when one fails: that stop is a stop, timed once."""
    rec = metrics.enable(Recorder())
    code = "import sys, time\nif sys.argv[1] == '0': sys.exit(3)\ntime.sleep(30)\n"
    group = "failing"
    async with aioproc.start_processes(
        group, sys.executable, {r: ("-c", code, str(r)) for r in range(2)}, {0: {}, 1: {}},
        aioproc.DefaultLogsSpecs(os.devnull),
    ) as pc:  # fmt: skip
        result = await pc.wait()
    assert result.is_failed() and result.failures[0].exitcode == 3
    count, seconds = _histogram(rec, "aioproc_group_stop_seconds", group)
    assert count == 1, metrics.render(rec)
    assert 0 < seconds < 30
    assert _value(rec, "aioproc_workers_exited_total", group, "default", "stopped") == 1


# -- prometheus_client ------------------------------------------------------


def test_register_into_a_callers_registry_shows_the_same_values() -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.CollectorRegistry()
    rec = metrics.enable()
    collector = metrics.register(registry)
    rec.worker_started("train", "default")
    rec.worker_started("train", "default")
    rec.group_started("train", "default", 0.2)
    rec.output("train", "default", "stderr", 2, 30)
    assert prometheus_client.generate_latest(registry).decode() == metrics.render()
    labels = {"group": "train", "role": "default"}
    assert registry.get_sample_value("aioproc_workers_started_total", labels) == 2
    assert registry.get_sample_value("aioproc_groups_running", labels) == 1
    assert registry.get_sample_value("aioproc_group_start_seconds_sum", labels) == 0.2
    bucket = {**labels, "le": "0.25"}
    assert registry.get_sample_value("aioproc_group_start_seconds_bucket", bucket) == 1
    stream = {**labels, "stream": "stderr"}
    assert registry.get_sample_value("aioproc_output_bytes_total", stream) == 30

    with pytest.raises(ValueError, match="Duplicated timeseries"):
        metrics.register(registry)
    metrics.disable()  # a collector of the process-wide recorder reports nothing while off
    assert prometheus_client.generate_latest(registry) == b""
    registry.unregister(collector)


def test_register_a_given_recorder_and_the_default_registry() -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    rec = Recorder()
    rec.pool_call("pool", "timeout", 2.0)
    collector = metrics.register(recorder=rec)
    try:
        value = prometheus_client.REGISTRY.get_sample_value(
            "aioproc_pool_calls_total", {"pool": "pool", "outcome": "timeout"}
        )
        assert value == 1
    finally:
        prometheus_client.REGISTRY.unregister(collector)
