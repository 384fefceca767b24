"""How a tensor-parallel run split each parameter over its TP ranks, and how to join the slices back.

DeepSpeed records the split in every model-states file's ``universal_checkpoint_info`` (AutoTP writes it;
Megatron-DeepSpeed puts the same patterns in its client state).  ``tp_splits(info, shard_shapes)`` does:
1. per parameter, its affine map (``affine_map.params``, version 1) when present: each TP rank holds pieces,
   each a block of the full tensor at ``source = [offset, strides]`` stored at ``dest = [offset, strides]`` of
   that rank's slice, on the ranks in ``locations`` (several: replicated);
2. otherwise DeepSpeed's pattern categories, in ``ds_to_universal``'s order: replicated, vocabulary (dim 0,
   trimmed to ``original_vocab_size``), sub-parameters (each split on its own, then joined), row parallel
   (dim 1), else dim 0;
3. both reduced to one form, a ``Split``: the full tensor is ``count`` periods of ``blocks``, each block a byte
   run of one rank's slice - one period for a dim-0 split, one per row for a dim-1 split.

Pure: shapes and numbers in, ``Split``s out; ``plan.tensor_parallel`` turns them into byte sources.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from ..errors import DsckptError, InconsistentCheckpointError, MissingRankError, UnsupportedCheckpointError

INFO = "universal_checkpoint_info"
AFFINE_MAP = "affine_map"
AFFINE_MAP_VERSION = 1
REPLICATED = "tp_replicated_parameter_patterns"
ROW_PARALLEL = "parameter_with_row_parallelism_patterns"
VOCABULARY = "vocabulary_parameter_patterns"
ORIGINAL_VOCAB_SIZE = "original_vocab_size"
SUB_PARAMS = "parameter_with_sub_params"  # [{"patterns": [...], "shape": [...], "partition_dim": d}]
TWO_SUB_PARAMS_DIM_0 = "parameter_with_2_sub_params_cat_dim_0"  # Megatron's fused gate/up (GLU)
SUB_PARAM_SHARD_WIDTHS = "sub_param_shard_widths"
TO_AVERAGE = "parameter_to_average_patterns"  # Megatron: kept per TP rank, averaged on merge (not a byte join)
UNSUPPORTED = "autotp_unsupported_parameter_patterns"  # pattern -> reason: AutoTP could not describe the split
PARALLEL_DIMENSIONS = "checkpoint_parallel_dimensions"  # {"tp_degree": T, "pp_degree": P}


@dataclass(frozen=True)
class Block:
    """``numel`` elements of the full tensor, taken from ``rank``'s slice at ``start`` (plus the period's offset)."""
    rank: int
    start: int
    numel: int


@dataclass(frozen=True)
class Split:
    """One parameter over the TP ranks: the full tensor is ``count`` periods, each ``blocks`` in order; period
    ``i`` of rank ``r``'s slice starts at element ``i * periods[r]``.  ``replicas``: other ranks holding the
    same elements (checked equal); ``category``: how DeepSpeed described it, for ``inspect``."""
    name: str
    shape: tuple[int, ...]
    count: int
    blocks: tuple[Block, ...]
    periods: tuple[int, ...]
    replicas: tuple[int, ...] = ()
    category: str = "split on dim 0"


def tp_info(head: dict[str, Any], path: Any) -> dict[str, Any]:
    """The split description a model-states file carries (empty when the run recorded none)."""
    info = head.get(INFO)
    if info is None:
        return {}
    if not isinstance(info, dict):
        raise InconsistentCheckpointError(f"'{INFO}' is a {type(info).__name__}, expected a dict", at=path)
    return info


def unsupported(info: dict[str, Any]) -> dict[str, str]:
    """AutoTP's ``autotp_unsupported_parameter_patterns``: pattern -> why it could not describe that split."""
    value = info.get(UNSUPPORTED) or {}
    return {str(k): str(v) for k, v in value.items()} if isinstance(value, dict) else {}


