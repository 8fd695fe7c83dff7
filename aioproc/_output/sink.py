"""What a sink is: the base class every sink derives from, and the line it may receive.

Defined here, below the tee that feeds sinks, and re-exported (and named)
by ``aioproc.sinks``, where users find them.
"""

from __future__ import annotations

from typing import NamedTuple

from .flow import Flow

__all__ = ["OutputLine", "Sink", "takes_text"]


class OutputLine(NamedTuple):
    """One line a worker wrote (without its newline)."""

    rank: int
    stream: str  # "stdout" or "stderr"
    line: str
    prefix: str

    def render(self) -> str:
        return f"{self.prefix}{self.line}"


class Sink:
    """Base class: override ``lines`` (and optionally ``text``, ``status``, ``aclose``)."""

    # the flow readers watch to pause while this sink's buffer is full (None: no buffer)
    _backpressure: Flow | None = None

    def lines(self, rank: int, stream: str, prefix: str, lines: list[str]) -> None:
        """Receive complete lines of one worker stream, in order."""
        raise NotImplementedError

    def text(self, rank: int, stream: str, prefix: str, text: str) -> None:
        """Receive complete lines of one worker stream as one text: ``"\\n".join(lines)``.

        A sink that works on text rather than on single lines (a console,
        a file) overrides this to skip making one object per line; the
        default splits ``text`` and calls ``lines``.  Output goes to
        ``text`` only where the class that defines it is the class that
        defines ``lines`` or one derived from it, so a subclass that
        overrides only ``lines`` still gets every line through ``lines``.
        """
        self.lines(rank, stream, prefix, text.split("\n"))

    def status(self, rank: int, stream: str, prefix: str, text: str | None) -> None:
        """The current state of a progress bar; ``None`` when the stream ended."""

    async def aclose(self) -> None:
        """Flush and release resources; called when the group is closed."""

    def _drop_pending(self) -> int:
        """Drop what is still buffered; the number of lines lost (ever) not yet reported."""
        return 0


def takes_text(sink: Sink) -> bool:
    """Whether ``sink`` is to get its lines through ``text`` (see ``Sink.text``)."""
    mro = type(sink).__mro__

    def owner(name: str) -> int:
        return next(i for i, c in enumerate(mro) if name in c.__dict__)

    i = owner("text")
    # a class attribute or property named text (a sink's own state) is no override
    return mro[i] is not Sink and callable(mro[i].__dict__["text"]) and i <= owner("lines")
