"""A module that starts a thread when imported: the forkserver template must refuse it."""

from __future__ import annotations

import threading

_stop = threading.Event()
threading.Thread(target=_stop.wait, name="sneaky-poller", daemon=True).start()
