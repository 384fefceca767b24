"""PEFT adapters: what ``PeftModel.from_pretrained(base, folder)`` reads.

A PEFT run's ``checkpoint-N`` (HF Trainer + LoRA under DeepSpeed) holds the engine's shards - saved with
``exclude_frozen_parameters=True``, so only the adapter's tensors, under the wrapped model's names
(``base_model.model.….q_proj.lora_A.default.weight``) - and ``adapter_config.json`` beside them.
``consolidate --hf`` then writes the folder PEFT's ``save_pretrained`` would: ``adapter_model.safetensors``
with PEFT's names (the adapter name dropped, as ``get_peft_model_state_dict`` does) and the config.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ConfigError
from ..io.context import WriteContext
from .adapters import ADAPTER_TENSOR
from .registry import Format, Listing, Prepared, Request, register

if TYPE_CHECKING:  # (the plan's modules load with the first conversion, not with --help)
    from ..plan.consolidate import Plan

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def adapter_config(root: Path) -> Path | None:
    path = Path(root) / ADAPTER_CONFIG
    return path if path.is_file() else None


def adapter_plan(plan: Plan, source: Path) -> Plan:
    """The plan's adapter tensors under PEFT's saved names; anything else (base weights) is left out."""
    from ..plan.consolidate import Plan, TensorPlan

    tensors, adapters = [], set()
    for t in plan.tensors:
        match = ADAPTER_TENSOR.search(t.name)
        if match:
            adapters.add(match.group("adapter"))
            name = t.name[:match.start("adapter") - 1] + t.name[match.end("adapter"):]
            tensors.append(TensorPlan(name, t.shape, t.src_dtype, t.dtype, t.kind, t.pieces))
    if not tensors:
        raise ConfigError(f"has {ADAPTER_CONFIG} but the checkpoint holds no adapter tensors "
                          "(names with lora_A/lora_B/modules_to_save)",
                          hint="for the full model, pass --config PATH/config.json", at=source)
    if len(adapters) > 1:
        raise ConfigError(f"holds {len(adapters)} adapters ({', '.join(sorted(adapters))}); "
                          "PEFT's folder holds one", at=source)
    return Plan(tuple(tensors), {}, dict(plan.metadata))


class PeftFormat(Format):
    name = "peft"
    directory = True
    selectable = False  # --hf, when adapter_config.json is beside the checkpoint
    exclude_frozen = True  # the base weights were never saved
    summary = "a folder PeftModel.from_pretrained loads: adapter_model.safetensors + adapter_config.json"

    def claims(self, root: Path) -> bool:
        return adapter_config(root) is not None

    def prepare(self, ckpt, plan: Plan, request: Request) -> Prepared:
        from .hf import find_companions

        root = ckpt.layout.root
        config = adapter_config(root)
        return Prepared(self, adapter_plan(plan, root), request,
                        (config, find_companions(root, config, request.trust)))  # the tokenizer files

    def write(self, prepared: Prepared, folder: Path, context: WriteContext) -> list[str]:
        import shutil

        from ..io.safetensors_writer import write_safetensors

        config, companions = prepared.companions
        write_safetensors(list(prepared.plan.tensors), folder / ADAPTER_WEIGHTS, prepared.plan.metadata, context)
        shutil.copyfile(config, folder / ADAPTER_CONFIG)
        for path in companions.others:
            shutil.copyfile(path, folder / path.name)
        return [ADAPTER_WEIGHTS, ADAPTER_CONFIG] + [p.name for p in companions.others]

    def read(self, path: Path) -> Listing:
        from .safetensors import read_safetensors

        return read_safetensors(path / ADAPTER_WEIGHTS if path.is_dir() else path)

    def reads(self, path: Path) -> bool:
        return path.is_dir() and (path / ADAPTER_WEIGHTS).is_file()


register(PeftFormat())
