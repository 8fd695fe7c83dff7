"""Multi-host rendezvous: agents on several hosts agree on a world (torch's names).

``create_handler(RendezvousParameters(...))`` builds the handler a
``WorkerSpec`` takes as ``rdzv_handler``, from the backend registered under
``params.backend``: ``"c10d"`` (dynamic membership; the agent on the
endpoint's host runs the store, an etcd server, as a child of its own),
``"etcd"`` (dynamic membership through an etcd v3 server of your own; both
need ``pip install 'aioproc[etcd]'``), ``"static"`` (fixed node ranks, no
store), or a backend another package registers: a ``RendezvousHandler``
subclass, registered with ``register_backend`` or declared as an entry
point of the ``aioproc.rendezvous_backends`` group (``registry``).
Importing this package imports no backend and no etcd client: only
building a handler does.
"""

from __future__ import annotations

from .api import RendezvousAssignment as RendezvousAssignment
from .api import RendezvousClosedError as RendezvousClosedError
from .api import RendezvousConnectionError as RendezvousConnectionError
from .api import RendezvousError as RendezvousError
from .api import RendezvousGracefulExitError as RendezvousGracefulExitError
from .api import RendezvousHandler as RendezvousHandler
from .api import RendezvousInfo as RendezvousInfo
from .api import RendezvousJobFailedError as RendezvousJobFailedError
from .api import RendezvousLeaseLostError as RendezvousLeaseLostError
from .api import RendezvousNode as RendezvousNode
from .api import RendezvousParameters as RendezvousParameters
from .api import RendezvousStateError as RendezvousStateError
from .api import RendezvousTimeoutError as RendezvousTimeoutError
from .api import WorldChange as WorldChange
from .registry import ENTRY_POINT_GROUP as ENTRY_POINT_GROUP
from .registry import RendezvousHandlerRegistry as RendezvousHandlerRegistry
from .registry import create_handler as create_handler
from .registry import get_rendezvous_handler as get_rendezvous_handler
from .registry import register_backend as register_backend
from .registry import rendezvous_handler_registry as rendezvous_handler_registry

__all__ = [
    "ENTRY_POINT_GROUP",
    "RendezvousAssignment",
    "RendezvousClosedError",
    "RendezvousConnectionError",
    "RendezvousError",
    "RendezvousGracefulExitError",
    "RendezvousHandler",
    "RendezvousHandlerRegistry",
    "RendezvousInfo",
    "RendezvousJobFailedError",
    "RendezvousLeaseLostError",
    "RendezvousNode",
    "RendezvousParameters",
    "RendezvousStateError",
    "RendezvousTimeoutError",
    "WorldChange",
    "create_handler",
    "get_rendezvous_handler",
    "register_backend",
    "rendezvous_handler_registry",
]
