"""By-value pickling (``aioproc._func.pickling``): functions from ``__main__`` in workers.

A function defined in a script's ``__main__`` cannot be imported by a worker,
so ``_func.pickling`` pickles it by value, without cloudpickle.  Each test
writes a real script, runs it as ``__main__`` with ``sys.executable``, and
reads the one JSON line it prints: the values its workers returned next to
what the same functions return in the script itself, and whether a worker
had to import cloudpickle (``_func.pickling`` keeps it out of the worker for
everything it can represent, and falls back to cloudpickle for the rest,
which must keep working).  The in-process tests at the end pin the encoding
itself against cloudpickle's.
"""

from __future__ import annotations

import functools
import json
import os
import pickle
import subprocess
import sys
import textwrap
import types
from pathlib import Path
from typing import Any

import cloudpickle
import pytest
from helpers import REPO_ROOT

from aioproc._child.pickling import define, restore
from aioproc._func import pickling

PRELUDE = """\
import asyncio, json, sys
import aioproc


def worker_has_cloudpickle():
    return "cloudpickle" in sys.modules


def run(fn, *args):
    async def go():
        result = await aioproc.run(fn, 1, args=args)
        return result.return_values[0]

    return asyncio.run(go())


def report(**values):
    print(json.dumps(values))
"""


