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
from collections.abc import Sequence
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
    "results",  # what a group reports; imports _errors only
    "errors",
    "logs",
    "sinks",
    "tail",
    "testing",
    "_limits",  # resource limits (cgroups, rlimits), usage, the process budget
    "_proc",  # one OS process: spawn, exit, channel, guardian, stop
    "rendezvous",  # c10d's agent runs the store as a child process of its own
    "_func",  # function workers, parent side
    "_group",  # what a group's ranks are made of: checks, outcomes, launcher, resources
    "_worker",  # persistent workers and pools
    "worker",
    "forkserver",
    "_supervisor",  # a group's crew: spec, launch, hold, exits, shutdown, supervisor
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
    """module -> the aioproc modules it imports.

    ``from pkg import name`` counts as an import of ``pkg.name`` where that is
    a module, else of ``pkg`` itself: a wing's module that imports its own
    package (``from .. import X``, ``from . import Y`` where ``Y`` is no
    module) depends on that package's face like any other importer.
    """
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        edges = set()
        for _, imported in imported_modules(path.read_text(), package):
            if not imported.startswith("aioproc"):
                continue
            while imported not in modules:  # ``from pkg import name``: the module is pkg
                imported = imported.rsplit(".", 1)[0]
            if imported != name:
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


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """The circles of ``graph``: its strongly connected components of more than one node."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(module: str) -> None:  # Tarjan's strongly connected components
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in sorted(graph[module]):
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

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(circles)


def test_no_import_circles() -> None:
    """Also inside a part: two modules that import each other are one room drawn as two."""
    assert strongly_connected(import_graph()) == []


MAX_FLOORS = 13


def floors(graph: dict[str, set[str]], order: Sequence[str]) -> dict[str, int]:
    """The floor of each node: 1 + the highest floor of what it imports (1 for none).

    ``order`` is a topological order of ``graph`` (bottom first).  Nodes that
    import nothing from each other share a floor, so the count of floors is
    the length of the longest chain of imports: what a reader climbs through
    to understand the top.
    """
    floor: dict[str, int] = {}
    for node in order:
        floor[node] = 1 + max((floor[t] for t in graph[node] if t in floor), default=0)
    return floor


def test_the_floors_are_few(capsys: pytest.CaptureFixture[str]) -> None:
    """Parts on one floor import only parts on the floors below; printed for the reader."""
    needs: dict[str, set[str]] = {part: set() for part in ORDER}
    for module, targets in import_graph().items():
        needs[_part(module)] |= {_part(t) for t in targets} - {_part(module)}
    floor = floors(needs, ORDER)  # ORDER is a topological order (test_every_import_goes_down)
    with capsys.disabled():
        print()
        for n in range(1, max(floor.values()) + 1):
            print(f"  floor {n:2}: {' '.join(p for p in ORDER if floor[p] == n)}")
        print(f"  {max(floor.values())} floors (at most {MAX_FLOORS})")
    assert max(floor.values()) <= MAX_FLOORS


def _wings() -> dict[str, list[str]]:
    """Every package of aioproc but the top one (private wings and public
    subpackages) -> its modules, its own face (``__init__``) first."""
    modules = _modules()
    wings: dict[str, list[str]] = {}
    for name, path in modules.items():
        if path.name == "__init__.py" and name != "aioproc":
            wings[name] = [name, *sorted(m for m in modules if m.rsplit(".", 1)[0] == name)]
    return wings


def topological(graph: dict[str, set[str]], nodes: Sequence[str]) -> list[str]:
    """``nodes`` ordered so that each comes after what it imports (``graph`` has no circle)."""
    order: list[str] = []
    seen: set[str] = set()

    def place(node: str) -> None:
        if node in seen:
            return
        seen.add(node)
        for target in sorted(graph[node]):
            place(target)
        order.append(node)

    for node in nodes:
        place(node)
    return order


def wing_report(graph: dict[str, set[str]]) -> dict[str, tuple[int, list[str], list[list[str]]]]:
    """Each wing's (floors, upward imports, circles), counted among its own modules.

    A wing's face (its ``__init__``) is its top floor: it may re-export the
    modules below it, and a module of the wing that imports it goes up.
    """
    report = {}
    for wing, members in _wings().items():
        inside = {m: graph[m] & set(members) for m in members}
        upward = sorted(f"{m} -> {wing}" for m in members[1:] if wing in inside[m])
        below = {m: targets - {wing} for m, targets in inside.items()}
        circles = strongly_connected(below)
        floor = floors(below, topological(below, members))
        report[wing] = (max(floor.values()), upward, circles)
    return report


def test_inside_every_wing_imports_go_down_and_never_round(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The rules of the house hold inside each wing too; its floors are printed."""
    report = wing_report(import_graph())
    with capsys.disabled():
        print()
        for wing, (count, up, circles) in sorted(report.items()):
            print(f"  {wing:28} {count} floors, {len(up)} upward, {len(circles)} circles")
    assert [u for _, up, _ in report.values() for u in up] == []
    assert [c for _, _, c in report.values() for c in c] == []


