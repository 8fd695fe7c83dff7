"""A module that fails to import: the forkserver template reports it."""

raise LookupError("fork_broken_mod refuses to load")
