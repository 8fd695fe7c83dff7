"""Worker output on its way: pipe bytes -> lines -> sinks.

``tee`` reads a worker's pipe into its log file and whole lines to the
sinks, ``console`` is the non-blocking console writer, ``flow`` the
backpressure every reader watches, ``sinkops`` the plumbing shared by the
sinks (queues, error reports, closing them within a deadline), ``drain``
the wait for the last bytes, and ``sink`` what a sink is.  Nothing here
imports the wings above it.
"""
