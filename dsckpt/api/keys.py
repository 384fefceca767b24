"""A module's state-dict entries and how a weights source's names and shapes fit them (needs torch).

One walk (``state_slots``: what ``state_dict()`` names - every parameter under each name it is tied
to, persistent buffers) and one comparison (``compare``), shared by ``load_into`` and the full-weights
resume, so both say the same thing about the same mismatch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import StateDictMismatchError

MAX_LISTED = 5


def state_slots(model: Any) -> dict[str, tuple[object, str, bool]]:
    """name -> (owning module, attribute, is a parameter), in module order; tied tensors under each name."""
    out = {}
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        prefix = f"{mod_name}." if mod_name else ""
        for attr, p in mod._parameters.items():
            if p is not None:
                out[prefix + attr] = (mod, attr, True)
        for attr, b in mod._buffers.items():
            if b is not None and attr not in mod._non_persistent_buffers_set:
                out[prefix + attr] = (mod, attr, False)
    return out


def full_shape(tensor: Any) -> tuple[int, ...]:
    """A tensor's whole shape, also for a ZeRO-3 partitioned parameter (whose ``shape`` is empty)."""
    return tuple(getattr(tensor, "ds_shape", tensor.shape))


def tie_groups(model: Any) -> dict[str, tuple[str, ...]]:
    """name -> every state-dict name sharing its tensor (only for tied tensors)."""
    by_tensor: dict[int, list[str]] = {}
    for name, (mod, attr, _) in state_slots(model).items():
        by_tensor.setdefault(id(getattr(mod, attr)), []).append(name)
    return {n: tuple(names) for names in by_tensor.values() if len(names) > 1 for n in names}


@dataclass
class KeyReport:
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)  # name, source, model

    def problems(self, strict: bool = True) -> list[str]:
        """What a load refuses: names (``strict`` only) and shapes (always)."""
        parts = []
        for label, names in (("missing", self.missing if strict else []),
                             ("unexpected", self.unexpected if strict else [])):
            if names:
                parts.append(f"{len(names)} {label} key{'s' * (len(names) != 1)} ({_listed(names)})")
        if self.mismatched:
            name, source, model = self.mismatched[0]
            parts.append(f"{len(self.mismatched)} of another shape ({name}: {list(source)} in the file, "
                         f"{list(model)} in the model{', ...' if len(self.mismatched) > 1 else ''})")
        return parts

    def raise_for(self, source: object, strict: bool = True, hint: str | None = None) -> None:
        problems = self.problems(strict)
        if problems:
            raise StateDictMismatchError("does not match the model: " + "; ".join(problems), at=source,
                                         hint=hint or "strict=False (--no-strict) loads what matches and reports "
                                                      "the rest; --strip-prefix removes a wrapper's prefix")


def compare(expected: dict[str, tuple[int, ...]], available: dict[str, tuple[int, ...]],
            tied: dict[str, tuple[str, ...]] | None = None) -> KeyReport:
    """The model's ``expected`` names and shapes against a source's ``available`` ones; a name the source
    lacks is not missing when a name ``tied`` to it is there (one stored copy fills both)."""
    tied = tied or {}
    report = KeyReport()
    for name, shape in expected.items():
        if name in available:
            if tuple(available[name]) != tuple(shape):
                report.mismatched.append((name, tuple(available[name]), tuple(shape)))
        elif not any(other in available for other in tied.get(name, ())):
            report.missing.append(name)
    report.unexpected = [n for n in available if n not in expected]
    return report


def _listed(names: list[str]) -> str:
    more = f", ... (+{len(names) - MAX_LISTED} more)" if len(names) > MAX_LISTED else ""
    return ", ".join(names[:MAX_LISTED]) + more
