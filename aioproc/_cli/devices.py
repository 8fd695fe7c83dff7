"""This host's accelerators and NUMA layout, as ``aioproc run``'s torchrun flags need them.

``count_workers`` answers ``--nproc-per-node cpu|gpu|xpu|auto``;
``numa_cpus`` computes the CPUs each local rank is bound to by
``--numa-binding`` and ``bind`` applies them to a started worker.

Where the answers come from (one rule for both): when torch can be
imported, torch is asked, exactly as torchrun asks it (so ``auto`` counts
any accelerator torch knows, XPUs included, and a GPU's PCI address is
torch's); otherwise the NVIDIA driver is asked without torch:
``nvidia-smi`` (else ``/proc/driver/nvidia/gpus``), narrowed by
``CUDA_VISIBLE_DEVICES`` the way CUDA reads it.  Without torch, devices are
numbered in PCI order (``nvidia-smi``'s), which is CUDA's order for
identical GPUs or with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``; XPUs can only be
counted through torch.  Nothing here runs for ``--help`` or for a numeric
``--nproc-per-node``, and torch is imported for ``gpu``, ``xpu`` and
``auto`` only (or a custom device's name, where a torch device extension is
installed): a word torch would reject is rejected without it.

The NUMA modes are torch's (``torch/numa/binding.py``), computed from
``/sys`` the same way; torch wraps each worker in ``numactl``, aioproc sets
the affinity of every thread of the started worker instead (needs no
``numactl``; threads it creates later inherit it).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import subprocess
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("aioproc.cli")

NUMA_MODES = ("node", "socket", "exclusive", "core-complex")
"""torch's ``AffinityMode`` values, in its order."""

_SYS = "/sys"  # the sysfs root (tests point it at a made-up tree)
_NVIDIA_PROC = "/proc/driver/nvidia/gpus"
_SMI_TIMEOUT = 20.0


def cpu_count() -> int:
    """The CPUs this process may run on (torch 2.13's ``torch._utils.cpu_count``)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def count_workers(kind: str) -> int:
    """``--nproc-per-node kind``: the number of workers torchrun would start.

    Args:
        kind: ``cpu``, ``gpu``, ``xpu``, ``auto`` (the accelerators, else
            the CPUs), or, with torch, its custom (privateuse1) device name.

    Raises:
        ValueError: an accelerator kind this host has none of, or an
            unknown kind; the message says which and what to give instead.
    """
    if kind == "cpu":
        return cpu_count()
    if kind not in _TORCH_KINDS and not _custom_device_possible(kind):
        # A usage error (``two``, ``tpu``) is told without importing torch,
        # which takes seconds: only torch's own kinds, or a device extension's
        # name, are worth asking it about.
        raise ValueError(_unknown(kind))
    torch = _torch()
    if torch is not None:
        count = _torch_count(torch, kind)
    elif kind in ("gpu", "auto"):
        count = len(cuda_devices())
        if count == 0 and kind == "auto":
            return cpu_count()
        if count == 0:
            raise ValueError(
                "'gpu': no CUDA GPU found (torch is not installed; nvidia-smi and "
                f"{_NVIDIA_PROC} show none, or CUDA_VISIBLE_DEVICES hides them); give the "
                "number of workers, or 'cpu'"
            )
    elif kind == "xpu":
        raise ValueError(
            "'xpu': counting Intel XPUs needs torch (with XPU support), which is not "
            "installed here; give the number of workers"
        )
    else:
        raise ValueError(_unknown(kind))
    if count <= 0:  # pragma: no cover - torch says available, yet counts none
        raise ValueError(f"{kind!r}: torch counts {count} devices")
    return count


_TORCH_KINDS = frozenset({"gpu", "xpu", "auto"})
"""The kinds torch is asked to count when it can be imported."""
_PRIVATEUSE1_DEFAULT = "privateuseone"
"""torch's name for its custom device until an extension renames it."""
_BACKENDS_GROUP = "torch.backends"
"""The entry points through which ``import torch`` loads device extensions."""


