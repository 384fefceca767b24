"""ZeRO-1/2's record of where each parameter sits, ``param_slice_mappings`` - and why dsckpt does not read by it.

Each optimizer-states file records, per param group, ``name -> fragment_address(start, numel)``.  With
``round_robin_gradients`` DeepSpeed 0.19.8 flattens each group in a reordered sequence (parameter i goes
to slot ``i % world_size`` first) and writes ``param_shapes`` in that order - the true layout of the saved
partitions - but builds the fragment addresses over the *unreordered* list (``_link_all_hp_params``), so
the record names the wrong elements.  Measured on a real 2-rank fp32 ZeRO-2 run
(``test_round_robin_checkpoint_is_read_by_param_shapes``): partitions read by ``param_shapes`` equal the
saved module weights bit for bit; read by the mappings, four of six parameters are other bytes.  (Read from
DeepSpeed's code, not measured: the same addresses back its ``safe_get_full_fp32_param`` in such runs.)

So consolidation lays groups out from ``param_shapes`` as ``zero_to_fp32`` does; ``mismatch`` tells a
reordered buffer apart, which ``reshard`` must refuse: the reorder depends on the world size.
"""
from __future__ import annotations

from typing import Any

from . import layout as L
from .partitioning import GroupLayout
from .reader import Checkpoint


def recorded(ckpt: Checkpoint, group: int) -> list[dict[str, Any]] | None:
    """Per rank, the group's name -> fragment_address map; None when any rank records none."""
    maps = []
    for tf in ckpt.optim_files:
        osd = tf.obj.get(L.OPTIMIZER_STATE_DICT) if isinstance(tf.obj, dict) else None
        groups = osd.get(L.PARAM_SLICE_MAPPINGS) if isinstance(osd, dict) else None
        if not isinstance(groups, list) or group >= len(groups) or not isinstance(groups[group], dict):
            return None
        maps.append(groups[group])
    return maps


def _address(value: Any) -> tuple[int, int] | None:
    """(start, numel) of a fragment_address placeholder, None when it is not one."""
    state = getattr(value, "state", None)
    if not isinstance(state, dict):
        return None
    start, numel = state.get("start"), state.get("numel")
    if type(start) is int and type(numel) is int and start >= 0 and numel >= 0:
        return start, numel
    return None


def mismatch(ckpt: Checkpoint, group: int, names: list[str], layout: GroupLayout,
             ranks: tuple[int, ...] | None = None) -> str | None:
    """The first disagreement between ``layout`` and the record, as a message; None if they agree.
    ``ranks``: the ranks whose partitions ``layout`` describes, in order (a group of experts: one
    expert-parallel rank's); default every rank."""
    maps = recorded(ckpt, group)
    if maps is None:
        return None
    for rank, mapping in enumerate(maps):
        if ranks is not None and rank not in ranks:
            continue
        position = ranks.index(rank) if ranks is not None else rank
        for name, spans in zip(names, layout.params):
            here = [(s.rank_start, s.count) for s in spans if s.rank == position and s.count]
            address = mapping.get(name)
            if not here and address is None:
                continue
            if here != [_address(address)]:
                return (f"{ckpt.optim_files[rank].path}: parameter {name!r} of group {group} is not where its "
                        f"{L.PARAM_SLICE_MAPPINGS} entry says (computed {here}, recorded {_address(address)})")
    return None