def slice_problems(heads: list[tuple[Any, dict[str, Any], int]]) -> list[DsckptError]:
    """What is wrong across the TP ranks' model-states files (``(path, parsed file, recorded mp world size)`` each):
    a recorded degree other than the files', split descriptions that differ, splits AutoTP could not describe."""
    problems: list[DsckptError] = []
    path, head, recorded = heads[0]
    dims = head.get(PARALLEL_DIMENSIONS)
    if isinstance(dims, dict) and isinstance(dims.get("tp_degree"), int):
        recorded = dims["tp_degree"]  # (mp_world_size counts the pipeline stages' ranks too)
    if recorded != len(heads):
        error = MissingRankError if recorded > len(heads) else InconsistentCheckpointError
        problems.append(error(f"records {recorded} tensor-parallel ranks, {len(heads)} wrote files", at=path))
    info = tp_info(head, path)
    for other_path, other, _ in heads[1:]:
        if tp_info(other, other_path) != info:
            problems.append(InconsistentCheckpointError(f"its '{INFO}' differs from TP rank 0's (files of two runs?)",
                                                        at=other_path))
    refused = unsupported(info)
    if refused:
        listed = "; ".join(f"{p} ({why})" for p, why in list(refused.items())[:3])
        problems.append(UnsupportedCheckpointError(f"AutoTP recorded {len(refused)} parameter(s) in '{UNSUPPORTED}' "
                                                   f"whose split it could not describe: {listed}", at=path))
    return problems


def tp_splits(info: dict[str, Any], shard_shapes: list[dict[str, tuple[int, ...]]], where: str) -> dict[str, Split]:
    """Each parameter's ``Split``, from the map or the categories; ``shard_shapes[r]``: rank r's slice shapes."""
    tp = len(shard_shapes)
    maps = _affine_maps(info, where)
    out = {}
    for name, shape0 in shard_shapes[0].items():
        missing = next((r for r, s in enumerate(shard_shapes) if name not in s), None)
        if missing is not None:
            raise InconsistentCheckpointError(f"parameter {name!r} is on TP rank 0 but not on TP rank {missing}", at=where)
        shapes = [s[name] for s in shard_shapes]
        try:
            entry = _matching(maps, name)
            if entry is not None and not _placeholder_map(entry, shapes):
                out[name] = _from_affine(name, entry, shapes, tp, where)
            else:
                out[name] = _from_categories(name, info, shapes, where)
        except (KeyError, TypeError, ValueError, IndexError, AttributeError, re.error) as exc:
            raise InconsistentCheckpointError(f"'{INFO}' does not describe {name!r} in a form dsckpt "
                                              f"reads ({type(exc).__name__}: {str(exc)[:80]})", at=where) from None
    return out


def _placeholder_map(entry: dict[str, Any], shapes: list[tuple[int, ...]]) -> bool:
    """A map of an empty tensor for a parameter that is not empty: DeepSpeed 0.19.8 describes the parameters AutoTP
    leaves whole from their shapes after ``zero.Init`` partitioned them (``[0]``); the categories still hold."""
    return not math.prod(int(d) for d in entry.get("logical_shape", [])) and any(math.prod(s) for s in shapes)


def _affine_maps(info: dict[str, Any], where: str) -> dict[str, Any]:
    value = info.get(AFFINE_MAP)
    if not value:
        return {}
    if not isinstance(value, dict) or value.get("version") != AFFINE_MAP_VERSION or not isinstance(value.get("params"), dict):
        version = value.get("version") if isinstance(value, dict) else None
        raise UnsupportedCheckpointError(f"'{INFO}.{AFFINE_MAP}' version {version!r}; dsckpt reads "
                                         f"version {AFFINE_MAP_VERSION}", at=where)
    params: dict[str, Any] = value["params"]
    return params


def _matching(patterns: dict[str, Any] | list[Any], name: str) -> Any:
    """The entry of the first pattern that matches ``name`` (``re.match``, as DeepSpeed's converter applies them)."""
    for pattern in patterns:
        if re.match(str(pattern), name):
            return patterns[pattern] if isinstance(patterns, dict) else pattern
    return None


# --- 1. the affine map ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Strided:
    """A piece as ``count`` runs of ``numel`` elements: full offset ``src + i*src_step``, slice ``dst + i*dst_step``."""
    rank: int
    src: int
    dst: int
    numel: int
    count: int
    src_step: int
    dst_step: int


