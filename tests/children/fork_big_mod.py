"""A large preload for the forkserver template: 48 MiB of bytes plus small objects.

``BLOCK`` is written page by page at import (resident, in one anonymous
mapping), ``NUMBERS`` fills pymalloc's arenas; ``DIGEST`` is what every
worker must find in ``BLOCK`` before it writes to it (see
``fork_funcs.scribble``).
"""

from __future__ import annotations

import hashlib

BLOCK = bytearray(range(256)) * (48 << 12)  # 48 MiB
NUMBERS = [str(i) for i in range(200_000)]
DIGEST = hashlib.sha256(BLOCK).hexdigest()
