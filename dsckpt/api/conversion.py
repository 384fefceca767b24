"""Conversion API: ``convert(ckpt, out, to=...)`` writes a ZeRO run's training state - weights, optimizer moments
and steps, param-group settings - for another system to carry on.  The targets are plug-ins
(``export.targets``; built-ins ``universal`` and ``dcp``, one module each).

Steps (one process, or every process of a torchrun run with ``group``: the same checks, notes and bytes):
1. the target's own refusals (``Target.check``); the view of the checkpoint (``parallel.view``: the checkpoint
   itself for one process), the training state (``plan.training_state``) and the target's plan
   (``Target.prepare``), the same on every process;
2. check OUT (not an input, not existing unless ``force``; the client-state sidecar's paths too);
3. rank 0 receives the source bytes it lacks (``parallel.transfer``) and writes into a temp folder beside OUT
   (``Target.write``), plus the client-state sidecar for targets that do not hold it;
4. publish (``parallel.outputs.GroupStaging`` over ``io.output.Staging``: with ``fsync``, the default, everything
   flushed first).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..export.sidecar import sidecar_paths, tensors_companion, write_sidecar
from ..export.targets import ConvertRequest, PreparedConversion, Target, target_named
from ..io.context import WriteContext
from ..io.output import check_output, write_errors
from ..parallel.group import ONE_PROCESS
from ..progress import Phase, begin
from .options import DEFAULTS, WriteOptions
from .frame import destination, writing
from ..parallel.outputs import GroupStaging, storage_groups
from ..parallel.transfer import fetch, ranges_held_elsewhere
from ..parallel.view import View
from ..plan.segments import tree_pieces
from ..plan.training_state import build_training_state
from ..zero.reader import Checkpoint


@dataclass(frozen=True)
class ConvertResult:
    """What ``convert`` wrote; the same names as ``dsckpt convert --json`` (docs/cli.md)."""
    out: Path
    to: str
    tag: str
    zero_stage: int
    tensors: int  # tensors written (moments and steps included)
    bytes: int
    files: tuple[str, ...]
    notes: tuple[str, ...] = ()


def convert(checkpoint: str | os.PathLike[str], out: str | os.PathLike[str], to: str, *, tag: str | None = None,
            weights_only: bool = False, options: WriteOptions = DEFAULTS) -> ConvertResult:
    """Write ``checkpoint`` (one tag) as ``to`` (a registered target: "dcp", "universal") into the folder ``out``.

    ``to="dcp"``: a torch.distributed.checkpoint folder in ``get_state_dict(model, optimizer)``'s layout (FSDP2 at
    any world size loads it); ``"universal"``: what DeepSpeed's ``ds_to_universal`` writes.  ``weights_only`` (dcp):
    the model half only.  ``options`` (``WriteOptions``): ``force`` writes into an existing folder (only what
    convert writes is replaced); ``trust`` follows links out of the checkpoint and copies objects of foreign
    classes; ``group``: the processes of a torchrun run (None: one process); ``progress``: a bucket's ``FETCH``,
    then the ``WRITE``.
    Returns a ``ConvertResult`` (the names of ``dsckpt convert --json``).
    """
    group, force, trust = options.group or ONE_PROCESS, options.force, options.trust
    target = target_named(to)
    request = ConvertRequest(weights_only, trust, options.fsync)
    target.check(request)
    with destination(group, out, force) as place:
        out = place.path
        with writing(group, checkpoint, tag, place, trust) as frame:
            view = frame.view
            ckpt, prepared = group.step(lambda: _prepare(view, target, request))
            client = bool(ckpt.client_state) and not target.stores_client_state
            inputs = [view.real_path(f.path) for f in ckpt.layout.all_files]
            tree = view.real_path(ckpt.layout.root)
            group.step(lambda: check_output(out, inputs, force, directory=True, tree=tree) if group.rank == 0 else None)
            groups = storage_groups(group, out)
            staged = frame.stage(GroupStaging(group, groups, out, directory=True, fsync=options.fsync,
                                              publishing={groups.of[0]}))
            clients = tree_pieces(ckpt.client_state) if client else []
            wanted = ranges_held_elsewhere(view, list(prepared.pieces) + clients, prepared.whole_files) \
                if group.rank == 0 else []
            fetch(group, view, wanted, options.progress)
            begin(options.progress, Phase.WRITE, prepared.nbytes)
            with frame.checked_reads(list(prepared.pieces) + clients, options.check_crc,
                                     progress=options.progress) as (context, crc_notes):
                names = group.broadcast(group.step(lambda: _write(prepared, staged, out, client, ckpt, context)
                                                   if group.rank == 0 else None), 0)
            with write_errors(out):
                staged.publish()
        notes = prepared.notes + tuple(crc_notes) + ((f"client state (not part of the {target.name} layout) in "
                                                      f"{sidecar_paths(out, True)[0]}",) if client else ())
        result = ConvertResult(out, target.name, prepared.tag, ckpt.zero_stage, prepared.tensors, prepared.nbytes,
                               tuple(str(out / n) for n in names), notes)
    return place.named(result)


def _prepare(view: View, target: Target, request: ConvertRequest) -> tuple[Checkpoint, PreparedConversion]:
    ckpt = view.open(request.trust)
    with view.real_names():
        ckpt.require_complete(tensor_parallel=True, pipeline=True)
        state = build_training_state(ckpt, weights_only=request.weights_only)
        return ckpt, target.prepare(ckpt, state, request)


def _write(prepared: PreparedConversion, staged: GroupStaging, out: Path, client: bool, ckpt: Checkpoint,
           context: WriteContext) -> list[str]:
    with write_errors(out):
        names = prepared.target.write(prepared, staged.tmp, staged.own, context)
        if client:
            written = write_sidecar(ckpt.client_state, out, staged.own, context, into=staged.tmp)
            names += [p.name for p in (written, tensors_companion(written)) if p.exists()]
    return names
