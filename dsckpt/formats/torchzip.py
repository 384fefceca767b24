"""Read a ``torch.save`` zip file without torch and without running any of its pickle code.

A torch checkpoint is an uncompressed zip::

    <archive>/data.pkl        the pickle: containers + calls to tensor rebuild functions
    <archive>/data/<key>      raw storage bytes, one entry per storage
    <archive>/byteorder, .format_version, version, ...

The pickle is loaded by ``unpickle`` (see ``dsckpt.formats.pickle_policy``); every tensor becomes a
``TensorRef`` that knows its storage's absolute byte offset in the file, so metadata costs
O(pickle size) and tensor bytes are read only when asked for, with ranged reads.
"""
from __future__ import annotations

import math
import os
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ByteRangeError, CorruptFileError, UnreadableFileError
from ..limits import check, limit
from .pickle_policy import Opaque, StorageRef, TensorRef, unpickle  # noqa: F401  (re-exported)
from .backends import storage_for
from .storage import Storage

_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")  # zip local file header, 30 bytes
_LOCAL_MAGIC = b"PK\x03\x04"


@dataclass(frozen=True)
class StorageLocation:
    offset: int  # absolute byte offset of the storage's first byte in the file
    nbytes: int
    crc32: int  # as recorded in the zip directory; checked by `consolidate --verify`


class StorageIndex:
    """A ``torch.save`` file's zip directory alone: where each storage's bytes lie and the CRC-32 recorded for them
    (checked as the directory is read: entries inside the file, disjoint, stored).  The pickle is not read: what
    the CRC check and the storage maps need costs a tenth of ``TorchFile``'s parse."""

    def __init__(self, path: str | os.PathLike[str], span: tuple[int, int] | None = None,
                 storage: Storage | None = None):
        """``span``: (offset, length) of an archive inside a larger file (a DCP ``.distcp`` item); offsets
        reported stay absolute in ``path``.  ``storage``: where ``path`` is a name (default: where it lives)."""
        self.path = Path(path)
        storage = storage or storage_for(self.path)
        try:
            whole = storage.size(self.path)
            self.base, self.size = span if span is not None else (0, whole)
            if self.base < 0 or self.size < 0 or self.base + self.size > whole:
                raise ByteRangeError(f"an archive at bytes [{self.base}, {self.base + self.size}) "
                                     f"of a {whole}-byte file (truncated?)", at=self.path)
            with storage.open(self.path) as raw:
                fh = _Slice(raw, self.base, self.size) if span is not None else raw
                if fh.read(4) != _LOCAL_MAGIC:
                    raise CorruptFileError("not a torch zip checkpoint (legacy or foreign format, or empty)", at=self.path)
                with zipfile.ZipFile(fh) as zf:
                    self._read(fh, zf)
        except CorruptFileError:
            raise
        except IsADirectoryError:
            raise CorruptFileError("is a directory, expected a checkpoint file", at=self.path) from None
        except PermissionError:
            raise UnreadableFileError("permission denied", at=self.path) from None
        except Exception as exc:  # hostile bytes reach zipfile's parser: every failure is a format error
            raise CorruptFileError(f"unreadable zip archive ({type(exc).__name__}: {exc}); "
                                   "truncated or damaged?", at=self.path) from None

    def _read(self, fh: Any, zf: zipfile.ZipFile) -> None:
        pickles = [i for i in zf.infolist() if i.filename.endswith("/data.pkl") or i.filename == "data.pkl"]
        if len(pickles) != 1:
            raise CorruptFileError("no data.pkl in the archive; not a torch checkpoint", at=self.path)
        self._pickle = pickles[0]
        self.prefix = self._pickle.filename[: -len("data.pkl")]
        check("MAX_PICKLE_BYTES", self._pickle.file_size, str(self.path), "the size data.pkl declares")
        spans = [(*self._entry_span(fh, self._pickle), self._pickle.filename)]
        self.storages: dict[str, StorageLocation] = {}
        data_dir = self.prefix + "data/"
        for info in zf.infolist():
            if not info.filename.startswith(data_dir):
                continue
            if info.compress_type != zipfile.ZIP_STORED:
                raise CorruptFileError(f"storage {info.filename} is compressed; torch never does that", at=self.path)
            key = info.filename[len(data_dir):]
            if key in self.storages:
                raise CorruptFileError(f"storage {info.filename} appears twice in the archive", at=self.path)
            start, end = self._entry_span(fh, info)
            spans.append((start, end, info.filename))
            self.storages[key] = StorageLocation(self.base + start, info.file_size, info.CRC)
        _check_disjoint(spans, self.path)

    def _entry_span(self, fh: Any, info: zipfile.ZipInfo) -> tuple[int, int]:
        """[start, end) of an entry's data in the file, from its local header; inside the file."""
        fh.seek(info.header_offset)
        head = fh.read(_LOCAL_HEADER.size)
        if len(head) != _LOCAL_HEADER.size or _LOCAL_HEADER.unpack(head)[0] != _LOCAL_MAGIC:
            raise CorruptFileError(f"bad local header for {info.filename}", at=self.path)
        fields = _LOCAL_HEADER.unpack(head)
        start = info.header_offset + _LOCAL_HEADER.size + fields[9] + fields[10]
        end = start + info.compress_size
        if end > self.size:
            raise ByteRangeError(f"entry {info.filename} runs past the end of the file (truncated)", at=self.path)
        return start, end

    def locate(self, storage: "StorageRef") -> StorageLocation:
        loc = self.storages.get(storage.key)
        if loc is None:
            raise CorruptFileError(f"pickle references storage {storage.key!r}, absent from the archive", at=self.path)
        if loc.nbytes < storage.numel * storage.itemsize:
            raise CorruptFileError(f"storage {storage.key!r} holds {loc.nbytes} bytes, "
                                   f"needs {storage.numel * storage.itemsize}", at=self.path)
        return loc


