"""What a sink is: the base class every sink derives from, and the line it may receive.

Defined here, below the tee that feeds sinks, and re-exported (and named)
by ``aioproc.sinks``, where users find them.
"""

from __future__ import annotations

from typing import NamedTuple

from .flow import Flow

__all__ = ["OutputLine", "Sink"]


class OutputLine(NamedTuple):
    """One line a worker wrote (without its newline)."""

    rank: int
    stream: str  # "stdout" or "stderr"
    line: str
    prefix: str

    def render(self) -> str:
        return f"{self.prefix}{self.line}"


class Sink:
    """Base class: override ``lines`` (and optionally ``status``, ``aclose``)."""

    # the flow readers watch to pause while this sink's buffer is full (None: no buffer)
    _backpressure: Flow | None = None

    def lines(self, rank: int, stream: str, prefix: str, lines: list[str]) -> None:
        """Receive complete lines of one worker stream, in order."""
        raise NotImplementedError

    def status(self, rank: int, stream: str, prefix: str, text: str | None) -> None:
        """The current state of a progress bar; ``None`` when the stream ended."""

    async def aclose(self) -> None:
        """Flush and release resources; called when the group is closed."""

    def _drop_pending(self) -> int:
        """Drop what is still buffered; the number of lines lost (ever) not yet reported."""
        return 0
