"""The ground floor: loop helpers, shielding, owned resources, the helper thread, input checks.

Nothing here knows about processes or output: ``loops`` checks the running
loop, ``shield`` runs cleanup through a cancellation, ``resource`` is the
``await``/``async with`` shape of the handles users open, and ``offloop``
is the one way blocking work leaves the loop; ``checks`` holds the input
checks every entry point shares.  No other wing is imported.

The package itself holds the two names every floor may need without
importing anything: the version (the package's face re-exports it lazily,
and the CLI names it without importing the face) and ``public_module``.
"""

from __future__ import annotations

__version__ = "0.1.0"


def public_module(module: str, *objects: object) -> None:
    """Show ``objects`` as defined in the public module ``module``.

    A class or function defined in a wing and imported by users from a
    public module then names that module in its repr, its pickle and the
    docs.  Called once, where the object is defined or by the face that
    imports it, never on first access: an object's identity must not depend
    on which path reached it first.

    Args:
        module: the public module's dotted name, e.g. ``"aioproc.errors"``.
        objects: classes and functions defined in a wing.

    Raises:
        ValueError: ``module`` is not the name of a public aioproc module.
    """
    if module != "aioproc" and (
        not module.startswith("aioproc.") or any(p.startswith("_") for p in module.split("."))
    ):
        raise ValueError(f"module must name a public aioproc module, got {module!r}")
    for obj in objects:
        obj.__module__ = module
