"""Resource limits, resource usage and a process budget: the pieces a launcher puts together.

``spec`` holds ``Limits``, the public description of a limit, and its
checks; ``usage`` turns the rusage of a reaped process (and a cgroup's
counters) into ``Usage``; ``cgroups`` finds the cgroup hierarchies this
process may create groups in and drives one group's files; ``rlimits`` is
the fallback where no cgroup can be made; ``placement`` puts the two
together behind ``open_placement``, which picks a mechanism per limit;
``capacity`` is the process budget groups share; and ``affinity`` checks
and applies CPU sets (``cpus=``).  ``join`` is what a child runs on itself
to enter a placement before user code: standard library only.
Nothing here knows about workers or groups; only ``_base`` and ``results``
(where ``Usage`` is defined) are below it.
"""
