"""Ends as argv[1] says (raise, exit N, interrupt, ok): a script's end as `aioproc run` sees it.

Says first how the interpreter set it up (argv, sys.path[0], __main__, stdio),
so a forked script can be compared with a spawned one line by line.
"""

import os
import sys

import __main__

mode = sys.argv[1]
stdio = (
    f"{sys.stdout.write_through}/{sys.stdout.line_buffering}/{type(sys.stdout.buffer).__name__}"
    f" {sys.stderr.errors} {sys.stdin.fileno()}"
)
# one write each: lines of several workers share the console
sys.stdout.write(
    f"rank {os.environ['RANK']} argv={sys.argv} path0={sys.path[0]} name={__name__} "
    f"file={__main__.__file__} spec={__main__.__spec__} stdio={stdio}\n"
)
sys.stdout.write("no newline at the end")  # flushed at exit by the interpreter


def fail() -> None:
    raise RuntimeError(f"{mode} from rank {os.environ['RANK']}")


if mode == "raise":
    fail()
elif mode == "exit":
    sys.exit(int(sys.argv[2]))
elif mode == "exit-text":
    sys.exit("exit with a message")
elif mode == "interrupt":
    raise KeyboardInterrupt
