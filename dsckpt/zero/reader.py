"""The checkpoint model: one tag of a DeepSpeed checkpoint as plain metadata, read safely.

``open_checkpoint(path)`` does, in order:
1. ``layout.discover`` - pick the tag and list the rank files;
2. parse every rank file's pickle with ``torchzip.TorchFile`` (metadata only, no tensor bytes);
3. derive stage, world size, parameter groups, frozen / tied / buffer names, client state;
4. check the files against the world size they record.  Problems are collected, not raised, so
   ``inspect`` can list them; ``Checkpoint.require_complete()`` raises the first as a typed error.
"""
from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import TYPE_CHECKING, Any, Collection, NoReturn

from . import layout as L
from .grid import GridShape
from .problems import Problem, check_ranks, check_same_run, short
from ..dtypes import label
from ..saves_in_flight import settle
from ..limits import check
from ..errors import (DsckptError, InconsistentCheckpointError, MissingRankError, UnsupportedCheckpointError)
from ..formats.pickle_policy import TensorRef
from ..formats.pickle_tree import opaque_int
from ..formats.torchzip import TorchFile

if TYPE_CHECKING:
    from .experts import Experts
    from .tensor_parallel import Split
    from .optim_state import RankState


@dataclass
class Checkpoint:
    layout: L.Layout
    zero_stage: int
    world_size: int
    mp_world_size: int
    ds_version: str | None
    precision: str  # dtype of the module's parameters as trained: fp32 / bf16 / fp16
    global_steps: int | None
    model_files: list[TorchFile]  # stage 0-2: one; stage 3: one per dp rank, in rank order
    optim_files: list[TorchFile]  # one per dp rank, in rank order (none at stage 0)
    param_groups: list[dict[str, tuple[int, ...]]]  # trainable, per optimizer group, in flat order
    frozen: dict[str, tuple[int, ...]]
    shared: dict[str, str]  # alias -> source
    buffers: dict[str, TensorRef]
    client_state: dict[str, Any]
    problems: list[Problem] = field(default_factory=list)
    # stage 3: parameters `module` names (as empty placeholders) that no shape list records, so no rank
    # file holds their values - ones in no optimizer group, or frozen ones of a DeepSpeed that did not save them
    unsaved: tuple[str, ...] = ()
    universal: bool = False  # ds_to_universal's layout: trainable parameters in zero/<name>/*.pt, no optim files
    grid: GridShape = GridShape()  # ranks along (tp, pp, dp, ep) that wrote files (zero.grid)
    experts: "Experts | None" = None  # a DeepSpeed-MoE run's layers, expert files and expert optimizer groups
    # tensor parallel: one data-parallel checkpoint per TP rank (its mp_rank_XX files), and how each parameter
    # was split over them (zero.tensor_parallel; None before it is asked for)
    tp_slices: "tuple[Checkpoint, ...]" = ()
    tp_info: dict[str, Any] = field(default_factory=dict)
    # pipeline parallel: one checkpoint per stage, and (in each) its layers' tensors from the layer_XX files
    # under PipelineModule's names ({layer}.{key}), which stand in for the `module` DeepSpeed leaves None
    pp_slices: "tuple[Checkpoint, ...]" = ()
    layers: dict[str, Any] = field(default_factory=dict)

    @property
    def module(self) -> dict[str, Any]:
        return self.model_files[0].obj.get(L.MODULE) or self.layers

    @cached_property
    def optimizer_states(self) -> "list[RankState]":
        """Per rank: fp32 and Adam-moment partitions per flat group, hyper-parameters, loss scaler."""
        from .optim_state import rank_states

        return rank_states(self)

    @cached_property
    def frozen_fragments(self) -> list[dict[str, TensorRef]]:
        """Per model-states file, frozen name -> its stored tensor (stage 2: the whole parameter in rank
        0's file; stage 3: each rank's part); [] when frozen parameters live only in ``module`` (ZeRO-1)."""
        out = []
        for f in self.model_files:
            fragments = f.obj.get(L.FROZEN_PARAM_FRAGMENTS)
            if not fragments:
                return []
            out.append({n: _typed(t, TensorRef, f.path, f"{L.FROZEN_PARAM_FRAGMENTS}.{n}")
                        for n, t in _typed(fragments, dict, f.path, L.FROZEN_PARAM_FRAGMENTS).items()})
        return out

    @cached_property
    def stage0_masters(self) -> dict[str, TensorRef]:
        """ZeRO-0 16-bit runs: name -> fp32 master (reads the 16-bit weights once; see ``stage0``)."""
        from .stage0 import match_masters

        return match_masters(self)

    @cached_property
    def trainable(self) -> dict[str, tuple[int, ...]]:
        return {name: shape for group in self.param_groups for name, shape in group.items()}

    def optimizer_state_keys(self) -> tuple[str, ...]:
        """The per-element optimizer state every flat group holds (Adam: ``exp_avg``, ``exp_avg_sq``); () at stage 0
        and for universal checkpoints (read from their files)."""
        if not self.zero_stage or self.universal:
            return ("exp_avg", "exp_avg_sq") if self.universal else ()
        held = [tuple(g.moments) for r in self.optimizer_states for g in r.groups]
        return tuple(k for k in held[0] if all(k in h for h in held)) if held else ()

    @property
    def leaves(self) -> "tuple[Checkpoint, ...]":
        """Every slice that holds rank files itself (each pipeline stage's TP ranks; the checkpoint itself when it
        is one slice): what a check of every file walks (``plan.joins`` joins them)."""
        parts = self.pp_slices or self.tp_slices
        return tuple(leaf for s in parts for leaf in s.leaves) if parts else (self,)

    @property
    def every_model_file(self) -> list[TorchFile]:
        """The model-states files of every TP rank and pipeline stage (``model_files``: the first's, which head the
        checkpoint)."""
        return [f for leaf in self.leaves for f in leaf.model_files]

    @property
    def tp_rank(self) -> int:
        """The TP rank whose files these are (``mp_rank_XX``; 0 without tensor parallelism)."""
        return self.layout.model_files[0].mp_rank if self.layout.model_files else 0

    @cached_property
    def tp_splits(self) -> "dict[str, Split]":
        """Tensor parallel: every parameter's split over the TP ranks (``zero.tensor_parallel``)."""
        from .tensor_parallel import tp_splits

        shapes = [{**s.trainable, **s.frozen} for s in self.tp_slices]
        return tp_splits(self.tp_info, shapes, str(self.model_files[0].path))

    def require_complete(self, *, tensor_parallel: bool = False, pipeline: bool = False) -> None:
        """Raise the first recorded problem as its typed error.  ``tensor_parallel`` / ``pipeline``: the caller
        joins TP slices / pipeline stages; every other caller is refused such a checkpoint by name."""
        if self.problems:
            raise copy.copy(self.problems[0])  # (a copy: the recorded one stays as found)
        if (self.grid.pp > 1 and not pipeline) or (self.grid.tp > 1 and not tensor_parallel):
            raise UnsupportedCheckpointError(
                f"a {self.grid.describe()} checkpoint; this command does not read "
                f"{'pipeline' if self.grid.pp > 1 else 'tensor'}-parallel checkpoints yet",
                hint="dsckpt consolidate and inspect read it", at=self.layout.tag_dir)


