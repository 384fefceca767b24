"""The consolidation plan: which bytes of which rank file make each output tensor.

``build_plan(ckpt)`` is pure bookkeeping over the checkpoint model (plain frozen dataclasses out,
no file access: every byte range comes from the model's ``TensorRef``s and ``partitioning``).  How each stage
maps partitions to parameters:

* ZeRO-1/2: per param group, rank r holds one flat fp32 partition; the ranks' partitions
  concatenated in rank order are the group's flat buffer, where parameters sit back to back in
  ``param_shapes`` order, each followed by its ``param_alignment_paddings`` entry.
* ZeRO-3: every parameter is split on its own: rank r holds elements
  ``[r*ceil(n/ws), (r+1)*ceil(n/ws))`` (the last rank zero-padded), packed in ``param_shapes``
  order into its flat group(s).  Frozen parameters are split the same way in each rank's
  ``frozen_param_fragments``.
* ZeRO-0: the model-states file holds full tensors; fp32 runs train on them directly, 16-bit runs
  keep fp32 masters per parameter in ``optimizer.fp32_groups``.
* A parallel run (tensor, pipeline): each slice's files planned as above, then joined (``plan.joins``).
"""
from __future__ import annotations

import math
from typing import Callable, Iterable

from ..errors import InconsistentCheckpointError, UnsupportedCheckpointError
from ..zero.partitioning import GroupLayout, stage3_group, stage12_trimmed
from ..dtypes import FLOATING, output_dtype
from ..formats import metadata as M
from ..formats.pickle_policy import TensorRef
from ..zero import layout as L
from ..zero.reader import Checkpoint
from ..formats.torchzip import TorchFile
from .groups import group_layouts, structure_errors
from .names import prefixes, strip_prefix
from .segments import FlatSpace, Piece, read_pieces, ref_segments
from .tensor_plan import Plan, TensorPlan

# how a planner adds one tensor: (name, shape, stored dtype, kind, pieces, output dtype unless --dtype says)
AddTensor = Callable[[str, Iterable[int], str, str, Iterable[Piece], str], None]


def build_plan(ckpt: Checkpoint, dtype: str | None = None, *, exclude_frozen: bool = False,
               strip_prefixes: tuple[str, ...] = (), state: str = "fp32") -> Plan:
    """The full plan: buffers, frozen and trainable parameters, tied aliases, metadata.

    ``state="exp_avg"`` / ``"exp_avg_sq"`` gathers Adam's moments instead of the fp32 masters (any per-element
    optimizer state by its key: ``momentum_buffer``, ``sum``...; trainable parameters only: frozen parameters and
    buffers have none).
    """
    ckpt.require_complete(tensor_parallel=True, pipeline=True)
    if not isinstance(state, str) or not state:
        raise ValueError(f"state must be 'fp32' or an optimizer state key such as 'exp_avg', got {state!r}")
    from .joins import outermost

    join = outermost(ckpt)
    if join is not None:  # a parallel run: each slice planned as a checkpoint of its own, then joined
        plan = join.plan(ckpt, lambda part: build_plan(part, dtype, exclude_frozen=exclude_frozen, state=state))
        strip_prefixes = prefixes(strip_prefixes)
        return strip_prefix(plan, strip_prefixes) if strip_prefixes else plan
    if state != "fp32" and ckpt.zero_stage == 0:
        raise UnsupportedCheckpointError("a ZeRO-0 checkpoint's optimizer moments are not "
                                         "partitioned; dsckpt gathers moments at stages 1-3", at=ckpt.layout.tag_dir)
    moments = state != "fp32"
    out_dtype = output_dtype(dtype)
    tensors: dict[str, TensorPlan] = {}

    def add(name: str, shape: Iterable[int], src_dtype: str, kind: str, pieces: Iterable[Piece],
            default_dtype: str) -> None:
        target = out_dtype if (out_dtype and src_dtype in FLOATING) else default_dtype
        tensors[name] = TensorPlan(name, tuple(shape), src_dtype, target, kind, tuple(pieces))

    with structure_errors(ckpt):
        if ckpt.universal:
            if not exclude_frozen and not moments:
                _plan_frozen(ckpt, add)  # ds_to_universal leaves them in the model states (stage 3: only there)
            _plan_universal(ckpt, add, state)
        elif ckpt.zero_stage == 0:
            _plan_stage0(ckpt, add, exclude_frozen)
        else:
            if not exclude_frozen and not moments:
                _plan_frozen(ckpt, add)
            _plan_flat_groups(ckpt, add, state)
    for name, ref in ({} if moments else ckpt.buffers).items():
        add(name, ref.shape, ref.dtype, "buffer", ref_segments(ref), ref.dtype)
    ordered = _module_order(ckpt, tensors)
    aliases = {a: s for a, s in ckpt.shared.items() if s in tensors and a not in tensors}
    plan = Plan(tuple(ordered), aliases, _metadata(ckpt, ordered, aliases))
    strip_prefixes = prefixes(strip_prefixes)
    return strip_prefix(plan, strip_prefixes) if strip_prefixes else plan