def _custom_device_possible(kind: str) -> bool:
    """Whether ``kind`` could be torch's custom (privateuse1) device name here.

    torch renames that device only when a device extension does it, and in
    torchrun's process an extension comes in through the ``torch.backends``
    entry points ``import torch`` loads (unless
    ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``).  Without one, the only custom
    name is torch's default, so any other word is an error torch would give.
    """
    if kind == _PRIVATEUSE1_DEFAULT:
        return True
    if os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD", "1") != "1":
        return False
    from importlib.metadata import entry_points

    return bool(entry_points(group=_BACKENDS_GROUP))


def _unknown(kind: str) -> str:
    return f"expected a positive number of workers, or auto, cpu, gpu or xpu, got {kind!r}"


def _torch() -> Any:
    """The torch module when it can be imported, else None (never installs anything)."""
    if importlib.util.find_spec("torch") is None:
        return None
    try:
        torch = importlib.import_module("torch")  # untyped here: torch is optional
    except Exception:  # a broken install: count as torchrun could not
        logger.debug("torch is installed but cannot be imported", exc_info=True)
        return None
    return torch


def _torch_count(torch: Any, kind: str) -> int:
    """torchrun's ``determine_local_world_size`` for a device kind."""
    if kind == "gpu":
        if not torch.cuda.is_available():
            raise ValueError("'gpu': CUDA is not available (torch.cuda.is_available() is False)")
        return int(torch.cuda.device_count())
    if kind == "xpu":
        xpu = getattr(torch, "xpu", None)
        if xpu is None or not xpu.is_available():
            raise ValueError("'xpu': no XPU is available (torch.xpu.is_available() is False)")
        return int(xpu.device_count())
    if kind == "auto":
        accelerator = getattr(torch, "accelerator", None)
        if accelerator is not None and accelerator.is_available():
            return int(accelerator.device_count())
        return cpu_count()
    custom = torch._C._get_privateuse1_backend_name()
    module = getattr(torch, custom, None)
    if kind != custom or module is None:
        raise ValueError(_unknown(kind))
    if not module.is_available():
        raise ValueError(f"{kind!r}: no {kind} device is available")
    return int(module.device_count())


# ------------------------------------------------------------------ GPUs


@dataclass(frozen=True)
class Gpu:
    """One CUDA device as the workers see it: its UUID and sysfs PCI address ("" if unknown)."""

    uuid: str
    pci: str


def cuda_devices() -> list[Gpu]:
    """The CUDA devices a worker sees, in CUDA's order (``CUDA_VISIBLE_DEVICES`` applied)."""
    torch = _torch()
    if torch is not None:
        return _torch_gpus(torch)
    return _visible(_driver_gpus(), os.environ.get("CUDA_VISIBLE_DEVICES"))


def _torch_gpus(torch: Any) -> list[Gpu]:
    if not torch.cuda.is_available():
        return []
    gpus = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        pci = ""
        if hasattr(props, "pci_bus_id"):  # torch's own formula (numa/binding.py)
            pci = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        gpus.append(Gpu(str(getattr(props, "uuid", i)), pci))
    return gpus


def _driver_gpus() -> list[Gpu]:
    """Every NVIDIA GPU of this host in PCI order, from nvidia-smi or the driver's /proc files."""
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=uuid,pci.bus_id", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=_SMI_TIMEOUT,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        done = None  # no nvidia-smi: the driver's files may still be there
    if done is not None and done.returncode == 0:
        gpus = []
        for line in done.stdout.splitlines():
            uuid, _, bus_id = (part.strip() for part in line.partition(","))
            if uuid:
                gpus.append(Gpu(uuid, _sysfs_pci(bus_id)))
        return gpus
    if done is not None:  # nvidia-smi failed: no driver loaded, no GPU usable
        logger.info("nvidia-smi failed (%s): no GPU counted", done.stderr.strip())
        return []
    try:
        names = sorted(os.listdir(_NVIDIA_PROC))
    except OSError:
        return []
    return [Gpu(_proc_uuid(name), _sysfs_pci(name)) for name in names]


def _proc_uuid(pci: str) -> str:
    try:
        with open(os.path.join(_NVIDIA_PROC, pci, "information")) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "GPU UUID":
                    return value.strip()
    except OSError:
        pass
    return ""


