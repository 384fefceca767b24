"""``classify(path)``: is this a DeepSpeed checkpoint or a weights file/folder?  Decided once, here.

Every command that accepts either (``inspect``, ``diff``, ``check-finite``, ``load_into``, the
full-weights reader) asks this function.  The rule: a rank file, a tag folder, or a folder holding tag
folders is a DeepSpeed checkpoint - also when a weights file sits beside it (an HF Trainer's
``checkpoint-N/`` may hold a 16-bit ``model.safetensors`` next to ``global_stepN/``; the checkpoint's fp32
masters are the exact values).  Otherwise the first registered format that reads the path owns it.
"""
from __future__ import annotations

import os
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from ..errors import CheckpointNotFoundError
from ..zero.layout import DCP_METADATA, LATEST_FILE, RANK_FILE_RE, checkpoints_below, is_tag_dir, list_tags

if TYPE_CHECKING:
    from ..export.registry import Format
    from ..zero.reader import Checkpoint


@dataclass(frozen=True)
class PathKind:
    kind: Literal["deepspeed", "weights", "unknown"]
    format: Format | None = None  # for "weights": the format that reads it

    @property
    def is_checkpoint(self) -> bool:
        return self.kind == "deepspeed"

    @property
    def reader(self) -> Format:
        """The format of a "weights" path (asked only of one)."""
        if self.format is None:
            raise ValueError(f"a {self.kind} path has no weights format")
        return self.format


def classify(path: str | os.PathLike[str]) -> PathKind:
    """What ``path`` is: ``PathKind("deepspeed")`` for a DeepSpeed checkpoint (a rank file, a tag folder, a folder of
    tags - also an HF ``checkpoint-N`` folder with weights beside its tags), ``PathKind("weights", format)`` for a
    weights file or folder a registered format reads (``.safetensors``, ``.pt``/``.bin``, a sharded folder, a
    Lightning ``.ckpt``), ``PathKind("unknown")`` otherwise.  Reads names and headers only.

    Raises ``CheckpointNotFoundError`` when nothing is at ``path``.  A URL (``s3://``...) is classified from its
    objects' names and headers.
    """
    from ..parallel.readable import readable

    with readable(path, None) as opened:  # (a URL: a local view of its objects' names and headers)
        return _classify_local(Path(opened.path))


def _classify_local(p: Path) -> PathKind:
    if not os.path.lexists(p):
        raise CheckpointNotFoundError("no such file or directory", at=p)
    if p.is_file() and RANK_FILE_RE.match(p.name):
        return PathKind("deepspeed")
    if p.is_dir():
        try:
            if is_tag_dir(p) or list_tags(p):
                return PathKind("deepspeed")
        except OSError:
            pass  # unreadable: the reader that opens it names the problem
    from ..export.registry import for_input  # (the formats only for a path that is not a DeepSpeed checkpoint)

    fmt = for_input(p)
    return PathKind("weights", fmt) if fmt is not None else PathKind("unknown")



def open_local_checkpoint(path: str | os.PathLike[str], tag: str | None = None) -> "Checkpoint":
    """``dsckpt.open_checkpoint``: a local DeepSpeed checkpoint's metadata - no tensor data - as a typed ``Checkpoint``
    (``zero.reader.open_checkpoint``: ``zero_stage``, ``world_size``, ``precision``, ``param_groups``, ``frozen``,
    ``shared``, ``buffers``, ``client_state``, ``problems``).  ``path``: the checkpoint folder, a tag folder or a rank
    file; ``tag``: default what ``latest`` names.  A URL is refused in its own spelling (``CheckpointNotFoundError``):
    the model points into the files, which a bucket's local view would not outlive."""
    from ..formats.storage import local_only
    from ..zero.reader import open_checkpoint

    refusal = CheckpointNotFoundError("open_checkpoint reads a local folder",
                                      hint="for a bucket: `dsckpt inspect URL --json`, dsckpt.load_state_dict(URL), "
                                           "dsckpt.verify(URL), or copy the checkpoint down first", at=path)
    return open_checkpoint(local_only(path, refusal), tag)


def weights_in(path: Path) -> Path | None:
    """The weights ``path`` is (a file or sharded folder a format reads), or holds (a ``save_pretrained`` folder
    without an index: the first weights file in it); None for anything else."""
    kind = classify(path)
    if kind.kind == "weights":
        return path
    if kind.kind == "unknown" and path.is_dir() and not (path / LATEST_FILE).exists():
        from ..export.registry import weights_file_in

        return weights_file_in(path)
    return None


def require_checkpoint(path: str | os.PathLike[str]) -> None:
    """A weights file or folder where a DeepSpeed checkpoint is needed (``consolidate``, ``reshard``, ``convert``):
    say what it is and what takes it.  A path absent here (a host without that folder) is left to the reader."""
    p = Path(path)
    if not os.path.lexists(p):
        return
    kind = classify(p)
    if kind.kind != "deepspeed" and p.is_dir() and (checkpoints_below(p) or (p / DCP_METADATA).is_file()):
        return  # an HF output_dir, a DCP folder: the reader says what it is (not a model file or sidecar inside it)
    found = weights_in(p)
    if found is not None:
        kind, p = classify(found), found
    if kind.kind != "weights":
        return
    what = "folder" if p.is_dir() else "file"
    quoted = shlex.quote(str(p))
    raise CheckpointNotFoundError(
        f"a {kind.reader.name} weights {what} (full tensors), not a DeepSpeed checkpoint's rank files",
        hint=f"weights load with `dsckpt resume --full-weights {quoted}` or dsckpt.load_into(model, {str(p)!r}); "
             f"`dsckpt diff CKPT {quoted}` compares them with a checkpoint, `dsckpt inspect {quoted}` describes them", at=p)
