"""Output formats: one registry used by consolidate, ``--verify``, inspect and the resume weights reader.

A format is a ``Format`` record: how OUT's name selects it, how a plan is written into a temp path
(the caller stages and publishes it: ``io.output``), and how a file of that format is listed back
as ``Stored`` tensors (name, dtype, shape, absolute byte range) plus its metadata.  Adding a
format is one new module and one ``register`` call; nothing else chooses by suffix.

Protocol of a write: 1. ``for_output(OUT)`` picks the format; 2. ``fmt.write(plan, temp path,
options, progress)`` writes everything and returns the file names; 3. the caller verifies (reading
back with ``fmt.read``) and renames.
"""
from __future__ import annotations

import math
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..dtypes import ITEMSIZE
from ..errors import OutputError

Progress = Callable[[int], None]


@dataclass(frozen=True)
class Stored:
    """One tensor inside a written file: where its bytes are."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    path: Path
    offset: int  # absolute, first element
    stride: tuple[int, ...] | None = None  # None: contiguous

    @property
    def span_bytes(self) -> int:
        if not all(self.shape):
            return 0
        if self.stride is None:
            return math.prod(self.shape) * ITEMSIZE[self.dtype]
        return (1 + sum((s - 1) * st for s, st in zip(self.shape, self.stride))) * ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class Listing:
    tensors: list[Stored]
    metadata: dict[str, str] = field(default_factory=dict)
    files: list[Path] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)  # what a .pt holds beside its state_dict


@dataclass(frozen=True)
class Format:
    name: str
    suffixes: tuple[str, ...]
    directory: bool  # OUT is a folder
    write: Callable[..., list[str]]  # (plan, temp path, options: dict, progress) -> file names
    read: Callable[[Path], Listing]
    accepts: tuple[str, ...] = ()  # further suffixes allowed when chosen by name (a Lightning .ckpt is a torch file)


FORMATS: dict[str, Format] = {}


def register(fmt: Format) -> Format:
    FORMATS[fmt.name] = fmt
    return fmt


def names_a_folder(out: str | Path) -> bool:
    """OUT written with a trailing slash (``model.safetensors/``) is a folder whatever its suffix."""
    return str(out).endswith(("/", os.sep))


def file_suffix(out: str | Path) -> str:
    """OUT's suffix when it is one a file format claims (any case), else "" (``Qwen2.5-0.5B``: a folder)."""
    suffix = Path(out).suffix.lower()
    _load()
    return suffix if any(suffix in f.suffixes + f.accepts for f in FORMATS.values() if not f.directory) else ""


def for_output(out: str | Path, form: str | None = None) -> Format:
    """The format for OUT: ``form`` when given (checked against OUT's name), else what the name says.

    A known file suffix (any case) picks its format; anything else - no suffix, a suffix no format
    claims (``gpt2-v1.5``), a trailing slash - is a folder.  A name that contradicts ``form``
    (``lt.safetensors`` with ``lightning``, ``model.pt`` with a folder format) is refused: the file
    would lie about what it holds.
    """
    _load()
    suffix = "" if names_a_folder(out) else file_suffix(out)
    if form is None:
        if suffix:
            return next(f for f in FORMATS.values() if not f.directory and suffix in f.suffixes)
        return next(f for f in FORMATS.values() if f.directory)
    fmt = by_name(form)
    if fmt.directory and suffix:
        raise OutputError(f"{out}: ends in {suffix}, a file suffix, but {fmt.name} writes a folder",
                          hint="name the folder without a file suffix (or end it with /)")
    if not fmt.directory and names_a_folder(out):
        raise OutputError(f"{out}: names a folder, but {fmt.name} writes one file")
    if not fmt.directory and suffix and suffix not in fmt.suffixes + fmt.accepts:
        owner = next(f.name for f in FORMATS.values() if suffix in f.suffixes)
        raise OutputError(f"{out}: ends in {suffix}, the suffix of {owner} files, but --format {fmt.name} "
                          f"writes {'/'.join(fmt.suffixes + fmt.accepts)}",
                          hint=f"name it {shlex.quote(str(Path(out).with_suffix(fmt.suffixes[0])))}" if fmt.suffixes else None)
    return fmt


def by_name(name: str) -> Format:
    """A format chosen explicitly (``--hf``, ``--format``) rather than by OUT's suffix."""
    _load()
    if name not in FORMATS:
        raise OutputError(f"unknown output format {name!r}; known: {', '.join(sorted(FORMATS))}")
    return FORMATS[name]


def for_input(path: Path) -> Format | None:
    """The format of an existing consolidated file or folder, or None (e.g. a DeepSpeed checkpoint)."""
    _load()
    if path.is_dir():
        return FORMATS["sharded"] if any(path.glob("*.index.json")) else None
    if path.name.endswith(".index.json"):
        return FORMATS["sharded"]
    if path.name.endswith(("_model_states.pt", "_optim_states.pt")):
        return None  # a DeepSpeed rank file
    return next((f for f in FORMATS.values() if not f.directory and path.suffix.lower() in f.suffixes), None)


def _load() -> None:
    if not FORMATS:
        from . import formats_builtin  # noqa: F401  (registers safetensors, sharded, torch)
