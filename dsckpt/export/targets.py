"""Conversion targets (``convert --to``) as plug-ins, as output formats are (``export.registry``).

A ``Target`` writes a ZeRO run's training state (``plan.training_state``) as a folder another system loads:
1. ``check(request)``: refusals that need no checkpoint (an option it does not take, a missing extra);
2. ``prepare(ckpt, state, request)``: everything decided before a byte moves - what is written, the notes, the
   byte total and the source pieces its writer reads (a distributed run moves those to the writer first);
3. ``write(prepared, tmp, staging, context)``: the files into the staged folder ``tmp`` (``staging`` takes
   files that go beside it), every reader and writer given ``context`` (``io.context.WriteContext``); returns the
   names written under ``tmp``.
The built-ins (``universal``, ``dcp``) import themselves on first use; ``register_target`` adds one beside them.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import OutputError
from .plugins import Plugins

if TYPE_CHECKING:
    from ..io.context import WriteContext
    from ..io.output import Staging

BUILTIN_MODULES = ("universal", "dcp")


@dataclass(frozen=True)
class ConvertRequest:
    weights_only: bool = False  # the model half only (a target that cannot do that refuses it in ``check``)
    trust: bool = False  # copy objects of foreign classes as recorded
    fsync: bool = True
    client_state: bool = True


@dataclass(frozen=True)
class PreparedConversion:
    target: "Target"
    tag: str
    tensors: int  # tensors written (moments and steps included)
    nbytes: int
    notes: tuple[str, ...]
    pieces: tuple[Any, ...]  # the Segments its writer reads
    whole_files: tuple[Path, ...]  # files its writer copies whole
    detail: Any = None  # the target's own plan


class Target:
    name: str = ""
    summary: str = ""
    stores_client_state: bool = False  # else the verb writes the client-state sidecar beside OUT

    def check(self, request: ConvertRequest) -> None:
        """Refuse a request this target cannot serve, before the checkpoint is read."""

    def prepare(self, ckpt, state, request: ConvertRequest) -> PreparedConversion:
        raise NotImplementedError

    def write(self, prepared: PreparedConversion, tmp: Path, staging: "Staging", context: "WriteContext") -> list[str]:
        raise NotImplementedError


_TARGETS: Plugins[Target] = Plugins("convert target", __package__, BUILTIN_MODULES)


def register_target(target: Target, *, replace: bool = False) -> Target:
    """Add ``target`` (the built-ins stay); a name already taken is refused unless ``replace``."""
    return _TARGETS.register(target, replace)


def targets() -> dict[str, Target]:
    """Every registered target by name, built-ins first."""
    return _TARGETS.all()


def target_named(name: str) -> Target:
    found = targets().get(name)
    if found is None:
        raise OutputError(f"--to {name!r}: expected one of {', '.join(targets())}")
    return found
