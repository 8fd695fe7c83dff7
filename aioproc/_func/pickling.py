"""Pickling a worker's function by value, for a worker without cloudpickle.

A function a worker cannot import by name (one defined in ``__main__`` or a
notebook, a lambda, a closure) must travel by value.  cloudpickle does that,
but unpickling its output imports cloudpickle in the worker, ~27 ms of CPU:
more than the whole rest of a worker's start.  ``dumps`` writes the common
cases as plain protocol-5 pickles instead, which the worker loads with the
standard library's C unpickler and the few functions of ``_child.pickling``.

A function by value is its code (marshal, the worker runs the same
interpreter), the globals its code reads or writes (found by walking its
bytecode and that of nested functions), its defaults, closure contents and
attributes.  Everything reachable from those is pickled as usual, with four
additions: other by-value functions (so recursion, mutual recursion, nested
closures, decorators built from closures and ``functools.partial`` work),
code objects, modules (by name) and, because the standard pickler would name
them by reference, a refusal of anything else that belongs to ``__main__``
(classes, their instances, enums, ``lru_cache`` wrappers).  Whatever this
cannot represent exactly as cloudpickle would falls back to cloudpickle, so
the result never differs; only the worker's start gets cheaper.

A persistent worker is sent such a function once (``cached``): the pickle is
kept, keyed weakly by the function, with a *key*, the identity of
everything the pickle was made from (code, defaults, names, the globals the
code reads, closure cell contents, attributes), for the function and every
by-value function it reaches.  Only functions whose key holds immutable
values (numbers, strings, tuples of them, code, modules, classes and
functions named by reference) are cached: for those, the same identities
mean the same pickle, so comparing identities at each call is an exact
check.  Anything else (a global list, a default dict) must be pickled again
at every call anyway, so such a function keeps the plain path.  A changed
function gets a new id: an id never stands for two pickles.
"""

from __future__ import annotations

import collections
import dis
import functools
import io
import itertools
import marshal
import operator
import pickle
import sys
import types
import weakref
from collections.abc import Callable
from typing import Any

from .._child import pickling as _funcload

__all__ = ["Cached", "cached", "dumps", "dumps_by_value", "function_ref", "lookup"]


class Unrepresentable(pickle.PicklingError):
    """Raised inside the pickler for what only cloudpickle can carry."""


def function_ref(fn: object) -> tuple[str, str] | None:
    """``(module, qualname)`` if ``fn`` can be imported back by name in a worker."""
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str):
        return None
    if module == "__main__" or "<" in qualname:
        return None
    obj: object = sys.modules.get(module)
    if "." in qualname:
        for part in qualname.split("."):
            obj = getattr(obj, part, None)
    else:
        obj = getattr(obj, qualname, None)
    return (module, qualname) if obj is fn else None


# LOAD_NAME: a class body inside the function reads globals by name
_GLOBAL_OPS = frozenset({"LOAD_GLOBAL", "STORE_GLOBAL", "DELETE_GLOBAL", "LOAD_NAME"})
_BASE_GLOBALS = ("__package__", "__name__", "__path__", "__file__")


@functools.lru_cache(maxsize=1024)
def _code_names(code: types.CodeType) -> tuple[frozenset[str], frozenset[str]]:
    """(global names, all names) used by ``code`` and the code nested in it."""
    globals_ = {i.argval for i in dis.get_instructions(code) if i.opname in _GLOBAL_OPS}
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            inner_globals, inner_names = _code_names(const)
            globals_ |= inner_globals
            names |= inner_names
    return frozenset(globals_), frozenset(names)


def _submodules(module: types.ModuleType, names: frozenset[str]) -> list[str]:
    """Loaded submodules of ``module`` that code using ``names`` may reach as attributes."""
    prefix = module.__name__ + "."
    return sorted(
        name
        for name in list(sys.modules)
        if name.startswith(prefix) and all(p in names for p in name[len(prefix) :].split("."))
    )