class _Slice:
    """Bytes ``[base, base + size)`` of an open file, seen as a file of their own (for ``zipfile``)."""

    def __init__(self, fh: Any, base: int, size: int) -> None:
        self.fh, self.base, self.size, self.pos = fh, base, size, 0

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = max(0, min(self.size, offset + (0, self.pos, self.size)[whence]))
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, n: int = -1) -> bytes:
        n = self.size - self.pos if n is None or n < 0 else min(n, self.size - self.pos)
        self.fh.seek(self.base + self.pos)
        data: bytes = self.fh.read(n)
        self.pos += len(data)
        return data

    def seekable(self) -> bool:
        return True


class TorchFile(StorageIndex):
    """One ``torch.save`` file: its parsed pickle (``obj``) and where each storage lives."""

    def _read(self, fh: Any, zf: zipfile.ZipFile) -> None:
        super()._read(fh, zf)
        pickle_bytes = zf.read(self._pickle)  # CRC-checked by zipfile
        try:
            self.obj: Any = unpickle(pickle_bytes, self)
        except CorruptFileError:
            raise
        except Exception as exc:  # any failure of a hostile or damaged pickle is a format error
            raise CorruptFileError(f"cannot parse data.pkl ({type(exc).__name__}: {str(exc)[:200]})", at=self.path) from None
        check_structure(self.obj, str(self.path))


def _check_disjoint(spans: list[tuple[int, int, str]], path: Path) -> None:
    """Zip entries must not share bytes: an fp32 partition aliasing exp_avg's bytes is forged."""
    spans.sort()
    for (_, end, name), (start, _, other) in zip(spans, spans[1:]):
        if start < end:
            raise ByteRangeError(f"zip entries {name} and {other} overlap (byte {start} is in both)", at=path)


def check_structure(obj: Any, where: str) -> None:
    """Bound what later code walks recursively (JSON, printing): nesting depth and the values visited.

    Iterative, so a pickle nested 100,000 deep fails here with a typed error, not a RecursionError
    in whichever encoder meets it first.  Shared references are visited once per path, like the
    encoders will, so a "billion laughs" of lists referencing lists hits the values limit.
    """
    max_depth, max_values = limit("MAX_NESTING"), limit("MAX_VALUES")
    if not isinstance(obj, _CONTAINERS):
        return
    stack, visited = [(obj, 1)], 1
    while stack:  # only containers are pushed, leaves counted with their parent (half the time per pickle)
        value, depth = stack.pop()
        if depth > max_depth:
            check("MAX_NESTING", depth, where, "the nesting depth of data.pkl")
        children: Any = [*value.keys(), *value.values()] if isinstance(value, dict) else \
            value.children() if isinstance(value, Opaque) else value
        visited += len(children)
        if visited > max_values:
            check("MAX_VALUES", visited, where, "the number of values in data.pkl (shared references counted per use)")
        stack.extend((child, depth + 1) for child in children if isinstance(child, _CONTAINERS))


_CONTAINERS = (dict, list, tuple, set, frozenset, Opaque)  # (an Opaque record holds what its pickle gave it)


def is_torch_zip(path: Path) -> bool:
    """``path`` starts as a zip does (a rank file; not a safetensors file)."""
    with open(path, "rb") as fh:
        return fh.read(len(_LOCAL_MAGIC)) == _LOCAL_MAGIC


def tensor_byte_range(ref: TensorRef) -> tuple[Path, int, int]:
    """(file, absolute offset, length) of a contiguous tensor's bytes."""
    if not ref.is_contiguous():
        raise CorruptFileError(f"tensor with shape {ref.shape} stride {ref.stride} is not contiguous", at=ref.file.path)
    loc = ref.file.locate(ref.storage)
    start = ref.offset * ref.storage.itemsize
    length = math.prod(ref.shape) * ref.storage.itemsize
    if start < 0 or start + length > loc.nbytes:
        raise ByteRangeError(f"tensor view [{start}, {start + length}) exceeds storage "
                               f"{ref.storage.key!r} of {loc.nbytes} bytes", at=ref.file.path)
    return ref.file.path, loc.offset + start, length


def read_tensor_bytes(ref: TensorRef) -> bytes | bytearray:
    from .positional import read_range

    path, offset, length = tensor_byte_range(ref)
    return read_range(path, offset, length)
