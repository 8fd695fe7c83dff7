"""The public namespace: every exported name exists, and importing is light."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import aioproc


@pytest.mark.parametrize("name", aioproc.__all__)
def test_every_exported_name_resolves(name: str) -> None:
    obj = getattr(aioproc, name)
    assert obj is not None
    module = obj.__module__
    assert module == "aioproc" or module.startswith("aioproc."), (name, module)


def test_all_is_sorted_and_unique() -> None:
    assert aioproc.__all__ == sorted(set(aioproc.__all__))


def test_unknown_attribute_raises_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = aioproc.no_such_name  # type: ignore[attr-defined]


def test_import_is_light_and_installs_nothing() -> None:
    code = (
        "import signal, sys, threading, json, asyncio\n"
        "sigs = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)\n"
        "before = {s: signal.getsignal(s) for s in sigs}\n"
        "import aioproc\n"
        "heavy = ('anyio', 'aiofiles', 'uvloop', 'cloudpickle')\n"
        "light = sorted(m for m in heavy if m in sys.modules)\n"
        "after = {s: signal.getsignal(s) for s in before}\n"
        "print(json.dumps({'light': light, 'same': before == after,"
        " 'threads': threading.active_count()}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    report = json.loads(out.stdout)
    assert report == {"light": [], "same": True, "threads": 1}


@pytest.mark.parametrize(
    "statement",
    ["from aioproc.cluster import barrier", "from aioproc.errors import record"],
)
def test_what_workers_import_loads_no_event_loop(statement: str) -> None:
    """A worker that calls ``barrier()`` or is decorated with ``@record`` pays for no loop."""
    code = (
        f"import sys\n{statement}\n"
        "print(sorted(m for m in ('asyncio', 'anyio', 'aiofiles', 'uvloop') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_preimport_leaves_nothing_for_the_first_start_to_import() -> None:
    """After ``preimport()``, a first group imports no module on the loop, and nothing started."""
    code = (
        "import asyncio, json, signal, sys, threading\n"
        "import aioproc\n"
        "from aioproc import run  # as a service imports what it calls\n"
        "sigs = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD)\n"
        "before = {s: signal.getsignal(s) for s in sigs}\n"
        "aioproc.preimport()\n"
        "aioproc.preimport()  # a second call finds everything loaded\n"
        "state = {'threads': threading.active_count(),"
        " 'same': before == {s: signal.getsignal(s) for s in sigs}}\n"
        "def f(r):\n"
        "    return r\n"
        "async def main():\n"
        "    loaded = set(sys.modules)\n"
        "    for entrypoint, args in ((f, (0,)), (sys.executable, ('-c', 'pass'))):\n"
        "        result = await run(entrypoint, 1, args)\n"
        "        assert not result.failures, result\n"
        "    return sorted(set(sys.modules) - loaded)\n"
        "state['new'] = asyncio.run(main())\n"
        "print(json.dumps(state))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == {"threads": 1, "same": True, "new": []}


def test_a_public_names_module_does_not_depend_on_the_path_that_reached_it() -> None:
    """A name defined in a wing carries its public module from the start: reaching it
    through its wing first, then through the package, changes nothing (and the other
    way round), and ``__version__`` is the base's."""
    code = (
        "import json\n"
        "from aioproc._limits.spec import Limits\n"
        "from aioproc._limits.capacity import Capacity\n"
        "from aioproc._child.boot import worker_state\n"
        "from aioproc.results import Usage\n"
        "from aioproc._cluster.runner import ClusterRunner\n"
        "before = [c.__module__ for c in (Limits, Capacity, worker_state, Usage, ClusterRunner)]\n"
        "import aioproc, aioproc.cluster\n"
        "from aioproc import _base\n"
        "same = [aioproc.Limits is Limits, aioproc.Capacity is Capacity,\n"
        "        aioproc.worker_state is worker_state, aioproc.Usage is Usage,\n"
        "        aioproc.cluster.ClusterRunner is ClusterRunner]\n"
        "after = [c.__module__ for c in (Limits, Capacity, worker_state, Usage, ClusterRunner)]\n"
        "print(json.dumps([before, after, same, aioproc.__version__ == _base.__version__]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    before, after, same, version = json.loads(out.stdout)
    expected = ["aioproc", "aioproc", "aioproc", "aioproc.results", "aioproc.cluster"]
    assert before == after == expected
    assert same == [True] * 5
    assert version


def test_public_module_refuses_a_private_module_name() -> None:
    from aioproc._base import public_module

    class Thing:
        pass

    with pytest.raises(ValueError, match=r"'aioproc\._base'"):
        public_module("aioproc._base", Thing)
    with pytest.raises(ValueError, match="'json'"):
        public_module("json", Thing)
    public_module("aioproc.errors", Thing)
    assert Thing.__module__ == "aioproc.errors"
