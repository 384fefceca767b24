"""A ``torch.distributed.checkpoint`` (DCP) folder read without torch and without running its pickles.

What ``FileSystemWriter`` leaves (measured, torch 2.13)::

    <folder>/.metadata         a pickle: Metadata(state_dict_metadata, storage_data, planner_data, ...)
    <folder>/__<r>_<n>.distcp  each item one ``torch.save`` archive, at the offset .metadata records

``state_dict_metadata`` maps each flattened key ("model.embed.weight", "optim.param_groups.0.lr") to a
``TensorStorageMetadata`` (dtype, global size, chunks: offsets + sizes of each saved shard) or a
``BytesStorageMetadata`` (any other value, pickled); ``storage_data`` maps (key, chunk offset) to
(file, offset, length); ``planner_data`` maps each flattened key to its path in the nested dict.  The
``.metadata`` pickle and every item archive are read with the allowlist (``pickle_policy``): torch's classes
become inert records whose recorded state is read here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CorruptFileError, UnsupportedCheckpointError
from ..limits import check
from .pickle_policy import Opaque, TensorRef, TorchDtype, unpickle
from .torchzip import TorchFile, check_structure, tensor_byte_range

METADATA_FILE = ".metadata"  # torch's name for a DCP folder's index


@dataclass(frozen=True)
class Chunk:
    """One saved shard of a tensor: its place in the global tensor and where its archive lies."""
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: Path
    offset: int
    length: int


@dataclass(frozen=True)
class DcpTensor:
    key: str
    dtype: str  # safetensors name ("F32")
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]


@dataclass(frozen=True)
class DcpValue:
    """A non-tensor entry (a number, a list of names), pickled in its own archive."""
    key: str
    file: Path
    offset: int
    length: int


@dataclass(frozen=True)
class DcpIndex:
    folder: Path
    tensors: dict[str, DcpTensor]  # in the order the save planned them
    values: dict[str, DcpValue]
    paths: dict[str, tuple[Any, ...]]  # flattened key -> its path in the saved nested dict (planner_data)

    @property
    def metadata_file(self) -> Path:
        return self.folder / METADATA_FILE


def _state(obj: Any, cls: str, where: str) -> Any:
    """The recorded state of an inert ``torch.distributed.checkpoint...<cls>`` record."""
    if not (isinstance(obj, Opaque) and obj.class_path.rsplit(".", 1)[-1] == cls):
        raise CorruptFileError(f"expected a {cls} record, found {type(obj).__name__}", at=where)
    return obj.state


def _field(state: Any, name: str, kind: type | tuple[type, ...], where: str) -> Any:
    value = state.get(name) if isinstance(state, dict) else None
    if not isinstance(value, kind):
        raise CorruptFileError(f"field {name!r} is missing or not a {getattr(kind, '__name__', kind)}", at=where)
    return value


def _counts(value: Any, where: str) -> tuple[int, ...]:
    if not (isinstance(value, tuple) and all(type(v) is int and v >= 0 for v in value)):
        raise CorruptFileError(f"{value!r:.80} is not a list of sizes", at=where)
    return tuple(value)


def read_index(folder: str | Path) -> DcpIndex:
    """Parse ``folder/.metadata``: every tensor's chunks and every value's location, checked to lie in the
    folder's files (no item archive is opened yet)."""
    folder = Path(folder)
    meta = folder / METADATA_FILE
    if not meta.is_file():
        raise CorruptFileError(f"no {METADATA_FILE}; not a torch.distributed.checkpoint folder", at=folder)
    where = str(meta)
    check("MAX_PICKLE_BYTES", meta.stat().st_size, where, "the size of .metadata")
    try:
        root = unpickle(meta.read_bytes(), None)
    except Exception as exc:  # hostile or damaged bytes: every failure is a format error
        raise CorruptFileError(f"cannot parse the DCP metadata pickle ({type(exc).__name__}: "
                               f"{str(exc)[:200]})", at=where) from None
    check_structure(getattr(root, "state", None), where)
    state = _state(root, "Metadata", where)
    described = _field(state, "state_dict_metadata", dict, where)
    stored = _field(state, "storage_data", dict, where)
    planner = state.get("planner_data") if isinstance(state.get("planner_data"), dict) else {}
    locations: dict[tuple[str, tuple[int, ...] | None], tuple[Path, int, int]] = {}
    sizes: dict[Path, int] = {}
    for index, info in stored.items():
        key_state, info_state = _state(index, "MetadataIndex", where), _state(info, "_StorageInfo", where)
        fqn = _field(key_state, "fqn", str, where)
        offset = key_state.get("offset")
        name = _field(info_state, "relative_path", str, where)
        file = folder / name
        if Path(name).name != name or name.startswith("."):
            raise CorruptFileError(f"item {fqn!r} names {name!r}, not a file of the folder", at=where)
        if file not in sizes:
            if not file.is_file():
                raise CorruptFileError(f"missing; {where} names it for {fqn!r}", at=file)
            sizes[file] = file.stat().st_size
        start, length = _field(info_state, "offset", int, where), _field(info_state, "length", int, where)
        if start < 0 or length <= 0 or start + length > sizes[file]:
            raise CorruptFileError(f"{fqn!r} at bytes [{start}, {start + length}) of a {sizes[file]}-byte "
                                   "file (truncated?)", at=file)
        locations[fqn, None if offset is None else _counts(tuple(offset), where)] = (file, start, length)
    tensors, values = {}, {}
    for key, item in described.items():
        if not isinstance(key, str):
            raise CorruptFileError(f"a key that is not a string ({key!r:.60})", at=where)
        kind = type(item).__name__
        if kind == "BytesStorageMetadata":
            found = locations.get((key, None))
            if found is None:
                raise CorruptFileError(f"{key!r} is described but no file holds it", at=where)
            values[key] = DcpValue(key, *found)
            continue
        item_state = _state(item, "TensorStorageMetadata", where)
        props = _state(item_state.get("properties"), "TensorProperties", where)
        dtype = props[0] if isinstance(props, tuple) and props else props.get("dtype") if isinstance(props, dict) else None
        if not isinstance(dtype, TorchDtype):
            raise CorruptFileError(f"{key!r} has no dtype torch can name", at=where)
        shape = _counts(tuple(_field(item_state, "size", tuple, where)), where)
        chunks = []
        for chunk in _field(item_state, "chunks", list, where):
            c = _state(chunk, "ChunkStorageMetadata", where)
            offsets, chunk_sizes = _counts(tuple(c.get("offsets", ())), where), _counts(tuple(c.get("sizes", ())), where)
            found = locations.get((key, offsets))
            if found is None:
                raise CorruptFileError(f"{key!r} chunk at {list(offsets)} is described but no file holds it", at=where)
            chunks.append(Chunk(offsets, chunk_sizes, *found))
        tensors[key] = DcpTensor(key, str(dtype), shape, tuple(chunks))
    paths = {k: tuple(v) for k, v in planner.items() if isinstance(k, str) and isinstance(v, tuple)}
    return DcpIndex(folder, tensors, values, paths)


