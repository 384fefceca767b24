"""A PEFT run merged into its base model (``consolidate --hf --base BASE``): a folder ``from_pretrained`` loads.

A PEFT run's checkpoint holds the adapter and no base weights, so the merged model needs the base's own files:
``BASE`` is the Hugging Face folder (or weights file) the run started from.  Each LoRA pair is folded into its
base weight as PEFT's ``merge_and_unload`` does (``W += transpose(B @ A, fan_in_fan_out) * scaling``, the add in
the base weight's dtype, so the result is PEFT's bit for bit); ``modules_to_save`` copies replace theirs.

The plan the consolidation checks and fetches is the adapter's; ``write`` reads the base one tensor at a time,
writes the merged weights to a hidden file in the staging folder, then lays out the folder as the ``hf`` export does
(sharded safetensors copied from the base file and that file, the base's config and the run's tokenizer).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ConfigError, StateDictMismatchError, UnsupportedCheckpointError
from ..formats.positional import pwrite_all, read_range_into
from ..formats.safetensors_file import INDEX_NAME, encode_header
from ..io.context import WriteContext
from .hf import CONFIG, HuggingFaceFormat, find_companions, write_companions
from .peft import ADAPTER_CONFIG, adapter_config, adapter_plan
from .registry import Prepared, Request, Stored, for_input, register, weights_file_in

if TYPE_CHECKING:
    from ..plan.consolidate import Plan

PEFT_PREFIX = "base_model.model."  # PeftModel's wrapper around the base model's own names
MERGED_TMP = ".dsckpt-merged.safetensors"  # the merged weights, inside the staging folder until laid out
UNMERGEABLE = ("use_dora", "lora_bias")  # settings whose merge is not ``W += B @ A * scaling``


@dataclass(frozen=True)
class Merge:
    """What ``write`` folds in: base weight name -> (lora_A name, lora_B name) in the adapter plan, or the
    ``modules_to_save`` copy that replaces it."""

    base: Path
    scaling: float
    fan_in_fan_out: bool
    pairs: dict[str, tuple[str, str]]
    replaced: dict[str, str]


def lora_settings(config_path: Path) -> tuple[float, bool]:
    """(scaling, fan_in_fan_out) of a LoRA adapter config; anything whose merge is not the plain one refused."""
    from ..formats.json_file import read_json_object

    config = read_json_object(config_path, "PEFT adapter config")
    if config.get("peft_type", "LORA") != "LORA":
        raise ConfigError(f"is a {config.get('peft_type')} adapter; --base merges LoRA adapters", at=config_path)
    for key in UNMERGEABLE:
        if config.get(key):
            raise ConfigError(f"sets {key}: its merge is not W + B @ A * scaling, which --base computes",
                              hint="merge in PEFT: PeftModel.from_pretrained(base, OUT).merge_and_unload()",
                              at=config_path)
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise ConfigError(f"sets {key} (a rank or alpha per module); --base merges one rank and alpha",
                              hint="merge in PEFT: PeftModel.from_pretrained(base, OUT).merge_and_unload()",
                              at=config_path)
    r, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(r, int) or r <= 0 or not isinstance(alpha, (int, float)):
        raise ConfigError(f"needs a positive integer r and a number lora_alpha (has r={r!r}, lora_alpha={alpha!r})",
                          at=config_path)
    scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    return scaling, bool(config.get("fan_in_fan_out"))


def base_weights_file(base: Path) -> tuple[Path, Path]:
    """(the weights to read, the config.json beside them) of ``--base``: a ``save_pretrained`` folder, its
    index or weights file."""
    if not base.exists():
        raise ConfigError("--base: no such file or folder", at=base)
    weights = base if for_input(base) else weights_file_in(base) if base.is_dir() else None
    if weights is None:
        raise ConfigError("--base holds no weights a format reads (.safetensors, a sharded folder, .bin/.pt)",
                          hint="pass the folder the base model was saved to (save_pretrained)", at=base)
    folder = base if base.is_dir() else base.parent
    if not (folder / CONFIG).is_file():
        raise ConfigError(f"--base: {folder} holds no {CONFIG}; the merged folder takes the base model's",
                          at=folder)
    return weights, folder / CONFIG


def base_tensors(base: Path) -> dict[str, Stored]:
    """The base's tensors by name, where their bytes are (each contiguous: a strided view is refused)."""
    fmt = for_input(base)
    assert fmt is not None
    listing = {s.name: s for s in fmt.read(base).tensors}
    strided = [s.name for s in listing.values() if s.stride is not None]
    if strided:
        raise UnsupportedCheckpointError(f"stores {strided[0]!r} as a strided view; --base reads contiguous "
                                         "tensors (a save_pretrained folder)", at=base)
    return listing


