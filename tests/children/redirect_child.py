"""Exercises aioproc.redirects on the real fds 1 and 2; argv[1] names the case, argv[2] a dir."""

import ctypes
import os
import subprocess
import sys

from aioproc.redirects import redirect, redirect_stderr, redirect_stdout

libc = ctypes.CDLL(None)
case, where = sys.argv[1], sys.argv[2]


def c_print(text: str, std: str) -> None:
    # through C's stdio buffers, as a native extension would write
    libc.fputs(text.encode(), ctypes.c_void_p.in_dll(libc, std))


def child_write(fd: int) -> None:
    code = f"import os; os.write({fd}, b'child inside\\n')"
    subprocess.run([sys.executable, "-c", code], check=True)


if case in ("stdout", "stderr"):
    fd = 1 if case == "stdout" else 2
    stream = getattr(sys, case)
    manager = redirect_stdout if case == "stdout" else redirect_stderr
    print("before", file=stream)
    c_print("c before\n", case)
    with manager(os.path.join(where, f"{case}.log")):
        print("python inside", file=getattr(sys, case))
        c_print("c inside\n", case)
        child_write(fd)
    print("after", file=stream)
    c_print("c after\n", case)
elif case == "raise":
    fds = sorted(os.listdir("/proc/self/fd"))
    try:
        with redirect("stdout", os.path.join(where, "out.log")):
            print("inside")
            raise KeyError("boom")
    except KeyError:
        pass
    print("outside")
    print("fds kept" if sorted(os.listdir("/proc/self/fd")) == fds else "fds leaked")
elif case == "nested":
    with redirect_stdout(os.path.join(where, "outer.log")):
        print("one")
        with redirect_stdout(os.path.join(where, "inner.log")):
            print("two")
        print("three")
    print("four")
libc.fflush(None)