def value(item: DcpValue) -> Any:
    """A non-tensor entry's value (plain data only: the allowlist)."""
    return TorchFile(item.file, (item.offset, item.length)).obj


def tensor_ranges(tensor: DcpTensor) -> list[tuple[Path, int, int]]:
    """The tensor's bytes in row-major order as (file, offset, length) ranges: its chunks must be whole rows
    (dim-0 shards, as FSDP2 and a one-process save write them) that tile it exactly."""
    where = f"{tensor.chunks[0].file if tensor.chunks else tensor.key}: {tensor.key!r}"
    if any(c.offsets[1:] != (0,) * (len(tensor.shape) - 1) or c.sizes[1:] != tensor.shape[1:] for c in tensor.chunks):
        raise UnsupportedCheckpointError("saved in chunks that split a dimension after the first "
                                         "(a 2-D sharding); dsckpt reads dim-0 shards only", at=where)
    out, row = [], 0
    for chunk in sorted(tensor.chunks, key=lambda c: c.offsets[:1]):
        if len(chunk.sizes) != len(tensor.shape):
            raise CorruptFileError(f"a chunk of {len(chunk.sizes)} dims for a {len(tensor.shape)}-dim tensor", at=where)
        if tensor.shape and chunk.offsets[0] != row:
            raise CorruptFileError(f"chunks do not tile the tensor (row {row} expected, "
                                   f"{chunk.offsets[0]} found)", at=where)
        rows = chunk.sizes[0] if tensor.shape else 1
        row += rows
        if math.prod(chunk.sizes) == 0:
            continue
        ref = TorchFile(chunk.file, (chunk.offset, chunk.length)).obj
        if not isinstance(ref, TensorRef) or ref.shape != chunk.sizes or ref.dtype != tensor.dtype:
            raise CorruptFileError(f"the item of {tensor.key!r} at byte {chunk.offset} holds "
                                   f"{ref!r:.80}, metadata says {tensor.dtype} {list(chunk.sizes)}", at=chunk.file)
        out.append(tensor_byte_range(ref))
    if (row if tensor.shape else min(row, 1)) != (tensor.shape[0] if tensor.shape else 1):
        raise CorruptFileError(f"chunks cover {row} of {tensor.shape[0] if tensor.shape else 1} rows", at=where)
    return out


@dataclass(frozen=True)
class DcpContents:
    """What a plan needs beyond the index: each tensor's byte ranges, each value, each 0-d tensor's number."""
    ranges: dict[str, list[tuple[Path, int, int]]]
    values: dict[str, Any]
    scalars: dict[str, float | int]


def read_contents(index: DcpIndex) -> DcpContents:
    """Open every item archive once (its header and pickle: no tensor bytes but the 0-d ones)."""
    import numpy as np

    from ..dtypes import DTYPES
    from .positional import read_range

    ranges = {key: tensor_ranges(t) for key, t in index.tensors.items()}
    values = {key: value(v) for key, v in index.values.items()}
    scalars: dict[str, float | int] = {}
    for key, t in index.tensors.items():
        if t.shape == () and ranges[key]:
            raw = read_range(*ranges[key][0])
            if t.dtype == "BF16":
                raw, t_dtype = b"\0\0" + raw, "float32"  # bf16 is the high half of a float32
            else:
                t_dtype = DTYPES[t.dtype].numpy
            scalars[key] = np.frombuffer(raw, dtype=t_dtype)[0].item()
    return DcpContents(ranges, values, scalars)
