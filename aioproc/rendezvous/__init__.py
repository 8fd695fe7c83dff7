"""Multi-host rendezvous: agents on several hosts agree on a world (torch's names).

``create_handler(RendezvousParameters(...))`` builds the handler a
``WorkerSpec`` takes as ``rdzv_handler``: ``"c10d"`` (dynamic membership;
the agent on the endpoint's host runs the store, an etcd server, as a child
of its own), ``"etcd"`` (dynamic membership through an etcd v3 server of
your own; both need ``pip install 'aioproc[etcd]'``) or ``"static"`` (fixed
node ranks, no store).  Importing this package imports
no etcd client: only building an etcd handler does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .api import RendezvousClosedError as RendezvousClosedError
from .api import RendezvousConnectionError as RendezvousConnectionError
from .api import RendezvousError as RendezvousError
from .api import RendezvousGracefulExitError as RendezvousGracefulExitError
from .api import RendezvousInfo as RendezvousInfo
from .api import RendezvousJobFailedError as RendezvousJobFailedError
from .api import RendezvousLeaseLostError as RendezvousLeaseLostError
from .api import RendezvousNode as RendezvousNode
from .api import RendezvousParameters as RendezvousParameters
from .api import RendezvousStateError as RendezvousStateError
from .api import RendezvousTimeoutError as RendezvousTimeoutError
from .api import WorldChange as WorldChange

if TYPE_CHECKING:
    from typing import TypeAlias

    from .etcd import EtcdRendezvousHandler
    from .static import StaticRendezvousHandler

    # the c10d handler is an EtcdRendezvousHandler
    RendezvousHandler: TypeAlias = EtcdRendezvousHandler | StaticRendezvousHandler

__all__ = [
    "RendezvousClosedError",
    "RendezvousConnectionError",
    "RendezvousError",
    "RendezvousGracefulExitError",
    "RendezvousInfo",
    "RendezvousJobFailedError",
    "RendezvousLeaseLostError",
    "RendezvousNode",
    "RendezvousParameters",
    "RendezvousStateError",
    "RendezvousTimeoutError",
    "WorldChange",
    "create_handler",
]

BACKENDS = ("c10d", "etcd", "etcd-v3", "static")


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """The handler for ``params.backend`` (torch's ``rendezvous.registry`` entry point).

    Raises:
        ValueError: an unknown backend, or a bad option (named in the message).
        ImportError: the etcd backend without aetcd installed (says how to install it).
    """
    if not isinstance(params, RendezvousParameters):
        raise TypeError(f"params must be RendezvousParameters, got {params!r}")
    if params.backend == "c10d":
        from .c10d import create_c10d_handler

        return create_c10d_handler(params)
    if params.backend in ("etcd", "etcd-v3"):
        from .etcd import EtcdRendezvousHandler

        return EtcdRendezvousHandler(params)
    if params.backend == "static":
        from .static import StaticRendezvousHandler

        return StaticRendezvousHandler(params)
    raise ValueError(
        f"unknown rendezvous backend {params.backend!r}; aioproc has: {', '.join(BACKENDS)}"
    )
