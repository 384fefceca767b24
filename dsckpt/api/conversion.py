"""Conversion API: ``convert(ckpt, out, to=...)`` writes a ZeRO run's training state - weights, Adam's
moments and steps, param-group settings - for another system to carry on.

* ``to="dcp"``: a ``torch.distributed.checkpoint`` folder in the layout ``get_state_dict(model, optimizer)``
  gives (``export.dcp``): FSDP2 and any DCP user load it at any world size with ``dcp.load`` +
  ``set_state_dict``.
* ``to="universal"``: DeepSpeed's universal checkpoint (``plan.universal``), what ``ds_to_universal`` writes,
  loaded by ``engine.load_checkpoint`` with ``{"checkpoint": {"load_universal": true}}`` at any world size.

Steps:
1. open the checkpoint and plan the training state (``plan.training_state``; refusals by name first);
2. check OUT (not an input, not existing unless ``force``); keep written pickles to allowed classes;
3. write into a temp folder beside OUT, one tensor at a time (DCP through torch's own writer; universal
   files through ``io.torch_writer``, no torch needed);
4. read the universal result back with dsckpt's reader; write the client-state sidecar beside a DCP folder;
5. rename into place (with ``fsync``, the default, everything flushed first).
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from ..errors import InconsistentCheckpointError, OutputError
from ..export.sidecar import sidecar_paths, write_sidecar
from ..formats.pickle_policy import foreign_classes
from ..io.output import check_output, staged, write_errors
from ..io.read import Reader
from ..io.torch_writer import write_archive
from ..plan.training_state import build_training_state
from ..plan.universal import UniversalFile, UniversalPlan, build_universal_plan
from .resharding import allowed_tree, dropped_notes, trusted_notes
from ..zero import layout as L
from ..zero.reader import open_checkpoint

TARGETS = ("dcp", "universal")


@dataclass(frozen=True)
class ConvertResult:
    out: Path
    to: str
    tag: str
    zero_stage: int
    tensors: int  # tensors written (moments and steps included)
    nbytes: int
    files: tuple[str, ...]
    notes: tuple[str, ...] = ()


def convert(checkpoint: str | os.PathLike, out: str | os.PathLike, to: str, *, tag: str | None = None,
            weights_only: bool = False, force: bool = False, fsync: bool = True, trust: bool = False,
            progress: Callable[[int], None] | None = None,
            progress_total: Callable[[int], None] | None = None) -> ConvertResult:
    """Write ``checkpoint`` (one tag) as ``to`` ("dcp" | "universal") into the folder ``out``.

    ``weights_only`` (dcp): the model half only.  ``trust``: follow links out of the checkpoint.
    """
    if to not in TARGETS:
        raise OutputError(f"--to {to!r}: expected one of {', '.join(TARGETS)}")
    if weights_only and to != "dcp":
        raise OutputError("--weights-only: a universal checkpoint is optimizer state by definition",
                          hint="leave --weights-only out, or use dsckpt consolidate for the weights")
    if to == "dcp":
        _require_torch()
    ckpt = open_checkpoint(checkpoint, tag)
    if not trust:
        L.require_contained(ckpt.layout)
    ckpt.require_complete()
    state = build_training_state(ckpt, weights_only=weights_only)
    out = Path(out)
    inputs = [f.path for f in ckpt.layout.all_files]
    check_output(out, inputs, force, directory=True, tree=ckpt.layout.root)
    notes: list[str] = []
    if to == "universal":
        plan, kept_notes = _carry_only_allowed(build_universal_plan(ckpt, state), ckpt, trust)
        notes += kept_notes
        total = plan.nbytes
        tensors = sum(1 for f in plan.files if f.name.startswith(f"{L.UNIVERSAL_DIR}/")
                      and not f.name.endswith(L.UNIVERSAL_OPTIMIZER_FILE))
    else:
        tensors = len(state.model.tensors) + sum(1 + len(p.moments) for p in state.params)
        total = state.model.nbytes + sum(t.nbytes for p in state.params for t in p.moments.values())
        for sidecar in sidecar_paths(out):
            check_output(sidecar, inputs, force)
    if progress_total:
        progress_total(total)
    with staged(fsync) as stage, write_errors(out):
        tmp = stage.temp_for(out, directory=True)
        if to == "universal":
            _write_universal(plan, tmp, progress, trust)
            names = [f"{plan.tag}/{f.name}" for f in plan.files] + [f"{plan.tag}/{n}" for _, n in plan.copies]
            names.append(L.LATEST_UNIVERSAL_FILE)
        else:
            from ..export.dcp import write_dcp

            tmp.rmdir()  # torch's writer makes its own folder
            write_dcp(state, tmp, progress, fsync)
            names = sorted(p.name for p in tmp.iterdir())
            if ckpt.client_state:
                write_sidecar(ckpt.client_state, out, stage)
                notes.append(f"client state (not part of DCP's layout) in {sidecar_paths(out)[0].name}")
    if weights_only:
        notes.append("weights only: no optimizer state written")
    return ConvertResult(out, to, ckpt.layout.tag_dir.name, ckpt.zero_stage, tensors, total,
                         tuple(str(out / n) for n in names), tuple(notes))


def _carry_only_allowed(plan: UniversalPlan, ckpt, trust: bool) -> tuple[UniversalPlan, list[str]]:
    """As reshard does (``api.resharding.allowed_tree``): a model-states file whose client state names a class
    beyond DeepSpeed's own is rewritten without that entry (a note says so) instead of copied; such a class in
    the optimizer state is refused.  ``trust``: copied as recorded, with a note."""
    if trust:
        trees = [f.tree for f in plan.files] + [tf.obj for tf in ckpt.model_files]
        return plan, list(trusted_notes(trees, "DeepSpeed's load_checkpoint of OUT_DIR"))
    dropped: dict[str, set[str]] = {}
    files = [replace(f, tree=allowed_tree(f.tree, ckpt.optim_files[0].path, True, dropped)) for f in plan.files]
    copies = []
    model_files = {tf.path: tf for tf in ckpt.model_files}
    for source, name in plan.copies:
        tree = model_files[source].obj
        if foreign_classes(tree):
            files.append(UniversalFile(name, allowed_tree(tree, source, False, dropped)))
        else:
            copies.append((source, name))
    return replace(plan, files=tuple(files), copies=tuple(copies)), list(dropped_notes(dropped))


def _require_torch() -> None:
    from ..errors import MissingExtraError, missing_modules

    if missing_modules("torch"):
        raise MissingExtraError("--to dcp writes through torch.distributed.checkpoint: torch is not installed",
                                hint="pip install torch  (--to universal needs no torch)")


def _write_universal(plan, root: Path, progress, trust: bool) -> None:
    tag_dir = root / plan.tag
    with Reader() as reader:
        for f in plan.files:
            path = tag_dir / f.name
            path.parent.mkdir(parents=True, exist_ok=True)
            write_archive(path, f.tree, reader.storage_chunks, progress, allow_foreign=trust)
    for source, name in plan.copies:
        shutil.copyfile(source, tag_dir / name)
        if progress:
            progress(source.stat().st_size)
    (root / L.LATEST_UNIVERSAL_FILE).write_text(plan.tag)
    written = open_checkpoint(root, plan.tag)  # what DeepSpeed's loader looks for, read back
    written.require_complete()
    if not written.universal or written.zero_stage != plan.stage:
        raise InconsistentCheckpointError(f"{root}: wrote a universal checkpoint that reads back as stage "
                                          f"{written.zero_stage} (universal: {written.universal}), meant {plan.stage}")
