"""Failures: what a failed worker left, the summary a group raises, and ``@record``.

``failure`` holds ``ProcessFailure`` and the error-file readers, ``summary``
``ChildFailedError`` with its hints, and ``record`` the worker side that
writes error.json.  Workers import all of it through ``aioproc.errors``, so
it imports the standard library and ``_child`` only.
"""
