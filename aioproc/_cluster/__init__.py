"""TensorFlow's multi-process runner, async: the parts behind ``aioproc.cluster``.

``tfconfig`` builds cluster specs and each task's ``TF_CONFIG``, ``task``
runs one task as a one-worker group, ``runner`` is ``ClusterRunner`` (the
tasks together, restarts, the timeout with partial results), and
``result`` the result and the two errors it raises.
"""
