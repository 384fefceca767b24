"""Make DeepSpeed's own checkpoint loading execute no pickle code.

DeepSpeed 0.19.8's ``TorchCheckpointEngine.load`` unpickles with full pickle semantics (``weights_only`` off):
a ``__reduce__`` payload in a checkpoint's client state runs during ``engine.load_checkpoint``.
dsckpt closes that path twice:

1. before any rank starts, ``check_checkpoint_classes`` reads every rank file with dsckpt's own
   allowlist reader (nothing is imported or called) and refuses a checkpoint that names any class
   beyond plain data, tensors and ``DATA_CLASSES`` - the error names the class;
2. in every rank, ``install`` replaces the engine's loader with ``torch.load(weights_only=True)``
   that allows exactly ``DATA_CLASSES`` (DeepSpeed's own, numpy's arrays, scalars and dtypes) besides what torch's
   safe unpickler allows.

``--trust-checkpoint`` (``trust=True``) restores DeepSpeed's own loader, with a warning.  A load answered from a
plan (another world size, an NVMe optimizer) first CRC-checks the source ranges each rank's files read and agrees on
the verdict (``check_agreed``).
"""
from __future__ import annotations

import functools
import re
import sys
from typing import Any

from ..errors import UnsafeCheckpointError
from ..formats.pickle_tree import DEEPSPEED_CLASSES, NUMPY_CLASSES, RECORD_CLASSES, foreign_classes

TRUST_HINT = ("if you trust whoever wrote it, pass --trust-checkpoint (in Python: engine.load_checkpoint(..., trust=True) "
              "on an engine given enable_async_save); its pickles may then run code")


def check_checkpoint_classes(ckpt) -> None:
    """Refuse (typed error naming file and class) a checkpoint DeepSpeed's loader would run code for."""
    for tf in [f for leaf in ckpt.leaves for f in leaf.model_files + leaf.optim_files]:
        foreign = foreign_classes(tf.obj)
        if foreign:
            raise UnsafeCheckpointError(
                f"names {', '.join(sorted(foreign)[:5])}, beyond DeepSpeed's own classes; "
                "loading it through DeepSpeed would run its pickle code", hint=TRUST_HINT, at=tf.path)


def safe_torch_load(path, map_location=None, name: str | None = None, mmap: bool = False):
    """``torch.load(path, weights_only=True)`` allowing DeepSpeed's own classes (``name``: what errors call ``path``;
    ``mmap``: tensors mapped from the file, not read)."""
    import torch
    from torch.serialization import safe_globals

    allowed = [_import(cls) for cls in DEEPSPEED_CLASSES + RECORD_CLASSES] + _numpy_allowed()
    try:
        with safe_globals(allowed):
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as exc:  # torch raises UnpicklingError (wrapped in various ways) for a foreign global
        match = re.search(r"(?:Unsupported global|GLOBAL) ([\w.]+)", str(exc))
        if match is None:
            raise
        raise UnsafeCheckpointError(f"names {match.group(1)}, beyond DeepSpeed's own classes; refused "
                                    "(weights_only load)", hint=TRUST_HINT, at=name or path) from None


@functools.cache
def _numpy_allowed() -> list:
    """numpy's rebuilders under the names this numpy pickles with, and its dtype classes (torch's weights-only
    unpickler asks for the class of each dtype it BUILDs); none where numpy is absent."""
    try:
        import numpy as np
    except ImportError:
        return []
    found = []
    for dotted in NUMPY_CLASSES:
        try:
            found.append(_import(dotted))
        except (ImportError, AttributeError):  # (numpy 1.x has no numpy._core)
            pass
    return found + sorted({type(np.dtype(code)) for code in np.typecodes["All"]}, key=str)


def _import(dotted: str):
    module, _, name = dotted.rpartition(".")
    __import__(module)
    return getattr(sys.modules[module], name)


def install(engine, trust: bool = False) -> None:
    """Route ``engine``'s checkpoint loads through the safe loader (or, with ``trust``, DeepSpeed's)."""
    loader = engine.checkpoint_engine
    original = getattr(loader, "_dsckpt_original_load", None) or loader.load
    loader._dsckpt_original_load = original
    if trust:
        loader.load = original
        print("dsckpt: warning: --trust-checkpoint: DeepSpeed unpickles this checkpoint without weights_only; "
              "its pickles may run code", file=sys.stderr)
    else:
        loader.load = safe_torch_load


def reads_file(name: str, engine: Any) -> bool:
    """Whether this rank's DeepSpeed load reads the planned file ``name``: every model-states file (it checks rank 0's)
    and its own optimizer file."""
    import torch.distributed as dist

    from ..zero.layout import RANK_FILE_RE

    found = RANK_FILE_RE.match(name)
    group = getattr(engine.optimizer, "dp_process_group", None)
    return found is None or found.group("kind") == "model" or int(found.group("dp") or 0) == dist.get_rank(group=group)


def check_agreed(engine: Any, files: list[Any]) -> None:
    """The source ranges of ``files`` CRC-checked (a partition's storage whole), then agreed: a damaged byte any
    rank's files read is every rank's error, raised before DeepSpeed reads anything (no rank waits in its
    collectives for one that stopped)."""
    import copy

    import torch.distributed as dist

    from ..errors import DsckptError
    from ..io.integrity import check_sources
    from ..plan.segments import planned_pieces

    failure = None
    try:
        check_sources([piece for f in files for piece in planned_pieces(f.tree)])
    except DsckptError as exc:
        failure = exc
    every: list[Any] = [None] * dist.get_world_size() if dist.is_initialized() else [failure]
    if dist.is_initialized():
        dist.all_gather_object(every, failure)
    first = next((f for f in every if f is not None), None)
    if first is not None:
        raise copy.copy(first)
