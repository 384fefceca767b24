"""`dsckpt inspect`: a summary of a checkpoint (or a consolidated file) from metadata alone.

``summarize(path)`` returns the JSON document (schema in docs/cli.md); ``render(summary)`` is the
human view.  No tensor payload is read.
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from ..jsondoc import JSON_SCHEMA
from ..dtypes import label
from ..errors import DsckptError
from ..formats.pickle_policy import Opaque, TensorRef
from ..plan.consolidate import build_plan
from ..plan.joins import JOINS, TensorParallel
from ..zero import offloaded
from ..api.paths import classify
from ..zero.companions import trainer_summary
from ..zero.reader import Checkpoint, open_checkpoint
from .report import table

# Peak RSS of `consolidate`, flat in model size as far as measured (docs/performance.md).
CONSOLIDATE_RSS = 64 << 20
CONSOLIDATE_CAST_RSS = 256 << 20
TOP_N = 5


def summarize(path: str | os.PathLike, tag: str | None = None, tensors: bool = False) -> dict[str, Any]:
    p = Path(path)
    if classify(p).kind == "weights":
        from .inspect_file import summarize_file  # a consolidated file or folder, of any registered format
        return summarize_file(p, tensors)
    return {**summarize_checkpoint(open_checkpoint(path, tag), tensors), "input": str(path)}


def summarize_checkpoint(ckpt: Checkpoint, with_tensors: bool = False) -> dict[str, Any]:
    lay = ckpt.layout
    trainable = ckpt.trainable
    module = ckpt.module
    shapes = dict(trainable)
    shapes.update(ckpt.frozen)
    if ckpt.zero_stage == 0:
        shapes.update({n: t.shape for n, t in module.items() if isinstance(t, TensorRef) and n not in ckpt.buffers
                       and n not in ckpt.shared})
    numel = lambda names: sum(math.prod(shapes[n]) for n in names)
    plan, plan_error = None, None
    sections: dict[str, Any] = {}
    for join in JOINS:  # each parallelism's own part of the report
        try:
            sections[join.section] = join.describe(ckpt)
        except DsckptError:
            sections[join.section] = None  # (the plan's error below names what is wrong)
    if not ckpt.problems:
        try:
            for join in JOINS:  # the whole's shapes, not one slice's
                shapes.update(join.shapes(ckpt))
            plan = build_plan(ckpt)
        except DsckptError as exc:
            plan_error = str(exc)
    if plan is not None and ckpt.experts:  # the recorded shapes name rank 0's experts only; the plan names all
        shapes = {t.name: t.shape for t in plan.tensors if t.kind != "buffer"}
    frozen = set(ckpt.frozen).union(*(s.frozen for s in ckpt.leaves))
    if plan is not None and ckpt.zero_stage == 0:  # stage 0 records no frozen list; the plan tells
        frozen = {t.name for t in plan.tensors if t.kind == "frozen"}
    params = [n for n in shapes if n not in frozen]
    elements = numel(shapes) + sum(t.numel for t in ckpt.buffers.values())
    largest = sorted(shapes.items(), key=lambda kv: -math.prod(kv[1]))[:TOP_N]
    problems = [str(p) for p in ckpt.problems] + ([plan_error] if plan_error else [])
    fp32 = numel(shapes) * 4 + sum(t.nbytes for t in ckpt.buffers.values())
    try:
        nvme = offloaded.describe(ckpt)
    except DsckptError as exc:
        nvme = None
        problems += [str(exc)] if str(exc) not in problems else []
    summary = {
        "schema": JSON_SCHEMA,
        "kind": "deepspeed",
        "input": str(lay.root),  # (summarize: as the user gave it)
        "root": str(lay.root),
        "tag": lay.tag,
        "tags": list(lay.tags),
        "latest": lay.latest,
        "zero_stage": ckpt.zero_stage,
        "universal": ckpt.universal,
        "world_size": ckpt.world_size,
        "mp_world_size": ckpt.mp_world_size,
        "grid": {"tp": ckpt.grid.tp, "pp": ckpt.grid.pp, "dp": ckpt.grid.dp, "ep": ckpt.grid.ep},
        "ds_version": ckpt.ds_version,
        "dtype": ckpt.precision,
        "global_steps": ckpt.global_steps,
        "parameters": {"count": len(params), "numel": numel(params), "groups": [len(g) for g in ckpt.param_groups]},
        "frozen": {"count": len(frozen), "numel": numel(frozen)},
        "tied": dict(ckpt.shared),
        "buffers": {n: {"dtype": label(t.dtype), "shape": list(t.shape)} for n, t in ckpt.buffers.items()},
        "largest": [{"name": n, "shape": list(s), "numel": math.prod(s)} for n, s in largest],
        "client_state": {k: describe(v) for k, v in ckpt.client_state.items()},
        "files": [str(f.path) for f in lay.all_files],
        "rank_files": [{"path": str(f.path), "kind": f.kind, "rank": f.dp_rank, "tp_rank": f.mp_rank, "size": f.size}
                       for f in lay.all_files],
        "bytes": sum(f.size for f in lay.all_files) + (nvme["bytes"] if nvme else 0),
        "nvme": nvme,  # ZeRO-Infinity: the optimizer state DeepSpeed copied into offloaded_tensors/
        "tensors": len(plan.tensors) + len(plan.aliases) if plan is not None else None,
        "estimates": {"elements": elements, "fp32_bytes": fp32,
                      "bf16_bytes": numel(shapes) * 2 + sum(t.nbytes for t in ckpt.buffers.values()),
                      "consolidate_peak_rss_bytes": CONSOLIDATE_RSS,
                      "consolidate_cast_peak_rss_bytes": CONSOLIDATE_CAST_RSS},
        "problems": problems,
        "notes": list(ckpt.layout.notes),
        "trainer_state": trainer_summary(lay.root),  # an HF Trainer's checkpoint-N: its trainer_state.json
        "experts": _experts(ckpt),
        **sections,
    }
    if with_tensors:
        summary["tensor_list"] = tensor_table(ckpt, plan, shapes)
    return summary


def _experts(ckpt: Checkpoint) -> list[dict[str, Any]] | None:
    """A DeepSpeed-MoE run's layers: experts, ep_size, the expert-data-parallel size, one expert's size."""
    if not ckpt.experts:
        return None
    return [{"layer": layer.index, "module": layer.prefix, "experts": layer.num_experts, "ep_size": layer.ep_size,
             "expert_data_parallel_size": ckpt.world_size // layer.ep_size,
             "expert_numel": sum(math.prod(shape) for shape in layer.expert_shapes().values()),
             "optimizer_group": layer.group} for layer in ckpt.experts.layers]


def tensor_table(ckpt: Checkpoint, plan, shapes) -> list[dict[str, Any]]:
    if plan is None:  # problems: list what the metadata says, without file mapping
        return [{"name": n, "shape": list(s), "dtype": None, "kind": "frozen" if n in ckpt.frozen else "param",
                 "files": []} for n, s in shapes.items()]
    splits = TensorParallel.splits(ckpt)
    rows = [{"name": t.name, "shape": list(t.shape), "dtype": label(t.src_dtype), "kind": t.kind,
             "files": sorted({p.path.name for p in t.pieces if hasattr(p, "path")}),
             **({"split": splits[t.name].category} if t.name in splits else {})} for t in plan.tensors]
    rows += [{"name": a, "shape": None, "dtype": None, "kind": "tied", "alias_of": s, "files": []}
             for a, s in plan.aliases.items()]
    return rows


def describe(value: Any) -> dict[str, Any]:
    """Type and a short value for scalars; sizes for containers; class path for opaque objects."""
    if isinstance(value, Opaque):
        return {"type": "opaque", "class": value.class_path}
    if isinstance(value, TensorRef):
        return {"type": "tensor", "dtype": value.dtype, "shape": list(value.shape)}
    if isinstance(value, int) and value.bit_length() > 64:
        return {"type": "int", "bits": value.bit_length()}  # str() of a 5000-digit int raises
    if isinstance(value, (bool, int, float)) or value is None:
        return {"type": type(value).__name__, "value": value if not isinstance(value, float) or math.isfinite(value) else str(value)}
    if isinstance(value, str):
        return {"type": "str", "value": value if len(value) <= 60 else value[:57] + "..."}
    if isinstance(value, (dict, list, tuple, set)):
        return {"type": type(value).__name__, "len": len(value)}
    return {"type": type(value).__name__}


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _short(value: Any) -> Any:
    """A logged float as people read it (HF logs losses like 2.3015000000000003)."""
    return f"{value:.4g}" if isinstance(value, float) else value


def render(s: dict[str, Any]) -> str:
    if s["kind"] != "deepspeed":
        from .inspect_file import render_file
        return render_file(s)
    lines = []
    row = lambda k, v: lines.append(f"{k:<18}{v}")
    tags = ", ".join(t + (" (latest)" if t == s["latest"] else "") for t in s["tags"])
    row("checkpoint", s["root"])
    row("tag", f"{s['tag']}    tags: {tags or '-'}")
    universal = " (universal: ds_to_universal's zero/ folder)" if s.get("universal") else ""
    row("zero stage", f"{s['zero_stage']}{universal}    world size: {s['world_size']}    dtype: {s['dtype']}    "
                      f"ds_version: {s['ds_version']}    global steps: {s['global_steps']}")
    grid = s.get("grid") or {}
    if any(grid.get(axis, 1) > 1 for axis in ("tp", "pp", "ep")):
        row("grid", " x ".join(f"{axis} {grid[axis]}" for axis in ("tp", "pp", "dp", "ep") if grid[axis] > 1 or axis == "dp"))
    if s.get("tensor_parallel"):
        t = s["tensor_parallel"]
        row("tensor parallel", f"{t['degree']} ranks, split described by {t['described_by']}: "
                               + ", ".join(f"{n} {c}" for c, n in ((c, t["categories"][c]) for c in t["categories"])))
    for stage in s.get("pipeline") or ():
        tied = f"; tied: {', '.join(stage['tied'])}" if stage["tied"] else ""
        row(f"stage {stage['stage']}", f"layers {', '.join(map(str, stage['layers'])) or '-'}{tied}")
    p, f = s["parameters"], s["frozen"]
    row("trainable", f"{p['count']} tensors, {p['numel']:,} elements in {len(p['groups'])} group(s)")
    if f["count"]:  # empty sections are left out (the JSON keeps every key)
        row("frozen", f"{f['count']} tensors, {f['numel']:,} elements")
    for e in s.get("experts") or ():
        group = f", optimizer group {e['optimizer_group']}" if e["optimizer_group"] is not None else ""
        row(f"MoE layer {e['layer']}", f"{e['module']}: {e['experts']} experts of {e['expert_numel']:,} elements, "
                                      f"ep_size {e['ep_size']} (expert data parallel {e['expert_data_parallel_size']}{group})")
    if s["tied"]:
        row("tied", ", ".join(f"{a} -> {b}" for a, b in s["tied"].items()))
    if s["buffers"]:
        row("buffers", ", ".join(f"{n} ({b['dtype']})" for n, b in s["buffers"].items()))
    lines.append("largest tensors")
    lines += table([(t["name"], str(t["shape"]), f"{t['numel']:>14,}") for t in s["largest"]], (40, 20, 14))
    if s.get("trainer_state"):
        t = s["trainer_state"]
        loss = "none logged yet" if t["last_loss"] is None else _short(t["last_loss"])  # (logging_steps not reached)
        row("trainer state", t.get("error") or f"global step {t['global_step']}    epoch {_short(t['epoch'])}    "
                                               f"last logged loss {loss}    (trainer_state.json)")
    if s["client_state"]:
        lines.append("client state")
        lines += table([(k, d["type"], str(d.get("value", d.get("len", d.get("class", d.get("shape", ""))))))
                        for k, d in s["client_state"].items()], (32, 10, 0))
    lines.append("rank files")
    tp = (s.get("grid") or {}).get("tp", 1) > 1
    lines += table([(Path(f["path"]).name, f["kind"], (f"tp {f['tp_rank']}  " if tp else "")
                     + f"rank {'-' if f['rank'] is None else f['rank']!s:<4}",
                     f"{human_bytes(f['size']):>12}") for f in s["rank_files"]], (52, 7, 15 if tp else 9, 12))
    if s.get("nvme"):
        n = s["nvme"]
        kinds = sorted({"masters" if k == "fp32" else k for r in n["per_rank"].values() for k in r}, key=lambda k: (k != "masters", k))
        row("NVMe offload", f"{', '.join(n['offloaded'])} on NVMe; {n['swapped_sub_groups']} of {n['sub_groups']} "
                            f"sub-groups' {' + '.join(kinds) or 'state'} in {n['folder']}/ ({n['files']} files, "
                            f"{human_bytes(n['bytes'])} over {len(n['per_rank'])} ranks); the rest in the rank files")
        if n["nvme_path"]:
            row("", f"nvme_path recorded: {n['nvme_path']} (the writer's swap folder; not needed to read or resume)")
    e = s["estimates"]
    row("consolidated", f"{human_bytes(e['fp32_bytes'])} as fp32, {human_bytes(e['bf16_bytes'])} as bf16")
    row("consolidate RSS", f"< {human_bytes(e['consolidate_peak_rss_bytes'])} streaming "
                           f"(< {human_bytes(e['consolidate_cast_peak_rss_bytes'])} with --dtype); measured up to "
                           "328M parameters, docs/performance.md")
    if "tensor_list" in s:
        lines.append("tensors")
        lines += table([(t["name"], str(t["shape"]), str(t["dtype"]), t["kind"],
                         t.get("alias_of") and f"= {t['alias_of']}" or (f"[{t['split']}] " if t.get("split") else "")
                         + ", ".join(t["files"])) for t in s["tensor_list"]],
                       (40, 16, 6, 8, 0))
    if s.get("notes"):
        lines.append("notes")
        lines += [f"  - {m}" for m in s["notes"]]
    if s["problems"]:
        lines.append("PROBLEMS")
        lines += [f"  - {m}" for m in s["problems"]]
    return "\n".join(lines)
