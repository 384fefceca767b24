"""What long work reports, in one protocol: every writing verb, ``verify`` and a bucket's fetch tell a ``Progress``
(the CLI's bar, a script's log, a test's ``Tally``) the bytes they move.

Order of calls, on each process for its own work: ``begin(phase, total)`` once a phase's size is known and before
its first byte, then ``advance(nbytes)`` for each piece done.  A checkpoint in object storage is ``FETCH``ed before
it is written (a streamed write fetches while it writes: only its ``WRITE`` is told); ``verify`` begins ``VERIFY``.
``advance`` may be called from the verb's worker threads, one call at a time.
"""
from __future__ import annotations

import enum
import threading
from dataclasses import dataclass, field
from typing import Callable, Protocol


class Phase(enum.Enum):
    FETCH = "fetch"  # a checkpoint's bytes landing from object storage
    WRITE = "write"  # OUT's bytes written
    VERIFY = "verify"  # a checkpoint's bytes read back and checked


class Progress(Protocol):
    def begin(self, phase: Phase, total: int | None) -> None:
        """A phase starts; ``total`` bytes will be advanced in it (None: not known in advance)."""

    def advance(self, nbytes: int) -> None:
        """``nbytes`` more of the current phase are done."""


@dataclass
class Step:
    phase: Phase
    total: int | None
    pieces: list[int] = field(default_factory=list)  # each ``advance``'s bytes, in order

    @property
    def done(self) -> int:
        return sum(self.pieces)


class Tally:
    """A ``Progress`` that keeps what it was told: ``steps`` in order (one per ``begin``)."""

    def __init__(self) -> None:
        self.steps: list[Step] = []
        self._lock = threading.Lock()

    def begin(self, phase: Phase, total: int | None) -> None:
        with self._lock:
            self.steps.append(Step(phase, total))

    def advance(self, nbytes: int) -> None:
        with self._lock:
            if not self.steps:
                raise RuntimeError("Progress.advance before begin")
            self.steps[-1].pieces.append(nbytes)


def begin(progress: Progress | None, phase: Phase, total: int | None) -> None:
    """``progress.begin``, where there is one to tell."""
    if progress is not None:
        progress.begin(phase, total)


def advancing(progress: Progress | None) -> Callable[[int], None] | None:
    """What a writer calls with each piece's bytes: ``progress.advance``, or None."""
    return progress.advance if progress is not None else None
