"""How a parallel run's slices join: one ``Join`` per input parallelism, all in this module.

``zero.reader`` reads a parallel run's checkpoint as slices, each a ``Checkpoint`` of its own: a pipeline run's
stages (``pp_slices``), a tensor-parallel run's TP ranks (``tp_slices``).  A ``Join`` answers, for its axis:
* ``slices(ckpt)``: the slices the checkpoint has along it (empty: the run did not use it);
* ``plan(ckpt, build)``: the consolidation plan of the whole, from ``build(slice)`` of each slice;
* ``shapes(ckpt)``: every parameter's shape in the whole (a slice records its own part);
* ``describe(ckpt)``: its section of ``inspect``'s report, named ``section`` (None: the run did not use it);
* ``disjoint``: its slices hold different parameters, each with optimizer groups of its own (a pipeline's stages),
  not parts of the same ones (TP ranks): ``holders(ckpt)`` gives them to what walks groups or module entries.
A reshard moves each slice's files on their own, to the same slices at the new data-parallel size.
``JOINS`` lists them outermost first (a pipeline stage may itself be tensor parallel); ``outermost(ckpt)`` is the
join a plan starts from, None for a checkpoint of one slice.

A new parallelism is the reader filling its slices (``zero/``) and one ``Join`` here, plus a ``ByteSource``
pattern where its tensors join as no list of byte ranges can say (``plan.segments.Interleaved``: a row-parallel
weight's rows).
"""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Protocol

from ..dtypes import ITEMSIZE
from ..errors import InconsistentCheckpointError, UnsupportedCheckpointError
from ..formats import metadata as M
from ..zero.reader import Checkpoint
from .tensor_plan import Plan, Replica, TensorPlan, stored
from .segments import Interleaved, merged

if TYPE_CHECKING:
    from ..zero.tensor_parallel import Split

BuildPlan = Callable[[Checkpoint], Plan]  # one slice's plan (the same options as the whole's)


class Join(Protocol):
    axis: str  # as ``zero.grid.GridShape`` names it
    section: str  # its part of ``inspect``'s report
    disjoint: bool  # its slices hold different parameters (their own optimizer groups), not parts of the same ones

    def slices(self, ckpt: Checkpoint) -> tuple[Checkpoint, ...]: ...

    def plan(self, ckpt: Checkpoint, build: BuildPlan) -> Plan: ...

    def shapes(self, ckpt: Checkpoint) -> dict[str, tuple[int, ...]]: ...

    def describe(self, ckpt: Checkpoint) -> Any: ...


class PipelineStages:
    """Every stage's tensors, in stage order; a tied module held by several stages written from the first and
    compared on the others."""

    axis, section, disjoint = "pp", "pipeline", True

    def slices(self, ckpt: Checkpoint) -> tuple[Checkpoint, ...]:
        return ckpt.pp_slices

    def shapes(self, ckpt: Checkpoint) -> dict[str, tuple[int, ...]]:
        return {n: shape for stage in ckpt.pp_slices for n, shape in {**stage.trainable, **stage.frozen}.items()}

    def describe(self, ckpt: Checkpoint) -> list[dict[str, Any]] | None:
        """Per stage: its layer indices and tied modules."""
        from ..zero.pipeline import stage_map

        return stage_map(list(ckpt.pp_slices)) if ckpt.pp_slices else None

    def plan(self, ckpt: Checkpoint, build: BuildPlan) -> Plan:
        stage_plans = [build(s) for s in ckpt.pp_slices]
        tensors: dict[str, TensorPlan] = {}
        replicas = []
        for stage, plan in enumerate(stage_plans):
            for t in plan.tensors:
                if t.name in tensors:
                    replicas.append(Replica(t.name, stage, stored(t), stored(tensors[t.name]), "pipeline stage"))
                else:
                    tensors[t.name] = t
        meta = {**stage_plans[0].metadata, M.PIPELINE_STAGES: str(ckpt.grid.pp)}
        aliases = {a: s for p in stage_plans for a, s in p.aliases.items()}
        return Plan(tuple(tensors.values()), aliases, meta, tuple(replicas))


