"""``python -m aioproc``: the ``aioproc`` command (``python -m aioproc run ...``)."""

from __future__ import annotations

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
