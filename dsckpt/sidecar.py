"""The client-state sidecar: ``OUT.client_state.json`` (+ ``OUT.client_state.safetensors`` for tensors).

JSON cannot hold every Python value, so a few tagged objects stand in (all code-free)::

    {"__tuple__": [...]}            a tuple (e.g. random.getstate())
    {"__dict_items__": [[k, v]]}    a dict with non-string keys
    {"__tensor__": "t0"}            a tensor, stored under that key in the companion safetensors file
    {"__bytes__": "<base64>"}       bytes
    {"__float__": "nan"}            nan / inf / -inf
    {"__opaque__": "pkg.Class"}     an object of a class dsckpt would not unpickle (kept as a name only)
"""
from __future__ import annotations

import base64
import json
import math
from pathlib import Path
from typing import Any

from .errors import CorruptFileError
from .pickle_policy import Opaque, TensorRef

JSON_SUFFIX = ".client_state.json"
TENSORS_SUFFIX = ".client_state.safetensors"


def sidecar_paths(out: Path) -> tuple[Path, Path]:
    return out.with_name(out.name + JSON_SUFFIX), out.with_name(out.name + TENSORS_SUFFIX)


def encode(value: Any, tensors: dict[str, TensorRef]) -> Any:
    if isinstance(value, TensorRef):
        key = f"t{len(tensors)}"
        tensors[key] = value
        return {"__tensor__": key}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value):
            return {k: encode(v, tensors) for k, v in value.items()}
        return {"__dict_items__": [[encode(k, tensors), encode(v, tensors)] for k, v in value.items()]}
    if isinstance(value, tuple):
        return {"__tuple__": [encode(v, tensors) for v in value]}
    if isinstance(value, (list, set, frozenset)):
        return [encode(v, tensors) for v in value]
    if isinstance(value, (bytes, bytearray)):
        return {"__bytes__": base64.b64encode(bytes(value)).decode()}
    if isinstance(value, float) and not math.isfinite(value):
        return {"__float__": repr(value)}
    if isinstance(value, Opaque):
        return {"__opaque__": value.class_path}
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return {"__opaque__": type(value).__name__}


def decode(value: Any, tensors: dict[str, Any]) -> Any:
    if isinstance(value, list):
        return [decode(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        (tag, inner), = value.items()
        if tag == "__tuple__":
            return tuple(decode(v, tensors) for v in inner)
        if tag == "__dict_items__":
            return {_hashable(decode(k, tensors)): decode(v, tensors) for k, v in inner}
        if tag == "__tensor__":
            return tensors[inner]
        if tag == "__bytes__":
            return base64.b64decode(inner)
        if tag == "__float__":
            return float(inner)
        if tag == "__opaque__":
            return {"__opaque__": inner}
    return {k: decode(v, tensors) for k, v in value.items()}


def _hashable(v: Any) -> Any:
    return tuple(_hashable(x) for x in v) if isinstance(v, list) else v


def write_sidecar(client_state: dict[str, Any], out: Path, fsync: bool = True) -> Path:
    """Write OUT's sidecar (JSON, plus a safetensors companion when the state holds tensors)."""
    from .output import atomic_output
    from .plan import TensorPlan, ref_pieces
    from .writer import write_safetensors

    json_path, tensors_path = sidecar_paths(out)
    tensors: dict[str, TensorRef] = {}
    doc = {"format": "dsckpt.client_state/1", "weights": out.name, "client_state": encode(client_state, tensors)}
    if tensors:
        plans = [TensorPlan(k, t.shape, t.dtype, t.dtype, "client", ref_pieces(t)) for k, t in tensors.items()]
        with atomic_output(tensors_path, fsync=fsync) as tmp:
            write_safetensors(plans, tmp, {"format": "dsckpt.client_state"})
    elif tensors_path.exists():
        tensors_path.unlink()  # a companion left by an earlier --force run would be misread as ours
    with atomic_output(json_path, fsync=fsync) as tmp:
        tmp.write_text(json.dumps(doc, indent=1, allow_nan=False) + "\n")
    return json_path


def read_sidecar(json_path: Path) -> dict[str, Any]:
    """Decode a sidecar into Python values; tensors come back as torch tensors."""
    try:
        doc = json.loads(json_path.read_text())
        encoded = doc["client_state"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CorruptFileError(f"{json_path}: not a dsckpt client-state sidecar ({exc})") from None
    tensors: dict[str, Any] = {}
    tensors_path = json_path.with_name(json_path.name[: -len(JSON_SUFFIX)] + TENSORS_SUFFIX)
    if tensors_path.exists():
        from safetensors.torch import load_file

        tensors = load_file(str(tensors_path))
    return decode(encoded, tensors)
