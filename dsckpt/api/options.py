"""The options every writing verb takes (``consolidate``, ``reshard``, ``convert``, ``into_deepspeed``): one object,
as the CLI's writing options are one set (``cli.options.writing_options``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..parallel.group import Group
    from ..progress import Progress


@dataclass(frozen=True)
class WriteOptions:
    """How ``consolidate``, ``reshard``, ``convert`` and ``into_deepspeed`` write OUT and read their input: the
    CLI's writing options (``--force``, ``--no-fsync``, ``--trust-checkpoint``, ``--skip-crc-check``, ``--nproc``
    and its bar) as one object, e.g. ``dsckpt.reshard(ckpt, out, 8, options=WriteOptions(force=True))``.
    ``trust`` and ``check_crc`` concern a DeepSpeed checkpoint's rank files; ``group``: every process of the run
    calls the verb with its own group and the same other options."""

    force: bool = False  # replace an existing OUT; in an existing folder only the files dsckpt writes are replaced
    fsync: bool = True  # flush OUT to disk before and after the rename
    trust: bool = False  # follow links out of the checkpoint, copy pickled objects of any class (DeepSpeed inputs)
    check_crc: bool = True  # check every storage read against its zip CRC-32 (DeepSpeed inputs)
    group: "Group | None" = None  # the processes of a torchrun run sharing the work; None: this process alone
    progress: "Progress | None" = None  # told each phase and its bytes (``dsckpt.progress``)


DEFAULTS = WriteOptions()
