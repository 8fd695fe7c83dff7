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
"""

from __future__ import annotations

import dis
import functools
import io
import marshal
import pickle
import sys
import types
from collections.abc import Callable
from typing import Any

from .._child import pickling as _funcload

__all__ = ["dumps", "dumps_by_value", "function_ref"]


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
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
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
    cloudpickle = sys.modules.get("cloudpickle")
    listing: Callable[[], Any] | None = getattr(cloudpickle, "list_registry_pickle_by_value", None)
    return bool(listing and listing())


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
