"""The house's walls, checked on the source: the wings at the bottom import nothing above them.

``aioproc/_child/`` holds everything that runs inside a worker or the
warm-start template.  A worker's start must not pay for asyncio, anyio or
the supervisor's modules, and the template must stay safe to fork, so these
modules import the standard library and ``_child`` only, with one
exception: ``cloudpickle``, imported only to load a value pickled by it.
``aioproc/_base/`` (loop helpers, shielding, the helper thread) imports no
other part of aioproc, and ``aioproc/_output/`` (pipe bytes -> lines ->
sinks) only ``_base`` and ``_child``.  Every import counts: module-level, function-level
and ``TYPE_CHECKING`` ones.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "aioproc"
CHILD = PACKAGE / "_child"
ALLOWED_THIRD_PARTY = {"cloudpickle"}


def imported_modules(source: str, package: str) -> list[tuple[int, str]]:
    """Every module ``source`` (a module of ``package``) imports, with its line.

    Relative imports are resolved against ``package``; ``from pkg import x``
    counts as ``pkg.x``, since ``x`` may be a submodule.
    """
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                parts = package.split(".")
                base = parts[: len(parts) - node.level + 1]
                module = ".".join([*base, *([module] if module else [])])
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
    return found


def _allowed_in_child(name: str) -> bool:
    if name.startswith("aioproc."):
        return name.startswith("aioproc._child.")
    top = name.split(".")[0]
    return top in sys.stdlib_module_names or top in ALLOWED_THIRD_PARTY


@pytest.mark.parametrize("path", sorted(CHILD.glob("*.py")), ids=lambda p: p.name)
def test_child_modules_import_only_the_standard_library_and_child(path: Path) -> None:
    wrong = [
        f"{path.name}:{line}: {name}"
        for line, name in imported_modules(path.read_text(), "aioproc._child")
        if not _allowed_in_child(name)
    ]
    assert wrong == [], "imports outside the standard library and _child:\n" + "\n".join(wrong)


# each wing above _child, and the parts of aioproc it may import (itself included)
WINGS = {
    "_base": ("_base",),
    "_output": ("_output", "_base", "_child"),
}


@pytest.mark.parametrize(
    "path",
    sorted(p for wing in WINGS for p in (PACKAGE / wing).glob("*.py")),
    ids=lambda p: f"{p.parent.name}/{p.name}",
)
def test_wings_import_only_the_wings_below_them(path: Path) -> None:
    wing = path.parent.name
    below = tuple(f"aioproc.{w}." for w in WINGS[wing])
    wrong = [
        f"{wing}/{path.name}:{line}: {name}"
        for line, name in imported_modules(path.read_text(), f"aioproc.{wing}")
        if name.startswith("aioproc.") and not name.startswith(below)
    ]
    assert wrong == [], f"{wing} imports from above it:\n" + "\n".join(wrong)


def test_the_check_sees_function_level_and_type_checking_imports() -> None:
    """The walk finds the imports a careless edit would add where they are least visible."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from ..context import PContext\n"
        "def f():\n    import anyio\n    from . import channel\n"
    )
    names = [name for _, name in imported_modules(source, "aioproc._child")]
    assert names == [
        "typing.TYPE_CHECKING",
        "aioproc.context.PContext",
        "anyio",
        "aioproc._child.channel",
    ]
    assert [_allowed_in_child(n) for n in names] == [True, False, False, True]
