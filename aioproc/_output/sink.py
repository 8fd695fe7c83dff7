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
    """Base class of every sink: override ``lines`` (and optionally the rest).

    The output readers call a sink on the event loop thread, in order, with
    whole lines (``lines`` or ``text``) and progress-bar states
    (``status``); the group calls ``aclose()`` when it is closed.  A sink
    that raises is isolated (logged once, never costing another sink, the
    log files or the verdict a line).

    A sink whose consumer can fall behind takes part in backpressure with
    public API only:

    * ``flow``: a ``Flow`` made in the sink's ``__init__``
      (``self.flow = Flow(self)``); the sink holds it while its buffer is
      full and releases it once drained, and the workers feeding it pause
      meanwhile (they block on their pipes).  ``None`` (the default): the
      sink never falls behind (it writes at once, or drops); anything that
      is not a ``Flow`` is ignored.
    * ``describe_pending()``: what the sink holds, for the warning that
      names a sink holding workers back too long.
    * ``drop_pending()``: drop what is still buffered once the sink's
      ``aclose()`` has used up the close deadline (``close_sinks``); returns
      the number of lines lost, counted in one warning.
    """

    flow: Flow | None = None
    """The sink's valve (see the class docstring); ``None``: no backpressure."""

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

    def describe_pending(self) -> str:
        """What the sink holds, said by the stall warning after the sink's ``repr``.

        For example ``"holds 1.0 MiB (900 lines) unread"``; the default says
        ``"holds lines it has not taken yet"``.
        """
        return "holds lines it has not taken yet"

    def drop_pending(self) -> int:
        """Drop what is still buffered; the number of lines lost (ever) not yet reported.

        Called once the close deadline has passed, after ``aclose()`` was
        cancelled; a sink with a ``flow`` releases it here.  The default
        (nothing buffered) returns 0.
        """
        return 0


def takes_text(sink: Sink) -> bool:
    """Whether ``sink`` is to get its lines through ``text`` (see ``Sink.text``)."""
    mro = type(sink).__mro__

    def owner(name: str) -> int:
        return next(i for i, c in enumerate(mro) if name in c.__dict__)

    i = owner("text")
    # a class attribute or property named text (a sink's own state) is no override
    return mro[i] is not Sink and callable(mro[i].__dict__["text"]) and i <= owner("lines")
