"""What may be written back into a DeepSpeed checkpoint without carrying pickle code: DeepSpeed's own classes,
plain data and tensors.  A client-state entry naming any other class is left out (with a note); such a class under
one of DeepSpeed's own keys, or in an optimizer file, is refused - leaving it out would break the checkpoint.
Used by ``reshard`` and by ``convert --to universal``.
"""
from __future__ import annotations

from typing import Any, Iterable

from ..errors import UnsafeCheckpointError
from ..formats.pickle_tree import foreign_classes
from . import layout as L


def allowed_tree(tree: Any, where: object, optimizer: bool, dropped: dict[str, set[str]]) -> Any:
    """``tree`` (a rank file's) without its client-state entries that name foreign classes (recorded in
    ``dropped``); such a class under one of DeepSpeed's own keys, or anywhere in an optimizer file, is refused."""
    if not isinstance(tree, dict):
        return tree
    kept = type(tree)()
    for key, value in tree.items():
        found = foreign_classes(value)
        if found:
            if key in L.DEEPSPEED_KEYS or optimizer:
                raise UnsafeCheckpointError(
                    f"entry {str(key)[:80]!r} names {', '.join(sorted(found)[:3])}, beyond "
                    "DeepSpeed's own classes; writing it would carry its pickle code", hint=L.TRUST_HINT, at=where)
            dropped.setdefault(str(key), set()).update(found)
            continue
        kept[key] = value
    return kept


def dropped_notes(dropped: dict[str, set[str]]) -> tuple[str, ...]:
    return tuple(f"client-state entry {k!r} left out: it holds objects of {', '.join(sorted(c)[:3])}, whose "
                 "pickles would run code when DeepSpeed loads OUT_DIR (--trust-checkpoint keeps it)"
                 for k, c in sorted(dropped.items()))


def trusted_notes(trees: Iterable[Any], loader: str) -> tuple[str, ...]:
    found = sorted({c for tree in trees for c in foreign_classes(tree)})
    return (f"--trust-checkpoint: objects of {', '.join(found[:5])} copied as recorded; {loader} runs their "
            "pickle code",) if found else ()
