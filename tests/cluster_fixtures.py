"""Fixtures shared by the cluster and barrier tests (test_cluster.py, test_barrier.py).

A plugin of the suite (``pytest_plugins`` in conftest.py): ``runners`` is
a fixture every test can ask for; ``make`` is imported by name.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from aioproc.cluster import ClusterRunner


@pytest.fixture
async def runners() -> AsyncIterator[list[ClusterRunner]]:
    """Runners a test builds by hand; closed even when the test fails."""
    made: list[ClusterRunner] = []
    yield made
    for r in made:
        await r.aclose()


def make(made: list[ClusterRunner], *args: object, **kwargs: object) -> ClusterRunner:
    """A ``ClusterRunner(*args, **kwargs)`` (quiet by default), closed by ``runners``."""
    kwargs.setdefault("stream_output", False)
    runner = ClusterRunner(*args, **kwargs)  # type: ignore[arg-type]
    made.append(runner)
    return runner