def run_script(tmp_path: Path, body: str) -> Any:
    """Run PRELUDE + ``body`` as ``__main__``; the JSON it printed last."""
    script = tmp_path / "script.py"
    script.write_text(PRELUDE + textwrap.dedent(body))
    # a failed run keeps its logs in a temp dir: tmp_path's, not the suite's
    env = {**os.environ, "PYTHONPATH": REPO_ROOT, "TMPDIR": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


FAST_SCRIPT = """
import functools
import os
import os.path
import xml.etree.ElementTree
from os.path import join

COUNTER = 0


def fact(n):
    return 1 if n <= 1 else n * fact(n - 1)


def is_even(n):
    return n == 0 or is_odd(n - 1)


def is_odd(n):
    return n != 0 and is_even(n - 1)


def bump(by):
    global COUNTER
    COUNTER += by
    return read_counter()


def read_counter():
    return COUNTER


def make_scaler(k):
    def scale(x, *, offset=0):
        return k * x + offset

    return scale


def traced(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return ["traced", fn(*args, **kwargs)]

    return wrapper


@traced
def decorated(x):
    return x + 1


def annotated(x: int, y: "str" = "d") -> str:
    '''Doc of annotated.'''
    return f"{x}{y}"


annotated.tag = "attr"


def probe(base, scale=make_scaler(3), lam=lambda v: v - 1, *, kw=lambda: "kw"):
    return {
        "fact": fact(base),
        "parity": [is_even(10), is_odd(7), is_even(7)],
        "bump": [bump(1), bump(2), COUNTER],
        "scale": scale(base, offset=1),
        "lam": lam(base),
        "kw": kw(),
        "join": join("a", "b"),
        "basename": os.path.basename("/x/y"),
        "xml": xml.etree.ElementTree.fromstring("<a>t</a>").text,
        "decorated": decorated(base),
        "wrapped": decorated.__wrapped__(1),
        "annotated": [
            annotated(1),
            annotated.__doc__,
            annotated.tag,
            annotated.__annotations__["x"].__name__,
            annotated.__defaults__,
        ],
        "names": [probe.__module__, probe.__qualname__, __name__, make_scaler(1).__qualname__],
    }


def probe_in_worker(base):
    return [probe(base), worker_has_cloudpickle()]


if __name__ == "__main__":
    worker, cloudpickled = run(probe_in_worker, 5)
    lam = run(lambda b: [fact(b), worker_has_cloudpickle()], 4)
    part = run(functools.partial(probe_in_worker, 6))
    report(
        worker=worker,
        parent=json.loads(json.dumps(probe(5))),
        cloudpickled=cloudpickled,
        lam=lam,
        partial_fact=part[0]["fact"],
        partial_cloudpickled=part[1],
    )
"""


def test_main_functions_run_without_cloudpickle(tmp_path: Path) -> None:
    got = run_script(tmp_path, FAST_SCRIPT)
    assert got["worker"] == got["parent"]
    assert got["worker"] == {
        "fact": 120,
        "parity": [True, True, False],
        "bump": [1, 3, 3],
        "scale": 16,
        "lam": 4,
        "kw": "kw",
        "join": "a/b",
        "basename": "y",
        "xml": "t",
        "decorated": ["traced", 6],
        "wrapped": 2,
        "annotated": ["1d", "Doc of annotated.", "attr", "int", ["d"]],
        "names": ["__main__", "probe", "__main__", "make_scaler.<locals>.scale"],
    }
    assert got["cloudpickled"] is False
    assert got["lam"] == [24, False]
    assert got["partial_fact"] == 720
    assert got["partial_cloudpickled"] is False


FALLBACK_SCRIPT = """
import dataclasses
import enum
import functools


@dataclasses.dataclass
class Point:
    x: int
    y: int


class Color(enum.Enum):
    RED = 1


class Counted:
    '''A decorator that wraps a function in an instance of a __main__ class.'''

    def __init__(self, fn):
        self.fn = fn
        functools.update_wrapper(self, fn)

    def __call__(self, *args):
        return self.fn(*args)


@Counted
def wrapped(n):
    return [n * 2, worker_has_cloudpickle()]


def uses_class(n):
    return [dataclasses.astuple(Point(n, n + 1)), worker_has_cloudpickle()]


def takes_values(p, color):
    return [p.x + p.y, color.name, worker_has_cloudpickle()]


if __name__ == "__main__":
    report(
        class_global=run(uses_class, 3),
        class_args=run(takes_values, Point(1, 2), Color.RED),
        class_decorator=run(wrapped, 4),
    )
"""


def test_what_needs_cloudpickle_still_works(tmp_path: Path) -> None:
    got = run_script(tmp_path, FALLBACK_SCRIPT)
    assert got == {
        "class_global": [[3, 4], True],
        "class_args": [3, "RED", True],
        "class_decorator": [8, True],
    }


UNBOUND_SCRIPT = """
import sys


def make_unbound():
    def inner():
        return late

    if len(sys.argv) > 99:
        late = 1
    return inner


def call_unbound():
    return make_unbound()()


if __name__ == "__main__":
    try:
        call_unbound()
    except NameError as e:
        parent = [type(e).__name__, str(e)]
    try:
        run(make_unbound())
    except aioproc.ChildFailedError as e:
        cause = e.__cause__
        worker = [type(cause).__name__, str(cause)]
    report(parent=parent, worker=worker)
"""


def test_empty_closure_cell_fails_as_in_the_script(tmp_path: Path) -> None:
    got = run_script(tmp_path, UNBOUND_SCRIPT)
    assert got["worker"] == got["parent"]
    assert got["worker"][0] == "NameError"
    assert "late" in got["worker"][1]


WORKER_SCRIPT = """
import cloudpickle
import json as json_module

TOTAL = 0


def add(n):
    global TOTAL
    TOTAL += n
    return [TOTAL, worker_has_cloudpickle()]


async def calls():
    async with aioproc.open_worker() as w:
        return [await w.call(add, 2), await w.call(add, 3), await w.call(lambda: sorted({3, 1}))]


if __name__ == "__main__":
    fast = asyncio.run(calls())
    cloudpickle.register_pickle_by_value(json_module)
    forced = asyncio.run(calls())
    report(fast=fast, forced=forced)
"""


def test_persistent_worker_calls_match_cloudpickle(tmp_path: Path) -> None:
    """Each call carries its own copy of the globals, as cloudpickle's calls do;
    a module registered for cloudpickle's by-value pickling sends all to cloudpickle."""
    got = run_script(tmp_path, WORKER_SCRIPT)
    assert got["fast"] == [[2, False], [3, False], [1, 3]]
    assert got["forced"] == [[2, True], [3, True], [1, 3]]


# ------------------------------------------------------- the encoding itself


def roundtrip(obj: Any) -> Any:
    return pickle.loads(pickling.dumps_by_value(obj))


def make_recursive() -> Any:
    def count(n: int) -> int:
        return 0 if n == 0 else 1 + count(n - 1)

    return count


def test_recursive_closure_is_one_function() -> None:
    fn = roundtrip(make_recursive())
    assert fn(7) == 7
    assert fn.__closure__[0].cell_contents is fn


def test_class_body_in_a_function_sees_the_globals_it_reads() -> None:
    namespace: dict[str, Any] = {"__name__": "scratch"}
    exec(
        "SIZE = 3\ndef build():\n    class Box:\n        size = SIZE * 2\n    return Box.size\n",
        namespace,
    )
    assert roundtrip(namespace["build"])() == 6


def test_functions_pickled_together_share_globals() -> None:
    namespace: dict[str, Any] = {"__name__": "scratch"}
    exec(
        "N = 1\ndef set_n(v):\n    global N\n    N = v\ndef get_n():\n    return N\n",
        namespace,
    )
    set_n, get_n = roundtrip((namespace["set_n"], namespace["get_n"]))
    assert set_n.__globals__ is get_n.__globals__
    assert set_n.__globals__ is not namespace
    set_n(42)
    assert get_n() == 42
    assert namespace["N"] == 1
    assert get_n.__module__ == "scratch"


CASES: list[tuple[Any, tuple[Any, ...]]] = [
    (lambda x, y=2: x**y, (3,)),
    (functools.partial(lambda a, b: [a, b], "p"), ("q",)),
    (make_recursive(), (4,)),
    (lambda: types.SimpleNamespace(a=1).a, ()),
    (lambda: json.dumps({"k": [1, 2]}), ()),
]


@pytest.mark.parametrize(("fn", "args"), CASES)
def test_same_results_as_cloudpickle(fn: Any, args: tuple[Any, ...]) -> None:
    expected = cloudpickle.loads(cloudpickle.dumps(fn))(*args)
    assert roundtrip(fn)(*args) == expected == fn(*args)


def test_local_class_falls_back_to_cloudpickle() -> None:
    class Local:
        value = 5

    def get() -> int:
        return Local.value

    with pytest.raises(pickling.Unrepresentable, match="Local"):
        pickling.dumps_by_value(get)
    assert pickle.loads(pickling.dumps(get))() == 5


def test_dynamic_module_falls_back_to_cloudpickle() -> None:
    module = types.ModuleType("made_up")
    module.value = 9  # type: ignore[attr-defined]

    def get() -> int:
        return module.value  # type: ignore[no-any-return]

    with pytest.raises(pickling.Unrepresentable, match="made_up"):
        pickling.dumps_by_value(get)
    assert pickle.loads(pickling.dumps(get))() == 9


async def test_unpicklable_global_is_a_clear_error_before_anything_starts() -> None:
    import threading

    import aioproc

    lock = threading.Lock()

    def locked() -> bool:
        with lock:
            return True

    with pytest.raises(TypeError, match=r"function .*locked.* cannot be pickled: .*lock"):
        await aioproc.run(locked, 1)


# ------------------------------------------- the call cache (persistent workers)


def script_namespace(source: str) -> dict[str, Any]:
    """Run ``source`` as a script's ``__main__`` would: its functions travel by value."""
    namespace: dict[str, Any] = {"__name__": "__main__"}
    exec(textwrap.dedent(source), namespace)
    return namespace


CACHED_SCRIPT = """
    import math
    SCALE = 1
    def f(x, k=1, *, m=1):
        return x * SCALE * k * m + helper()
    def helper():
        return 0
    def make(n):
        def get():
            return n
        def set_(v):
            nonlocal n
            n = v
        return get, set_
"""


def test_unchanged_function_is_pickled_once_and_any_change_gets_a_new_id() -> None:
    ns = script_namespace(CACHED_SCRIPT)
    f = ns["f"]
    first = pickling.cached(f)
    assert first is not None
    assert pickling.cached(f) is first  # nothing changed: the same pickle, the same id
    fids = {first.fid}

    def changed() -> Any:
        entry = pickling.cached(f)
        assert entry is not None
        assert entry.fid not in fids, "a change kept the old id"
        fids.add(entry.fid)
        assert pickling.cached(f) is entry
        return pickle.loads(entry.data)

    ns["SCALE"] = True  # equal to 1, not the same object: must not pass for it
    assert changed().__globals__["SCALE"] is True
    f.__defaults__ = (2,)
    assert changed()(1) == 2
    assert f.__kwdefaults__ is not None
    f.__kwdefaults__["m"] = 3  # changed in place
    assert changed()(1) == 6
    f.tag = "t"  # type: ignore[attr-defined]
    assert changed().tag == "t"
    ns["helper"] = lambda: 100  # a function the cached one calls
    assert changed()(1) == 106
    f.__code__ = (lambda x, k=1, *, m=1: -x).__code__
    assert changed()(1) == -1
    f.__qualname__ = "renamed"
    assert changed().__qualname__ == "renamed"
    get, set_ = ns["make"](1)
    entry = pickling.cached(get)
    assert entry is not None and pickle.loads(entry.data)() == 1
    set_(7)  # a closure cell the parent rebinds
    again = pickling.cached(get)
    assert again is not None and again.fid != entry.fid
    assert pickle.loads(again.data)() == 7


def test_a_helper_changed_behind_the_function_is_seen() -> None:
    ns = script_namespace(CACHED_SCRIPT)
    f, helper = ns["f"], ns["helper"]
    entry = pickling.cached(f)
    assert entry is not None
    helper.__defaults__ = ()  # helper's own state is part of f's pickle
    assert pickling.cached(f) is not entry
    ns["SCALE"] = 2
    assert pickle.loads(pickling.cached(f).data)(3) == 6  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "source",
    [
        "ITEMS = [1]\ndef f():\n    return sum(ITEMS)\n",
        "def f(acc=[]):\n    return acc\n",
        "def f(*, opts={}):\n    return opts\n",
        "import threading\nLOCK = threading.Lock()\ndef f():\n    return LOCK\n",
        "class Box:\n    pass\ndef f():\n    return Box\n",
    ],
    ids=["global list", "default list", "kwdefault dict", "unpicklable", "__main__ class"],
)
def test_functions_with_mutable_state_are_not_cached(source: str) -> None:
    # their state must be pickled at every call: nothing to gain, much to get wrong
    assert pickling.cached(script_namespace(source)["f"]) is None


