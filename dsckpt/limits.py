"""Resource limits for reading untrusted checkpoints: every size a file declares is checked against one.

A checkpoint is a set of numbers and pickles written by someone else.  Each limit below bounds what
a declared size can make dsckpt allocate, read or print; crossing one is a ``LimitExceededError``
that names the file, the quantity and the limit.  Defaults are far above what real DeepSpeed,
Lightning and HF checkpoints hold (measured: a 330M-parameter ZeRO-3 checkpoint's largest data.pkl
is 0.2 MiB, its deepest nesting 9, its `latest` 6 bytes).  Each can be raised through an environment
variable named ``DSCKPT_<NAME>`` (e.g. ``DSCKPT_MAX_PICKLE_BYTES=4294967296``).
"""
from __future__ import annotations

import os

from .errors import LimitExceededError

_DEFAULTS = {
    "MAX_PICKLE_BYTES": 256 << 20,  # one data.pkl (metadata only: tensor bytes live outside it)
    "MAX_CONTAINER_ITEMS": 10_000_000,  # set/frozenset/bytearray built by a pickle from one argument
    "MAX_NESTING": 500,  # containers inside containers (JSON encoders and printers recurse)
    "MAX_VALUES": 5_000_000,  # values in one data.pkl, a shared reference counted at each use (as encoders expand it)
    "MAX_WORLD_SIZE": 1 << 16,  # data-parallel ranks a checkpoint may record
    "MAX_LATEST_BYTES": 4096,  # the `latest` file holds one tag name
    "MAX_JSON_BYTES": 256 << 20,  # index.json, a client-state sidecar
    "MAX_LISTED_PROBLEMS": 20,  # problems of one kind listed before a count stands for the rest
}


def limit(name: str) -> int:
    """The limit ``name``: ``$DSCKPT_<name>`` if set to an integer, else the default."""
    raw = os.environ.get(f"DSCKPT_{name}")
    if raw is not None:
        try:
            return int(raw)
        except ValueError:
            pass
    return _DEFAULTS[name]


def check(name: str, value: int, where: str, what: str) -> None:
    """Raise ``LimitExceededError`` when ``value`` exceeds ``limit(name)``."""
    bound = limit(name)
    if value > bound:
        raise LimitExceededError(f"{what} is {value:,}, above the limit of {bound:,}",
                                 hint=f"if the file is trusted and this is intended, set DSCKPT_{name} higher", at=where)


def defaults() -> dict[str, int]:
    return dict(_DEFAULTS)
