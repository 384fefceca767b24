"""Read and validate safetensors files and sharded index.json folders without loading tensors."""
from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

from .errors import CorruptFileError
from .plan import ITEMSIZE

MAX_HEADER = 100 << 20  # the reference implementation's own limit


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    """The parsed header and the absolute offset where data starts; validates every entry."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            prefix = fh.read(8)
            if len(prefix) != 8:
                raise CorruptFileError(f"{path}: too short for a safetensors file ({size} bytes)")
            (n,) = struct.unpack("<Q", prefix)
            if n > MAX_HEADER or 8 + n > size:
                raise CorruptFileError(f"{path}: header length {n} exceeds the file ({size} bytes)")
            raw = fh.read(n)
    except IsADirectoryError:
        raise CorruptFileError(f"{path}: is a directory, expected a safetensors file") from None
    except PermissionError:
        raise CorruptFileError(f"{path}: permission denied") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        raise CorruptFileError(f"{path}: header is not valid JSON") from None
    if not isinstance(header, dict):
        raise CorruptFileError(f"{path}: header is not a JSON object")
    data_start = 8 + n
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                raise CorruptFileError(f"{path}: __metadata__ must map strings to strings")
            continue
        try:
            dtype, shape, (b, e) = info["dtype"], [int(s) for s in info["shape"]], info["data_offsets"]
            if dtype not in ITEMSIZE or any(s < 0 for s in shape) or not (isinstance(b, int) and isinstance(e, int)):
                raise ValueError
        except (KeyError, TypeError, ValueError):
            raise CorruptFileError(f"{path}: tensor {name!r} has a malformed header entry") from None
        if not 0 <= b <= e or e - b != math.prod(shape) * ITEMSIZE[dtype]:
            raise CorruptFileError(f"{path}: tensor {name!r} offsets [{b}, {e}) do not match its shape and dtype")
        if data_start + e > size:
            raise CorruptFileError(f"{path}: tensor {name!r} points past the end of the file")
        spans.append((b, e, name))
    spans.sort()
    pos = 0
    for b, e, name in spans:
        if b != pos:
            what = "overlaps another tensor" if b < pos else "leaves a gap before it"
            raise CorruptFileError(f"{path}: tensor {name!r} {what}")
        pos = e
    if data_start + pos != size:
        raise CorruptFileError(f"{path}: {size - data_start - pos} trailing bytes after the last tensor")
    return header, data_start


def read_index(path: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """A sharded folder's ``*.index.json``: (metadata, weight_map); every shard must exist."""
    try:
        doc = json.loads(path.read_text())
        weight_map = doc["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CorruptFileError(f"{path}: not a safetensors index ({exc})") from None
    for shard in sorted(set(weight_map.values())):
        if not (path.parent / shard).is_file():
            raise CorruptFileError(f"{path}: names shard {shard!r}, which does not exist")
    return doc.get("metadata", {}), weight_map
