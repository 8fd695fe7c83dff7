"""Function workers, the parent side: what a Python function needs to run in a worker.

``boot`` builds a worker's boot code and its calls' frames, ``pickling``
pickles functions by value, ``launch`` starts a function worker (fresh or
forked), ``template`` runs the warm-start template that forks them,
``script`` turns a Python script into a forked worker's command, and
``barrier`` is the control hub that holds a group's barrier.  Each has its
child half under the same name in ``_child``.
"""