def master_pieces(plan: Plan) -> list[Piece]:
    """The byte ranges of the plan's fp32 trainable tensors (the masters): what a NaN/Inf scan watches."""
    return [p for t in plan.tensors if t.kind == "param" and t.src_dtype == "F32" for p in read_pieces(t)]


def _rank_spaces(ckpt: Checkpoint, state: str, group: int | None = None) -> list[FlatSpace]:
    """Per rank, the flat partition(s) of ``state`` ("fp32", or a per-element state key): one group, or all."""
    spaces = []
    for rank in ckpt.optimizer_states:
        groups = rank.groups if group is None else rank.groups[group:group + 1]
        try:
            spaces.append(FlatSpace([g.fp32 if state == "fp32" else g.moments[state] for g in groups]))
        except KeyError:
            raise InconsistentCheckpointError(f"holds no {state!r} optimizer state", at=rank.path) from None
    return spaces


def _pieces(layout: GroupLayout, index: int, spaces: list[FlatSpace], where: str) -> list[Piece]:
    return [p for span in layout.params[index] for p in spaces[span.rank].pieces(span.rank_start, span.count, where)]


def group_plans(ckpt: Checkpoint, state: str) -> list[TensorPlan]:
    """Optimizer state ``state`` of the parameters whose flat groups hold it - an optimizer that keeps different
    state per group (DeepSpeed's Muon: momentum for its matrices, Adam's moments for the rest)."""
    if ckpt.tp_slices:
        raise UnsupportedCheckpointError("a tensor-parallel run whose optimizer keeps "
                                         f"{state!r} in some param groups only; not joined yet", at=ckpt.layout.tag_dir)
    tensors: list[TensorPlan] = []

    def add(name: str, shape: Iterable[int], src_dtype: str, kind: str, pieces: Iterable[Piece],
            default_dtype: str) -> None:
        tensors.append(TensorPlan(name, tuple(shape), src_dtype, default_dtype, kind, tuple(pieces)))

    with structure_errors(ckpt):
        _plan_flat_groups(ckpt, add, state, holding_only=True)
    return tensors


def _plan_flat_groups(ckpt: Checkpoint, add: AddTensor, state: str, holding_only: bool = False) -> None:
    """Per flat group (``plan.groups``), each parameter's elements from the ranks' partitions that hold them:
    ZeRO-1/2 one padded flat buffer per param group split in equal slices, ZeRO-3 each parameter split on
    its own within each sub-group (``zero.partitioning``)."""
    for group in group_layouts(ckpt):
        g, layout = group.index, group.layout
        if holding_only and any(state not in ckpt.optimizer_states[r].groups[g].moments for r in group.ranks):
            continue
        every_rank = _rank_spaces(ckpt, state, g)
        spaces = [every_rank[r] for r in group.ranks]
        for pos, (rank, space) in enumerate(zip(group.ranks, spaces)):
            trimmed = stage12_trimmed(layout, pos) if state == "fp32" and ckpt.zero_stage != 3 else 0
            if space.numel != layout.partition_numel - trimmed:
                raise InconsistentCheckpointError(f"group {g} partition holds {space.numel} "
                                                  f"elements, the recorded shapes need {layout.partition_numel - trimmed}", at=ckpt.optim_files[rank].path)
        for i, name in enumerate(group.names):
            add(name, group.shapes[i], spaces[0].dtype, "param",
                _pieces(layout, i, spaces, f"{ckpt.layout.tag_dir}: group {g} parameter {name!r}"), "F32")


def _plan_universal(ckpt: Checkpoint, add: AddTensor, state: str) -> None:
    """ds_to_universal's folder: each trainable parameter whole in zero/<name>/<state>.pt (layout.py)."""
    folder = ckpt.layout.tag_dir / L.UNIVERSAL_DIR
    full = {n: s.shape for n, s in ckpt.tp_splits.items()} if ckpt.tp_slices else {}
    for name, shape in ckpt.trainable.items():
        shape = full.get(name, shape)
        if "/" in name or "\\" in name or name in (".", ".."):  # a recorded name must not lead out of zero/
            raise InconsistentCheckpointError(f"parameter name {name!r} is not a folder name", at=ckpt.model_files[0].path)
        path = folder / name / L.UNIVERSAL_STATE_FILES[state]
        if not path.is_file():
            raise InconsistentCheckpointError(f"missing - the universal checkpoint holds no {state} for {name!r}", at=path)
        obj = TorchFile(path).obj
        ref = obj.get(L.UNIVERSAL_PARAM_KEY) if isinstance(obj, dict) else obj
        if not isinstance(ref, TensorRef) or ref.numel != math.prod(shape):
            held = f"{ref.numel} elements" if isinstance(ref, TensorRef) else f"a {type(ref).__name__}"
            raise InconsistentCheckpointError(f"holds {held}, parameter {name!r} of shape {list(shape)} "
                                              f"needs {math.prod(shape)} elements", at=path)
        add(name, shape, ref.dtype, "param", ref_segments(ref), "F32")