def plan_merge(adapter: Plan, base: Path, settings: tuple[float, bool], source: Path) -> Merge:
    """Pair every adapter tensor with the base weight it changes; shapes checked against the base's."""
    weights = base_tensors(base)
    shapes = {t.name: t.shape for t in adapter.tensors}
    pairs: dict[str, tuple[str, str]] = {}
    replaced: dict[str, str] = {}
    for name in shapes:
        module, _, kind = _split(name)
        if kind == "lora_A":
            b_name = name.replace(".lora_A.", ".lora_B.")
            if b_name not in shapes:
                raise StateDictMismatchError(f"holds {name!r} without its lora_B", at=source)
            pairs[_base_name(module, "weight", weights, base)] = (name, b_name)
        elif kind == "modules_to_save":
            replaced[_base_name(module, name.rsplit(".", 1)[1], weights, base)] = name
        elif kind != "lora_B":
            raise ConfigError(f"holds {name!r}: --base merges LoRA's lora_A/lora_B pairs (and modules_to_save); "
                              f"not {kind}", hint="merge in PEFT: PeftModel.from_pretrained(base, OUT)"
                              ".merge_and_unload()", at=source)
    scaling, fan_in_fan_out = settings
    for target, (a, b) in pairs.items():
        (r, fan_in), (fan_out, r_b) = shapes[a], shapes[b]
        want = (fan_in, fan_out) if fan_in_fan_out else (fan_out, fan_in)
        if r != r_b or tuple(weights[target].shape) != want:
            raise StateDictMismatchError(f"{target!r} is {list(weights[target].shape)} in the base; the adapter's "
                                         f"{a.rsplit('.', 2)[0]} changes a {list(want)} weight (another base model?)",
                                         at=base)
    for target, name in replaced.items():
        if tuple(weights[target].shape) != tuple(shapes[name]):
            raise StateDictMismatchError(f"{target!r} is {list(weights[target].shape)} in the base, "
                                         f"{list(shapes[name])} in the run's modules_to_save", at=base)
    if not pairs:
        raise ConfigError("holds no LoRA pair (lora_A/lora_B) to merge", at=source)
    return Merge(base, scaling, fan_in_fan_out, pairs, replaced)


def _split(name: str) -> tuple[str, str, str]:
    """``base_model.model.<module>.<kind>.<leaf>`` -> (module, leaf, kind), the adapter name already dropped."""
    head, leaf = name.rsplit(".", 1)
    module, kind = head.rsplit(".", 1)
    return module, leaf, kind


def _base_name(module: str, leaf: str, weights: dict[str, Stored], base: Path) -> str:
    name = f"{module[len(PEFT_PREFIX):] if module.startswith(PEFT_PREFIX) else module}.{leaf}"
    if name not in weights:
        raise StateDictMismatchError(f"holds no {name!r}, which the adapter changes (another base model?)", at=base)
    return name


