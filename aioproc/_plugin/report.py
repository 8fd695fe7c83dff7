"""How a multi-rank test's failure reads in pytest's report.

The failure is the ranks' own tracebacks, not the parent's frames that ran
them; ``reprcrash`` gives pytest's one-line forms (``-ra``'s summary,
``--tb=line``) the root cause, named by rank.
"""

from __future__ import annotations

import pytest
from _pytest._code.code import ReprFileLocation, TerminalRepr
from _pytest._io import TerminalWriter


class RanksRepr(TerminalRepr):
    """The report of failed ranks: each rank's traceback, root cause first."""

    def __init__(self, text: str, summary: str, path: str, item: pytest.Item) -> None:
        self.text = text
        _, lineno, _ = item.reportinfo()
        self.reprcrash = ReprFileLocation(path, (lineno or 0) + 1, summary)

    def toterminal(self, tw: TerminalWriter) -> None:
        for line in self.text.splitlines():
            # rank headers and exception lines stand out, as pytest's "E" lines do
            red = bool(line) and not line[0].isspace() and not line.startswith("Traceback")
            tw.line(line, red=red, bold=red)
