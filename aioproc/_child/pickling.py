"""Worker half of ``_func.pickling``: rebuild functions that were pickled by value.

The pickles ``_func.pickling`` writes reach these functions as attributes of
``__import__("aioproc._child.pickling", fromlist=...)``; the boot code (``_func.boot``)
registers this module under that name in every function worker, so
unpickling finds it in ``sys.modules`` without importing the aioproc
package, and a worker rebuilds a script's functions with the standard
library's ``_pickle`` alone (no cloudpickle, whose import costs a worker
more than its whole start).

A function is rebuilt in two steps, like any recursive pickle: a skeleton
(code, shared globals, name, empty closure cells) that the unpickler
memoizes, then its state (referenced globals, defaults, cell contents,
attributes), which may refer back to the skeleton: recursion and mutual
recursion come out as real cycles.  Stdlib only, and nothing imported at
module level: this runs in every worker, used or not.

A persistent worker keeps the functions the supervisor defines once
(``define``) and calls them again by id.  Such a function is the same object
at every call, but each call must see it as a freshly unpickled copy would
be: the supervisor sends a definition again whenever anything it pickled
changed in the parent, and ``restore`` undoes, before every call, what an
earlier call in this worker changed (a ``global`` statement, a ``nonlocal``
counter, an attribute set on the function).  The supervisor caches only
functions whose state is made of immutable values, so putting back the very
objects of the definition is exact.
"""

from __future__ import annotations

import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from types import CellType, FunctionType
    from typing import Any

    # What ``restore`` puts back: (globals dict, its contents) per globals dict,
    # and (function, defaults, kwdefaults, cells, __dict__, other attributes)
    # per function.
    Plan = tuple[tuple[tuple[dict[str, Any], dict[str, Any]], ...], tuple[tuple[Any, ...], ...]]


def _cell_type() -> type[CellType]:
    value = None

    def read() -> None:
        return value

    assert read.__closure__ is not None
    return type(read.__closure__[0])


_Cell = _cell_type()
_Function: Any = type(_cell_type)  # types.FunctionType, without importing types


def make_function(code: Any, globals_: dict[str, Any], name: str, ncells: int) -> FunctionType:
    """The skeleton of a function: its closure cells are empty until ``fill_function``.

    ``globals_`` is one dict per parent globals dict and pickle, so functions
    rebuilt together share it, and a ``global`` statement in one is seen by
    the others (as in the parent, and as with cloudpickle).
    """
    if "__builtins__" not in globals_:
        globals_["__builtins__"] = sys.modules["builtins"]
    closure = tuple(_Cell() for _ in range(ncells)) if ncells else None
    fn: FunctionType = _Function(code, globals_, name, None, closure)
    return fn


_FILLED: list[FunctionType] | None = None
"""While ``define`` unpickles: every function it rebuilt, in order."""


def fill_function(fn: FunctionType, state: tuple[Any, ...]) -> None:
    """Complete a skeleton: the state-setter of ``_func.pickling``'s reductions."""
    if _FILLED is not None:
        _FILLED.append(fn)
    names, defaults, kwdefaults, cells, attrs, submodules = state
    for module in submodules:
        # `import a.b` binds `a`; code that reaches `a.b` needs it loaded
        __import__(module, None, None, ("__name__",))
    fn.__globals__.update(names)
    fn.__defaults__ = defaults
    fn.__kwdefaults__ = kwdefaults
    if cells:
        assert fn.__closure__ is not None
        for cell, value in zip(fn.__closure__, cells, strict=True):
            if value:  # () stands for a cell that was empty in the parent
                cell.cell_contents = value[0]
    for attr, value in attrs.items():
        setattr(fn, attr, value)


def define(data: bytes | bytearray | memoryview) -> tuple[Any, Plan]:
    """Unpickle a function sent once to be called by id: (function, restore plan).

    The plan snapshots every function the pickle rebuilt (the function and
    the by-value functions it reaches) before any call can change them.
    """
    import _pickle

    global _FILLED
    outer, _FILLED = _FILLED, []
    try:
        fn = _pickle.loads(data)
        filled, _FILLED = _FILLED, outer
    except BaseException:
        _FILLED = outer
        raise
    groups: dict[int, tuple[dict[str, Any], dict[str, Any]]] = {}
    functions = []
    for f in filled:
        g = f.__globals__
        if id(g) not in groups:
            groups[id(g)] = (g, dict(g))
        cells = tuple(_contents(cell) for cell in f.__closure__ or ())
        kwdefaults = f.__kwdefaults__
        functions.append(
            (
                f,
                f.__defaults__,
                None if kwdefaults is None else dict(kwdefaults),
                cells,
                dict(f.__dict__),
                (f.__name__, f.__qualname__, f.__module__, f.__doc__, dict(f.__annotations__)),
            )
        )
    return fn, (tuple(groups.values()), tuple(functions))


def _contents(cell: CellType) -> tuple[Any, ...]:
    try:
        return (cell.cell_contents,)
    except ValueError:
        return ()


def restore(plan: Plan) -> None:
    """Put the functions of ``define`` back as they were defined (see the module doc).

    What a call can only replace is compared by identity and set only if it
    was; what it can change in place (the dicts) is replaced by a copy.
    """
    groups, functions = plan
    for g, contents in groups:
        g.clear()
        g.update(contents)
    for f, defaults, kwdefaults, cells, fdict, (name, qualname, module, doc, ann) in functions:
        if f.__defaults__ is not defaults:
            f.__defaults__ = defaults
        if kwdefaults is not None or f.__kwdefaults__ is not None:
            f.__kwdefaults__ = None if kwdefaults is None else dict(kwdefaults)
        if cells:
            assert f.__closure__ is not None
            for cell, value in zip(f.__closure__, cells, strict=True):
                if value:
                    cell.cell_contents = value[0]
                else:
                    try:
                        del cell.cell_contents
                    except ValueError:
                        pass  # still empty
        if fdict or f.__dict__:
            f.__dict__ = dict(fdict)
        if f.__name__ is not name:
            f.__name__ = name
        if f.__qualname__ is not qualname:
            f.__qualname__ = qualname
        if f.__module__ is not module:
            f.__module__ = module
        if f.__doc__ is not doc:
            f.__doc__ = doc
        if ann or f.__annotations__:
            f.__annotations__ = dict(ann)
