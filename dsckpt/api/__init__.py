"""The public operations, over the layers: consolidate, convert, into_deepspeed, reshard, load_into, classify (and reading a
checkpoint's state dict into memory).  Imported lazily: ``consolidate``, ``reshard`` and ``convert(to="universal")`` need neither
torch nor DeepSpeed; ``load_into`` and the state-dict readers need torch."""
from __future__ import annotations

from typing import Any

_WHERE = {
    "consolidate": "consolidation", "convert": "conversion", "load_state_dict": "consolidation", "iter_state_dict": "consolidation",
    "verify_output": "consolidation", "reshard": "resharding", "load_into": "loading", "classify": "paths",
    "into_deepspeed": "ingest", "WriteOptions": "options", "list_tags": "catalog", "prune": "catalog",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(name)
    from importlib import import_module

    return getattr(import_module(f"{__name__}.{_WHERE[name]}"), name)
