"""`dsckpt inspect` on consolidated files: safetensors (validated header), sharded index, torch .pt/.bin."""
from __future__ import annotations

from ..formats import hf

import math
from collections import Counter
from pathlib import Path
from typing import Any

from ..errors import DsckptError
from ..formats import metadata as M
from ..formats.safetensors_file import parse_aliases
from ..io.formats import for_input


KINDS = {"safetensors": "safetensors", "sharded": "safetensors-sharded", "torch": "torch", "lightning": "lightning",
         "hf": "safetensors-sharded"}


def summarize_file(path: Path, with_tensors: bool = False) -> dict[str, Any]:
    """Tensors, dtypes and metadata of a consolidated file, read through its format (``io.formats``)."""
    fmt = for_input(path)
    rows, metadata, problems, files = [], {}, [], [path] if path.is_file() else []
    try:
        listing = fmt.read(path)
        rows = [(t.name, t.dtype, list(t.shape)) for t in listing.tensors]
        metadata, files = listing.metadata, listing.files
        parse_aliases(metadata.get(M.ALIASES), path)
    except DsckptError as exc:
        problems.append(str(exc))
    numel = sum(math.prod(s) for _, _, s in rows)
    summary = {"schema": 1, "kind": KINDS[fmt.name], "path": str(path),
               "files": [{"path": str(f), "size": f.stat().st_size} for f in files if f.exists()],
               "tensor_count": len(rows), "numel": numel, "dtypes": dict(Counter(d for _, d, _ in rows)),
               "metadata": metadata, "problems": problems}
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
    if with_tensors:
        summary["tensors"] = [{"name": n, "dtype": d, "shape": s} for n, d, s in rows]
    return summary


def render_file(s: dict[str, Any]) -> str:
    lines = [f"{'file':<14}{s['path']}", f"{'kind':<14}{s['kind']}",
             f"{'tensors':<14}{s['tensor_count']} ({s['numel']:,} elements)",
             f"{'dtypes':<14}" + ", ".join(f"{d}: {n}" for d, n in s["dtypes"].items())]
    if "hf_config" in s:
        lines.append(f"{'hf config':<14}" + ", ".join(f"{k}: {v}" for k, v in s["hf_config"].items()))
        lines.append(f"{'hf files':<14}" + (", ".join(s["hf_files"]) or "-"))
    for k, v in s["metadata"].items():
        lines.append(f"  {k}: {v if len(str(v)) < 80 else str(v)[:77] + '...'}")
    for t in s.get("tensors", []):
        lines.append(f"  {t['name']:<44}{t['dtype']:<6}{t['shape']}")
    if s["problems"]:
        lines.append("PROBLEMS")
        lines += [f"  - {m}" for m in s["problems"]]
    return "\n".join(lines)
