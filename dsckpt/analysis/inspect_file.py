"""`dsckpt inspect` on consolidated files: safetensors (validated header), sharded index, torch .pt/.bin."""
from __future__ import annotations

from ..export import hf

import math
from collections import Counter
from pathlib import Path
from typing import Any

from ..jsondoc import JSON_SCHEMA
from ..dtypes import label
from ..errors import CorruptFileError, DsckptError
from ..formats import metadata as M
from ..formats.safetensors_file import parse_aliases
from ..export.registry import for_input
from .report import table


KINDS = {"safetensors": "safetensors", "sharded": "safetensors-sharded", "torch": "torch", "lightning": "lightning",
         "hf": "safetensors-sharded"}


def summarize_file(path: Path, with_tensors: bool = False) -> dict[str, Any]:
    """Tensors, dtypes and metadata of a consolidated file, read through its format (``io.formats``)."""
    fmt = for_input(path)
    if fmt is None:
        raise CorruptFileError("not a weights file any registered format reads", at=path)
    rows: list[tuple[str, str, list[int]]] = []
    metadata: dict[str, str] = {}
    problems: list[str] = []
    files = [path] if path.is_file() else []
    try:
        listing = fmt.read(path)
        rows = [(t.name, t.dtype, list(t.shape)) for t in listing.tensors]
        metadata, files = listing.metadata, listing.files
        parse_aliases(metadata.get(M.ALIASES), path)
    except DsckptError as exc:
        problems.append(str(exc))
    numel = sum(math.prod(s) for _, _, s in rows)
    present = [f for f in files if f.exists()]
    summary = {"schema": JSON_SCHEMA, "kind": KINDS[fmt.name], "input": str(path),
               "files": [str(f) for f in present], "bytes": sum(f.stat().st_size for f in present),
               "tensors": len(rows), "numel": numel, "dtypes": dict(Counter(label(d) for _, d, _ in rows)),
               "metadata": metadata, "problems": problems, "notes": []}
    folder = path if path.is_dir() else path.parent
    if (folder / hf.CONFIG).is_file():  # a Hugging Face model folder: what from_pretrained will build
        try:
            config = hf.read_json(folder / hf.CONFIG)
            summary["hf_config"] = {k: config.get(k) for k in ("model_type", "architectures", "dtype", "torch_dtype",
                                                               "tie_word_embeddings") if k in config}
        except DsckptError as exc:
            problems.append(str(exc))
        summary["hf_files"] = sorted(p.name for p in folder.iterdir()
                                     if p.name in (hf.GENERATION_CONFIG, *hf.TOKENIZER_FILES))
    if fmt.name in ("torch", "lightning") and not problems and LIGHTNING_MARKERS & set(map(str, listing.extra)):
        summary["lightning"] = lightning_summary(listing.extra)
    if with_tensors:
        summary["tensor_list"] = [{"name": n, "dtype": label(d), "shape": s} for n, d, s in rows]
    return summary


LIGHTNING_MARKERS = {"pytorch-lightning_version", "loops", "hyper_parameters"}  # keys only Lightning writes


def lightning_summary(extra: dict) -> dict[str, Any]:
    """What a Lightning checkpoint says beside its weights: where training stands and what it was built with."""
    hparams = extra.get("hyper_parameters")
    plain = lambda v: v if isinstance(v, (int, float, str, type(None))) else None
    return {"epoch": plain(extra.get("epoch")), "global_step": plain(extra.get("global_step")),
            "version": plain(extra.get("pytorch-lightning_version")),
            "hyper_parameters": sorted(map(str, hparams)) if isinstance(hparams, dict) else [],
            "keys": sorted(map(str, extra))}


def render_file(s: dict[str, Any]) -> str:
    lines = [f"{'file':<14}{s['input']}", f"{'kind':<14}{s['kind']}",
             f"{'tensors':<14}{s['tensors']} ({s['numel']:,} elements)",
             f"{'dtypes':<14}" + ", ".join(f"{d}: {n}" for d, n in s["dtypes"].items())]
    if "hf_config" in s:
        lines.append(f"{'hf config':<14}" + ", ".join(f"{k}: {v}" for k, v in s["hf_config"].items()))
        lines.append(f"{'hf files':<14}" + (", ".join(s["hf_files"]) or "-"))
    if "lightning" in s:
        lt = s["lightning"]
        lines.append(f"{'lightning':<14}epoch {lt['epoch']}    global step {lt['global_step']}    version {lt['version']}")
        lines.append(f"{'hparams':<14}" + (", ".join(lt["hyper_parameters"]) or "-"))
    for k, v in s["metadata"].items():
        lines.append(f"  {k}: {v if len(str(v)) < 80 else str(v)[:77] + '...'}")
    lines += table([(t["name"], t["dtype"], str(t["shape"])) for t in s.get("tensor_list", [])], (44, 6, 0))
    if s["problems"]:
        lines.append("PROBLEMS")
        lines += [f"  - {m}" for m in s["problems"]]
    return "\n".join(lines)
