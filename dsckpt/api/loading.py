"""``load_into(model, source)``: fill an existing ``nn.Module`` from a checkpoint, one tensor at a time.

Peer: DeepSpeed's ``load_state_dict_from_zero_checkpoint`` builds the whole fp32 state dict in memory
and loads it with ``strict=False``, reporting nothing.  Here:
1. list the source's names (a DeepSpeed checkpoint folder: its consolidation plan; a consolidated file
   or folder: its header) and the model's (parameters and persistent buffers, tied names grouped);
2. compare names and shapes first: with ``strict`` any missing, unexpected or mismatched key raises
   ``StateDictMismatchError`` before the model is touched;
3. read and assign one tensor at a time - peak memory is the model plus the largest tensor; a tensor
   on the meta device is materialized (on the CPU, in the model's dtype) as it loads, and every name a
   tied parameter has gets the same new Parameter, so ties survive;
4. return a ``LoadReport`` (``missing_keys`` / ``unexpected_keys`` first, as ``load_state_dict``'s).
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
from torch import nn

from ..plan.names import prefixes
from ..plan.segments import read_pieces
from .keys import compare, state_slots, tie_groups
from ..parallel.readable import Readable, readable
from .paths import classify


@dataclass
class LoadReport:
    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)
    mismatched_keys: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)  # name, file, model
    loaded: list[str] = field(default_factory=list)
    tied: dict[str, str] = field(default_factory=dict)  # model name filled through the tensor it is tied to
    still_meta: list[str] = field(default_factory=list)  # meta tensors no source entry filled (non-persistent buffers)


class _Source:
    """Names, shapes and one-tensor reads of a checkpoint folder or a consolidated file."""

    def __init__(self, source: Readable, strip_prefixes: tuple[str, ...]):
        path, tag = Path(source.path), source.tag
        if classify(path).is_checkpoint:
            from ..io.read import check_plan, torch_state_dict
            from ..plan.consolidate import build_plan
            from ..plan.names import strip_name
            from ..zero.reader import open_checkpoint

            plan = build_plan(open_checkpoint(path, tag))
            source.fetch(p for t in plan.tensors for p in read_pieces(t))
            check_plan(plan)
            by_name = {t.name: t for t in plan.tensors}
            targets = {**{n: n for n in by_name}, **plan.aliases}
            self.shapes = {strip_name(n, strip_prefixes): tuple(by_name[t].shape) for n, t in targets.items()}
            originals = {strip_name(n, strip_prefixes): t for n, t in targets.items()}
            self.read: Callable[[str], torch.Tensor] = \
                lambda name: torch_state_dict(plan, only={originals[name]})[originals[name]]
        else:
            from .weights import WeightsFile

            source.fetch_all()
            weights = WeightsFile(path, strip_prefixes)
            self.shapes = {n: tuple(weights.shape(n)) for n in weights.source}
            self.read = weights.get


def load_into(model: nn.Module, source: str | os.PathLike[str], *, strict: bool = True, tag: str | None = None,
              strip_prefixes: str | tuple[str, ...] = ()) -> LoadReport:
    """Fill ``model``'s parameters and buffers from a checkpoint or a weights file, one tensor at a time.

    Args:
        model: any ``nn.Module``; meta-device tensors are materialized as they load; tied weights stay tied.
        source: a DeepSpeed checkpoint folder (the fp32 masters) or a weights file / folder (``.safetensors``,
            ``.pt``/``.bin``, a sharded folder with its index); a local path or an ``s3://``/``gs://``/``az://`` URL.
        strict: refuse (``StateDictMismatchError``, before anything is touched) when names or shapes differ;
            ``False`` loads what matches and reports the rest.
        tag: the checkpoint's tag (default: ``latest``).
        strip_prefixes: a prefix (or several) to remove from the source's names, e.g. ``"module."``.

    Returns:
        ``LoadReport``: ``missing_keys``, ``unexpected_keys``, ``mismatched_keys`` and ``still_meta``.
    Every storage read is checked against its CRC-32 first.
    """
    with readable(source, tag) as opened:  # (a URL: a local view, what is read fetched first)
        return _load_into(model, _Source(opened, prefixes(strip_prefixes)), source, strict)


def _load_into(model: nn.Module, src: _Source, source: object, strict: bool) -> LoadReport:
    slots = state_slots(model)  # name -> (module, attribute, is parameter)
    groups = tie_groups(model)  # name -> every name sharing its tensor
    keys = compare({n: tuple(getattr(m, a).shape) for n, (m, a, _) in slots.items()}, src.shapes, groups)
    if strict:
        keys.raise_for(source, hint="strict=False loads what matches and reports the rest")
    report = LoadReport(keys.missing, keys.unexpected, keys.mismatched)
    mismatched = {m[0] for m in report.mismatched_keys}
    done: set[int] = set()
    for name in slots:
        if name not in src.shapes or name in mismatched:
            continue
        tensor = src.read(name)
        module, attr, is_param = slots[name]
        current = getattr(module, attr)
        if current.is_meta:
            _materialize(slots, groups.get(name, (name,)), tensor, current, is_param)
        else:
            with torch.no_grad():
                current.copy_(tensor.reshape(current.shape))
        done.add(id(getattr(module, attr)))
        report.loaded.append(name)
    for name in slots:
        if name not in report.loaded and id(getattr(slots[name][0], slots[name][1])) in done:
            source_name = next(o for o in groups.get(name, ()) if o in report.loaded)
            report.tied[name] = source_name
    report.still_meta = [n for n, (m, a, _) in _all_tensors(model).items() if getattr(m, a).is_meta]
    if report.still_meta:  # a checkpoint never holds non-persistent buffers: the first forward would fail on them
        shown = ", ".join(report.still_meta[:5]) + (f" and {len(report.still_meta) - 5} more"
                                                     if len(report.still_meta) > 5 else "")
        warnings.warn(f"load_into: {len(report.still_meta)} tensor(s) of the model are still on the meta device "
                      f"(no checkpoint holds them: non-persistent buffers such as RoPE's inv_freq): {shown}; build "
                      "the model with parameters alone on meta, e.g. accelerate.init_empty_weights() (buffers real)",
                      StillMetaWarning, stacklevel=3)
    return report


class StillMetaWarning(UserWarning):
    """``load_into`` left tensors on the meta device: the checkpoint cannot fill them (non-persistent buffers)."""


def _all_tensors(model: nn.Module) -> dict[str, tuple[nn.Module, str, bool]]:
    out = {}
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        prefix = f"{mod_name}." if mod_name else ""
        out.update({prefix + a: (mod, a, True) for a, p in mod._parameters.items() if p is not None})
        out.update({prefix + a: (mod, a, False) for a, b in mod._buffers.items() if b is not None})
    return out


def _materialize(slots: dict[str, tuple[Any, str, bool]], names: Iterable[str], tensor: torch.Tensor, like: torch.Tensor, is_param: bool) -> None:
    data = tensor.reshape(like.shape).to(like.dtype)
    new = nn.Parameter(data, requires_grad=like.requires_grad) if is_param else data
    for name in names:  # every name of a tied tensor gets the same object
        module, attr, _ = slots[name]
        (module._parameters if is_param else module._buffers)[attr] = new
