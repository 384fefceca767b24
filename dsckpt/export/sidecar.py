"""The client-state sidecar: ``OUT.client_state.json`` (+ ``OUT.client_state.safetensors`` for tensors).

JSON cannot hold every Python value, so a few tagged objects stand in (all code-free)::

    {"__tuple__": [...]}            a tuple (e.g. random.getstate())
    {"__dict_items__": [[k, v]]}    a dict with non-string keys
    {"__tensor__": "t0"}            a tensor, stored under that key in the companion safetensors file
    {"__bytes__": "<base64>"}       bytes
    {"__float__": "nan"}            nan / inf / -inf
    {"__opaque__": "pkg.Class"}     an object of a class dsckpt would not unpickle (kept as a name only)
    {"__int_hex__": "0x..."}        an int too long for decimal (str() refuses beyond 4300 digits)
    {"__set__": [...]}              a set (also "__frozenset__"), {"__complex__": [re, im]}, {"__bytearray__": "<base64>"}
    {"__ndarray__": {"dtype": "<u4", "shape": [624], "fortran": false, "data": "<base64>"}}   a numpy array
    {"__npscalar__": {"dtype": "<i8", "data": "<base64>"}}                                      a numpy scalar
A dict of the user's whose one key is one of these tags goes as "__dict_items__", so it is not read back as the tag.
"""
from __future__ import annotations

import base64
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import CorruptFileError
from ..formats import metadata as M
from ..formats.pickle_policy import Opaque, TensorRef

if TYPE_CHECKING:
    from ..io.context import WriteContext
    from ..io.output import Staging

JSON_SUFFIX = ".client_state.json"
TENSORS_SUFFIX = ".client_state.safetensors"
FOLDER_JSON = "client_state.json"  # inside a folder output (a sharded or --hf export, a DCP folder)
FOLDER_TENSORS = "client_state.safetensors"


def sidecar_paths(out: Path, directory: bool = False) -> tuple[Path, Path]:
    """Where OUT's client state goes: beside a file output, inside a folder output."""
    if directory:
        return out / FOLDER_JSON, out / FOLDER_TENSORS
    return out.with_name(out.name + JSON_SUFFIX), out.with_name(out.name + TENSORS_SUFFIX)


def tensors_companion(json_path: Path) -> Path:
    """The safetensors file beside a sidecar JSON."""
    if json_path.name == FOLDER_JSON:
        return json_path.with_name(FOLDER_TENSORS)
    return json_path.with_name(json_path.name[: -len(JSON_SUFFIX)] + TENSORS_SUFFIX)


TAGS = {"__tuple__", "__dict_items__", "__tensor__", "__bytes__", "__bytearray__", "__float__", "__opaque__",
        "__int_hex__", "__set__", "__frozenset__", "__complex__", "__ndarray__", "__npscalar__"}
HUGE_INT_BITS = 10_000  # str() of an int refuses beyond 4300 digits (~14,000 bits): such ints go as hex


