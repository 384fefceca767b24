"""Restore a training position from any checkpoint's client state, whoever wrote it.

A client state is whatever the training job saved beside its weights: dsckpt's own trainer,
Lightning's ``DeepSpeedStrategy`` (``epoch``, ``global_step``, ``loops``, ``callbacks``,
``hyper_parameters``...), an HF Trainer (``trainer_state.json``: ``global_step``, a float ``epoch``,
``log_history``...), or any DeepSpeed job's own keys.  ``interpret`` takes the keys the runtime
understands when they hold a usable value and reports every other key as left alone; it never
raises on a foreign type or a missing key.
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..export.sidecar import FOLDER_JSON, JSON_SUFFIX, read_sidecar
from ..zero.companions import TRAINER_STATE
from ..formats.safetensors_file import INDEX_SUFFIX

# Keys the runtime understands, by writer.
GLOBAL_STEP = "global_step"  # dsckpt, Lightning and HF trainer_state.json all use this name
EPOCH = "epoch"  # dsckpt/Lightning: an int; HF: a float (fraction of the epoch done)
DATA_POSITION = "data_position"  # dsckpt: index of the next synthetic batch
RNG = "rng"  # dsckpt: {"python": random.getstate(), "torch": CPU generator state}
ARGS = "args"  # dsckpt: the run's options; only "seed" is used (it defines the data stream)
USER = "user"  # dsckpt: the caller's own state, carried as is


@dataclass
class Position:
    """What a client state says about where training stands; ``None``: not said (or unusable)."""

    global_step: int | None = None
    epoch: int | None = None
    data_position: int | None = None
    seed: int | None = None
    rng: dict[str, Any] | None = None
    user: Any = None
    restored: list[str] = field(default_factory=list)
    left_alone: list[str] = field(default_factory=list)  # "key (why)" for keys present but not used


def _count(value: Any) -> int | None:
    """A non-negative whole number from an int or an integral float; None for anything else."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int) and value >= 0:
        return value
    if isinstance(value, float) and math.isfinite(value) and value >= 0:
        return int(value)  # HF's epoch 1.5 means the second epoch is under way: epoch index 1
    return None


def _rng(value: Any) -> dict[str, Any] | None:
    """dsckpt's RNG record, checked by actually applying it to throw-away generators."""
    import torch

    if not isinstance(value, dict) or set(value) != {"python", "torch"}:
        return None
    try:
        py = value["python"]
        random.Random().setstate((py[0], tuple(py[1]), py[2]))
        torch.Generator().set_state(torch.as_tensor(value["torch"], dtype=torch.uint8))
    except (TypeError, ValueError, IndexError, RuntimeError):
        return None
    return value


def interpret(client: Any) -> Position:
    """Read the keys the runtime understands out of ``client`` (a dict of plain values)."""
    pos = Position()
    if not isinstance(client, dict):
        pos.left_alone.append(f"<client state> (a {type(client).__name__}, not a dict)")
        return pos
    readers = {GLOBAL_STEP: _count, EPOCH: _count, DATA_POSITION: _count, RNG: _rng}
    for key, value in client.items():
        if key in readers:
            got = readers[key](value)
            if got is None:
                pos.left_alone.append(f"{key} (unusable {type(value).__name__} value)")
                continue
            setattr(pos, key, got)
            pos.restored.append(key)
        elif key == ARGS and isinstance(value, dict) and _count(value.get("seed")) is not None:
            pos.seed = _count(value["seed"])
            pos.restored.append(f"{ARGS}.seed")
        elif key == USER:
            pos.user = value
            pos.restored.append(key)
        else:
            pos.left_alone.append(str(key))
    if pos.data_position is None and pos.global_step is not None:
        pos.data_position = pos.global_step  # one batch per step: a foreign run's position is its step
    return pos


def hf_trainer_state(folder: Path) -> dict[str, Any] | None:
    """The ``trainer_state.json`` of an HF Trainer checkpoint folder, if there is a readable one."""
    path = Path(folder) / TRAINER_STATE
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def describe(pos: Position) -> str:
    """One line for the user: what was restored and what was left alone."""
    parts = [f"restored {', '.join(pos.restored)}" if pos.restored else "nothing restored"]
    if pos.left_alone:
        more = f" (+{len(pos.left_alone) - 8} more)" if len(pos.left_alone) > 8 else ""
        parts.append(f"left alone: {', '.join(pos.left_alone[:8])}{more}")
    return "; ".join(parts)


def default_sidecar(weights: Path) -> Path | None:
    """The client state consolidate wrote: inside a folder output (beside an index), else beside the file."""
    if weights.is_dir() or weights.name.endswith(INDEX_SUFFIX):
        candidate = (weights if weights.is_dir() else weights.parent) / FOLDER_JSON
        if candidate.exists():
            return candidate
    candidate = weights.with_name(weights.name + JSON_SUFFIX)
    return candidate if candidate.exists() else None


def read_client_state(weights: Path, client_state: str | None, check_only: bool = False) -> tuple[Any, str | None]:
    """The client state for a full-weights resume and where it came from (rank 0 reads files).
    ``check_only``: a sidecar's tensors are validated, not loaded (a `--nproc` parent imports no torch)."""
    sidecar = Path(client_state) if client_state else default_sidecar(weights)
    if sidecar is not None:
        return read_sidecar(sidecar, load_tensors=not check_only), str(sidecar)
    from ..api.weights import WeightsFile

    embedded = WeightsFile(weights).embedded_state()
    if embedded:
        return embedded, f"{weights} (beside its state_dict)"
    return None, None
