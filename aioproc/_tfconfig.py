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