def _runs(piece: dict[str, Any], rank: int, name: str, where: str) -> _Strided:
    """One map piece as strided runs: its innermost dimensions contiguous on both sides become one run, the
    rest must fold into one step (a block of rows); anything else is a layout dsckpt cannot stream."""
    shape = [int(d) for d in piece["shape"]]
    (src, src_strides), (dst, dst_strides) = piece["source"], piece["dest"]
    if float(piece.get("scale", 1.0)) != 1.0:
        raise UnsupportedCheckpointError(f"parameter {name!r} is stored scaled on TP rank {rank} "
                                         f"(scale {piece['scale']}); dsckpt joins unscaled slices only", at=where)
    dims = [(n, int(s), int(d)) for n, s, d in zip(shape, src_strides, dst_strides) if n != 1]
    numel = 1
    while dims and dims[-1][1] == numel and dims[-1][2] == numel:
        numel *= dims.pop()[0]
    while len(dims) > 1 and dims[-2][1] == dims[-1][0] * dims[-1][1] and dims[-2][2] == dims[-1][0] * dims[-1][2]:
        n, s, d = dims.pop()
        dims[-1] = (dims[-1][0] * n, s, d)
    if len(dims) > 1:
        raise UnsupportedCheckpointError(f"parameter {name!r}: TP rank {rank}'s piece {shape} at strides "
                                         f"{list(src_strides)} is not a block of whole rows; not supported", at=where)
    count, src_step, dst_step = dims[0] if dims else (1, 0, 0)
    return _Strided(rank, int(src), int(dst), numel, count, src_step, dst_step)


def _from_affine(name: str, entry: dict[str, Any], shapes: list[tuple[int, ...]], tp: int, where: str) -> Split:
    shape = tuple(int(d) for d in entry["logical_shape"])
    if not math.prod(shape):
        return Split(name, shape, 1, (), (0,) * tp)
    ranks = {int(r): v for r, v in entry["ranks"].items()}
    if sorted(ranks) != list(range(tp)):
        raise InconsistentCheckpointError(f"the affine map of {name!r} covers TP ranks {sorted(ranks)}, "
                                          f"the checkpoint has {tp}", at=where)
    for r, value in ranks.items():
        if tuple(int(d) for d in value["shard_shape"]) != tuple(shapes[r]):
            raise InconsistentCheckpointError(f"{name!r} on TP rank {r} has shape {list(shapes[r])}, its "
                                              f"affine map says {list(value['shard_shape'])}", at=where)
    runs, replicas = [], set()
    for r in range(tp):
        for piece in ranks[r]["pieces"]:
            holders = sorted(int(x) for x in piece["locations"])
            if holders[0] != r:  # a replicated piece is read from its first holder, compared on the others
                replicas.add(r)
                continue
            runs.append(_runs(piece, r, name, where))
    whole = len(runs) == 1 and runs[0].numel * runs[0].count == math.prod(shape)
    category = "replicated" if replicas and whole else f"split on dim {_split_dim(shape, runs[0].count)}"
    # a partly replicated tensor is read from each block's first holder; only whole replicas are compared
    return _periodic(name, shape, runs, [math.prod(s) for s in shapes], tuple(sorted(replicas)) if whole else (),
                     category, where)


def _periodic(name: str, shape: tuple[int, ...], runs: list[_Strided], sizes: list[int], replicas: tuple[int, ...],
              category: str, where: str) -> Split:
    """Strided runs that tile the full tensor as ``count`` equal periods (every run repeats once per period)."""
    count = runs[0].count
    numel = math.prod(shape)
    period = numel // count
    steps: dict[int, int] = {}
    for run in runs:
        if run.count != count or (count > 1 and run.src_step != period) or steps.setdefault(run.rank, run.dst_step) != run.dst_step:
            raise UnsupportedCheckpointError(f"parameter {name!r}: its TP slices do not repeat in equal "
                                             "periods; not supported", at=where)
    ordered = sorted(runs, key=lambda r: r.src)
    at = 0
    for run in ordered:
        if run.src != at:
            raise InconsistentCheckpointError(f"the TP slices of {name!r} "
                                              f"{'overlap' if run.src < at else 'leave a gap'} at element {at}", at=where)
        at += run.numel
    if at != period:
        raise InconsistentCheckpointError(f"the TP slices of {name!r} cover {at * count} of its {numel} elements", at=where)
    periods = {r.rank: (r.dst_step if count > 1 else sizes[r.rank]) for r in ordered}
    blocks = tuple(Block(r.rank, r.dst, r.numel) for r in ordered)
    return Split(name, shape, count, blocks, tuple(periods.get(r, 0) for r in range(len(sizes))), replicas, category)