class _Pickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=5)
        # one skeleton globals dict per parent globals dict: pickled once (the
        # memo shares it), so functions rebuilt together share their globals
        self._bases: dict[int, dict[str, Any]] = {}

    def reducer_override(self, obj: Any) -> Any:
        kind = type(obj)
        if kind is types.FunctionType:
            if obj is _funcload.make_function or obj is _funcload.fill_function:
                # not `aioproc._child.pickling.<name>`: finding that by name would import
                # the aioproc package in the worker (~2.5 ms), where the boot
                # code registered just this module
                return getattr, (_funcload, obj.__name__)
            if function_ref(obj) is not None:
                return NotImplemented  # by reference, as cloudpickle does
            return self._reduce_function(obj)
        if kind is types.CodeType:
            return marshal.loads, (marshal.dumps(obj),)
        if kind is types.ModuleType:
            return self._reduce_module(obj)
        if isinstance(obj, type) and function_ref(obj) is None:
            # cloudpickle carries such classes by value (or builtin types by
            # its own names); the standard pickler would fail or name them
            raise Unrepresentable(f"class {obj!r} cannot be imported by name")
        try:
            module = getattr(obj, "__module__", None)
        except Exception:
            module = None
        if module == "__main__":
            # the standard pickler would name it `__main__.<name>`, which the
            # worker's __main__ does not have
            raise Unrepresentable(f"{obj!r} is defined in __main__")
        return NotImplemented

    def _reduce_module(self, module: types.ModuleType) -> Any:
        name = module.__name__
        if name == "__main__" or sys.modules.get(name) is not module:
            raise Unrepresentable(f"module {name!r} cannot be imported by name")
        if getattr(module, "__spec__", None) is None:
            raise Unrepresentable(f"module {name!r} was built dynamically")
        # `__import__` with a fromlist returns the module itself, found in
        # sys.modules if there, without importing its parent packages
        return __import__, (name, None, None, ("__name__",))

    def _reduce_function(self, fn: types.FunctionType) -> Any:
        code = fn.__code__
        g = fn.__globals__
        base = self._bases.get(id(g))
        if base is None:
            base = self._bases[id(g)] = {k: g[k] for k in _BASE_GLOBALS if k in g}
        global_names, all_names = _code_names(code)
        referenced = {name: g[name] for name in sorted(global_names) if name in g}
        submodules = sorted(
            {
                sub
                for value in referenced.values()
                if type(value) is types.ModuleType
                for sub in _submodules(value, all_names)
            }
        )
        closure = fn.__closure__ or ()
        cells = tuple(_cell_contents(cell) for cell in closure)
        attrs: dict[str, Any] = {"__qualname__": fn.__qualname__, "__module__": fn.__module__}
        if fn.__doc__ is not None:
            attrs["__doc__"] = fn.__doc__
        if fn.__dict__:
            attrs["__dict__"] = fn.__dict__
        if fn.__annotations__:
            attrs["__annotations__"] = fn.__annotations__
        type_params = getattr(fn, "__type_params__", ())
        if type_params:
            attrs["__type_params__"] = type_params
        state = (referenced, fn.__defaults__, fn.__kwdefaults__, cells, attrs, submodules)
        args = (code, base, fn.__name__, len(closure))
        return _funcload.make_function, args, state, None, None, _funcload.fill_function


def _cell_contents(cell: types.CellType) -> tuple[Any, ...]:
    try:
        return (cell.cell_contents,)
    except ValueError:
        return ()  # an empty cell (a variable assigned after the closure was made)


def _by_value_registry() -> bool:
    """True if the program asked cloudpickle to pickle some module by value."""
    registry = _registry
    if registry is None:
        cloudpickle = sys.modules.get("cloudpickle")
        listing: Callable[[], Any] | None = getattr(
            cloudpickle, "list_registry_pickle_by_value", None
        )
        if listing is not None:
            _find_registry(cloudpickle)
        return bool(listing and listing())
    return bool(registry)


_registry: set[str] | None = None
"""cloudpickle's own set of modules registered by value, once found: asked at
every call of a cached function, where copying it (its public listing) costs
more than the rest of the check."""


def _find_registry(cloudpickle: Any) -> None:
    global _registry
    registry = getattr(getattr(cloudpickle, "cloudpickle", None), "_PICKLE_BY_VALUE_MODULES", None)
    if type(registry) is set:
        _registry = registry


def dumps_by_value(obj: Any) -> bytes:
    """Pickle ``obj`` for a worker without cloudpickle.

    Raises:
        pickle.PicklingError: ``obj`` (or something it refers to) needs
            cloudpickle; ``Unrepresentable`` when it belongs to ``__main__``.
        Exception: whatever the standard pickler raises for it.
    """
    if _by_value_registry():
        raise Unrepresentable("modules registered with cloudpickle.register_pickle_by_value")
    buf = io.BytesIO()
    _Pickler(buf).dump(obj)
    return buf.getvalue()


def dumps(obj: Any) -> bytes:
    """Protocol-5 pickle of ``obj``: ``dumps_by_value`` where it can, else cloudpickle.

    Raises:
        Exception: whatever cloudpickle raises for ``obj``.
    """
    try:
        return dumps_by_value(obj)
    except Exception:
        import cloudpickle

        return cloudpickle.dumps(obj, protocol=5)  # type: ignore[no-any-return]


