"""Persistent workers and pools, behind ``aioproc.worker`` and ``aioproc.pool``.

``options``: the factories' keywords, checked once into a frozen
``WorkerOptions``; ``turn``: one request at a time; ``process``: the
``WorkerProcess`` handle (calls, pings, its stop); ``start``: the one way a
worker comes to exist; ``records``: what a pool keeps of its starts and
calls, and ``PoolStats``; ``supply``: what a pool gives each start (slots,
placements, CPUs, the template); ``dispatch``: which positions are free and
who waits for one; ``pool``: ``WorkerPool``'s body, the owner of the rest.
"""
