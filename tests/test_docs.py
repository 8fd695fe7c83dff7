"""The documentation site (docs/): its examples run, its API reference is complete.

mkdocs builds the site (``.ci/run`` builds it with ``--strict``, which fails on
a broken link, anchor or reference); this test needs no mkdocs.

A ```python block of a page whose previous non-blank line is ``<!-- run -->``
is a complete program: it runs in a fresh interpreter, in the sandbox of
``test_readme`` (an empty working dir, a private ``TMPDIR`` that must be left
empty), and when the next block is a ```text block after ``<!-- output -->``,
its stdout must be exactly those lines (after ``<!-- output: any order -->``,
the same lines in any order, for workers whose lines interleave).  A block
after ``<!-- run: pytest -->`` is a test module, run by pytest in
pytest-asyncio's strict mode: every test in it must pass.  A block after a
line "Excerpt of `examples/x.py`" must appear in that file, which
``test_readme`` runs.  Other blocks are excerpts and are not run.

The reference pages (``docs/reference/``) document objects with
mkdocstrings' ``::: identifier`` lines; every name in the ``__all__`` of the
public modules must be one of them, or the same object under another name.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import test_readme as readme
from helpers import REPO_ROOT

DOCS = Path(REPO_ROOT) / "docs"

PUBLIC_MODULES = (
    "aioproc",
    "aioproc.cluster",
    "aioproc.agent",
    "aioproc.rendezvous",
    "aioproc.launcher",
    "aioproc.torchrun",
    "aioproc.errors",
    "aioproc.testing",
    "aioproc.timer",
    "aioproc.redirects",
    "aioproc.metrics",
)

# an empty working dir and a private TMPDIR, removed afterwards (test_readme's)
sandbox = readme.sandbox

FENCE = re.compile(r"^```(\w*)")
DIRECTIVE = re.compile(r"^::: ([\w.]+)\s*$", re.M)


@dataclass
class Block:
    where: str  # page:line, for the test id
    kind: str  # "python" (a program) or "pytest" (a test module)
    code: str
    output: list[str] | None  # the stdout expected, line by line
    any_order: bool  # the output's lines may come in any order


def runnable_blocks() -> list[Block]:
    blocks: list[Block] = []
    for page in sorted(DOCS.rglob("*.md")):
        lines = page.read_text().splitlines()
        fences = []  # (start line, language, code, previous non-blank line)
        i = 0
        while i < len(lines):
            match = FENCE.match(lines[i])
            if match:
                end = lines.index("```", i + 1)
                before = next((x.strip() for x in reversed(lines[:i]) if x.strip()), "")
                fences.append((i, match.group(1), "\n".join(lines[i + 1 : end]) + "\n", before))
                i = end
            i += 1
        for n, (start, lang, code, before) in enumerate(fences):
            if before not in ("<!-- run -->", "<!-- run: pytest -->"):
                continue
            assert lang == "python", f"{page.name}:{start + 1}: only python blocks run"
            output = None
            marker = fences[n + 1][3] if n + 1 < len(fences) else ""
            if marker in ("<!-- output -->", "<!-- output: any order -->"):
                assert fences[n + 1][1] == "text", f"{page.name}: an output block is ```text"
                output = fences[n + 1][2].splitlines()
            kind = "pytest" if before == "<!-- run: pytest -->" else "python"
            where = f"{page.relative_to(DOCS)}:{start + 1}"
            any_order = marker == "<!-- output: any order -->"
            blocks.append(Block(where, kind, code, output, any_order))
    return blocks


BLOCKS = runnable_blocks()


def test_some_blocks_run() -> None:
    assert len(BLOCKS) >= 3, "the markers <!-- run --> went missing"


@pytest.mark.parametrize("block", BLOCKS, ids=[b.where for b in BLOCKS])
def test_block_runs_as_written(block: Block, sandbox: tuple[Path, dict[str, str]]) -> None:
    work, env = sandbox
    if block.kind == "pytest":
        (work / "test_example.py").write_text(block.code)
        argv = [sys.executable, "-m", "pytest", "test_example.py", "-q", "-p", "no:cacheprovider"]
        argv += ["-p", "asyncio", "-p", "aioproc.pytest_plugin", "-c", os.devnull]
        argv += ["-o", "asyncio_mode=strict", "-o", "asyncio_default_fixture_loop_scope=function"]
        # pytest's own tmp_path dirs stay out of the TMPDIR checked below
        argv += ["--basetemp", str(work / "pytest-tmp")]
        if pytest.version_tuple >= (8, 4):
            # only the two plugins it needs (-p finds them by entry point name): seconds faster
            env = {**env, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
        lines = readme.run(argv, work, env)
        tests = len(re.findall(r"^(?:async )?def test_", block.code, re.M))
        assert re.match(rf"{tests} passed\b", lines[-1]), lines
    else:
        script = work.parent / "block.py"
        script.write_text(block.code)
        lines = readme.run([sys.executable, str(script)], work, env)
        if block.output is not None and block.any_order:
            assert sorted(lines) == sorted(block.output)
        elif block.output is not None:
            assert lines == block.output
    assert os.listdir(env["TMPDIR"]) == []


EXCERPT = re.compile(r"^Excerpt of `(examples/[\w-]+\.py)`")


def excerpts() -> list[tuple[str, str, str]]:
    """(page, example file, code) of every block quoted from ``examples/``."""
    found = []
    for page in sorted(DOCS.rglob("*.md")):
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.startswith("```") and line != "```":
                before = next((x.strip() for x in reversed(lines[:i]) if x.strip()), "")
                if match := EXCERPT.match(before):
                    end = lines.index("```", i + 1)
                    found.append((page.name, match.group(1), "\n".join(lines[i + 1 : end]) + "\n"))
    return found


def test_excerpts_appear_in_their_example_files() -> None:
    found = excerpts()
    assert found, "the excerpts of examples/ went missing"
    for page, example, code in found:
        assert example.rsplit("/", 1)[-1] in readme.EXAMPLE_OUTPUT, example  # it runs
        source = (Path(REPO_ROOT) / example).read_text()
        assert code in source, f"{page}: the excerpt of {example} is not in that file"


def documented() -> dict[str, Any]:
    """Every ``::: identifier`` of the reference pages, resolved to its object."""
    objects: dict[str, Any] = {}
    for page in sorted((DOCS / "reference").glob("*.md")):
        for ident in DIRECTIVE.findall(page.read_text()):
            parts = ident.split(".")
            for cut in range(len(parts), 0, -1):
                try:
                    obj: Any = importlib.import_module(".".join(parts[:cut]))
                except ImportError:
                    continue
                for attr in parts[cut:]:
                    obj = getattr(obj, attr)  # AttributeError: a name that is gone
                objects[ident] = obj
                break
            else:
                raise AssertionError(f"{page.name}: ::: {ident} names no module")
    return objects


def test_reference_documents_every_public_name() -> None:
    docs = documented()
    same_objects = [o for o in docs.values() if inspect.isclass(o) or callable(o)]
    missing = []
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            ident = f"{module_name}.{name}"
            value = getattr(module, name)
            shown = ident in docs or (
                (inspect.isclass(value) or callable(value))
                and any(o is value for o in same_objects)
            )
            if not shown:
                missing.append(ident)
    assert not missing, f"add a ::: line to a page of docs/reference/ for {missing}"


def test_cancellation_paragraphs_are_written_one_way() -> None:
    """Docstrings open the paragraph with ``Cancellation:``; the docs extension bolds it.

    A paragraph written ``**Cancellation:**`` in the source renders the same, so
    nothing else would catch the second dialect coming back.
    """
    package = Path(REPO_ROOT) / "aioproc"
    bold = [
        f"{path.relative_to(REPO_ROOT)}:{number}"
        for path in sorted(package.rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if "**Cancellation:**" in line
    ]
    assert bold == []