def _sysfs_pci(bus_id: str) -> str:
    """``00000000:1B:00.0`` (nvidia-smi) as sysfs names it: ``0000:1b:00.0``."""
    parts = bus_id.strip().lower().split(":")
    if len(parts) == 2:  # no domain: domain 0
        parts.insert(0, "0")
    try:
        return f"{int(parts[0], 16):04x}:{parts[1]}:{parts[2]}" if len(parts) == 3 else ""
    except ValueError:
        return ""


def _visible(gpus: list[Gpu], spec: str | None) -> list[Gpu]:
    """``gpus`` narrowed and reordered by ``CUDA_VISIBLE_DEVICES`` as CUDA reads it.

    Indices, ``GPU-<uuid>`` prefixes and MIG instances (``MIG-...``, PCI
    address unknown) are taken in order; the first entry CUDA would reject
    (``-1``, an unknown index or UUID) ends the list.
    """
    if spec is None:
        return gpus
    chosen: list[Gpu] = []
    for item in (part.strip() for part in spec.split(",")):
        if item.isdigit():
            found = [gpus[int(item)]] if int(item) < len(gpus) else []
        elif item.startswith("MIG-"):
            found = [Gpu(item, "")]
        else:
            prefix = item if item.startswith("GPU-") else f"GPU-{item}"
            found = [g for g in gpus if item and g.uuid.startswith(prefix)]
        if len(found) != 1 or found[0] in chosen:
            break
        chosen.append(found[0])
    return chosen


# ------------------------------------------------------------------ NUMA


def numa_cpus(mode: str, nprocs: int) -> tuple[dict[int, frozenset[int]], str]:
    """The CPUs ``--numa-binding mode`` binds each local rank to, and why any rank is not bound.

    Local rank ``i`` is bound near CUDA device ``i``, as torchrun assumes.

    Returns:
        ``({local_rank: cpus}, note)``: the ranks to bind (none where the
        host exposes no NUMA information or no GPU), and ``""`` or a
        sentence naming the ranks left unbound and why.

    Raises:
        ValueError: a mode that finds no CPU for a GPU (e.g. ``exclusive``
            with more GPUs than cores on their node), as torch raises.
    """
    if not os.path.isdir(os.path.join(_SYS, "devices/system/node")):
        return {}, "this machine exposes no NUMA information (no /sys/devices/system/node)"
    gpus = cuda_devices()
    if not gpus:
        return {}, "no CUDA GPU found: the binding follows each rank's GPU"
    nodes = [_gpu_node(gpu) for gpu in gpus]
    cpus: dict[int, frozenset[int]] = {}
    unbound: list[int] = []
    for rank in range(nprocs):
        if rank >= len(gpus) or nodes[rank] is None:
            unbound.append(rank)
            continue
        found = _mode_cpus(mode, rank, nodes)
        if not found:
            raise ValueError(
                f"--numa-binding {mode}: no CPU this process may use is near GPU {rank}"
            )
        cpus[rank] = frozenset(found)
    note = ""
    if unbound:
        which = ", ".join(map(str, unbound))
        note = (
            f"local rank(s) {which} not bound: no GPU of that index with a known NUMA node "
            f"({len(gpus)} GPU(s) visible)"
        )
    return cpus, note


def _gpu_node(gpu: Gpu) -> int | None:
    """The NUMA node of a GPU (torch's: sysfs says -1 on one-node machines, meaning node 0)."""
    if not gpu.pci:
        return None
    try:
        with open(os.path.join(_SYS, "bus/pci/devices", gpu.pci, "numa_node")) as f:
            return max(int(f.read().strip()), 0)
    except (OSError, ValueError):
        return None