def test_a_wing_importing_its_own_face_is_seen() -> None:
    """``from .. import X`` and ``from . import Y`` (no module) inside a wing are
    edges to the package, which the checks above then see going up."""
    graph = {
        "aioproc.agent": {"aioproc.agent.local"},
        "aioproc.agent.local": {"aioproc.agent"},
    }
    wings = {"aioproc.agent": ["aioproc.agent", "aioproc.agent.local"]}
    names = [n for _, n in imported_modules("from . import WorkerSpec\n", "aioproc.agent")]
    assert names == ["aioproc.agent.WorkerSpec"]
    original = _wings
    try:
        globals()["_wings"] = lambda: wings
        report = wing_report(graph)
    finally:
        globals()["_wings"] = original
    assert report["aioproc.agent"][1] == ["aioproc.agent.local -> aioproc.agent"]
    assert strongly_connected(graph) == [["aioproc.agent", "aioproc.agent.local"]]


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


# ------------------------------------------------------- the group's face and crew

FACE = PACKAGE / "context.py"
CREW = PACKAGE / "_supervisor"
FACE_LINES, CLASS_LINES, CLASS_ATTRIBUTES, METHOD_LINES, FACE_IMPORTS = 450, 300, 20, 60, 10


def _self_attributes(cls: ast.ClassDef) -> set[str]:
    """The attributes a class's methods set on ``self`` (``self.x = ...``, ``as self.x``...)."""
    found = set()
    for node in ast.walk(cls):
        targets: list[ast.expr] = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        elif isinstance(node, ast.withitem) and node.optional_vars is not None:
            targets = [node.optional_vars]
        elif isinstance(node, ast.NamedExpr):
            targets = [node.target]
        for target in targets:
            for sub in ast.walk(target):
                if (
                    isinstance(sub, ast.Attribute)
                    and isinstance(sub.value, ast.Name)
                    and sub.value.id in ("self", "pc")
                ):
                    found.add(sub.attr)
    return found


def _reads(tree: ast.AST) -> set[str]:
    loads = (n for n in ast.walk(tree) if isinstance(n, ast.Attribute))
    return {n.attr for n in loads if isinstance(n.ctx, ast.Load)}


def shape_report() -> tuple[dict[str, int], list[str]]:
    """The face's and the crew's figures, and what breaks the rules (see the test)."""
    modules = [FACE, *sorted(CREW.glob("*.py"))]
    trees = {path: ast.parse(path.read_text()) for path in modules}
    everywhere: set[str] = set()
    for path in [*PACKAGE.rglob("*.py"), *PACKAGE.parent.joinpath("tests").glob("*.py")]:
        everywhere |= _reads(ast.parse(path.read_text()))
    face_imports = {n for _, n in imported_modules(FACE.read_text(), "aioproc")}
    figures = {
        "context.py lines": len(FACE.read_text().splitlines()),
        "context.py aioproc imports": len(
            {_module_of(n) for n in face_imports if n.startswith("aioproc")}
        ),
    }
    wrong: list[str] = []
    for path, tree in trees.items():
        local_reads = _reads(tree)
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
            attributes = _self_attributes(cls)
            where = f"{path.relative_to(PACKAGE.parent)}:{cls.name}"
            if cls.name == "PContext":
                figures["PContext lines"] = cls.end_lineno - cls.lineno + 1  # type: ignore[operator]
                figures["PContext attributes"] = len(attributes)
            for attr in sorted(attributes):
                if attr not in (local_reads if attr.startswith("_") else everywhere):
                    wrong.append(f"{where}.{attr} is written and never read")
            functions = (ast.FunctionDef, ast.AsyncFunctionDef)
            for fn in (n for n in cls.body if isinstance(n, functions)):
                length = fn.end_lineno - fn.lineno + 1  # type: ignore[operator]
                key = "longest method"
                figures[key] = max(figures.get(key, 0), length)
                if length > METHOD_LINES:
                    wrong.append(f"{where}.{fn.name} has {length} lines")
    return figures, wrong


def _module_of(name: str) -> str:
    modules = _modules()
    while name not in modules:
        name = name.rsplit(".", 1)[0]
    return name


def test_the_group_face_and_crew_stay_small(capsys: pytest.CaptureFixture[str]) -> None:
    """``PContext`` stays torch's face over the crew in ``_supervisor``: a short module
    importing a few others, a class of a few attributes, short methods there and in the
    crew, and no attribute that is written but never read; the figures are printed."""
    figures, wrong = shape_report()
    with capsys.disabled():
        print()
        for name, value in figures.items():
            print(f"  {name}: {value}")
    assert wrong == []
    assert figures["context.py lines"] <= FACE_LINES
    assert figures["context.py aioproc imports"] <= FACE_IMPORTS
    assert figures["PContext lines"] <= CLASS_LINES
    assert figures["PContext attributes"] <= CLASS_ATTRIBUTES


def test_the_shape_check_sees_an_attribute_nobody_reads() -> None:
    source = (
        "class C:\n"
        "    def __init__(self):\n"
        "        self._kept = 1\n        self._lost = 2\n"
        "        with open('x') as self._file:\n            pass\n"
        "    def use(self):\n        return self._kept\n"
    )
    (cls,) = ast.parse(source).body
    assert isinstance(cls, ast.ClassDef)
    assert _self_attributes(cls) == {"_kept", "_lost", "_file"}
    assert _reads(cls) == {"_kept"}