def open_checkpoint(path: str | os.PathLike[str], tag: str | None = None) -> Checkpoint:
    """Read a DeepSpeed checkpoint's metadata - no tensor data - into a typed ``Checkpoint``.

    Args:
        path: the checkpoint folder (holding ``latest`` and tag folders), one tag folder, or one rank file.
        tag: the tag to open; default what ``latest`` names (or the only tag).

    Returns:
        ``Checkpoint``: ``zero_stage``, ``world_size``, ``precision``, ``global_steps``, the trainable parameters'
        shapes per optimizer group (``param_groups``), ``frozen``, tied names (``shared``), ``buffers``, the client
        state (pickled objects of unknown classes stay inert records), and ``problems`` found (missing ranks, files
        of two runs...); ``require_complete()`` raises the first.

    Raises:
        CheckpointNotFoundError, TagError, CorruptFileError, UnsafeCheckpointError: the path is not a readable
        checkpoint (each names the file).  No pickle code of the checkpoint ever runs.
    """
    settle()  # a save of this process still in flight: its tag and `latest` once it has finished
    lay = L.discover(path, tag)
    if lay.pipeline_files:
        return _pipeline(lay)
    if len(lay.model_parallel_ranks()) > 1:
        return _tensor_parallel(lay)
    ckpt = _open(lay)
    if ckpt.mp_world_size > 1 and not lay.pipeline_files:
        ckpt.problems.append(MissingRankError(f"records {ckpt.mp_world_size} tensor-parallel ranks (mp world size), "
                                              f"but only TP rank {lay.model_parallel_ranks()[0]}'s files are in its "
                                              "folder", at=lay.model_files[0].path))
    return ckpt


