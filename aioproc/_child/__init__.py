"""What runs inside a worker or the warm-start template: the standard library only.

Each module is the child half of a parent module elsewhere, under the same
name: a function worker boots from ``boot`` (sent as compiled code with
``channel`` and ``pickling``, see ``aioproc._func.boot``), speaks ``channel``
to ``_proc.channel`` and rebuilds functions pickled by ``_func.pickling``;
the template runs ``template`` and, for Python script workers, ``script``;
``boot`` also holds the worker's side of ``_func.barrier``; ``shm`` and
``errorfile`` are shared by both sides.  Nothing here imports anyio or any
other part of aioproc but this package, so a worker's start costs only what
it uses (``cloudpickle`` is imported only to load a value pickled by it).
"""