class TensorParallel:
    """The TP slices' plans (TP-local shapes) joined into full tensors by each parameter's
    ``zero.tensor_parallel.Split``: a dim-0 join the slices' pieces in turn, a row-parallel one ``Interleaved``
    runs; a replicated parameter from TP rank 0, its other copies listed to compare; buffers from TP rank 0."""

    axis, section, disjoint = "tp", "tensor_parallel", False

    def slices(self, ckpt: Checkpoint) -> tuple[Checkpoint, ...]:
        return () if ckpt.universal else ckpt.tp_slices  # (a universal checkpoint holds each parameter whole)

    @staticmethod
    def joined(ckpt: Checkpoint) -> list[Checkpoint]:
        """The checkpoint, or each pipeline stage of it, that is itself tensor parallel."""
        return [s for s in (ckpt.pp_slices or (ckpt,)) if s.tp_slices]

    @classmethod
    def splits(cls, ckpt: Checkpoint) -> dict[str, Split]:
        """Each parameter's split."""
        return {n: split for s in cls.joined(ckpt) for n, split in s.tp_splits.items()}

    def shapes(self, ckpt: Checkpoint) -> dict[str, tuple[int, ...]]:
        return {n: tuple(split.shape) for n, split in self.splits(ckpt).items()}

    def describe(self, ckpt: Checkpoint) -> dict[str, Any] | None:
        """Its degree, where the split description came from, and each parameter's split."""
        joined = self.joined(ckpt)
        if not joined:
            return None
        splits = self.splits(ckpt)
        counts: dict[str, int] = {}
        for split in splits.values():
            counts[split.category] = counts.get(split.category, 0) + 1
        return {"degree": ckpt.grid.tp,
                "described_by": "affine_map" if joined[0].tp_info.get("affine_map") else "patterns",
                "categories": dict(sorted(counts.items())), "split": {n: s.category for n, s in splits.items()}}

    def plan(self, ckpt: Checkpoint, build: BuildPlan) -> Plan:
        slice_plans = [self._slice_plan(s, ckpt.grid.tp, build) for s in ckpt.tp_slices]
        splits = ckpt.tp_splits
        by_rank = [{t.name: t for t in plan.tensors} for plan in slice_plans]
        tensors, replicas = [], []
        for local in slice_plans[0].tensors:
            split = splits.get(local.name)
            if split is None:  # a buffer: the same on every TP rank
                tensors.append(local)
                continue
            found = [by_rank[r].get(local.name) for r in range(len(slice_plans))]
            parts = [p for p in found if p is not None and p.src_dtype == local.src_dtype]
            if len(parts) != len(found):
                raise InconsistentCheckpointError(f"{local.name!r} is not held in "
                                                  f"{local.src_dtype} by every TP rank", at=ckpt.layout.tag_dir)
            size = ITEMSIZE[local.src_dtype]
            try:
                pieces = Interleaved([tuple(p.pieces) for p in parts],
                                     [(b.rank, b.start * size, b.numel * size) for b in split.blocks],
                                     [period * size for period in split.periods], split.count)
            except InconsistentCheckpointError as exc:
                raise InconsistentCheckpointError(f"{local.name!r}: {exc}", at=ckpt.layout.tag_dir) from None
            tensors.append(replace(local, shape=split.shape,
                                   pieces=merged(list(pieces)) if split.count == 1 else pieces))
            replicas += [Replica(local.name, r, stored(parts[r]), stored(local)) for r in split.replicas]
        head = slice_plans[0]
        meta = {**head.metadata, M.TENSOR_PARALLEL: str(ckpt.grid.tp)}
        return Plan(tuple(tensors), head.aliases, meta, tuple(replicas))

    @staticmethod
    def _slice_plan(part: Checkpoint, tp: int, build: BuildPlan) -> Plan:
        try:
            return build(part)
        except InconsistentCheckpointError as exc:
            if part.zero_stage != 3:
                raise
            raise UnsupportedCheckpointError(str(exc), hint=(
                f"an AutoTP model built under zero.Init: DeepSpeed 0.19.8 then partitions the parameters it leaves "
                f"whole over all {part.world_size * tp} ranks, TP ranks included; dsckpt does not join that layout "
                "yet (docs/format.md)")) from exc


JOINS: tuple[Join, ...] = (PipelineStages(), TensorParallel())


def outermost(ckpt: Checkpoint) -> Join | None:
    """The join a plan of ``ckpt`` starts from (its slices are planned, then joined), or None: one slice."""
    return next((join for join in JOINS if join.slices(ckpt)), None)


def holders(ckpt: Checkpoint) -> tuple[Checkpoint, ...]:
    """The parts of ``ckpt`` that hold different parameters, each with its own optimizer groups and module entries:
    a disjoint join's slices, else the checkpoint itself."""
    return next((join.slices(ckpt) for join in JOINS if join.disjoint and join.slices(ckpt)), (ckpt,))
