"""Run examples/train.py on 2 workers under a LocalElasticAgent and print its events.

Run: python examples/agent.py
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile

from aioproc import LocalElasticAgent, RestartPolicy, WorkerSpec

TRAIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train.py")


async def main(log_dir: str) -> None:
    spec = WorkerSpec(
        role="trainer",
        local_world_size=2,
        entrypoint=sys.executable,
        args=(TRAIN, "--steps=3"),
        max_restarts=3,
        restart_policy=RestartPolicy(
            initial_delay=1, factor=2, max_delay=30, jitter=0.1, reset_after=600
        ),
    )
    agent = LocalElasticAgent(spec, log_dir=log_dir)

    async def show_events() -> None:
        async for event in agent.events():  # starts, exits, restarts, verdict
            print(f"event: {event.kind} local_rank={event.local_rank}")

    events = asyncio.create_task(show_events())  # events() ends when run() returns
    result = await agent.run()  # RunResult(state, return_values, failures)
    await events
    print(f"agent finished: {result.state.name}")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(prefix="aioproc-agent-") as logs:
        asyncio.run(main(logs))
