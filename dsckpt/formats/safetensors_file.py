"""Read and validate safetensors files and sharded index.json folders without loading tensors."""
from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any, Iterable

from ..errors import CheckpointNotFoundError, CorruptFileError, UnreadableFileError
from ..dtypes import ITEMSIZE
from .json_file import read_json

INDEX_NAME = "model.safetensors.index.json"  # a sharded folder's index, as save_pretrained names it
SHADOWING_WEIGHTS = ("model.safetensors",)  # from_pretrained reads this before any index: it would hide a folder's shards
INDEX_SUFFIX = ".index.json"
METADATA_KEY = "__metadata__"  # the header's one entry that is not a tensor
HEADER_ALIGN = 8  # data starts 8-byte aligned (the header padded with spaces), as the reference writer does


def shard_name(i: int, n: int) -> str:
    """The i-th of n shards (1-based), as save_pretrained names them."""
    return f"model-{i:05d}-of-{n:05d}.safetensors"


def encode_header(entries: list[tuple[str, str, tuple[int, ...], int]],
                  metadata: dict[str, str]) -> tuple[bytes, list[int]]:
    """Header bytes (length prefix included) for (name, dtype, shape, nbytes) entries laid out in order, and each
    tensor's data offset relative to the data start."""
    header: dict[str, object] = {METADATA_KEY: metadata} if metadata else {}
    offsets, pos = [], 0
    for name, dtype, shape, nbytes in entries:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        offsets.append(pos)
        pos += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % HEADER_ALIGN)
    return struct.pack("<Q", len(raw)) + raw, offsets


def tensor_entries(header: dict[str, Any]) -> dict[str, Any]:
    """The header's tensors (its metadata entry left out)."""
    return {name: info for name, info in header.items() if name != METADATA_KEY}

MAX_HEADER = 100 << 20  # the reference implementation's own limit


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    """The parsed header and the absolute offset where data starts; validates every entry."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            prefix = fh.read(8)
            if len(prefix) != 8:
                raise CorruptFileError(f"too short for a safetensors file ({size} bytes)", at=path)
            (n,) = struct.unpack("<Q", prefix)
            if n > MAX_HEADER or 8 + n > size:
                raise CorruptFileError(f"header length {n} exceeds the file ({size} bytes)", at=path)
            raw = fh.read(n)
    except FileNotFoundError:
        raise CheckpointNotFoundError("no such file", at=path) from None
    except IsADirectoryError:
        raise CorruptFileError("is a directory, expected a safetensors file", at=path) from None
    except PermissionError:
        raise UnreadableFileError("permission denied", at=path) from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        raise CorruptFileError("header is not valid JSON", at=path) from None
    except RecursionError:
        raise CorruptFileError("header JSON is nested too deeply", at=path) from None
    if not isinstance(header, dict):
        raise CorruptFileError("header is not a JSON object", at=path)
    data_start = 8 + n
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                raise CorruptFileError("__metadata__ must map strings to strings", at=path)
            continue
        try:
            dtype, shape, (b, e) = info["dtype"], info["shape"], info["data_offsets"]
            # exact ints: ["4"] or [2.5, 1.9] are not shapes, whatever int() would make of them
            if dtype not in ITEMSIZE or not isinstance(shape, list) or not all(map(_is_count, [*shape, b, e])):
                raise ValueError
        except (KeyError, TypeError, ValueError):
            raise CorruptFileError(f"tensor {name!r} has a malformed header entry", at=path) from None
        if not 0 <= b <= e or e - b != math.prod(shape) * ITEMSIZE[dtype]:
            raise CorruptFileError(f"tensor {name!r} offsets [{b}, {e}) do not match its shape and dtype", at=path)
        if data_start + e > size:
            raise CorruptFileError(f"tensor {name!r} points past the end of the file", at=path)
        spans.append((b, e, name))
    spans.sort()
    pos = 0
    for b, e, name in spans:
        if b != pos:
            what = "overlaps another tensor" if b < pos else "leaves a gap before it"
            raise CorruptFileError(f"tensor {name!r} {what}", at=path)
        pos = e
    if data_start + pos != size:
        raise CorruptFileError(f"{size - data_start - pos} trailing bytes after the last tensor", at=path)
    return header, data_start


def _is_count(value: Any) -> bool:
    return type(value) is int and value >= 0


def read_index(path: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """A sharded folder's ``*.index.json``: (metadata, weight_map).

    ``weight_map`` must map tensor names to shard file names inside the index's own folder (no
    paths: an index may not make dsckpt read files elsewhere), and every shard must exist.
    """
    doc = read_json(path, "safetensors index")
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise CorruptFileError("not a safetensors index ('weight_map' must map tensor names to file names)", at=path)
    metadata = doc.get("metadata", {})
    if not isinstance(metadata, dict):
        raise CorruptFileError(f"'metadata' is a {type(metadata).__name__}, expected an object", at=path)
    for shard in sorted(set(weight_map.values())):
        if Path(shard).name != shard or shard in (".", ".."):
            raise CorruptFileError(f"shard {shard[:120]!r} is a path; an index names files in its own folder", at=path)
        if not (path.parent / shard).is_file():
            raise CorruptFileError(f"names shard {shard!r}, which does not exist", at=path)
    return metadata, weight_map


def check_shard_names(index: Path, weight_map: dict[str, str], shard: str, names: Iterable[str]) -> None:
    """Each tensor lives in the one shard the index names (two shards holding one name is ambiguous)."""
    for name in names:
        if name != "__metadata__" and weight_map.get(name) != shard:
            where = f"the index puts it in {weight_map[name]!r}" if name in weight_map else "the index does not list it"
            raise CorruptFileError(f"tensor {name!r} is in shard {shard!r}, but {where}", at=index)


def parse_aliases(text: str | None, where: Path) -> dict[str, str]:
    """The ``dsckpt.aliases`` metadata (tied name -> stored name), validated."""
    if not text:
        return {}
    try:
        aliases = json.loads(text)
    except (ValueError, RecursionError):
        raise CorruptFileError("metadata 'dsckpt.aliases' is not JSON", at=where) from None
    if not isinstance(aliases, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in aliases.items()):
        raise CorruptFileError("metadata 'dsckpt.aliases' must map names to names", at=where)
    return aliases
