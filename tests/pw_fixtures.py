"""Fixtures shared by the persistent-worker and pool tests."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from types import ModuleType

import pytest
from helpers import import_child
from proc_utils import Fifo


@pytest.fixture
def pw(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The worker-function module, importable here and (by path) in workers."""
    return import_child(monkeypatch, "pw_funcs")


@pytest.fixture
async def fifo(tmp_path: Path) -> AsyncIterator[Fifo]:
    """A FIFO a worker writes a line to once inside a call; read without polling."""
    async with Fifo(tmp_path / "ready") as f:
        yield f