def _tensor_parallel(lay: L.Layout, slices: list[Checkpoint] | None = None) -> Checkpoint:
    """One checkpoint per TP rank (its mp_rank_XX files), headed by TP rank 0's (``tensor_parallel.slice_problems``).
    ``slices``: a pipeline stage's, opened by ``_pipeline``."""
    from .tensor_parallel import slice_problems, tp_info

    if slices is None:
        _require_every_mp_rank(lay, "tensor-parallel rank")
        slices = [_open(lay.for_mp_rank(mp)) for mp in lay.model_parallel_ranks()]
    head = slices[0]
    # DeepSpeed records tied names in TP rank 0's file only (0.19.8, ZeRO-3: the others say {})
    slices[1:] = [replace(s, shared=head.shared, unsaved=tuple(n for n in s.unsaved if n not in head.shared))
                  if head.shared and not s.shared else s for s in slices[1:]]
    heads = [(s.model_files[0].path, s.model_files[0].obj, s.mp_world_size) for s in slices]
    problems = [p for s in slices for p in s.problems] + slice_problems(heads)
    return replace(head, layout=lay, problems=problems, tp_slices=tuple(slices), grid=replace(head.grid, tp=len(slices)),
                   tp_info=tp_info(head.model_files[0].obj, head.model_files[0].path))


def _require_every_mp_rank(lay: L.Layout, what: str) -> None:
    ranks = lay.model_parallel_ranks()
    missing = next((mp for mp in range(max(ranks) + 1) if not any(f.mp_rank == mp for f in lay.model_files)), None)
    if missing is not None:
        raise MissingRankError(f"the model-states file of {what} {missing} is missing "
                               f"(files of {what}s {', '.join(map(str, ranks))} are present)", at=lay.tag_dir)


