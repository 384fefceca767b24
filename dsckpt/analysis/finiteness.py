"""Whether a run's checkpoints are worth keeping: ``prune`` that never removes the last finite ones.

``masters_finite(entry)`` streams one checkpoint's fp32 masters (``stats``, no CRC read) and answers whether every
value is finite; ``prune`` is ``api.catalog.prune`` with that check (the one ``dsckpt.prune`` and ``dsckpt prune``
run unless told not to).
"""
from __future__ import annotations

import os
from pathlib import Path

from ..api.catalog import Entry, prune as prune_entries
from .sources import sources
from .stats import compute_stats


def masters_finite(entry: Entry) -> bool:
    path = Path(entry.path)
    tag = entry.tag if (path / entry.tag).is_dir() else None  # (an HF checkpoint-N folder holds its tag)
    return all(s.finite for s in compute_stats(sources(path, tag, optimizer=False, check_crc=False)))


def prune(root: str | os.PathLike[str], keep: int, dry_run: bool = False,
          check: bool = True) -> tuple[list[Entry], list[Entry]]:
    """``dsckpt.prune``: all but the newest ``keep`` complete checkpoints under ``root`` removed, and what interrupted
    saves left; never the one a resume picks, an incomplete one or a save in progress.  With ``check`` the newest
    ``keep`` whose fp32 masters are finite (and every newer one) are kept: a run gone to NaN keeps its last good
    ones.  ``dry_run``: nothing removed.  Returns (removed, kept), lists of ``Entry``."""
    return prune_entries(root, keep, dry_run, finite=masters_finite if check else None)
