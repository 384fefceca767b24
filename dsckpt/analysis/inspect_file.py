"""`dsckpt inspect` on consolidated files: safetensors (validated header), sharded index, torch .pt/.bin."""
from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any

from ..errors import DsckptError
from ..formats import metadata as M
from ..formats.pickle_policy import TensorRef
from ..formats.safetensors_file import check_shard_names, parse_aliases, read_header, read_index
from ..formats.torchzip import TorchFile


def summarize_file(path: Path, with_tensors: bool = False) -> dict[str, Any]:
    rows, metadata, problems, files = [], {}, [], []
    if path.name.endswith(".index.json"):
        metadata, weight_map = read_index(path)
        for shard in sorted(set(weight_map.values())):
            files.append(path.parent / shard)
        kind = "safetensors-sharded"
    elif path.suffix == ".safetensors":
        files, kind = [path], "safetensors"
    else:
        files, kind = [path], "torch"
    for f in files:
        try:
            if kind == "torch":
                rows += [(n, t.dtype, list(t.shape)) for n, t in _tensors(TorchFile(f).obj)]
            else:
                header, _ = read_header(f)
                if kind == "safetensors-sharded":
                    check_shard_names(path, weight_map, f.name, header)
                metadata = {**header.get("__metadata__", {}), **{k: str(v) for k, v in metadata.items()}}
                parse_aliases(metadata.get(M.ALIASES), f)
                rows += [(n, i["dtype"], i["shape"]) for n, i in header.items() if n != "__metadata__"]
        except DsckptError as exc:
            problems.append(str(exc))
    numel = sum(math.prod(s) for _, _, s in rows)
    summary = {"schema": 1, "kind": kind, "path": str(path), "files": [{"path": str(f), "size": f.stat().st_size}
                                                                      for f in files if f.exists()],
               "tensor_count": len(rows), "numel": numel, "dtypes": dict(Counter(d for _, d, _ in rows)),
               "metadata": metadata, "problems": problems}
    if with_tensors:
        summary["tensors"] = [{"name": n, "dtype": d, "shape": s} for n, d, s in rows]
    return summary


def _tensors(obj: Any, prefix: str = ""):
    if isinstance(obj, TensorRef):
        yield prefix.rstrip("."), obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{prefix}{k}.")


def render_file(s: dict[str, Any]) -> str:
    lines = [f"{'file':<14}{s['path']}", f"{'kind':<14}{s['kind']}",
             f"{'tensors':<14}{s['tensor_count']} ({s['numel']:,} elements)",
             f"{'dtypes':<14}" + ", ".join(f"{d}: {n}" for d, n in s["dtypes"].items())]
    for k, v in s["metadata"].items():
        lines.append(f"  {k}: {v if len(str(v)) < 80 else str(v)[:77] + '...'}")
    for t in s.get("tensors", []):
        lines.append(f"  {t['name']:<44}{t['dtype']:<6}{t['shape']}")
    if s["problems"]:
        lines.append("PROBLEMS")
        lines += [f"  - {m}" for m in s["problems"]]
    return "\n".join(lines)
