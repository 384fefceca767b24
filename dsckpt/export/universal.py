"""``convert --to universal``: DeepSpeed's universal checkpoint, what ``ds_to_universal`` writes, tensor for tensor
(``plan.universal``): ``OUT/latest_universal`` + ``OUT/<tag>/zero/<param>/{fp32,exp_avg,exp_avg_sq,step}.pt``,
the optimizer's common state and the model-states files.  Needs neither torch nor DeepSpeed.

Client-state entries naming classes beyond DeepSpeed's own are left out with a note, as ``reshard`` does
(``zero.allowed``); each file's tree is pickled once, in ``prepare``.
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import InconsistentCheckpointError, OutputError
from ..zero import layout as L
from .targets import ConvertRequest, PreparedConversion, Target, register_target

if TYPE_CHECKING:  # (the plans and writers load with the first conversion, not with --help)
    from ..formats.pickle_writer import StorageOut
    from ..io.context import WriteContext
    from ..io.output import Staging
    from ..plan.universal import UniversalFile, UniversalPlan


@dataclass(frozen=True)
class Pickled:
    file: UniversalFile
    data: bytes
    storages: list[StorageOut]


class UniversalTarget(Target):
    name = "universal"
    summary = "DeepSpeed's universal checkpoint (load_universal, any world size)"
    stores_client_state = True  # in the copied model-states files

    def check(self, request: ConvertRequest) -> None:
        if request.weights_only:
            raise OutputError("--weights-only: a universal checkpoint is optimizer state by definition",
                              hint="leave --weights-only out, or use dsckpt consolidate for the weights")

    def prepare(self, ckpt, state, request: ConvertRequest) -> PreparedConversion:
        from ..formats.pickle_writer import dumps
        from ..plan.segments import written_source
        from ..plan.universal import build_universal_plan

        plan, notes = _carry_only_allowed(build_universal_plan(ckpt, state), ckpt, request.trust)
        pickled = []
        for f in plan.files:
            data, storages = dumps(f.tree, request.trust)
            pickled.append(Pickled(f, data, storages))
        tensors = sum(1 for f in plan.files if f.name.startswith(f"{L.UNIVERSAL_DIR}/")
                      and not f.name.endswith(L.UNIVERSAL_OPTIMIZER_FILE))
        nbytes = sum(s.nbytes for p in pickled for s in p.storages) + sum(src.stat().st_size for src, _ in plan.copies)
        pieces = tuple(piece for p in pickled for s in p.storages for piece in written_source(s).pieces)
        return PreparedConversion(self, plan.tag, tensors, nbytes, tuple(notes), pieces,
                                  tuple(src for src, _ in plan.copies), (plan, pickled))

    def write(self, prepared: PreparedConversion, tmp: Path, staging: Staging, context: WriteContext) -> list[str]:
        from ..io.read import Reader
        from ..io.torch_writer import write_pickled

        plan, pickled = prepared.detail
        tag_dir = tmp / plan.tag
        with Reader(context) as reader:
            for p in pickled:
                path = tag_dir / p.file.name
                path.parent.mkdir(parents=True, exist_ok=True)
                write_pickled(path, (p.data, p.storages), reader, context)
        for source, name in plan.copies:
            shutil.copyfile(source, tag_dir / name)
            if context.progress:
                context.progress(source.stat().st_size)
        (tmp / L.LATEST_UNIVERSAL_FILE).write_text(plan.tag)
        _check_written(tmp, plan)
        return [f"{plan.tag}/{f.name}" for f in plan.files] + [f"{plan.tag}/{n}" for _, n in plan.copies] \
            + [L.LATEST_UNIVERSAL_FILE]


def _carry_only_allowed(plan: UniversalPlan, ckpt, trust: bool) -> tuple[UniversalPlan, list[str]]:
    """A model-states file whose client state names a class beyond DeepSpeed's own is rewritten without that
    entry (a note says so) instead of copied; such a class in the optimizer state is refused.  ``trust``:
    copied as recorded, with a note."""
    from ..formats.pickle_tree import foreign_classes
    from ..formats.torchzip import TorchFile
    from ..plan.universal import UniversalFile, UniversalPlan
    from ..zero.allowed import allowed_tree, dropped_notes, trusted_notes

    if trust:
        trees = [f.tree for f in plan.files] + [tf.obj for tf in ckpt.every_model_file]
        return plan, list(trusted_notes(trees, "DeepSpeed's load_checkpoint of OUT_DIR"))
    dropped: dict[str, set[str]] = {}
    files = [UniversalFile(f.name, allowed_tree(f.tree, ckpt.optim_files[0].path, True, dropped)) for f in plan.files]
    copies = []
    model_files = {tf.path: tf for tf in ckpt.every_model_file}
    for source, name in plan.copies:
        tree = model_files[source].obj if source in model_files else TorchFile(source).obj  # (a pipeline's layers)
        if foreign_classes(tree):
            files.append(UniversalFile(name, allowed_tree(tree, source, False, dropped)))
        else:
            copies.append((source, name))
    return UniversalPlan(plan.tag, plan.stage, tuple(files), tuple(copies)), list(dropped_notes(dropped))


def _check_written(root: Path, plan: UniversalPlan) -> None:
    """What DeepSpeed's universal loader looks for, read back with dsckpt's reader."""
    from ..zero.reader import open_checkpoint

    written = open_checkpoint(root, plan.tag)
    written.require_complete(tensor_parallel=True, pipeline=True)
    if not written.universal or written.zero_stage != plan.stage:
        raise InconsistentCheckpointError("wrote a universal checkpoint that reads back as stage "
                                          f"{written.zero_stage} (universal: {written.universal}), meant {plan.stage}", at=root)


register_target(UniversalTarget())