class MergedFormat(HuggingFaceFormat):
    """The ``hf`` folder (read back, replaced files: the same), its weights the base's with the adapter merged."""
    name = "merged"
    takes_config = False  # the base's config.json
    streams_tensors = False  # (the merged weights are a local file of the staging folder)
    computes = True
    summary = "a PEFT run merged into its base model: a folder from_pretrained loads"

    def prepare(self, ckpt, plan: Plan, request: Request) -> Prepared:
        root = ckpt.layout.root
        config = adapter_config(root)
        if config is None:
            raise ConfigError(f"--base merges a PEFT run's adapter; {root} holds no {ADAPTER_CONFIG}",
                              hint="for a full model, leave --base out", at=root)
        if request.base is None:
            raise ConfigError("the merged export needs the base model: --base PATH", at=root)
        adapter = adapter_plan(plan, root)
        base, base_config = base_weights_file(request.base)
        merge = plan_merge(adapter, base, lora_settings(config), root)
        note = (f"merged {len(merge.pairs)} LoRA pairs into {base} (scaling {merge.scaling:g})"
                + (f", {len(merge.replaced)} modules_to_save copies" if merge.replaced else ""))
        companions = find_companions(root, base_config, request.trust)
        return Prepared(self, adapter, request, (companions, merge), notes=(note,))

    def write(self, prepared: Prepared, folder: Path, context: WriteContext) -> list[str]:
        from ..io.safetensors_writer import write_sharded

        companions, merge = prepared.companions
        scratch = folder / MERGED_TMP
        try:
            plan = _merged_plan(prepared.plan, merge, scratch, context)
            names = write_sharded(plan, folder, prepared.request.max_shard_bytes, context)
        finally:
            scratch.unlink(missing_ok=True)
        dtypes = {t.dtype for t in plan.tensors}
        return names + [INDEX_NAME] + write_companions(companions, folder, dtypes.pop() if len(dtypes) == 1 else "F32")


def _merged_plan(adapter: Plan, merge: Merge, scratch: Path, context: WriteContext) -> Plan:
    """The output's plan in the base's order: unchanged tensors are ranges of the base files, the merged and
    replaced ones ranges of ``scratch``, written here one tensor at a time."""
    import torch

    from ..dtypes import torch_dtype
    from ..io.read import Reader, torch_tensor
    from ..plan.consolidate import Plan, TensorPlan
    from ..plan.segments import Segment

    listing = base_tensors(merge.base)
    adapter_tensors = {t.name: t for t in adapter.tensors}
    computed = list(merge.pairs) + list(merge.replaced)
    entries = [(n, listing[n].dtype, listing[n].shape, listing[n].span_bytes) for n in computed]
    header, offsets = encode_header(entries, {})
    fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        pwrite_all(fd, header, 0)
        with Reader(context) as reader:
            for (name, _, _, _), offset in zip(entries, offsets):
                stored = listing[name]
                if name in merge.pairs:
                    weight = torch.empty(stored.shape, dtype=torch_dtype(stored.dtype))
                    read_range_into(stored.path, stored.offset, stored.span_bytes,
                                    weight.view(-1).view(torch.uint8).numpy())
                    a, b = (torch_tensor(reader, adapter_tensors[n]) for n in merge.pairs[name])
                    delta = b @ a
                    weight.add_((delta.T if merge.fan_in_fan_out else delta) * merge.scaling)  # PEFT's merge
                else:
                    weight = torch_tensor(reader, adapter_tensors[merge.replaced[name]]).to(torch_dtype(stored.dtype))
                pwrite_all(fd, weight.contiguous().view(-1).view(torch.uint8).numpy(), len(header) + offset)
    finally:
        os.close(fd)
    placed = {n: Segment(scratch, len(header) + off, nbytes) for (n, _, _, nbytes), off in zip(entries, offsets)}
    tensors = []
    for stored in listing.values():
        piece = placed.get(stored.name) or Segment(stored.path, stored.offset, stored.span_bytes)
        tensors.append(TensorPlan(stored.name, stored.shape, stored.dtype, stored.dtype, "param",
                                  (piece,) if piece.nbytes else ()))
    return Plan(tuple(tensors), {}, {"format": "pt"})


register(MergedFormat())