def _split_dim(shape: tuple[int, ...], count: int) -> int:
    """The dimension a join of ``count`` periods runs along: the first whose leading dimensions make ``count``."""
    dim, rows = 0, 1
    while rows < count and dim < len(shape):
        rows *= shape[dim]
        dim += 1
    return dim


def universal_fields(info: dict[str, Any], name: str) -> dict[str, Any]:
    """The keys ``ds_to_universal`` writes beside a TP parameter's merged ``param`` (0.19.8): none for one an affine
    map or the replicated patterns describe; ``sub_param_shape`` (its ``SubparamShape``, as a record) for fused
    sub-parameters; else ``cat_dim`` (+ ``param_n_sub_params`` for fused GLU weights); ``vocab_tensor`` for a
    vocabulary parameter either way."""
    fields: dict[str, Any] = {}
    if _matching(_affine_maps(info, name), name) is None and _matching(info.get(REPLICATED) or [], name) is None:
        sub = _matching({str(p): g for g in info.get(SUB_PARAMS) or [] for p in g.get("patterns", [])}, name)
        if _matching(info.get(TWO_SUB_PARAMS_DIM_0) or [], name) is not None:
            fields = {"cat_dim": 0, "param_n_sub_params": 2}
        elif sub is not None:
            fields = {"sub_param_shape": _subparam_shape(sub)}
        else:
            fields = {"cat_dim": 1 if _matching(info.get(ROW_PARALLEL) or [], name) is not None else 0}
    if _matching(info.get(VOCABULARY) or [], name) is not None:
        fields["vocab_tensor"] = True
    return fields


def _subparam_shape(sub: dict[str, Any]) -> Any:
    """DeepSpeed's ``SubparamShape`` record of a sub-parameter group as ds_to_universal writes it: as recorded, or
    (a count of equal parts before version 0.4) with that count's sizes unknown here - refused then."""
    from ..formats.pickle_policy import opaque_type

    dim, spec = int(sub["partition_dim"]), sub["shape"][int(sub["partition_dim"])]
    if not isinstance(spec, (list, tuple)):
        raise UnsupportedCheckpointError(f"sub-parameters recorded as a count ({spec}) before "
                                         "universal checkpoint version 0.4; their universal record is not written", at=list(sub['patterns']))
    record = opaque_type("deepspeed.checkpoint.universal_checkpoint", "SubparamShape").__new__(
        opaque_type("deepspeed.checkpoint.universal_checkpoint", "SubparamShape"))
    record.state = {"patterns": sub["patterns"], "shape": sub["shape"], "partition_dim": dim}
    return record


# --- 2. the pattern categories ------------------------------------------------------------------------------

def _from_categories(name: str, info: dict[str, Any], shapes: list[tuple[int, ...]], where: str) -> Split:
    tp, sizes = len(shapes), [math.prod(s) for s in shapes]
    if _matching(info.get(TO_AVERAGE) or [], name) is not None:
        raise UnsupportedCheckpointError(f"parameter {name!r} is in '{TO_AVERAGE}': its TP copies are "
                                         "averaged into one, which is arithmetic, not a join; not supported", at=where)
    if _matching(info.get(REPLICATED) or [], name) is not None:
        if len(set(shapes)) != 1:
            raise InconsistentCheckpointError(f"replicated {name!r} has shapes {[list(s) for s in shapes]} "
                                              "on the TP ranks", at=where)
        return Split(name, tuple(shapes[0]), 1, (Block(0, 0, sizes[0]),), (sizes[0],) * tp, tuple(range(1, tp)),
                     "replicated")
    sub = _matching({str(p): g for g in info.get(SUB_PARAMS) or [] for p in g.get("patterns", [])}, name)
    if sub is not None or _matching(info.get(TWO_SUB_PARAMS_DIM_0) or [], name) is not None:
        dim = int(sub["partition_dim"]) if sub else 0
        widths = _sub_widths(info, name, sub, shapes, dim, where)
        return _joined(name, shapes, dim, widths, "sub-parameters", where)
    if _matching(info.get(VOCABULARY) or [], name) is not None:
        split = _joined(name, shapes, 0, None, "vocabulary", where)
        vocab = info.get(ORIGINAL_VOCAB_SIZE)
        return _trimmed(split, int(vocab), where) if isinstance(vocab, int) and vocab < split.shape[0] else split
    row = _matching(info.get(ROW_PARALLEL) or [], name) is not None
    return _joined(name, shapes, 1 if row and len(shapes[0]) > 1 else 0, None,
                   "row parallel (dim 1)" if row else "split on dim 0", where)