def encode(value: Any, tensors: dict[str, TensorRef]) -> Any:
    """JSON-able form of a parsed client state (its size and depth were bounded when its pickle was
    read: ``torchzip.check_structure``)."""
    encode_ = lambda v: encode(v, tensors)  # noqa: E731
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > HUGE_INT_BITS:
        return {"__int_hex__": hex(value)}
    if isinstance(value, TensorRef):
        key = f"t{len(tensors)}"
        tensors[key] = value
        return {"__tensor__": key}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and not (len(value) == 1 and next(iter(value)) in TAGS):
            return {k: encode_(v) for k, v in value.items()}
        return {"__dict_items__": [[encode_(k), encode_(v)] for k, v in value.items()]}
    if isinstance(value, tuple):
        return {"__tuple__": [encode_(v) for v in value]}
    if isinstance(value, list):
        return [encode_(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return {f"__{type(value).__name__}__": [encode_(v) for v in value]}
    if isinstance(value, complex):
        return {"__complex__": [encode_(value.real), encode_(value.imag)]}
    if isinstance(value, (bytes, bytearray)):
        return {f"__{type(value).__name__}__": base64.b64encode(bytes(value)).decode()}
    if isinstance(value, float) and not math.isfinite(value):
        return {"__float__": repr(value)}
    if isinstance(value, Opaque):
        return _numpy_record(value) or {"__opaque__": value.class_path}
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return {"__opaque__": type(value).__name__}


def _numpy_dtype(record: Any) -> str | None:
    """``"<u4"`` for a parsed ``numpy.dtype('u4', False, True)`` of plain numbers; None for any other."""
    if not (isinstance(record, Opaque) and record.class_path == "numpy.dtype" and record.args
            and isinstance(record.args[0], str) and isinstance(record.state, tuple) and len(record.state) >= 3):
        return None
    code, order, fields = record.args[0], record.state[1], record.state[2:5]
    if code[:1] not in ("b", "i", "u", "f", "c") or order not in ("<", ">", "|") or any(x is not None for x in fields):
        return None
    return order + code


def _numpy_record(value: Opaque) -> dict[str, Any] | None:
    """A numpy array or scalar of plain numbers, as ``numpy.ndarray.__reduce__`` / ``numpy.generic`` recorded it."""
    path = value.class_path
    if path.endswith("multiarray._reconstruct") and isinstance(value.state, tuple) and len(value.state) == 5:
        _, shape, dtype, fortran, data = value.state
        code = _numpy_dtype(dtype)
        if code and isinstance(data, bytes) and isinstance(shape, tuple) and all(isinstance(n, int) for n in shape):
            return {"__ndarray__": {"dtype": code, "shape": list(shape), "fortran": bool(fortran),
                                    "data": base64.b64encode(data).decode()}}
    if path.endswith("multiarray.scalar") and len(value.args) == 2 and isinstance(value.args[1], bytes):
        code = _numpy_dtype(value.args[0])
        if code:
            return {"__npscalar__": {"dtype": code, "data": base64.b64encode(value.args[1]).decode()}}
    return None


def _numpy_value(tag: str, inner: dict[str, Any]) -> Any:
    import numpy as np

    dtype = np.dtype(inner["dtype"])
    flat = np.frombuffer(bytearray(base64.b64decode(inner["data"])), dtype=dtype)
    if tag == "__npscalar__":
        return flat[0]
    return flat.reshape(inner["shape"], order="F" if inner["fortran"] else "C")


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
            if inner not in tensors:
                raise CorruptFileError(f"client state names tensor {str(inner)[:80]!r}, absent from its companion file")
            return tensors[inner]
        if tag == "__int_hex__":
            return int(inner, 16)
        if tag == "__bytes__":
            return base64.b64decode(inner)
        if tag == "__bytearray__":
            return bytearray(base64.b64decode(inner))
        if tag in ("__set__", "__frozenset__"):
            items = (_hashable(decode(v, tensors)) for v in inner)
            return set(items) if tag == "__set__" else frozenset(items)
        if tag == "__complex__":
            return complex(*(decode(v, tensors) for v in inner))
        if tag == "__float__":
            return float(inner)
        if tag == "__opaque__":
            return {"__opaque__": inner}
        if tag in ("__ndarray__", "__npscalar__") and isinstance(inner, dict):
            return _numpy_value(tag, inner)
    return {k: decode(v, tensors) for k, v in value.items()}


def _hashable(v: Any) -> Any:
    return tuple(_hashable(x) for x in v) if isinstance(v, list) else v


def write_sidecar(client_state: dict[str, Any], out: Path, stage: "Staging", context: "WriteContext",
                  into: Path | None = None) -> Path:
    """Stage OUT's sidecar (JSON, plus a safetensors companion when the state holds tensors): beside a file OUT;
    ``into``: the staged folder of a folder OUT, written in place there (the folder is published whole).  Its bytes
    are not counted in ``context``'s progress (OUT's total does not hold them)."""
    from dataclasses import replace

    from ..plan.consolidate import TensorPlan
    from ..plan.segments import ref_segments
    from ..io.safetensors_writer import write_safetensors

    json_path, tensors_path = sidecar_paths(into, True) if into is not None else sidecar_paths(out)
    place = (lambda path: path) if into is not None else stage.temp_for
    tensors: dict[str, TensorRef] = {}
    doc = {"format": M.SIDECAR_FORMAT, "weights": "." if into is not None else out.name,  # (inside: the folder's)
           "client_state": encode(client_state, tensors)}
    if tensors:
        plans = [TensorPlan(k, t.shape, t.dtype, t.dtype, "client", ref_segments(t)) for k, t in tensors.items()]
        write_safetensors(plans, place(tensors_path), {M.FORMAT: M.SIDECAR_TENSORS_FORMAT},
                          replace(context, progress=None))
    elif into is None and tensors_path.exists():
        stage.remove_on_commit([tensors_path])  # a companion left by an earlier --force run would be misread as ours
    elif into is not None and (out / FOLDER_TENSORS).exists():
        stage.remove_on_commit([out / FOLDER_TENSORS])
    place(json_path).write_text(json.dumps(doc, indent=1, allow_nan=False) + "\n")
    return json_path


def read_sidecar(json_path: Path, load_tensors: bool = True) -> dict[str, Any]:
    """Decode a sidecar into Python values; tensors come back as torch tensors (without ``load_tensors``:
    as their names, the file checked by dsckpt's reader only - a launcher's preflight, which needs no torch)."""
    from ..formats.json_file import read_json

    doc = read_json(json_path, "dsckpt client-state sidecar")
    if not isinstance(doc, dict) or "client_state" not in doc:
        raise CorruptFileError("not a dsckpt client-state sidecar (no 'client_state' entry)", at=json_path)
    tensors: dict[str, Any] = {}
    tensors_path = tensors_companion(json_path)
    if tensors_path.exists():
        from ..formats.safetensors_file import read_header, tensor_entries

        header, _ = read_header(tensors_path)  # validated by dsckpt's reader before safetensors parses it
        tensors = {name: name for name in tensor_entries(header)}
        if load_tensors:
            from safetensors.torch import load_file

            tensors = load_file(str(tensors_path))
    try:
        return decode(doc["client_state"], tensors)
    except CorruptFileError as exc:
        raise CorruptFileError(f"{exc}", at=json_path) from None
    except (ValueError, TypeError, KeyError, RecursionError) as exc:
        raise CorruptFileError(f"malformed client state ({type(exc).__name__})", at=json_path) from None


def recorded_step(folder: Path) -> int | None:
    """The training step a folder's client-state sidecar records (``global_steps``, else ``global_step``: what
    DeepSpeed, dsckpt's runtime and Lightning count), None where there is no sidecar or no such number."""
    if not (folder / FOLDER_JSON).is_file():
        return None
    client = read_sidecar(folder / FOLDER_JSON, load_tensors=False)
    return next((client[k] for k in ("global_steps", "global_step") if isinstance(client.get(k), int)), None)
