"""The ``aioproc run`` command's parts, behind its public face ``aioproc.cli``.

``values`` parses each flag's value, ``args`` builds the argument parser
from them, ``run`` turns the parsed flags into the worker spec, the logs
and the rendezvous handler (``devices`` counts the accelerators and finds
the NUMA binding, ``torchrun`` resolves torchrun's plug-ins: logs specs,
event handlers, ``--run-path``), ``supervise`` runs the agent on the event loop
under the signals and job control, ``report`` tells the user (events, the
log, errors, where the logs are), and ``live`` draws the table of the
workers on a terminal.
"""
