"""Worker-side code of bench_coro_groups.py: a coroutine function, stdlib only.

Importing it costs a worker nothing but this file: the coroutine worker's
own cost (asyncio, the runner, its loop) is what the benchmark measures.
"""


async def aret_rank(rank):
    """Return the rank from a coroutine, on the worker's own loop."""
    return rank
