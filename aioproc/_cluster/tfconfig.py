"""TensorFlow cluster specs: one pool worker per task, each told its task in ``TF_CONFIG``."""

from __future__ import annotations

import json
import socket
from collections.abc import Mapping, Sequence

ClusterSpec = Mapping[str, Sequence[str] | int]
"""``{"worker": ["host:port", ...], "ps": 2}``: addresses, or a count of local tasks."""


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports free right now (all held until all are chosen)."""
    socks = []
    try:
        for _ in range(n):
            sock = socket.socket()
            socks.append(sock)
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def worker_slots(
    spec: int | ClusterSpec, name: str, env: dict[str, str]
) -> list[tuple[str, dict[str, str]]]:
    """``(name, env)`` of each worker: ``<name>/<i>``, or ``<type>:<index>`` with ``TF_CONFIG``.

    Raises:
        TypeError, ValueError: ``spec`` is neither a positive count nor a
            cluster spec of non-empty task lists or positive counts.
    """
    if isinstance(spec, bool):
        raise TypeError(f"pool size must be an int or a cluster spec, got {spec!r}")
    if isinstance(spec, int):
        if spec <= 0:
            raise ValueError(f"pool size must be positive, got {spec}")
        return [(f"{name}/{i}", env) for i in range(spec)]
    if not isinstance(spec, Mapping) or not spec:
        raise TypeError(f"pool size must be an int or a cluster spec dict, got {spec!r}")
    cluster: dict[str, list[str]] = {}
    for task_type, tasks in spec.items():
        if isinstance(tasks, int) and not isinstance(tasks, bool) and tasks > 0:
            # like TF's create_cluster_spec: a distinct free port per task
            cluster[task_type] = [f"localhost:{port}" for port in free_ports(tasks)]
        elif isinstance(tasks, Sequence) and not isinstance(tasks, str) and tasks:
            cluster[task_type] = [str(t) for t in tasks]
        else:
            raise ValueError(f"cluster spec entry {task_type!r} must be a count or addresses")
    slots = []
    for task_type, tasks in cluster.items():
        for index in range(len(tasks)):
            tf_config = json.dumps(
                {"cluster": cluster, "task": {"type": task_type, "index": index}}
            )
            slots.append((f"{task_type}:{index}", {**env, "TF_CONFIG": tf_config}))
    return slots


TASK_ORDER = ("chief", "worker", "ps", "evaluator")
"""The order of ``MultiProcessRunnerResult.return_value``: by task type, then index."""


def create_cluster_spec(
    has_chief: bool = False, num_workers: int = 1, num_ps: int = 0, has_eval: bool = False
) -> dict[str, list[str]]:
    """A local cluster spec: ``{"worker": ["localhost:12345", ...], ...}``.

    Every task gets a distinct TCP port that was free when chosen (TF's
    ``multi_worker_test_base.create_cluster_spec``).  Task types with no
    task are left out.

    Raises:
        TypeError, ValueError: a count that is not a non-negative int, or no
            task at all.
    """
    counts = {"chief": has_chief, "worker": num_workers, "ps": num_ps, "evaluator": has_eval}
    for what, n in (("num_workers", num_workers), ("num_ps", num_ps)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"{what} must be a non-negative int, got {n!r}")
    for what, flag in (("has_chief", has_chief), ("has_eval", has_eval)):
        if not isinstance(flag, bool):
            raise TypeError(f"{what} must be a bool, got {flag!r}")
    total = sum(int(n) for n in counts.values())
    if total == 0:
        raise ValueError("create_cluster_spec: the cluster has no task")
    ports = iter(free_ports(total))
    return {
        task_type: [f"localhost:{next(ports)}" for _ in range(int(n))]
        for task_type, n in counts.items()
        if n
    }


def check_cluster_spec(spec: object) -> dict[str, list[str]]:
    """``spec`` as ``{task_type: [address, ...]}``, checked (counts become free ports).

    Raises:
        TypeError, ValueError: not a dict of non-empty address lists or
            positive counts, a task type that is not a non-empty str, or
            more than one chief.
    """
    if not isinstance(spec, Mapping) or not spec:
        raise TypeError(f"cluster_spec must be a non-empty dict, got {spec!r}")
    cluster: dict[str, list[str]] = {}
    for task_type, tasks in spec.items():
        if not isinstance(task_type, str) or not task_type:
            raise ValueError(f"cluster_spec task type {task_type!r} must be a non-empty str")
        if isinstance(tasks, int) and not isinstance(tasks, bool) and tasks > 0:
            cluster[task_type] = [f"localhost:{port}" for port in free_ports(tasks)]
        elif (
            isinstance(tasks, Sequence)
            and not isinstance(tasks, str)
            and tasks
            and all(isinstance(t, str) for t in tasks)
        ):
            cluster[task_type] = list(tasks)
        else:
            raise ValueError(
                f"cluster_spec[{task_type!r}] must be a positive count or a list of "
                f"addresses, got {tasks!r}"
            )
    if len(cluster.get("chief", ())) > 1:
        raise ValueError(
            f"a cluster has at most one chief, got {len(cluster['chief'])}: {cluster['chief']}"
        )
    return cluster


def task_sort_key(task: tuple[str, int]) -> tuple[int, str, int]:
    """chief, worker, ps, evaluator, then other types by name; then the index."""
    task_type, index = task
    rank = TASK_ORDER.index(task_type) if task_type in TASK_ORDER else len(TASK_ORDER)
    return rank, task_type, index


def tf_config(
    cluster: Mapping[str, Sequence[str]], task_type: str, index: int, rpc_layer: str | None
) -> str:
    """The ``TF_CONFIG`` value of one task."""
    config: dict[str, object] = {
        "cluster": {t: list(a) for t, a in cluster.items()},
        "task": {"type": task_type, "index": index},
    }
    if rpc_layer is not None:
        config["rpc_layer"] = rpc_layer
    return json.dumps(config)


def visible_gpus(environ: Mapping[str, str], proc_root: str = "/proc") -> list[str]:
    """The GPU ids tasks may be given: the parent's ``CUDA_VISIBLE_DEVICES``, else
    the NVIDIA GPUs the driver lists (``/proc/driver/nvidia/gpus``), else none."""
    import os

    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d.strip() for d in visible.split(",") if d.strip()]
    try:
        count = len(os.listdir(os.path.join(proc_root, "driver", "nvidia", "gpus")))
    except OSError:
        return []
    return [str(i) for i in range(count)]


def assign_gpus(
    tasks: Sequence[tuple[str, int]], gpus: Sequence[str]
) -> dict[tuple[str, int], str]:
    """``CUDA_VISIBLE_DEVICES`` of each task when tasks do not share GPUs.

    Tasks in result order (chief, worker, ps, evaluator) take the GPUs round
    robin: with more GPUs than tasks a task gets several (``"0,2"``), with
    fewer they are reused.  No GPU: no assignment (an empty dict).
    """
    if not gpus:
        return {}
    ordered = sorted(tasks, key=task_sort_key)
    n = len(ordered)
    if len(gpus) >= n:
        return {task: ",".join(gpus[i::n]) for i, task in enumerate(ordered)}
    return {task: gpus[i % len(gpus)] for i, task in enumerate(ordered)}