def _pipeline(lay: L.Layout) -> Checkpoint:
    """One checkpoint per pipeline stage (``zero.pipeline``), headed by stage 0's; with TP, each stage's TP ranks
    (``mp_rank_{stage * tp + t}``) joined as ``_tensor_parallel`` joins them."""
    from .pipeline import layer_owners, layer_tensors, recorded_names, tp_degree

    _require_every_mp_rank(lay, "model-parallel rank")
    ranks = lay.model_parallel_ranks()
    tp = tp_degree(lay)
    layers, found = layer_tensors(lay.pipeline_files)
    owner = layer_owners(layers, [recorded_names(lay, stage * tp) for stage in range(len(ranks) // tp)])
    stages = []
    for stage in range(len(ranks) // tp):
        mine = range(stage * tp, (stage + 1) * tp)
        slices = [_open(lay.for_mp_rank(mp), {n: ref for n, ref in layers.get(mp - stage * tp, {}).items()
                                              if owner.get(n) == stage}) for mp in mine]
        stages.append(slices[0] if tp == 1 else _tensor_parallel(lay.for_mp_ranks(mine), slices))
    head = stages[0]
    problems = found + [p for s in stages for p in s.problems]
    return replace(head, layout=lay, problems=problems, pp_slices=tuple(stages), tp_slices=(),
                   grid=replace(head.grid, tp=tp, pp=len(stages)))


def _open(lay: L.Layout, layers: dict[str, TensorRef] | None = None) -> Checkpoint:
    """One data-parallel checkpoint (one TP rank's or pipeline stage's files, or a run without either).
    ``layers``: a pipeline stage's tensors from its layer files (its ``module``: DeepSpeed leaves that None)."""
    problems = list(lay.problems)
    model_files = _parse(lay.model_files, problems)
    optim_files = _parse(lay.optim_files, problems)
    if not model_files:
        _raise(problems[-1])  # nothing to read metadata from
    head = model_files[0].obj
    if not isinstance(head, dict) or L.MODULE not in head or L.BUFFER_NAMES not in head:
        raise UnsupportedCheckpointError("not a DeepSpeed model-states file "
                                         f"(no '{L.MODULE}' / '{L.BUFFER_NAMES}' entries)", at=lay.model_files[0].path)
    where = lay.model_files[0].path
    world = _count(head.get(L.DP_WORLD_SIZE), where, L.DP_WORLD_SIZE)
    mp = _count(head.get(L.MP_WORLD_SIZE), where, L.MP_WORLD_SIZE)
    universal = not lay.optim_files and (lay.tag_dir / L.UNIVERSAL_DIR).is_dir()
    stage = _recorded_stage(head, lay) if universal else _zero_stage(lay, optim_files)
    grid = GridShape(dp=world)
    check_ranks(lay, stage, world, problems, optimizer=not universal)
    check_same_run(model_files, optim_files, world, problems, _expert_groups(stage, head, optim_files))
    buffer_names = _typed(head.get(L.BUFFER_NAMES) or [], list, where, L.BUFFER_NAMES)
    param_groups = [_shapes(g, where, L.PARAM_SHAPES) for g in _typed(head.get(L.PARAM_SHAPES) or [], list, where, L.PARAM_SHAPES)]
    module = _typed(head.get(L.MODULE) or layers or {}, dict, where, L.MODULE)
    shared = _typed(head.get(L.SHARED_PARAMS) or {}, dict, where, L.SHARED_PARAMS)
    trainable = {n for g in param_groups for n in g}
    frozen = _shapes(head.get(L.FROZEN_PARAM_SHAPES) or {}, where, L.FROZEN_PARAM_SHAPES)
    if (stage == 0 and not shared) or L.SHARED_PARAMS not in head:
        shared = _aliases_by_storage(module, trainable | set(frozen), empty_too=stage == 3)
    if stage in (1, 2):  # `module` holds every parameter whole: read from it the ones no shape list records -
        # ZeRO-1's frozen ones, and parameters never given to the optimizer (requires_grad, in no param group)
        frozen.update({n: t.shape for n, t in module.items() if isinstance(t, TensorRef) and n not in trainable
                       and n not in buffer_names and n not in shared and n not in frozen})
    buffers = {n: module[n] for n in buffer_names if isinstance(module.get(n), TensorRef)}
    unsaved = tuple(n for n, t in module.items() if stage == 3 and isinstance(t, TensorRef) and n not in trainable
                    and n not in frozen and n not in buffers and n not in shared)
    for name in buffer_names:
        if name not in buffers:
            problems.append(InconsistentCheckpointError(f"buffer {name!r} listed but not in '{L.MODULE}'",
                                                        at=lay.model_files[0].path))
    client = {k: v for k, v in head.items() if k not in L.DEEPSPEED_KEYS}
    param_dtypes = {t.dtype for n, t in module.items() if isinstance(t, TensorRef) and n not in buffers}
    precision = next((label(d) for d in ("BF16", "F16", "F32") if d in param_dtypes), "fp32")
    experts = _experts(lay, head, param_groups, stage, precision, world, optim_files, problems)
    if experts:
        grid = replace(grid, ep=max(layer.ep_size for layer in experts.layers))
    return Checkpoint(layout=lay, zero_stage=stage, world_size=world, mp_world_size=mp,
                      ds_version=head.get(L.DS_VERSION), precision=precision,
                      global_steps=head.get(L.GLOBAL_STEPS), model_files=model_files, optim_files=optim_files,
                      param_groups=param_groups, frozen=frozen, shared=shared, buffers=buffers,
                      client_state=client, problems=problems, unsaved=unsaved, universal=universal, grid=grid,
                      experts=experts, layers=layers or {})


def _count(value: Any, path: object, key: str) -> int:
    """A world size as recorded: a positive int (absent means 1)."""
    if value is None:
        return 1
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InconsistentCheckpointError(f"'{key}' is {short(value)}, expected a positive integer", at=path)
    check("MAX_WORLD_SIZE", value, str(path), f"'{key}'")
    return value


def _optimizer_groups(stage: int, head: Any, optim_files: list[TorchFile]) -> list[Any]:
    """The torch optimizer's param groups as saved (settings only; 'moe' / 'name' mark expert groups)."""
    try:
        if stage == 0:
            groups: list[Any] = head[L.OPTIMIZER]["param_groups"]
            return groups
        osd = optim_files[0].obj[L.OPTIMIZER_STATE_DICT]
        groups = osd[L.OPTIMIZER_STATE_DICT if stage == 3 else L.BASE_OPTIMIZER_STATE]["param_groups"]
        return groups
    except (KeyError, TypeError, IndexError):
        return []


def _expert_groups(stage: int, head: Any, optim_files: list[TorchFile]) -> dict[int, int]:
    """Optimizer group index -> ep_size, for groups holding experts (partitioned over W / ep_size ranks)."""
    from .experts import EP_GROUP_NAME

    out = {}
    for g, group in enumerate(_optimizer_groups(stage, head, optim_files)):
        match = EP_GROUP_NAME.match(str(group.get("name", ""))) if isinstance(group, dict) and group.get("moe") else None
        if match:
            out[g] = int(match.group(1))
    return out


def _experts(lay: L.Layout, head: dict[str, Any], param_groups: list[Any], stage: int, precision: str, world: int,
             optim_files: list[TorchFile], problems: list[Problem]) -> "Experts | None":
    """A DeepSpeed-MoE run's experts (``zero.experts``); what this version cannot read is a problem, so
    nothing is ever half-converted."""
    if not lay.expert_files:
        return None
    from .experts import check_stage, read_experts

    try:
        experts = read_experts(lay.tag_dir, lay.expert_files, head, param_groups,
                               _optimizer_groups(stage, head, optim_files), world)
        check_stage(stage, precision, lay.tag_dir)
        return experts
    except UnsupportedCheckpointError as exc:
        problems.append(exc)
        return None


def _typed(value: Any, kind: type, path: object, key: str) -> Any:
    if not isinstance(value, kind):
        raise InconsistentCheckpointError(f"'{key}' is a {type(value).__name__}, expected a {kind.__name__}", at=path)
    return value


def _shapes(value: Any, path: object, key: str) -> dict[str, tuple[int, ...]]:
    """A name -> shape map, checked: names are strings, shapes tuples of non-negative ints."""
    _typed(value, dict, path, key)
    for name, shape in value.items():
        if not (isinstance(name, str) and isinstance(shape, tuple) and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise InconsistentCheckpointError(f"'{key}' entry {name!r} is not a name -> shape pair", at=path)
    return dict(value)


def _parse(files: tuple[L.RankFile, ...], problems: list[Problem]) -> list[TorchFile]:
    """Parse each rank file; a broken one becomes a problem so inspect can still report the rest."""
    parsed = []
    for f in files:
        try:
            parsed.append(TorchFile(f.path))
        except DsckptError as exc:
            problems.append(exc)
    return parsed


def _raise(problem: Problem) -> NoReturn:
    raise copy.copy(problem)


def _zero_stage(lay: L.Layout, optim_files: list[TorchFile]) -> int:
    if not optim_files:
        # stage 0 - or a ZeRO-3 save whose optimizer files are gone: its model states hold no weights, so it
        # counts as stage 3 and the missing files are reported (it was read as stage 0: empty tensors out)
        return 3 if any(f.dp_rank is not None for f in lay.model_files) else 0
    osd = optim_files[0].obj.get(L.OPTIMIZER_STATE_DICT) if isinstance(optim_files[0].obj, dict) else None
    if not isinstance(osd, dict) or L.ZERO_STAGE not in osd:
        raise UnsupportedCheckpointError(f"no '{L.ZERO_STAGE}' in the optimizer state", at=lay.optim_files[0].path)
    stage: int = opaque_int(osd[L.ZERO_STAGE])
    if stage not in (1, 2, 3):
        raise UnsupportedCheckpointError(f"unknown zero_stage {stage!r}", at=lay.optim_files[0].path)
    return stage


def _recorded_stage(head: dict[str, Any], lay: L.Layout) -> int:
    """The ZeRO stage a universal checkpoint's run used: its file names, else its recorded config."""
    if any(f.dp_rank is not None for f in lay.model_files):
        return 3
    config = head.get(L.DS_CONFIG)
    zero = config.get("zero_optimization") if isinstance(config, dict) else None
    stage = zero.get("stage") if isinstance(zero, dict) else None
    return stage if stage in (1, 2) else 0


def _aliases_by_storage(module: dict[str, Any], known: Collection[str] = frozenset(),
                        empty_too: bool = False) -> dict[str, str]:
    """Tied names where no ``shared_params`` says so (stage 0; DeepSpeed before it recorded them): names
    viewing the same bytes.  ``empty_too``: stage 3's empty placeholders, one storage per parameter, shared
    only by tied names.  The source is the first name of a group that ``known`` lists, else the first."""
    groups: dict[tuple[Any, ...], list[str]] = {}
    for name, t in module.items():
        if isinstance(t, TensorRef) and (t.numel or empty_too):
            groups.setdefault((t.storage.key, t.offset, t.shape, t.stride), []).append(name)
    aliases: dict[str, str] = {}
    for names in groups.values():
        source = next((n for n in names if n in known), names[0])
        aliases.update((n, source) for n in names if n != source)
    return aliases
