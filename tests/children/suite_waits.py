"""Two tests that say they run (a line on the FIFO named by ``SUITE_READY``) and wait.

Run by tests/test_suite_tmp.py as the suite runs, with the suite's
conftest.py: it stops the run while both wait, as a user would.
"""

from __future__ import annotations

import os
import threading

import pytest


@pytest.mark.parametrize("i", range(2))
def test_waits(i: int) -> None:
    with open(os.environ["SUITE_READY"], "w") as ready:
        ready.write(f"{os.getpid()}\n")
    threading.Event().wait(60)
