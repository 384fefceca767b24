"""`inspect --du`: where a checkpoint's bytes go - weights, fp32 masters, each optimizer state, client state,
companions - from metadata alone.

Every storage of every file of the tag is counted once, under the component that names it first in its file's
tree: ``module`` and frozen fragments (the model's own tensors), the fp32 partitions of the optimizer, a per-element
optimizer state by its key (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``...), tensors under client-state keys;
expert files count as expert weights.  What a file holds beyond its storages (pickles, zip records) is overhead;
files beside the tag folders (a trainer's state, RNG states, configs) are companions.  ZeRO-Infinity's swap files
(``offloaded_tensors/``) count whole under the masters or their optimizer state.
"""
from __future__ import annotations

from typing import Any

from ..formats.pickle_policy import TensorRef
from ..zero import layout as L
from ..zero.offloaded import MASTER, kind_of, offloaded_files
from ..zero.reader import Checkpoint

MASTERS = "fp32 masters"
WEIGHTS = "weights (module)"
FROZEN = "frozen fragments"
CLIENT = "client state"
EXPERTS = "expert weights"
OVERHEAD = "overhead (pickles, zip records)"
COMPANIONS = "companions (beside the tags)"


def disk_usage(ckpt: Checkpoint) -> dict[str, Any]:
    """``{components: {name: bytes}, total, files}`` for one tag (see the module docstring)."""
    from ..formats.torchzip import TorchFile

    parts: dict[str, int] = {}

    def add(name: str, n: int) -> None:
        parts[name] = parts.get(name, 0) + n
    files = [(tf, False) for tf in ckpt.model_files] + [(tf, True) for tf in ckpt.optim_files]
    files += [(TorchFile(p), False) for p in ckpt.layout.expert_files]
    total = 0
    for tf, optimizer in files:
        seen: set[str] = set()
        expert = tf.path in set(ckpt.layout.expert_files)
        for key, ref in _refs(tf.obj, ()):
            if ref.storage.key in seen:
                continue
            seen.add(ref.storage.key)
            add(EXPERTS if expert else _component(key, optimizer), tf.storages[ref.storage.key].nbytes)
        size = tf.path.stat().st_size
        add(OVERHEAD, size - sum(tf.storages[k].nbytes for k in seen))
        total += size
    offloaded = offloaded_files(ckpt.layout.tag_dir)
    for path in offloaded:  # ZeRO-Infinity's swap files: raw, all payload
        kind = kind_of(path)
        add(MASTERS if kind == MASTER else kind, path.stat().st_size)
        total += path.stat().st_size
    root = ckpt.layout.root
    beside = [p for p in root.iterdir() if p.is_file()] if root != ckpt.layout.tag_dir else []
    for p in beside:
        add(COMPANIONS, p.stat().st_size)
        total += p.stat().st_size
    return {"components": dict(sorted(parts.items(), key=lambda kv: -kv[1])), "bytes": total,
            "files": [str(p.relative_to(root)) if p.is_relative_to(root) else str(p)
                      for p in [*(tf.path for tf, _ in files), *offloaded, *beside]]}


def _component(path: tuple[str, ...], optimizer: bool) -> str:
    if not path:
        return CLIENT
    top = path[0]
    if optimizer:
        if L.SINGLE_PARTITION_OF_FP32_GROUPS in path or L.FP32_FLAT_GROUPS in path:
            return MASTERS
        return path[-1] if len(path) > 1 else top  # a per-element state by its key: exp_avg, exp_avg_sq, ...
    if top == L.MODULE:
        return WEIGHTS
    if top == L.FROZEN_PARAM_FRAGMENTS:
        return FROZEN
    return top if top in L.DEEPSPEED_KEYS else CLIENT


def _refs(value: Any, path: tuple[str, ...]):
    """(key path, TensorRef) of every tensor in a parsed tree, depth first in file order."""
    if isinstance(value, TensorRef):
        yield path, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _refs(v, path + (str(k),))
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _refs(v, path)