# ------------------------------------------------------------- the call cache

CACHE_SIZE = 256
"""By-value functions whose pickle the supervisor keeps (least recently used go)."""

CACHE_MAX_BYTES = 1 << 20
"""A bigger pickle (a function holding a large constant) is not kept: the
cache, and each worker's copy of it, would hold that much per function."""

_MISSING = object()  # a global the code names but the globals dict lacks; an empty cell
# section marks of a key's contents: one layout cannot pass for another by chance
_CELLS, _KWDEFAULTS, _DICT, _ANNOTATIONS = (object() for _ in range(4))
_REPEAT_MISSING = itertools.repeat(_MISSING)

_ATTR_NAMES: tuple[str, ...] = ("__code__", "__defaults__", "__name__", "__qualname__")
_ATTR_NAMES += ("__module__", "__doc__")
if hasattr(types.FunctionType, "__type_params__"):
    _ATTR_NAMES += ("__type_params__",)
# containers last: their identity is compared with the rest, their contents apart
_ATTR_NAMES += ("__closure__", "__kwdefaults__", "__dict__", "__annotations__")
_attrs = operator.attrgetter(*_ATTR_NAMES)
"""What ``_reduce_function`` pickles of a function, its globals aside, in one C call."""


def _contents(attrs: tuple[Any, ...]) -> list[Any]:
    """The contents of the containers among ``_attrs(fn)``: cells and dicts."""
    closure, kwdefaults, fdict, annotations = attrs[-4:]
    out: list[Any] = []
    if closure:
        out.append(_CELLS)
        for cell in closure:
            try:
                out.append(cell.cell_contents)
            except ValueError:
                out.append(_MISSING)
    for mark, d in ((_KWDEFAULTS, kwdefaults), (_DICT, fdict), (_ANNOTATIONS, annotations)):
        if d:
            out += (mark, len(d), *d, *d.values())
    return out


class _Node:
    """One by-value function of a cached pickle, and what it was pickled from."""

    __slots__ = ("attrs", "contents", "fn", "names", "values")

    def __init__(self, fn: types.FunctionType, top: bool, names: tuple[str, ...]) -> None:
        self.fn = None if top else fn  # None: the cached function itself, held weakly
        self.names = names  # the globals its code reads, and the base ones
        self.attrs: tuple[Any, ...] = _attrs(fn)
        self.values = tuple(map(fn.__globals__.get, names, _REPEAT_MISSING))
        self.contents = _contents(self.attrs)

    def unchanged(self, fn: types.FunctionType) -> bool:
        """Every object compared by identity: immutable ones (see ``_frozen``) that
        are the same objects pickle the same."""
        attrs = _attrs(fn)
        if not all(map(operator.is_, attrs, self.attrs)):
            return False
        now = map(fn.__globals__.get, self.names, _REPEAT_MISSING)
        if not all(map(operator.is_, now, self.values)):
            return False
        if not self.contents:
            # the same dicts, still empty (a closure cannot appear)
            return not (attrs[-3] or attrs[-2] or attrs[-1])
        contents = _contents(attrs)
        return len(contents) == len(self.contents) and all(
            map(operator.is_, contents, self.contents)
        )


_ATOMS = frozenset(
    {
        type(None),
        bool,
        int,
        float,
        complex,
        str,
        bytes,
        type(...),
        type(NotImplemented),
        types.CodeType,
        types.ModuleType,
        range,
    }
)
_MARKS = frozenset(map(id, (_MISSING, _KWDEFAULTS, _CELLS, _DICT, _ANNOTATIONS)))


def _frozen(value: Any, depth: int = 0) -> bool:
    """True if ``value`` cannot change without being replaced (and pickles the same).

    Numbers, strings, code, modules and ranges; tuples and frozensets of such;
    classes, functions and builtins the pickle names by reference;
    ``list[int]``-style aliases of such.
    """
    kind = type(value)
    if kind in _ATOMS:
        return True
    if depth > 4:
        return False
    if kind is tuple or kind is frozenset:
        return len(value) <= 64 and all(_frozen(v, depth + 1) for v in value)
    if kind is types.GenericAlias or kind is types.UnionType:
        return _frozen(value.__origin__ if kind is types.GenericAlias else (), depth + 1) and all(
            _frozen(v, depth + 1) for v in value.__args__
        )
    if kind is types.BuiltinFunctionType:
        # `len`, `math.sqrt`: named by reference; a bound method (`[].append`) is not
        return type(value.__self__) in (types.ModuleType, type(None))
    if kind is types.FunctionType or isinstance(value, type):
        return function_ref(value) is not None
    return False


