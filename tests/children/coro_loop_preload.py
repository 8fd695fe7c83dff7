"""A preloaded module that leaves asyncio holding an event loop (as
``asyncio.get_event_loop()`` at import does on older Pythons)."""

import asyncio

asyncio.set_event_loop(asyncio.new_event_loop())
