"""What runs inside a worker or the warm-start template: the standard library only.

A function worker boots from ``main`` (sent as compiled code with ``wire``
and ``funcload``, see ``aioproc._boot``), the template runs ``template``
and, for Python script workers, ``script``; ``shm`` and ``errorfile`` are
shared by both sides.  Nothing here imports asyncio, anyio or any other
part of aioproc but this package, so a worker's start costs only what it
uses (``cloudpickle`` is imported only to load a value pickled by it).
"""
