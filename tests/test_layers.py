"""The house's walls, checked on the source: every import goes down, and none goes round.

Private modules live in wings (``_child``, ``_base``, ``_proc``, ...), each
a folder of at most eight modules; ``ORDER`` lists every wing and public
module bottom to top, and each may import only what comes before it.
``_child`` holds everything that runs inside a worker or the warm-start
template: a worker's start must not pay for asyncio, anyio or the
supervisor's modules, and the template must stay safe to fork, so it
imports the standard library and ``_child`` only, with two exceptions:
``cloudpickle``, imported only to load a value pickled by it, and ``uvloop``,
imported by ``_child.aio`` only, in a worker that asked for uvloop's loop.
Every import counts: module-level, function-level and ``TYPE_CHECKING`` ones.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "aioproc"
CHILD = PACKAGE / "_child"
ALLOWED_THIRD_PARTY = {"cloudpickle"}
ALLOWED_IN = {"aio.py": {"uvloop"}}
"""Third-party modules one ``_child`` module (and no other) may import."""


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
        if not _allowed_in_child(name) and name not in ALLOWED_IN.get(path.name, ())
    ]
    assert wrong == [], "imports outside the standard library and _child:\n" + "\n".join(wrong)


# Every part of the package, bottom to top: a private wing (folder), a public
# subpackage, or a public module.  Each may import only the parts before it.
ORDER = (
    "_child",  # inside workers: the standard library only
    "_base",  # loop helpers, shielding, the helper thread, generic checks
    "_errors",  # failures and @record, standard library only
    "_metrics",  # the recorder's hooks (all the launcher imports) and the exporters
    "metrics",
    "signals",
    "timer",
    "redirects",
    "_output",  # pipe bytes -> lines -> sinks
    "errors",
    "results",
    "logs",
    "sinks",
    "tail",
    "testing",
    "_limits",  # resource limits (cgroups, rlimits), usage, the process budget
    "_proc",  # one OS process: spawn, exit, channel, guardian, stop
    "rendezvous",  # c10d's agent runs the store as a child process of its own
    "_func",  # function workers, parent side
    "_group",  # what a PContext is made of
    "_worker",  # persistent workers and pools
    "worker",
    "forkserver",
    "context",
    "runner",
    "agent",
    "_cli",
    "cli",
    "__main__",
    "_launch",  # torch's launch API: LaunchConfig and torchrun's flags, run by the agent
    "launcher",
    "torchrun",
    "_cluster",
    "cluster",
    "pool",
    "_plugin",
    "pytest_plugin",
    "aioproc",  # the package itself: lazy re-exports of everything
)
# The version string is a literal in the package's ``__init__``: importing it
# loads nothing, so the CLI may name it.
CONSTANTS = {"aioproc.__version__"}


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if path.name == "__init__.py" else parts)] = path
    return found


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "aioproc"


def import_graph() -> dict[str, set[str]]:
    """module -> the aioproc modules it imports (a package's own parents left out)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        edges = set()
        for _, imported in imported_modules(path.read_text(), package):
            if not imported.startswith("aioproc") or imported in CONSTANTS:
                continue
            while imported not in modules:  # ``from pkg import name``: the module is pkg
                imported = imported.rsplit(".", 1)[0]
            if imported != name and not name.startswith(imported + "."):
                edges.add(imported)
        graph[name] = edges
    return graph


def test_every_part_of_the_package_has_its_floor() -> None:
    parts = {_part(m) for m in _modules()}
    assert parts == set(ORDER), f"not in ORDER: {parts - set(ORDER)}, gone: {set(ORDER) - parts}"


def test_every_import_goes_down() -> None:
    rank = {part: i for i, part in enumerate(ORDER)}
    upward = [
        f"{module} -> {target}"
        for module, targets in import_graph().items()
        for target in targets
        if rank[_part(target)] > rank[_part(module)]
    ]
    assert upward == [], "imports going up:\n" + "\n".join(sorted(upward))


def test_no_import_circles() -> None:
    """Also inside a part: two modules that import each other are one room drawn as two."""
    graph = import_graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(module: str) -> None:  # Tarjan's strongly connected components
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in graph[module]:
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for module in graph:
        if module not in index:
            visit(module)
    assert circles == []


def test_the_layers_are_few(capsys: pytest.CaptureFixture[str]) -> None:
    """Parts on one layer import only parts on the layers below; printed for the reader."""
    graph = import_graph()
    needs: dict[str, set[str]] = {part: set() for part in ORDER}
    for module, targets in graph.items():
        needs[_part(module)] |= {_part(t) for t in targets} - {_part(module)}
    layer: dict[str, int] = {}
    for part in ORDER:  # ORDER is a topological order (the test above)
        layer[part] = 1 + max((layer[p] for p in needs[part]), default=0)
    with capsys.disabled():
        print()
        for n in range(1, max(layer.values()) + 1):
            print(f"  layer {n:2}: {' '.join(p for p in ORDER if layer[p] == n)}")
    assert max(layer.values()) <= 12


def private_names_from_faces(source: str, package: str, modules: set[str]) -> list[str]:
    """The private names ``source`` imports from a public module (not its private submodules)."""
    found = []
    for line, imported in imported_modules(source, package):
        face, _, name = imported.rpartition(".")
        public = not any(part.startswith("_") for part in face.split(".")[1:])
        private = name.startswith("_") and not name.startswith("__")
        if face in modules and public and private and imported not in modules:
            found.append(f"{line}: {imported}")
    return found


def test_no_private_name_is_imported_from_a_public_module() -> None:
    """A public module is a face: what another module needs of it lives in a wing."""
    modules = _modules()
    wrong = [
        f"{name}:{found}"
        for name, path in modules.items()
        for found in private_names_from_faces(
            path.read_text(),
            name if path.name == "__init__.py" else name.rsplit(".", 1)[0],
            set(modules),
        )
    ]
    assert wrong == [], "private names imported from public modules:\n" + "\n".join(wrong)
    # the check sees the offence where it hides: relative, function-level, aliased
    source = "def f():\n    from ..worker import _start as start, WorkerProcess\n"
    assert private_names_from_faces(source, "aioproc._worker", set(modules)) == [
        "2: aioproc.worker._start"
    ]
    allowed = "from ..agent import _workers\nfrom .. import __version__\n"
    assert private_names_from_faces(allowed, "aioproc._cli", set(modules)) == []


def test_private_modules_live_in_wings_of_at_most_eight() -> None:
    top_level = sorted(p.name for p in PACKAGE.glob("_*.py") if not p.name.startswith("__"))
    assert top_level == []
    crowded = {
        folder.name: len(modules)
        for folder in PACKAGE.iterdir()
        if folder.is_dir()
        and folder.name.startswith("_")
        and len(modules := [p for p in folder.glob("*.py") if p.name != "__init__.py"]) > 8
    }
    assert crowded == {}


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


PUBLIC_MODULES = (
    "aioproc",
    "aioproc.agent",
    "aioproc.cli",
    "aioproc.cluster",
    "aioproc.context",
    "aioproc.errors",
    "aioproc.forkserver",
    "aioproc.logs",
    "aioproc.pool",
    "aioproc.redirects",
    "aioproc.rendezvous",
    "aioproc.results",
    "aioproc.runner",
    "aioproc.signals",
    "aioproc.sinks",
    "aioproc.tail",
    "aioproc.testing",
    "aioproc.timer",
    "aioproc.worker",
)


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_public_names_carry_a_public_module(module: str) -> None:
    """A class or function users import from ``module`` never names a wing in its repr or pickle."""
    import importlib
    import inspect

    mod = importlib.import_module(module)
    private = [
        f"{name}: {value.__module__}"
        for name in mod.__all__
        if (inspect.isclass(value := getattr(mod, name)) or inspect.isfunction(value))
        and any(part.startswith("_") for part in value.__module__.split(".")[1:])
    ]
    assert private == []
