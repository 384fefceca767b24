"""Read one full-weights file tensor by tensor, with positional reads (no mmap, no pickle code).

Formats: ``.safetensors``, a sharded folder (or its ``*.index.json``), and torch ``.pt/.bin``
state dicts (also a Lightning-style ``{"state_dict": ...}``), the latter through dsckpt's own
allowlist reader.  Each ``get`` reads exactly one tensor's bytes, so memory is one tensor at a
time and the RSS of the reading rank does not grow with the file (mmap would count every touched
page of the file).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import CheckpointNotFoundError, CorruptFileError
from ..formats import metadata as M
from ..dtypes import ITEMSIZE, torch_dtype
from ..plan.consolidate import strip_name
from ..formats.pickle_policy import TensorRef



@dataclass(frozen=True)
class Entry:
    path: Path
    offset: int  # absolute byte offset of the first element
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...] | None = None  # None: contiguous


class WeightsFile:
    """Name -> tensor access to one weights file; aliases recorded by ``dsckpt consolidate`` are expanded."""

    def __init__(self, path: str | Path, strip_prefixes: tuple[str, ...] = ()):
        self.path = Path(path)
        self._beside: dict = {}  # a .pt training checkpoint's other top-level entries
        aliases: dict[str, str] = {}
        if not self.path.exists():
            raise CheckpointNotFoundError(f"{self.path}: no such weights file or folder")
        try:
            if self.path.is_dir() or self.path.name.endswith(".index.json"):
                self.entries, aliases = self._sharded()
            elif self.path.suffix == ".safetensors":
                self.entries, aliases = self._safetensors(self.path)
            else:
                self.entries = self._torch()
        except (OSError, ValueError) as exc:
            raise CorruptFileError(f"{self.path}: cannot read weights ({exc})") from None
        self.aliases = {a: s for a, s in aliases.items() if a not in self.entries and s in self.entries}
        self.source = {strip_name(n, strip_prefixes): n for n in list(self.entries) + list(self.aliases)}

    # -- formats ------------------------------------------------------------------------------
    @staticmethod
    def _safetensors(path: Path) -> tuple[dict[str, Entry], dict[str, str]]:
        from ..formats.safetensors_file import parse_aliases, read_header

        header, data_start = read_header(path)
        entries = {name: Entry(path, data_start + info["data_offsets"][0], info["dtype"], tuple(info["shape"]))
                   for name, info in header.items() if name != "__metadata__"}
        return entries, parse_aliases(header.get("__metadata__", {}).get(M.ALIASES), path)

    def _sharded(self) -> tuple[dict[str, Entry], dict[str, str]]:
        from ..formats.safetensors_file import check_shard_names, parse_aliases, read_index

        index = self.path if self.path.is_file() else next(self.path.glob("*.index.json"), None)
        if index is None:
            raise CorruptFileError(f"{self.path}: folder holds no *.index.json")
        meta, weight_map = read_index(index)
        entries: dict[str, Entry] = {}
        for shard in sorted(set(weight_map.values())):
            found = self._safetensors(index.parent / shard)[0]
            check_shard_names(index, weight_map, shard, found)
            entries.update(found)
        return entries, parse_aliases(meta.get(M.ALIASES), index)

    def _torch(self) -> dict[str, Entry]:
        from ..formats.torchzip import TorchFile

        tf = TorchFile(self.path)
        obj = tf.obj
        if isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
            self._beside = {k: v for k, v in obj.items() if k != "state_dict"}
            obj = obj["state_dict"]  # a training checkpoint (e.g. Lightning's): its weights
        if not isinstance(obj, dict):
            raise CorruptFileError(f"{self.path}: not a state dict")
        entries = {}
        for name, ref in obj.items():
            if isinstance(ref, TensorRef):
                loc = tf.locate(ref.storage)
                entries[str(name)] = Entry(self.path, loc.offset + ref.offset * ref.storage.itemsize, ref.dtype,
                                           ref.shape, None if ref.is_contiguous() else ref.stride)
        if not entries:
            raise CorruptFileError(f"{self.path}: holds no tensors")
        return entries

    # -- access -------------------------------------------------------------------------------
    def embedded_state(self) -> dict:
        """What a ``.pt`` training checkpoint holds beside ``state_dict`` (Lightning: ``epoch``,
        ``global_step``, ``hyper_parameters``...), as plain values: tensors read, objects of classes
        dsckpt does not load kept as ``{"__opaque__": "module.Class"}``."""
        from ..formats.sidecar import decode, encode

        refs: dict = {}
        encoded = encode(self._beside, refs)
        tensors = {key: self._read_ref(ref) for key, ref in refs.items()}
        return decode(encoded, tensors)

    @staticmethod
    def _read_ref(ref: TensorRef) -> torch.Tensor:
        from ..formats.torchzip import read_tensor_bytes

        data = bytearray(read_tensor_bytes(ref))
        flat = torch.frombuffer(data, dtype=torch_dtype(ref.dtype)) if data else torch.empty(0, dtype=torch_dtype(ref.dtype))
        return flat.reshape(ref.shape)

    def keys(self) -> list[str]:
        return list(self.source)

    def _entry(self, key: str) -> Entry:
        name = self.source[key]
        return self.entries[self.aliases.get(name, name)]

    def shape(self, key: str) -> tuple[int, ...]:
        return self._entry(key).shape

    def get(self, key: str) -> torch.Tensor:
        e = self._entry(key)
        stride = e.stride or tuple(math.prod(e.shape[i + 1:]) for i in range(len(e.shape)))
        span = (1 + sum((s - 1) * st for s, st in zip(e.shape, stride))) if all(e.shape) else 0
        nbytes = span * ITEMSIZE[e.dtype]
        buf = bytearray(nbytes)
        with open(e.path, "rb") as fh:
            if os.preadv(fh.fileno(), [buf], e.offset) != nbytes:
                raise CorruptFileError(f"{e.path}: short read of tensor {key!r} (file truncated?)")
        flat = torch.frombuffer(buf, dtype=torch_dtype(e.dtype)) if nbytes else torch.empty(0, dtype=torch_dtype(e.dtype))
        if e.stride is None:
            return flat.reshape(e.shape)
        return flat.as_strided(e.shape, e.stride).clone()

