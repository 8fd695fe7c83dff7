"""The ground floor: loop helpers, shielding, owned resources, the helper thread, input checks.

Nothing here knows about processes or output: ``loops`` checks the running
loop, ``shield`` runs cleanup through a cancellation, ``resource`` is the
``await``/``async with`` shape of the handles users open, and ``offloop``
is the one way blocking work leaves the loop; ``checks`` holds the input
checks every entry point shares.  No other wing is imported.
"""
