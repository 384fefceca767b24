"""`dsckpt inspect` of a torch.distributed.checkpoint folder: what ``convert --to deepspeed`` will read, before it does.

From the index and the small values alone (``formats.dcp``, no tensor byte but the 0-d steps): the layout (FSDP2's
``get_state_dict`` or torchtitan's), the world size it was saved at (its ``__<rank>_<n>.distcp`` files), the step,
the optimizer's param groups with their settings, the model entries no optimizer holds (floating-point ones need
``--model`` to be told apart: frozen parameters, buffers and tied names look the same in DCP), and the bytes.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ..dtypes import FLOATING
from ..export.sidecar import FOLDER_JSON, recorded_step
from ..formats.dcp import read_contents, read_index
from ..jsondoc import JSON_SCHEMA
from ..plan.from_dcp import FSDP2, split_entries, training_step

RANK_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")


def summarize_dcp(folder: Path) -> dict[str, Any]:
    index = read_index(folder)
    contents = read_contents(index)
    layout, model, state, group_entries, other = split_entries(index)

    def setting(key: str) -> Any:
        return contents.values.get(key, contents.scalars.get(key))

    groups: list[dict[str, Any]] = []
    if layout == FSDP2:
        for g in sorted(group_entries, key=lambda g: int(g) if str(g).isdigit() else str(g)):
            settings = {k: setting(v) for k, v in group_entries[g].items()}
            names = settings.pop("params", None)
            groups.append({"params": len(names) if isinstance(names, list) else None,
                           "first": names[0] if isinstance(names, list) and names else None, "settings": settings})
        trainable = {n for g in group_entries.values() for n in (setting(g.get("params", "")) or [])
                     if isinstance(n, str)}
    else:  # torchtitan: settings per parameter; the groups are those of equal settings (their order is not recorded)
        by_settings: dict[str, dict[str, Any]] = {}
        for fqn in model:
            if fqn in group_entries:
                settings = {k: setting(v) for k, v in group_entries[fqn].items()}
                entry = by_settings.setdefault(repr(sorted(settings.items())),
                                               {"params": 0, "first": fqn, "settings": settings})
                entry["params"] += 1
        groups = list(by_settings.values())
        trainable = set(group_entries)
    untrained = [n for n in model if n not in trainable]
    steps = {setting(keys["step"]) for keys in state.values() if "step" in keys}
    ranks = {int(m.group(1)) for f in folder.iterdir() for m in [RANK_FILE.match(f.name)] if m is not None}
    notes = []
    step = training_step(index, contents, other, steps)
    recorded = recorded_step(folder)
    if recorded is not None and recorded != step:
        notes.append(f"training step {recorded} as {FOLDER_JSON} records it; the optimizer's step is {step}")
        step = recorded
    needs_model = [n for n in untrained if index.tensors[model[n]].dtype in FLOATING]
    if needs_model:
        notes.append(f"{len(needs_model)} floating-point entries no optimizer holds: `convert --to deepspeed` needs "
                     "--model MODULE:FACTORY to tell frozen parameters, buffers and tied names apart")
    if layout != FSDP2 and len(groups) > 1:
        notes.append(f"{len(groups)} param groups by their settings, their order not recorded: `convert --to "
                     "deepspeed` takes them in model order; --group-order NAME,... (one parameter of each, in the "
                     "DeepSpeed job's order) sets another")
    return {"schema": JSON_SCHEMA, "input": str(folder), "format": f"dcp ({layout})", "step": step,
            "world_size": len(ranks) or None, "entries": len(model),
            "parameters": sum(_numel(index.tensors[model[n]].shape) for n in model),
            "param_groups": groups, "trainable": len(trainable), "untrained": untrained,
            "optimizer_state": sorted({k for keys in state.values() for k in keys}),
            "bytes": sum(f.stat().st_size for f in folder.iterdir() if f.is_file()), "problems": [], "notes": notes}


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def render_dcp(s: dict[str, Any]) -> str:
    lines = [f"{s['input']}: torch.distributed.checkpoint, {s['format'][5:-1]} layout, saved by "
             f"{s['world_size'] or '?'} process{'es' * (s['world_size'] != 1)}, step {s['step']}",
             f"  {s['entries']} model entries, {s['parameters']:,} values, {s['bytes']:,} bytes; optimizer state: "
             f"{', '.join(s['optimizer_state']) or 'none'}"]
    for i, g in enumerate(s["param_groups"]):
        shown = ", ".join(f"{k}={v}" for k, v in sorted(g["settings"].items()))
        lines.append(f"  group {i}: {g['params']} parameters (first {g['first']}): {shown}")
    if s["untrained"]:
        lines.append(f"  no optimizer holds: {', '.join(s['untrained'][:8])}{' ...' if len(s['untrained']) > 8 else ''}")
    lines += [f"note: {n}" for n in s["notes"]]
    return "\n".join(lines)
