"""torch's Python launch API on aioproc's agent, behind the faces ``launcher`` and ``torchrun``.

``config`` is torch's ``LaunchConfig`` and its checks; ``flags`` is the one
translation to ``aioproc run``'s parsed flags (a ``LaunchConfig``, or
torchrun's ``Namespace``), so every flag and field means what it means to
that command; ``launch`` runs one launch on the running loop (the real
implementation) and ``blocking`` runs it on a loop of its own for torch's
blocking callers; ``parser`` is torchrun's argument parser and ``torchrun``
its ``config_from_args``, ``run`` and ``main``.
"""
