"""One OS process: starting it, watching it exit, its control socket, stopping it.

``spawn`` starts a worker in its own session with its pipes wired to the
tees, ``posix_spawn`` is the fast path for binaries, ``exits`` notices an
exit through a pidfd, ``channel`` is the parent's end of a worker's control
socket, ``lifeline`` the guardian that kills the groups when the supervisor
cannot, ``fence`` the lease deadline the guardian keeps for some of them,
and ``shutdown`` the graceful-then-forced stop.
"""
