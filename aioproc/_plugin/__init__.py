"""The pytest plugin's parts, behind ``aioproc.pytest_plugin``.

``fixtures`` holds the group, pool and cluster factories, ``ranks`` runs a
test body in a group of workers and ``rank_child`` is its half inside each
worker (it runs pytest there, so it cannot live in the standard-library-only
``_child``), ``report`` formats a rank's failure, and ``leakcheck`` fails a
test that leaves processes or temp dirs behind.
"""
