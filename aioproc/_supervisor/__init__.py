"""A worker group's crew: what ``PContext`` is, behind torch's face.

``spec`` holds every option of a group once (``GroupSpec``, checked once,
with the one default grace period); ``supervisor`` owns the group's task and
its collaborators, each an object with state of its own: ``launch`` starts
the ranks, ``hold`` keeps the workers that returned until their peers have,
``exits`` turns each exit into an outcome, ``shutdown`` is the one stop a
failure or a close asks for.  Imports go one way: spec, hold, exits,
launch, shutdown, supervisor.
"""
