"""What the background engine's training thread hands its writer thread (``runtime.async_save``): a tag
(``QueuedTag``), each of its files (``QueuedFile``) in the order DeepSpeed saved them, and the record of each save
(``SaveRecord``, the figures the handle's ``records`` and rank 0's one line per save report).
"""
from __future__ import annotations

import os
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

from .snapshot import Snapshot
from .staged_files import SaveTarget


@dataclass
class SaveRecord:
    """One save as it went: how long training was held (by the call; by the next optimizer step, for the snapshot's
    deferred copies), how long the background persist took."""
    tag: str
    blocked_s: float
    step_waited_s: float = 0.0
    waited_s: float = 0.0
    nbytes: int = 0
    persist_s: float = 0.0
    ok: bool = False


@dataclass
class QueuedTag:
    """A tag the training thread queued: its files, where it goes, what runs once it is published."""
    save_dir: str
    tag: str
    save_latest: bool
    record: SaveRecord
    files: list[str] = field(default_factory=list)
    aborted: bool = False
    then: list[Callable[[], None]] = field(default_factory=list)  # run by the writer once the tag is published
    done: bool = False
    target: SaveTarget | None = None  # where the tag is published

    @property
    def name(self) -> str:
        return os.path.join(self.target.name if self.target else self.save_dir, self.tag)


@dataclass
class QueuedFile:
    """A file of the tag: its state over the snapshot's host copies, and what orders those copies."""
    path: str
    state: Any
    snapshot: Snapshot
    ready: Any  # a CUDA event the copies are ordered before, or None on CPU
    staged: Future[None] | None = None  # the deferred copies (an optimizer-states file on CPU)
