"""Every code block in README.md runs as written, and every link in it resolves.

A ```python block is either a complete program, run here in a fresh
interpreter in an empty directory (its output checked against
``EXPECTED``, keyed by the block's section), or it follows a line
"Excerpt of [`examples/x.py`](...)", and then its text must appear in that
file, which runs here too.  The Quick start commands run as well (all but
``pip install``).  Every run gets a private ``TMPDIR`` inside a temp dir
that is removed afterwards, and must leave that ``TMPDIR`` empty.  The
examples of the documentation pages (docs/) run in ``test_docs``, with the
excerpts they quote from ``examples/``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import REPO_ROOT

README = Path(REPO_ROOT) / "README.md"

EXPECTED: dict[str, list[str]] = {
    # section heading -> regexes that stdout lines must match, in order
    "Example": [
        r"\{0: 0\.1038, 1: 0\.1038, 2: 0\.1038, 3: 0\.1038\}",
        r"\[trainer[01]\]:h[io]",
        r"\[trainer[01]\]:h[io]",
        r"False \{0: 'hi\\n', 1: 'ho\\n'\}",
    ],
}

EXAMPLE_OUTPUT: dict[str, list[str]] = {
    # examples/<name> -> regexes its stdout lines must match, in order
    "agent.py": [r"event: group_succeeded local_rank=None", r"agent finished: SUCCEEDED"],
    "pytest_plugin.py": [r"\.{6} +\[100%\]", r"6 passed in [\d.]+s"],
    "quickstart.py": [
        *[r"function worker [0-3]: \{'rank': [0-3], 'pid': \d+, 'square': (1|4|9|16)\}"] * 4,
        r"binary worker 0: exit ok, stdout\.log = 'hello from binary worker 0'",
        r"binary worker 1: exit ok, stdout\.log = 'hello from binary worker 1'",
        r"root cause: local rank [01] exited 1: ValueError\(\"invalid literal for int\(\) .*",
    ],
}

EXCERPT = re.compile(r"^Excerpt of \[`(examples/[\w-]+\.py)`\]")


@dataclass
class Block:
    section: str
    code: str
    excerpt_of: str | None  # the examples/ file, for an excerpt


def readme_blocks(lang: str) -> list[Block]:
    blocks: list[Block] = []
    section = ""
    lines = README.read_text().splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("## "):
            section = line[3:].strip()
        if line.strip() == f"```{lang}":
            end = lines.index("```", i + 1)
            before = [x for x in lines[:i] if x.strip()][-1]
            match = EXCERPT.match(before)
            code = "\n".join(lines[i + 1 : end]) + "\n"
            blocks.append(Block(section, code, match.group(1) if match else None))
            i = end
        i += 1
    return blocks


@pytest.fixture
def sandbox() -> Iterator[tuple[Path, dict[str, str]]]:
    """An empty working dir, and an environment whose TMPDIR is private.

    Both live in one temp dir, removed afterwards: runs that keep their logs
    in a temp dir (``aioproc run`` without ``--log-dir``, as torchrun does)
    leave nothing in the real ``$TMPDIR`` either.
    """
    with tempfile.TemporaryDirectory(prefix="aioproc-readme-") as top:
        work, tmp = Path(top) / "work", Path(top) / "tmp"
        work.mkdir()
        tmp.mkdir()
        env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": REPO_ROOT}
        env.pop("AIOPROC_LIFELINE", None)
        yield work, env


def run(argv: list[str], cwd: Path, env: dict[str, str]) -> list[str]:
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout.splitlines()


def assert_lines_match(lines: list[str], patterns: list[str]) -> None:
    """Each pattern matches a whole line, in order (other lines may come between)."""
    it = iter(lines)
    for pattern in patterns:
        assert any(re.fullmatch(pattern, line) for line in it), (pattern, lines)


def test_every_python_block_is_complete_or_an_excerpt_and_has_a_check() -> None:
    blocks = readme_blocks("python")
    complete = [b.section for b in blocks if b.excerpt_of is None]
    assert sorted(complete) == sorted(EXPECTED), "a complete block needs its EXPECTED output"
    for b in blocks:
        if b.excerpt_of is not None:
            assert Path(b.excerpt_of).name in EXAMPLE_OUTPUT, b.excerpt_of


@pytest.mark.parametrize("section", sorted(EXPECTED))
def test_complete_block_runs_as_written(section: str, sandbox: tuple[Path, dict[str, str]]) -> None:
    work, env = sandbox
    (block,) = [b for b in readme_blocks("python") if b.section == section and not b.excerpt_of]
    script = work.parent / "block.py"
    script.write_text(block.code)
    assert_lines_match(run([sys.executable, str(script)], work, env), EXPECTED[section])
    assert os.listdir(env["TMPDIR"]) == []  # the README's examples keep their logs in ./logs


def test_excerpts_appear_in_their_example_files() -> None:
    for b in readme_blocks("python"):
        if b.excerpt_of is not None:
            source = (Path(REPO_ROOT) / b.excerpt_of).read_text()
            assert b.code in source, f"the README excerpt of {b.excerpt_of} is not in that file"


def anchors(page: Path) -> set[str]:
    """The ids of a Markdown page's headings, as GitHub and mkdocs' toc make them."""
    ids = set()
    for line in page.read_text().splitlines():
        if match := re.match(r"#{1,6} (.+)", line):
            text = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower())
            ids.add(text.replace(" ", "-"))
    return ids


def test_every_link_resolves() -> None:
    """Relative links name a file of the repository and, with ``#``, one of its headings."""
    links = re.findall(r"\]\(([^)\s]+)\)", README.read_text())
    assert links
    for link in links:
        if link.startswith(("https://", "http://")):
            continue
        path, _, anchor = link.partition("#")
        target = (README.parent / path) if path else README
        assert target.exists(), f"the README links to {link}, which is not in the repository"
        if anchor:
            assert anchor in anchors(target), f"the README links to {link}: no such heading"


def test_landing_page_is_short() -> None:
    assert len(README.read_text().splitlines()) < 250


@pytest.mark.parametrize("name", sorted(EXAMPLE_OUTPUT))
def test_example_runs(name: str, sandbox: tuple[Path, dict[str, str]]) -> None:
    work, env = sandbox
    path = Path(REPO_ROOT) / "examples" / name
    assert_lines_match(run([sys.executable, str(path)], work, env), EXAMPLE_OUTPUT[name])


def test_quick_start_commands_run(sandbox: tuple[Path, dict[str, str]]) -> None:
    """The ``aioproc run`` line runs as written (``-m aioproc`` for the script pip installs)."""
    _, env = sandbox
    (block,) = readme_blocks("sh")
    commands = [c.strip() for line in block.code.splitlines() for c in line.split("&&")]
    assert commands == [
        "pip install .",
        "aioproc run --nproc-per-node 4 --tee 3 examples/train.py",
        "pip install '.[test]'",
        "python -m pytest",
    ]
    pyproject = (Path(REPO_ROOT) / "pyproject.toml").read_text()
    assert 'aioproc = "aioproc.cli:main"' in pyproject  # the script pip install makes
    assert re.search(r"^test = \[", pyproject, re.M)  # the [test] extra
    argv = [sys.executable, "-m", *commands[1].split()]
    lines = run(argv, Path(REPO_ROOT), env)
    done = sorted(line for line in lines if " done: " in line)
    assert done == [f"[default{r}]:rank {r} done: final loss 0.1216" for r in range(4)], lines