def _sub_widths(info: dict[str, Any], name: str, sub: dict[str, Any] | None, shapes: list[tuple[int, ...]], dim: int,
                where: str) -> list[list[int]]:
    """Per sub-parameter, its width on each TP rank along ``dim``."""
    recorded = _matching(info.get(SUB_PARAM_SHARD_WIDTHS) or {}, name)
    if recorded:
        return [[int(w) for w in widths] for widths in recorded]
    spec = sub["shape"][dim] if sub else 2  # the sub-parameters' sizes, or before version 0.4 a count of equal ones
    if isinstance(spec, (list, tuple)):  # each split evenly over the TP ranks (ds_to_universal's reading)
        sizes, tp = [int(size) for size in spec], len(shapes)
        if any(size % tp for size in sizes):
            raise InconsistentCheckpointError(f"{name!r}: sub-parameter sizes {sizes} do not split evenly "
                                              f"over {tp} TP ranks and no '{SUB_PARAM_SHARD_WIDTHS}' are recorded", at=where)
        return [[size // tp] * tp for size in sizes]
    parts = int(spec)
    for r, s in enumerate(shapes):
        if s[dim] % parts:
            raise InconsistentCheckpointError(f"{name!r} on TP rank {r} ({list(s)}) does not hold "
                                              f"{parts} equal sub-parameters along dim {dim}", at=where)
    return [[s[dim] // parts for s in shapes] for _ in range(parts)]


def _joined(name: str, shapes: list[tuple[int, ...]], dim: int, widths: list[list[int]] | None, category: str,
            where: str) -> Split:
    """Slices joined along ``dim``: each rank's slice split into sub-parameters (``widths[k][r]``, or the whole
    slice), the full tensor sub-parameter by sub-parameter, rank by rank within each."""
    tp = len(shapes)
    others = {tuple(d for i, d in enumerate(s) if i != dim) for s in shapes}
    if len(others) != 1 or any(len(s) <= dim for s in shapes):
        raise InconsistentCheckpointError(f"the TP slices of {name!r} ({[list(s) for s in shapes]}) "
                                          f"cannot be joined along dim {dim}", at=where)
    widths = widths or [[s[dim] for s in shapes]]
    if any(sum(w[r] for w in widths) != shapes[r][dim] for r in range(tp)):
        raise InconsistentCheckpointError(f"{name!r}: its sub-parameter widths do not add up to its slices", at=where)
    shape = list(shapes[0])
    shape[dim] = sum(map(sum, widths))
    inner = math.prod(shape[dim + 1:])
    count = math.prod(shape[:dim])
    blocks, offsets = [], [0] * tp
    for part in widths:
        for r in range(tp):
            blocks.append(Block(r, offsets[r], part[r] * inner))
            offsets[r] += part[r] * inner
    periods = tuple(s[dim] * inner for s in shapes)
    return Split(name, tuple(shape), count, tuple(b for b in blocks if b.numel), periods, (), category)


def _trimmed(split: Split, rows: int, where: str) -> Split:
    """A vocabulary split padded past ``original_vocab_size``: its first ``rows`` rows."""
    keep = rows * math.prod(split.shape[1:])
    blocks, left = [], keep
    for block in split.blocks:
        if left:
            blocks.append(Block(block.rank, block.start, min(block.numel, left)))
            left -= blocks[-1].numel
    return Split(split.name, (rows, *split.shape[1:]), 1, tuple(blocks), split.periods, split.replicas,
                 f"{split.category}, trimmed to {rows} rows")
