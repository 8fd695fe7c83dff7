"""A bounded fork bomb: forks until ``fork`` fails (at most 200 times).

Prints ``<forks made> <errno of the failed fork, or None>``.  Every child
waits on a pipe until the parent closes it, so all of them exist while the
next fork is tried; the parent then reaps them.  Run as a script, or its
text given to ``python -c`` or ``exec`` (the tests of the pids limit).
"""

import os

r, w = os.pipe()
forked, error = 0, None
while forked < 200:  # bounded: a limit that fails to hold must not hurt the machine
    try:
        pid = os.fork()
    except OSError as exc:
        error = exc.errno
        break
    if pid == 0:
        os.close(w)
        os.read(r, 1)
        os._exit(0)
    forked += 1
os.close(w)
for _ in range(forked):
    os.wait()
print(forked, error, flush=True)