def _plan_frozen(ckpt: Checkpoint, add: AddTensor) -> None:
    where = ckpt.model_files[0].path
    if ckpt.unsaved:
        more = f" (+{len(ckpt.unsaved) - 5} more)" if len(ckpt.unsaved) > 5 else ""
        raise UnsupportedCheckpointError(
            f"{len(ckpt.unsaved)} parameters have no saved values: {', '.join(ckpt.unsaved[:5])}{more} "
            f"('{L.MODULE}' holds empty placeholders, '{L.PARAM_SHAPES}' and '{L.FROZEN_PARAM_SHAPES}' do not list them)",
            hint="parameters in no optimizer param group, or frozen ones of a DeepSpeed that did not record them; "
                 "--exclude-frozen writes the rest", at=where)
    fragments = ckpt.frozen_fragments  # stage 2: rank 0's file holds each whole; stage 3: each rank its part
    for name, shape in ckpt.frozen.items():
        n = math.prod(shape)
        if ckpt.zero_stage == 3 and fragments:
            spans = stage3_group([n], ckpt.world_size).params[0]  # each rank's model states: its part
            pieces = [p for span in spans for p in FlatSpace([fragments[span.rank][name]]).pieces(
                0, span.count, f"{ckpt.model_files[span.rank].path}: frozen {name!r}")]
            add(name, shape, fragments[0][name].dtype, "frozen", pieces, "F32")
            continue
        in_fragments = ckpt.zero_stage == 2 and fragments and name in fragments[0]
        # else ZeRO-1, parameters outside the optimizer, older writers: whole in `module`
        ref = fragments[0][name] if in_fragments else ckpt.module.get(name)
        if not isinstance(ref, TensorRef) or ref.numel != n:
            held = f"{ref.numel} elements" if isinstance(ref, TensorRef) else "nothing"
            source = f"'{L.FROZEN_PARAM_FRAGMENTS}'" if in_fragments else f"'{L.MODULE}'"
            gap = f"no '{L.FROZEN_PARAM_FRAGMENTS}' entry; " if not in_fragments and (fragments or ckpt.zero_stage == 3) else ""
            raise InconsistentCheckpointError(f"frozen {name!r} (shape {list(shape)}): {gap}{source} holds "
                                              f"{held} for it", at=where)
        add(name, shape, ref.dtype, "frozen", ref_segments(ref), "F32")


def _plan_stage0(ckpt: Checkpoint, add: AddTensor, exclude_frozen: bool) -> None:
    masters = ckpt.stage0_masters
    for layer in ckpt.experts.layers if ckpt.experts else ():  # fp32 MoE runs: experts whole in their files
        for path in layer.files:
            for name, ref in TorchFile(path).obj.items():
                if not isinstance(ref, TensorRef):
                    raise InconsistentCheckpointError(f"entry {str(name)[:80]!r} is not a tensor", at=path)
                add(str(name), ref.shape, ref.dtype, "param", ref_segments(ref), "F32")
    for name, ref in ckpt.module.items():
        if name in ckpt.buffers or name in ckpt.shared or not isinstance(ref, TensorRef):
            continue
        if name in masters:
            add(name, ref.shape, "F32", "param", ref_segments(masters[name]), "F32")
        elif not exclude_frozen or ckpt.precision == "fp32":  # fp32 runs cannot tell frozen from trainable
            add(name, ref.shape, ref.dtype, "frozen" if masters else "param", ref_segments(ref), "F32")


def _module_order(ckpt: Checkpoint, tensors: dict[str, TensorPlan]) -> list[TensorPlan]:
    """Output in the module's state-dict order (what users expect), extras at the end."""
    order = [tensors[n] for n in ckpt.module if n in tensors]
    seen = {t.name for t in order}
    return order + [t for n, t in tensors.items() if n not in seen]


def _metadata(ckpt: Checkpoint, tensors: list[TensorPlan], aliases: dict[str, str]) -> dict[str, str]:
    import json

    meta = {M.FORMAT: M.FORMAT_PT, M.SOURCE_TAG: ckpt.layout.tag, M.ZERO_STAGE: str(ckpt.zero_stage),
            M.WORLD_SIZE: str(ckpt.world_size), M.TRAINED_PRECISION: ckpt.precision}
    if aliases:
        meta[M.ALIASES] = json.dumps(aliases, sort_keys=True)
    frozen = {t.name: t.src_dtype for t in tensors if t.kind == "frozen"}
    if frozen:
        meta[M.FROZEN_STORED_DTYPES] = json.dumps(frozen, sort_keys=True)
    return meta