def test_a_function_with_a_large_constant_is_not_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    ns = script_namespace("BLOB = b'x' * 4096\ndef f():\n    return len(BLOB)\n")
    assert pickling.cached(ns["f"]) is not None
    monkeypatch.setattr(pickling, "CACHE_MAX_BYTES", 1024)
    ns["BLOB"] = b"y" * 4096
    assert pickling.cached(ns["f"]) is None


def test_functions_named_by_reference_and_other_callables_are_not_cached() -> None:
    assert pickling.cached(json.dumps) is None
    assert pickling.cached(functools.partial(len)) is None
    assert pickling.cached(len) is None


def test_cache_is_bounded_and_holds_functions_weakly(monkeypatch: pytest.MonkeyPatch) -> None:
    import gc

    monkeypatch.setattr(pickling, "CACHE_SIZE", 3)
    fns = [script_namespace(f"def f():\n    return {i}\n")["f"] for i in range(5)]
    for fn in fns:
        assert pickling.cached(fn) is not None
    assert len(pickling._cache) <= 3
    assert id(fns[-1]) in pickling._cache
    key = id(fns[-1])
    del fns, fn
    gc.collect()
    assert key not in pickling._cache


def test_worker_puts_a_defined_function_back_before_each_call() -> None:
    """What a call changes in the worker does not reach the next one (as with a
    fresh copy per call, which is what a worker got without the cache)."""
    ns = script_namespace(
        """
        COUNT = 0
        def bump(step=1):
            global COUNT, NEW
            COUNT += step
            NEW = 1
            bump.calls = getattr(bump, "calls", 0) + 1
            bump.__defaults__ = (100,)
            return [COUNT, bump.calls]
        def counter():
            n = 0
            def inc():
                nonlocal n
                n += 1
                return n
            return inc
        """
    )
    for name, fn, expected in (("bump", ns["bump"], [1, 1]), ("inc", ns["counter"](), 1)):
        entry = pickling.cached(fn)
        assert entry is not None, name
        rebuilt, plan = define(entry.data)
        for _ in range(3):
            restore(plan)
            assert rebuilt() == expected, name
        if name == "bump":
            assert "NEW" in rebuilt.__globals__
            restore(plan)
            assert "NEW" not in rebuilt.__globals__
            assert rebuilt.__defaults__ == (1,) and not hasattr(rebuilt, "calls")


def test_worker_restores_recursive_and_mutually_recursive_functions() -> None:
    ns = script_namespace(
        """
        def is_even(n):
            return True if n == 0 else is_odd(n - 1)
        def is_odd(n):
            return False if n == 0 else is_even(n - 1)
        """
    )
    entry = pickling.cached(ns["is_even"])
    assert entry is not None
    fn, plan = define(entry.data)
    assert len(plan[1]) == 2  # both functions are put back
    fn.__globals__["is_odd"] = None  # broken by a call...
    restore(plan)
    assert fn(10) is True  # ...and mended before the next
    recursive = make_recursive()
    entry = pickling.cached(recursive)
    assert entry is not None
    fn, plan = define(entry.data)
    restore(plan)
    assert fn(5) == 5 and fn.__closure__[0].cell_contents is fn
