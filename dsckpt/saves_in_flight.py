"""The checkpoint saves this process still has in flight (the background engine's, ``checkpoint_engine.background``): a read
of a checkpoint settles them first, so it never opens a tag half written, nor a ``latest`` from before a save the
caller saw return.

Order: the engine registers its wait once, when it is imported; every reading entry point (``open_checkpoint``,
``readable``, a run's view) calls ``settle()`` before it looks at the folder.  A save that failed is not raised
there (the read sees the tag before it): the failure stays for the engine's next save, step or ``wait()``, so a
reader that swallows errors cannot lose it.  Never called from a save's own threads.
"""
from __future__ import annotations

from typing import Callable

_WAITS: list[Callable[[], None]] = []


def register(wait: Callable[[], None]) -> None:
    if wait not in _WAITS:
        _WAITS.append(wait)


def settle() -> None:
    """Return once every save this process has in flight has finished (at once where none is)."""
    for wait in list(_WAITS):
        wait()
