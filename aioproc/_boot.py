"""How a function worker's interpreter is started (parent side).

The child runs a few lines given with ``-c`` that read the compiled code of
``_wire`` and ``_bootstrap`` from the channel and execute it.  Shipping code
objects (compiled once per supervisor) instead of importing the package
means a worker never searches for, reads or compiles aioproc's sources:
with ``PYTHONDONTWRITEBYTECODE`` set or a read-only install there are no
cached ``.pyc`` files, and compiling them cost every worker several
milliseconds.  The worker is the same ``sys.executable``, so the marshal
format matches.
"""

from __future__ import annotations

import functools
import marshal
import subprocess
import sys
from pathlib import Path

BOOT_CODE = """\
import marshal, os, sys
fd = int(sys.argv[1])
del sys.argv[1]
def _read(n):
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            raise SystemExit("aioproc worker: supervisor closed the channel during startup")
        buf += chunk
    return buf
wire_code, boot_code = marshal.loads(_read(int.from_bytes(_read(8), "big")))
_wire = type(sys)("aioproc._wire")
exec(wire_code, _wire.__dict__)
_boot = {"__name__": "aioproc._bootstrap", "_wire": _wire}
exec(boot_code, _boot)
del _read, wire_code, boot_code, _wire
_boot["main"](fd)
"""


@functools.cache
def boot_blob() -> bytes:
    """Length-prefixed marshalled code of ``_wire`` and ``_bootstrap``."""
    here = Path(__file__).parent
    codes = tuple(
        compile((here / f"{name}.py").read_text(), str(here / f"{name}.py"), "exec")
        for name in ("_wire", "_bootstrap")
    )
    data = marshal.dumps(codes)
    return len(data).to_bytes(8, "big") + data


def boot_argv(fd: int) -> list[str]:
    """argv of a function worker whose channel is ``fd``."""
    return [
        sys.executable,
        *subprocess._args_from_interpreter_flags(),  # type: ignore[attr-defined]
        "-c",
        BOOT_CODE,
        str(fd),
    ]
