"""What a ``PContext`` is made of: a group of workers started, watched and judged together.

``checks`` validates a whole group before anything starts, ``rank_launcher``
starts each rank (binary, function, script, forked from the template),
``rankdirs`` makes the ranks' log directories, ``outcomes`` turns the
way each worker ended into the group's result or its failures,
``resources`` holds the group's limits (placements) and process slots, and
``restart`` says when and how fast a failed group starts again.
"""
