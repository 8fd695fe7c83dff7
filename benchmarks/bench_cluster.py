"""Cluster runner: a 1 chief + 4 workers + 2 ps run, aioproc.cluster vs TF-style threads.

Three figures per round:

- time to first result: from the start of the run until the parent holds
  the first task's value.  aioproc: the first ``on_exit`` callback (values
  are recorded by then).  TF style: ``join()`` returning, since TF hands
  out nothing before its watchdog saw every task exit.
- total wall time: the whole run, start to result.
- failure detection: worker-3 writes ``time.time()`` to a file and exits 1
  (after the others returned); the figure is the parent's ``time.time()``
  when it noticed (aioproc: ``on_exit`` for worker-3; TF style: the
  watchdog iteration that saw its exit code) minus the stamp.  Target
  <= 10 ms; TF's 1 s watchdog period allows up to 1 s.

Baseline: a faithful minimal reimplementation of TensorFlow's
``MultiProcessRunner`` mechanics (``multiprocessing`` spawn processes, a
Manager process holding the status queue, one reader thread per task
prefixing its output, a watchdog thread that sleeps 1 s between checks of
every exit code, ``join`` waiting for the watchdog then draining the
queue).  TensorFlow itself is not installed here.  Rounds are capped at 3:
a baseline run costs at least one watchdog period.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import threading
import time
from typing import Any

from _util import Config, Row, Sample, Series, Target, rows_from, run_on

SPEC_COUNTS = {"chief": 1, "worker": 4, "ps": 2}
FAILING = ("worker", 3)
WATCHDOG_PERIOD = 1.0  # TF's _process_watchdog sleeps 1 s per iteration
FAIL_AFTER = 0.2  # the failing task exits this long after it started


# ------------------------------------------------------------ task functions
# (imported by name in the tasks: this module's top level stays light)


def task_value() -> tuple[str, int]:
    config = json.loads(os.environ["TF_CONFIG"])["task"]
    return config["type"], config["index"]


def fail_one(stamp: str) -> tuple[str, int]:
    task = task_value()
    if task == FAILING:
        time.sleep(FAIL_AFTER)  # the others are done by then: a failure mid-run
        with open(stamp, "w") as f:
            f.write(repr(time.time()))
        os._exit(1)
    return task


# ------------------------------------------------------------ TF-style runner


def _tf_proc(
    fn: Any,
    args: tuple[Any, ...],
    task: tuple[str, int],
    tf_config: str,
    statuses: Any,
    pipe_w: Any,
) -> None:
    """The child: output to the parent's pipe, then one status on the Manager queue."""
    os.environ["TF_CONFIG"] = tf_config
    os.dup2(pipe_w.fileno(), 1)
    os.dup2(pipe_w.fileno(), 2)
    try:
        value = fn(*args)
    except Exception as e:
        statuses.put((task, False, repr(e), None))
        raise
    statuses.put((task, True, None, value))


class TFStyleRunner:
    """TF's MultiProcessRunner mechanics, minimal (see the module docstring)."""

    def __init__(self, fn: Any, cluster: dict[str, list[str]], args: tuple[Any, ...] = ()):
        import multiprocessing

        self._ctx = multiprocessing.get_context("spawn")
        self._fn, self._cluster, self._args = fn, cluster, args
        self._procs: dict[tuple[str, int], Any] = {}
        self._readers: list[threading.Thread] = []
        self.stdout: list[str] = []
        self.noticed: dict[tuple[str, int], float] = {}  # when the watchdog saw the exit

    def start(self) -> None:
        self._manager = self._ctx.Manager()
        self._statuses = self._manager.Queue()
        for task_type, addrs in self._cluster.items():
            for index in range(len(addrs)):
                task = (task_type, index)
                config = json.dumps(
                    {"cluster": self._cluster, "task": {"type": task_type, "index": index}}
                )
                pipe_r, pipe_w = self._ctx.Pipe(duplex=False)
                p = self._ctx.Process(
                    target=_tf_proc,
                    args=(self._fn, self._args, task, config, self._statuses, pipe_w),
                )
                p.start()
                pipe_w.close()
                self._procs[task] = p
                t = threading.Thread(target=self._read, args=(pipe_r, task), daemon=True)
                t.start()
                self._readers.append(t)
        self._watchdog = threading.Thread(target=self._watch, daemon=True)
        self._watchdog.start()

    def _read(self, pipe_r: Any, task: tuple[str, int]) -> None:
        with os.fdopen(pipe_r.fileno(), "r", closefd=False) as reader:
            for line in reader:
                self.stdout.append(f"[{task[0]}-{task[1]}]:".ljust(14) + " " + line)
        pipe_r.close()

    def _watch(self) -> None:
        while True:
            time.sleep(WATCHDOG_PERIOD)
            now = time.time()
            for task, p in self._procs.items():
                if p.exitcode is not None and task not in self.noticed:
                    self.noticed[task] = now
            if all(p.exitcode is not None for p in self._procs.values()):
                return

    def join(self) -> dict[tuple[str, int], Any]:
        self._watchdog.join()
        for t in self._readers:
            t.join()
        values, failures = {}, {}
        while not self._statuses.empty():
            task, ok, error, value = self._statuses.get()
            if ok:
                values[task] = value
            else:
                failures[task] = error
        for p in self._procs.values():
            p.join()
        self._manager.shutdown()
        self.failures = failures
        return values


