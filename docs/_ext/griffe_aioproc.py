"""A Griffe extension: aioproc's docstrings, rendered as their authors wrote them.

The docstrings follow the Google style that ``mkdocstrings`` reads, with a few
habits its parser does not know; left alone, those would render wrongly (or be
dropped with a warning, which fails ``mkdocs build --strict``).  Before a
docstring is parsed this rewrites, in its text only (the sources are untouched):

- ``Cancellation:`` opening a paragraph -> ``**Cancellation:**``, so every
  coroutine's cancellation contract stands out (the STYLE.md convention);
- reStructuredText leftovers: a paragraph ending in ``::`` ends in ``:`` (its
  indented block stays a code block), and roles such as ``:class:`X``` become
  plain code (``X``);
- ``Args:`` / ``Raises:`` items that share a description (``a, b: ...``, also
  when the names run over two lines) become one item per name, and a line of an
  item written at the item's own indent is read as the item's continuation;
- a ``Raises:`` section written as prose becomes a paragraph headed
  **Raises:**.

Anything else the parser warns about still fails the strict build.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:func|class|meth|attr|exc|mod|data|obj|const):`~?([^`]+)`")
_LONE_LITERAL = re.compile(r"^[ \t]*::[ \t]*$", re.M)
_LITERAL = re.compile(r"(\S)::[ \t]*$", re.M)
_CANCELLATION = re.compile(r"^([ \t]*)Cancellation:", re.M)
_SECTION = re.compile(r"^([ \t]*)(Args|Arguments|Parameters|Raises|Exceptions):[ \t]*$")
_NAMES = r"\*{0,2}[A-Za-z_][\w.]*(?:\s*,\s*\*{0,2}[A-Za-z_][\w.]*)*"
_ITEM = re.compile(rf"^({_NAMES})\s*(\([^)]*\))?\s*:(?:\s|$)(.*)$")
_NAME_LIST = re.compile(rf"^{_NAMES}\s*,\s*$")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _section_end(lines: list[str], start: int, title_indent: int) -> int:
    """Index after the last line of the section whose first content line is ``start``."""
    end = last = start
    while end < len(lines):
        line = lines[end]
        if line.strip():
            if _indent(line) <= title_indent:
                break
            last = end + 1
        end += 1
    return last


def _rewrite_section(title: str, title_indent: int, block: list[str]) -> list[str] | None:
    """The section's lines rewritten, or None to keep them."""
    content = [line for line in block if line.strip()]
    if not content:
        return None
    indent = _indent(content[0])
    first = content[0].strip()
    pad = " " * title_indent
    if not (_ITEM.match(first) or _NAME_LIST.match(first)):
        if title in ("Raises", "Exceptions"):  # prose: a paragraph
            return [f"{pad}**{title}:** " + " ".join(line.strip() for line in content)]
        return None
    items: list[tuple[str, list[str]]] = []  # (head line, continuation lines)
    for line in block:
        text = line.strip()
        if not text:
            if items:
                items[-1][1].append("")
            continue
        if _indent(line) > indent:
            items[-1][1].append(line)
        elif items and not items[-1][1] and _NAME_LIST.match(items[-1][0]):
            items[-1] = (f"{items[-1][0]} {text}", [])  # the list of names goes on
        elif _ITEM.match(text) or _NAME_LIST.match(text):
            items.append((text, []))
        else:  # written at the item's indent, yet part of the item
            items[-1][1].append(" " * (2 * indent) + text)
    out: list[str] = []
    for head, rest in items:
        match = _ITEM.match(head)
        if match is None:
            return None  # a list of names that never reached its colon
        names, kind, desc = match.groups()
        for name in re.split(r"\s*,\s*", names):
            typed = f"{name} {kind}" if kind else name
            out.append(f"{' ' * indent}{typed}: {desc.strip()}".rstrip())
            out.extend(rest)
    return out


def normalise(text: str) -> str:
    """The docstring ``text`` as the Google parser should read it (see the module doc)."""
    text = _ROLE.sub(r"``\1``", text)
    text = _LONE_LITERAL.sub("", text)
    text = _LITERAL.sub(r"\1:", text)
    text = _CANCELLATION.sub(r"\1**Cancellation:**", text)
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        match = _SECTION.match(lines[i])
        if match is None:
            out.append(lines[i])
            i += 1
            continue
        title_indent = len(match.group(1))
        end = _section_end(lines, i + 1, title_indent)
        rewritten = _rewrite_section(match.group(2), title_indent, lines[i + 1 : end])
        if rewritten is None:
            out.extend(lines[i:end])
        elif rewritten[0].lstrip().startswith("**"):
            out.extend(rewritten)  # the prose paragraph replaces the title too
        else:
            out.append(lines[i])
            out.extend(rewritten)
        i = end
    return "\n".join(out)


class AioprocDocstrings(griffe.Extension):
    """Applies :func:`normalise` to every docstring griffe loads."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = normalise(obj.docstring.value)
