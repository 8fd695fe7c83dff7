"""Function workers, the parent side: what a Python function needs to run in a worker.

``boot`` builds a worker's boot code and its calls' frames, ``pickling``
pickles functions by value, ``launch`` starts a function worker (fresh or
forked), ``template`` runs the warm-start template that forks them (with
``template_exec``, what the template process is made of and how its forks
are found), ``fork`` starts a worker forked from a template, ``script``
turns a Python script into a forked worker's command, and ``barrier`` is the
control hub that holds a group's barrier.  A module with a child half has
it under the same name in ``_child``.
"""