def _cluster() -> dict[str, list[str]]:
    import aioproc.cluster

    return aioproc.cluster.create_cluster_spec(
        has_chief=True, num_workers=SPEC_COUNTS["worker"], num_ps=SPEC_COUNTS["ps"]
    )


def tf_run() -> dict[str, float]:
    t0 = time.time()
    runner = TFStyleRunner(task_value, _cluster())
    runner.start()
    values = runner.join()
    t1 = time.time()
    if len(values) != 7:
        raise AssertionError(f"TF style: {len(values)} values of 7")
    tmp = tempfile.mkdtemp(prefix="aioproc-bench-")
    try:
        stamp = os.path.join(tmp, "stamp")
        failing = TFStyleRunner(fail_one, _cluster(), (stamp,))
        failing.start()
        failing.join()
        if list(failing.failures) != [] or failing._procs[FAILING].exitcode != 1:
            raise AssertionError(f"TF style: worker-3 should exit 1: {failing.failures}")
        with open(stamp) as f:
            detect = failing.noticed[FAILING] - float(f.read())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"first": t1 - t0, "total": t1 - t0, "detect": detect}


async def aioproc_run() -> dict[str, float]:
    import aioproc.cluster

    first: list[float] = []
    t0 = time.time()
    result = await aioproc.cluster.run(
        task_value,
        _cluster(),
        stream_output=False,
        on_exit=lambda key, code: first.append(time.time()),
    )
    t1 = time.time()
    if len(result.return_value) != 7:
        raise AssertionError(f"aioproc: {len(result.return_value)} values of 7")
    noticed: dict[tuple[str, int], float] = {}
    tmp = tempfile.mkdtemp(prefix="aioproc-bench-")
    try:
        stamp = os.path.join(tmp, "stamp")
        try:
            await aioproc.cluster.run(
                fail_one,
                _cluster(),
                args=(stamp,),
                stream_output=False,
                on_exit=lambda key, code: noticed.setdefault(key, time.time()),
            )
        except aioproc.cluster.UnexpectedSubprocessExitError as e:
            if "worker-3 exited with exit code 1" not in str(e):
                raise
        else:
            raise AssertionError("aioproc: worker-3 should have failed the run")
        with open(stamp) as f:
            detect = noticed[FAILING] - float(f.read())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"first": first[0] - t0, "total": t1 - t0, "detect": detect}


def cluster_rows(cfg: Config) -> list[Row]:
    rounds = cfg.rounds
    keys = ("first", "total", "detect")
    base = {k: Series() for k in keys}
    cand = {loop: {k: Series() for k in keys} for loop in cfg.loops}
    for i in range(cfg.warmup + rounds):
        b = tf_run()
        for loop in cfg.loops:

            async def one() -> dict[str, float]:
                return await aioproc_run()

            c = run_on(loop, one)
            if i >= cfg.warmup:
                for k in keys:
                    cand[loop][k].samples.append(_sample(c[k]))
        if i >= cfg.warmup:
            for k in keys:
                base[k].samples.append(_sample(b[k]))
    name = "cluster 1 chief + 4 workers + 2 ps"
    note = f"baseline: TF-style threads + {WATCHDOG_PERIOD:g} s watchdog; {rounds} rounds"
    rows: list[Row] = []
    for k, label, target in (
        ("first", "time to first result", None),
        ("total", "total wall time", Target("ratio", 1.0)),
        ("detect", "failure detection latency", Target("max", 0.010, "ms")),
    ):
        series = {loop: (base[k], cand[loop][k]) for loop in cfg.loops}
        rows += rows_from(f"{name}: {label}", series, target, note=note)
    return rows


def _sample(value: float) -> Sample:
    return Sample(value)


if __name__ == "__main__":
    from _util import standalone_main

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    standalone_main(__doc__ or "", cluster_rows, lambda argv: None)