class Cached:
    """A by-value function pickled once for persistent workers (see the module doc).

    Attributes:
        fid: the id workers know it by; a changed function gets a new one.
        data: its pickle (``dumps_by_value``).
    """

    __slots__ = ("_modules", "_nameable", "_nodes", "_ref", "_top", "data", "fid")

    def __init__(
        self, fn: types.FunctionType, nodes: list[_Node], modules: int | None, data: bytes
    ) -> None:
        self.fid = next(_fids)
        self.data = data
        self._nodes = nodes
        self._modules = modules
        # the usual case: one function, no module among its globals
        self._top = nodes[0] if len(nodes) == 1 and modules is None else None
        # whether function_ref may name it some day (its module and qualname,
        # checked as part of the key, allow that): then it is asked each time
        self._nameable = fn.__module__ != "__main__" and "<" not in fn.__qualname__
        self._ref = weakref.ref(fn, functools.partial(_forget, id(fn)))

    def unchanged(self, fn: types.FunctionType) -> bool:
        """Whether pickling ``fn`` now gives ``data`` again (identities compared)."""
        nodes = self._nodes
        if self._modules is not None and self._modules != len(sys.modules):
            # a referenced module's loaded submodules travel with the function
            return False
        # a loop, not all(<genexpr>): this runs at every call
        for node in nodes:  # noqa: SIM110
            if not node.unchanged(fn if node.fn is None else node.fn):
                return False
        return True


_fids = itertools.count(1)
_cache: collections.OrderedDict[int, Cached] = collections.OrderedDict()


def _forget(key: int, ref: weakref.ref[Any]) -> None:
    entry = _cache.get(key)
    if entry is not None and entry._ref is ref:
        del _cache[key]


def lookup(fn: Any) -> Cached | None:
    """``cached(fn)`` if it is cached and unchanged; None (and nothing built) if not."""
    key = id(fn)
    entry = _cache.get(key)
    if entry is None:
        return None
    func = entry._ref()
    if func is None or func is not fn:
        return None
    # Cached.unchanged and _by_value_registry, inlined for their usual cases:
    # this runs at every call of a cached function
    top = entry._top
    if (
        (top.unchanged(func) if top is not None else entry.unchanged(func))
        and not (_by_value_registry() if _registry is None else _registry)
        and not (entry._nameable and function_ref(func) is not None)
    ):
        try:
            _cache.move_to_end(key)
        except KeyError:
            pass  # dropped meanwhile by a loop in another thread: still valid
        return entry
    _cache.pop(key, None)
    return None


def cached(fn: object) -> Cached | None:
    """The by-value function ``fn`` pickled for persistent workers, or None.

    None: ``fn`` is not a plain function, is named by reference, or its
    state holds something mutable (then it is pickled at every call), or it
    needs cloudpickle.  A function changed since it was cached is pickled
    again, under a new id.
    """
    if type(fn) is not types.FunctionType:
        return None
    entry = lookup(fn)
    if entry is not None:
        return entry
    if function_ref(fn) is not None or _by_value_registry():
        return None
    entry = _build(fn)
    if entry is not None:
        _cache[id(fn)] = entry
        while len(_cache) > CACHE_SIZE:
            _cache.popitem(last=False)
    return entry


def _build(fn: types.FunctionType) -> Cached | None:
    """Walk the by-value functions ``fn`` reaches; pickle it if every value is frozen."""
    nodes: list[_Node] = []
    seen = {id(fn)}
    todo = [fn]
    modules = False
    while todo:
        f = todo.pop()
        node = _Node(f, f is fn, _BASE_GLOBALS + tuple(sorted(_code_names(f.__code__)[0])))
        # the containers themselves (closure, dicts) are compared by identity
        # and their contents apart
        for where, values in enumerate((node.attrs[:-4], node.values, node.contents)):
            for value in values:
                if id(value) in _MARKS:
                    continue
                kind = type(value)
                if kind is types.FunctionType and function_ref(value) is None:
                    if id(value) not in seen:  # another function of the graph
                        seen.add(id(value))
                        todo.append(value)
                    continue
                if not _frozen(value):
                    return None
                if kind is types.ModuleType and where == 1:
                    modules = True
        nodes.append(node)
    try:
        data = dumps_by_value(fn)
    except Exception:
        return None  # cloudpickle's, pickled at each call as before
    if len(data) > CACHE_MAX_BYTES:
        return None
    return Cached(fn, nodes, len(sys.modules) if modules else None, data)
