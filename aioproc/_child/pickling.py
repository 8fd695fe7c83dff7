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
"""

from __future__ import annotations

import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from types import CellType, FunctionType
    from typing import Any


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


def fill_function(fn: FunctionType, state: tuple[Any, ...]) -> None:
    """Complete a skeleton: the state-setter of ``_func.pickling``'s reductions."""
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
