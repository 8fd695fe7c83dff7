"""``RestartPolicy``: when and how fast a failed group is restarted.

Used by the agent and by the cluster runner's ``auto_restart``; exported as
``aioproc.agent.RestartPolicy`` (and ``aioproc.RestartPolicy``).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from .._base.checks import check_duration


@dataclass(frozen=True)
class RestartPolicy:
    """When and how fast a failed group is restarted.

    The delay before restart ``n`` (0-based, counted since the last reset) is
    ``min(max_delay, initial_delay * factor**n)``, scaled by a random factor
    in ``[1 - jitter, 1 + jitter]`` so that many agents do not restart in
    lockstep.

    Attributes:
        expected_exit_codes: exit codes of the root-cause worker that end the
            run without a restart, as success (supervisord's ``exitcodes``).
            0 is always a success.
        initial_delay: seconds before the first restart.
        factor: growth of the delay per consecutive restart.
        max_delay: cap on the delay.
        jitter: relative random spread of each delay, in [0, 1].
        reset_after: an attempt that stayed up at least this many seconds
            counts as healthy: the delay starts again from ``initial_delay``
            and the full ``max_restarts`` budget is available again.
            ``None`` never resets (torchrun's behaviour).
    """

    expected_exit_codes: frozenset[int] = frozenset()
    initial_delay: float = 0.0
    factor: float = 2.0
    max_delay: float = 60.0
    jitter: float = 0.0
    reset_after: float | None = None

    def __post_init__(self) -> None:
        for name in ("initial_delay", "max_delay"):
            check_duration(f"RestartPolicy.{name}", getattr(self, name))
        # NaN passes "< 1" and "<= 0" checks, so each asks for a finite number first
        if (
            isinstance(self.factor, bool)
            or not isinstance(self.factor, (int, float))
            or not math.isfinite(self.factor)
            or self.factor < 1
        ):
            raise ValueError(f"RestartPolicy.factor must be >= 1 and finite, got {self.factor!r}")
        if (
            isinstance(self.jitter, bool)
            or not isinstance(self.jitter, (int, float))
            or not 0 <= self.jitter <= 1
        ):
            raise ValueError(f"RestartPolicy.jitter must be in [0, 1], got {self.jitter!r}")
        reset_after = check_duration("RestartPolicy.reset_after", self.reset_after, allow_none=True)
        if reset_after is not None and reset_after <= 0:
            raise ValueError(f"RestartPolicy.reset_after must be > 0, got {self.reset_after!r}")
        object.__setattr__(self, "expected_exit_codes", frozenset(self.expected_exit_codes))

    def delay(self, n: int, rng: Callable[[float, float], float] = random.uniform) -> float:
        """Seconds to wait before the ``n``-th consecutive restart (0-based)."""
        base = min(self.max_delay, self.initial_delay * self.factor**n)
        if self.jitter and base:
            base *= rng(1 - self.jitter, 1 + self.jitter)
        return float(base)
