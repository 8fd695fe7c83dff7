"""The backends by name: one registry, as torch's ``rendezvous_handler_registry``.

A backend is a ``RendezvousHandler`` subclass registered under a name,
which is what ``--rdzv-backend`` and ``RendezvousParameters.backend`` say.
aioproc's own backends register here the way another package's do, by
where they live (``"module:Class"``), so that naming them imports nothing
until one is used: ``aioproc run`` on one host never imports the etcd
backend.  Another package registers its backend either by calling
``register_backend`` when it is imported, or, so that ``aioproc run
--rdzv-backend NAME`` finds it without any import, by declaring an entry
point in the ``aioproc.rendezvous_backends`` group (as torchrun finds
its out-of-tree handlers in ``torchrun.handlers``)::

    [project.entry-points."aioproc.rendezvous_backends"]
    my-store = "my_package.rendezvous:MyStoreRendezvousHandler"

An entry point is loaded only when its name is asked for and no backend of
that name was registered.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Iterable
from importlib.metadata import entry_points

from .api import RendezvousHandler, RendezvousParameters

__all__ = [
    "ENTRY_POINT_GROUP",
    "RendezvousHandlerRegistry",
    "create_handler",
    "get_rendezvous_handler",
    "register_backend",
    "rendezvous_handler_registry",
]

logger = logging.getLogger("aioproc.rendezvous")

ENTRY_POINT_GROUP = "aioproc.rendezvous_backends"
"""The entry point group where packages declare their backends: name = ``"module:Class"``."""

HandlerClass = type[RendezvousHandler]


class RendezvousHandlerRegistry:
    """Rendezvous backends by name (torch's ``RendezvousHandlerRegistry``).

    The process-wide one is ``rendezvous_handler_registry``; a registry of
    one's own serves tests and embedders that must not touch it.

    Args:
        entry_point_group: where unknown names are looked up among the
            installed packages' entry points; None: nowhere.
    """

    def __init__(self, entry_point_group: str | None = ENTRY_POINT_GROUP) -> None:
        self._group = entry_point_group
        self._classes: dict[str, HandlerClass | str] = {}  # a name -> its class, or where it is
        self._aliases: dict[str, str] = {}  # another name -> the name it stands for

    def __repr__(self) -> str:
        return f"<RendezvousHandlerRegistry {', '.join(self.names(aliases=True)) or 'empty'}>"

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (name in self._classes or name in self._aliases)

    def register(
        self, backend: str, handler: HandlerClass | str, *, aliases: Iterable[str] = ()
    ) -> None:
        """Register ``handler`` as the backend ``backend`` (and as each of ``aliases``).

        Registering the same class (or the same ``"module:Class"``) again
        under the same name does nothing, as in torch.

        Args:
            backend: the name (``--rdzv-backend``); the handler's
                ``get_backend()`` must return it.
            handler: a ``RendezvousHandler`` subclass, or where it lives as
                ``"module:Class"`` (imported when the backend is first used).
            aliases: other names for the same backend; its handlers still
                say ``backend`` (``get_backend()``).

        Raises:
            TypeError: ``handler`` is neither a ``RendezvousHandler``
                subclass nor a ``"module:Class"`` string.
            ValueError: an empty name, or a name registered already for
                something else.
        """
        names = [backend, *aliases]
        for name in names:
            if not isinstance(name, str) or not name.strip() or name != name.strip():
                raise ValueError(
                    f"a rendezvous backend's name must be a non-empty str, got {name!r}"
                )
        if isinstance(handler, str):
            module, colon, attr = handler.partition(":")
            if not (module and colon and attr):
                raise TypeError(
                    f"rendezvous backend {backend!r}: expected a RendezvousHandler subclass or "
                    f"'module:Class', got {handler!r}"
                )
        elif not (isinstance(handler, type) and issubclass(handler, RendezvousHandler)):
            raise TypeError(
                f"rendezvous backend {backend!r}: expected a RendezvousHandler subclass "
                f"(aioproc.rendezvous.RendezvousHandler) or 'module:Class', got {handler!r}"
            )
        for name in names:
            taken = self._holder(name)
            # registering the same thing again does nothing, as in torch
            if name == backend:
                again = taken == _shown(handler)
            else:
                again = self._aliases.get(name) == backend
            if taken is not None and not again:
                raise ValueError(f"rendezvous backend {name!r} is registered already: {taken}")
        self._classes[backend] = handler
        self._aliases.update(dict.fromkeys(aliases, backend))

    def _holder(self, name: str) -> str | None:
        """What ``name`` is registered as now (a class, or an alias), or None."""
        if name in self._aliases:
            return f"another name of {self._aliases[name]!r}"
        if name in self._classes:
            return _shown(self._classes[name])
        return None

    def names(self, *, aliases: bool = False) -> tuple[str, ...]:
        """The backends' names, sorted: registered ones and those packages declare.

        Args:
            aliases: include the other names of backends too.
        """
        found = set(self._classes)
        if aliases:
            found |= set(self._aliases)
        if self._group is not None:
            found |= {ep.name for ep in entry_points(group=self._group)}
        return tuple(sorted(found))

    def backend(self, name: str) -> HandlerClass:
        """The class registered as ``name`` (an alias: the backend it stands for).

        A name registered by where its class lives is imported now; a name
        nobody registered is looked up among the entry points and registered.

        Raises:
            ValueError: no backend has that name (the message lists those
                there are), or its class cannot be imported (named).
        """
        canonical = self._aliases.get(name, name)
        handler = self._classes.get(canonical)
        if handler is None:
            handler = self._from_entry_point(name)
            canonical = name
        if isinstance(handler, str):
            handler = _load(canonical, handler, "registered as")
            self._classes[canonical] = handler
        return handler

    def canonical(self, name: str) -> str:
        """The name ``name`` stands for (itself unless it is an alias)."""
        return self._aliases.get(name, name)

    def create_handler(self, params: RendezvousParameters) -> RendezvousHandler:
        """The handler of ``params.backend``, built as ``cls(params)``.

        Raises:
            TypeError: ``params`` is not a ``RendezvousParameters``.
            ValueError: no such backend, or the backend refused ``params``
                (its message).
            ImportError: the backend needs a package that is not installed
                (its message says which).
            RuntimeError: the handler says it is another backend
                (``get_backend()``): a bug of the backend, as in torch.
        """
        if not isinstance(params, RendezvousParameters):
            raise TypeError(f"params must be RendezvousParameters, got {params!r}")
        cls = self.backend(params.backend)
        handler = cls(params)  # type: ignore[call-arg]  # the contract's constructor
        said, expected = handler.get_backend(), self.canonical(params.backend)
        if said != expected:
            raise RuntimeError(
                f"the rendezvous backend {expected!r} ({_shown(cls)}) built a handler whose "
                f"get_backend() is {said!r}"
            )
        return handler

    def _from_entry_point(self, name: str) -> HandlerClass | str:
        """The entry point ``name`` of the group, registered; ValueError if there is none."""
        if self._group is not None:
            for ep in entry_points(group=self._group, name=name):
                cls = _load(name, ep.value, f"declared by the entry point {ep.group}:{name} as")
                self.register(name, cls)
                return cls
        known = ", ".join(self.names(aliases=True))
        how = "with aioproc.rendezvous.register_backend"
        if self._group is not None:
            how = f"with an {self._group!r} entry point, or {how}"
        raise ValueError(
            f"unknown rendezvous backend {name!r}; registered: {known or 'none'} (another "
            f"package adds one {how})"
        )


def _load(name: str, where: str, how: str) -> HandlerClass:
    """The class at ``where`` (``"module:Class"``), checked to be a handler."""
    module, _, attr = where.partition(":")
    try:
        found: object = importlib.import_module(module.strip())
        for part in attr.strip().split("."):
            found = getattr(found, part)
    except ImportError as e:
        if module.strip().startswith("aioproc."):
            raise  # aioproc's own backend: its dependency is what is missing
        raise ValueError(
            f"rendezvous backend {name!r}, {how} {where!r}, cannot be imported: {e}"
        ) from e
    except AttributeError as e:
        raise ValueError(f"rendezvous backend {name!r}, {how} {where!r}: {e}") from e
    if not (isinstance(found, type) and issubclass(found, RendezvousHandler)):
        raise ValueError(
            f"rendezvous backend {name!r}, {how} {where!r}, is {found!r}, not a "
            "RendezvousHandler subclass (aioproc.rendezvous.RendezvousHandler)"
        )
    return found


def _shown(handler: HandlerClass | str) -> str:
    if isinstance(handler, str):
        return handler
    return f"{handler.__module__}:{handler.__qualname__}"


rendezvous_handler_registry = RendezvousHandlerRegistry()
"""The registry ``aioproc run``, ``create_handler`` and the agent's users go through."""


def register_backend(
    name: str, handler: HandlerClass | str, *, aliases: Iterable[str] = ()
) -> None:
    """Register a rendezvous backend in ``rendezvous_handler_registry``.

    Example::

        from aioproc.rendezvous import RendezvousHandler, register_backend

        class MyStoreRendezvousHandler(RendezvousHandler):
            ...  # the contract: see RendezvousHandler

        register_backend("my-store", MyStoreRendezvousHandler)

    Args:
        name: the backend's name (``--rdzv-backend``); the handler's
            ``get_backend()`` must return it.
        handler: a ``RendezvousHandler`` subclass, or where it lives as
            ``"module:Class"`` (imported when the backend is first used).
        aliases: other names for the same backend.

    Raises:
        TypeError: ``handler`` is no ``RendezvousHandler`` subclass.
        ValueError: the name is taken by another backend.
    """
    rendezvous_handler_registry.register(name, handler, aliases=aliases)


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """The handler for ``params.backend`` (torch's ``registry.get_rendezvous_handler``).

    Raises:
        ValueError: an unknown backend, or a bad option (named in the message).
        ImportError: the etcd backend without aetcd installed (says how to install it).
    """
    return rendezvous_handler_registry.create_handler(params)


get_rendezvous_handler = create_handler
"""torch's name for ``create_handler``."""


# aioproc's own backends, registered as any package registers one
register_backend("c10d", "aioproc.rendezvous.c10d:C10dRendezvousHandler")
register_backend("etcd", "aioproc.rendezvous.etcd:EtcdRendezvousHandler", aliases=("etcd-v3",))
register_backend("static", "aioproc.rendezvous.static:StaticRendezvousHandler")