def _mode_cpus(mode: str, gpu: int, nodes: list[int | None]) -> set[int]:
    """torch's four affinity modes for GPU ``gpu`` (``nodes``: each GPU's NUMA node)."""
    node = nodes[gpu]
    assert node is not None
    allowed = _node_cpus(node)
    if mode == "node" or not allowed:
        return allowed
    if mode == "socket":
        socket = _socket(min(allowed))
        found: set[int] = set()
        for other in _ints(_read("devices/system/node/possible")):
            theirs = _node_cpus(other)
            if theirs and _socket(min(theirs)) == socket:
                found |= theirs
        return found
    peers = sorted(i for i, n in enumerate(nodes) if n == node)
    position = peers.index(gpu)
    if mode == "exclusive":
        # one physical core is named by its lowest logical CPU; cores are shared out evenly,
        # the lowest GPUs getting one more when they do not divide
        cores = _group(
            allowed, lambda cpu: min(_ints(_cpu_file(cpu, "topology/thread_siblings_list")))
        )
        share, extra = divmod(len(cores), len(peers))
        if share < 1:
            raise ValueError(
                f"--numa-binding exclusive: NUMA node {node} has {len(cores)} physical cores "
                f"for {len(peers)} GPUs"
            )
        start = position * share + min(position, extra)
        end = start + share + (1 if position < extra else 0)
        return {cpu for core in list(cores.values())[start:end] for cpu in core}
    # core-complex: the cores sharing a last-level cache, the fullest first
    caches = _group(allowed, lambda cpu: min(_last_level_cache(cpu)))
    ordered = sorted(caches.items(), key=lambda item: (-len(item[1]), item[0]))
    return ordered[position % len(ordered)][1]


def _node_cpus(node: int) -> set[int]:
    try:
        listed = _ints(_read(f"devices/system/node/node{node}/cpulist"))
    except OSError:
        return set()
    return listed & _allowed_cpus()


def _allowed_cpus() -> set[int]:
    """The CPUs this process may run on: a binding never reaches past them (torch's rule)."""
    return set(os.sched_getaffinity(0))


def _socket(cpu: int) -> int:
    return int(_cpu_file(cpu, "topology/physical_package_id"))


def _last_level_cache(cpu: int) -> set[int]:
    base = f"devices/system/cpu/cpu{cpu}/cache"
    level, shared = -1, {cpu}
    for entry in sorted(os.listdir(os.path.join(_SYS, base))):
        if not entry.startswith("index") or not entry[5:].isdecimal():
            continue
        if _read(f"{base}/{entry}/type").strip() not in ("Unified", "Data"):
            continue
        this = int(_read(f"{base}/{entry}/level"))
        if this > level:
            level, shared = this, _ints(_read(f"{base}/{entry}/shared_cpu_list"))
    return shared


def _group(cpus: Iterable[int], key: Callable[[int], int]) -> dict[int, set[int]]:
    groups: dict[int, set[int]] = {}
    for cpu in cpus:
        groups.setdefault(key(cpu), set()).add(cpu)
    return dict(sorted(groups.items()))


def _cpu_file(cpu: int, name: str) -> str:
    return _read(f"devices/system/cpu/cpu{cpu}/{name}")


def _read(path: str) -> str:
    with open(os.path.join(_SYS, path)) as f:
        return f.read()


def _ints(ranges: str) -> set[int]:
    """A sysfs CPU list such as ``0-3,8,10-11``."""
    found: set[int] = set()
    for part in filter(None, (p.strip() for p in ranges.split(","))):
        low, _, high = part.partition("-")
        found.update(range(int(low), int(high or low) + 1))
    return found


def ranges(cpus: Iterable[int]) -> str:
    """``{0, 1, 2, 4}`` as ``0-2,4`` (numactl's and sysfs's notation)."""
    out: list[str] = []
    for cpu in sorted(cpus):
        if out and cpu == int(out[-1].rpartition("-")[2]) + 1:
            out[-1] = f"{out[-1].partition('-')[0]}-{cpu}"
        else:
            out.append(str(cpu))
    return ",".join(out)


def bind(pid: int, cpus: frozenset[int]) -> None:
    """Bind every thread of the process ``pid`` to ``cpus``.

    Threads it creates afterwards inherit the binding.  A process that
    already exited is left alone.
    """
    try:
        threads = [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        threads = [pid]
    for tid in threads:
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:
            continue  # that thread (or the whole worker) is gone
        except OSError as e:
            logger.warning(
                "could not bind pid %d (thread %d) to CPUs %s: %s", pid, tid, ranges(cpus), e
            )
            return
