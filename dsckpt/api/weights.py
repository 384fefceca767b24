"""Read one full-weights file tensor by tensor, with positional reads (no mmap, no pickle code).

Any format of the registry (``export.registry``): ``.safetensors``, a sharded folder (or its
``*.index.json``), torch ``.pt/.bin`` state dicts (also a Lightning-style ``{"state_dict": ...}``,
through dsckpt's own allowlist reader).  Each ``get`` reads exactly one tensor's bytes, so memory
is one tensor at a time and the RSS of the reading rank does not grow with the file (mmap would
count every touched page of the file).
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..dtypes import torch_dtype
from ..errors import CheckpointNotFoundError, CorruptFileError
from ..formats import metadata as M
from ..formats.pickle_policy import TensorRef
from ..formats.safetensors_file import parse_aliases
from ..export.registry import Stored
from .paths import classify
from ..formats.positional import read_range_into
from ..plan.names import strip_name

if TYPE_CHECKING:
    import torch


class WeightsFile:
    """Name -> tensor access to one weights file; aliases recorded by ``dsckpt consolidate`` are expanded."""

    def __init__(self, path: str | Path, strip_prefixes: tuple[str, ...] = ()):
        self.path = Path(path)
        if not self.path.exists():
            raise CheckpointNotFoundError("no such weights file or folder", at=self.path)
        kind = classify(self.path)
        if kind.kind != "weights":
            what = "a DeepSpeed checkpoint, not a weights file" if kind.is_checkpoint else \
                "not a weights file (.safetensors, a sharded folder or its index.json, .pt/.pth/.bin)"
            raise CorruptFileError(f"{what}",
                                   hint="for a DeepSpeed checkpoint folder, resume CKPT_DIR or consolidate it first", at=self.path)
        fmt = kind.reader
        try:
            listing = fmt.read(self.path)
        except (OSError, ValueError) as exc:
            raise CorruptFileError(f"cannot read weights ({exc})", at=self.path) from None
        if not listing.tensors:
            raise CorruptFileError("holds no tensors", at=self.path)
        self.entries: dict[str, Stored] = {t.name: t for t in listing.tensors}
        self._beside = listing.extra  # a .pt training checkpoint's other top-level entries
        aliases = parse_aliases(listing.metadata.get(M.ALIASES), self.path)
        self.aliases = {a: s for a, s in aliases.items() if a not in self.entries and s in self.entries}
        self.source = {strip_name(n, strip_prefixes): n for n in list(self.entries) + list(self.aliases)}

    # -- access -------------------------------------------------------------------------------
    def embedded_state(self) -> dict[str, Any]:
        """What a ``.pt`` training checkpoint holds beside ``state_dict`` (Lightning: ``epoch``,
        ``global_step``, ``hyper_parameters``...), as plain values: tensors read, objects of classes
        dsckpt does not load kept as ``{"__opaque__": "module.Class"}``."""
        from ..export.sidecar import decode, encode

        refs: dict[str, Any] = {}
        encoded = encode(self._beside, refs)
        tensors = {key: self._read_ref(ref) for key, ref in refs.items()}
        state: dict[str, Any] = decode(encoded, tensors)
        return state

    @staticmethod
    def _read_ref(ref: TensorRef) -> torch.Tensor:
        from ..formats.torchzip import read_tensor_bytes

        data = bytearray(read_tensor_bytes(ref))
        return _tensor(data, ref.dtype, ref.shape, None)

    def keys(self) -> list[str]:
        return list(self.source)

    def _entry(self, key: str) -> Stored:
        name = self.source[key]
        return self.entries[self.aliases.get(name, name)]

    def shape(self, key: str) -> tuple[int, ...]:
        return self._entry(key).shape

    def get(self, key: str, pin: bool = False) -> torch.Tensor:
        """One tensor, read into memory of its own: uninitialised (a zero-filled buffer cost a pass over
        every byte) and, with ``pin``, page-locked, so the copy to a GPU is a DMA the caller need not wait
        for (torch caches pinned blocks, so the pool stays as large as the tensors alive at once)."""
        import torch  # (here: listing a file's names and shapes - a launcher's preflight - needs no torch)

        e = self._entry(key)
        raw = torch.empty(e.span_bytes, dtype=torch.uint8, pin_memory=pin)
        if e.span_bytes:
            read_range_into(e.path, e.offset, e.span_bytes, raw.numpy())
        return _tensor(raw, e.dtype, e.shape, e.stride)


def _tensor(raw: Any, dtype: str, shape: tuple[int, ...], stride: tuple[int, ...] | None) -> torch.Tensor:
    """A tensor over ``raw``'s bytes (a bytearray or a uint8 tensor)."""
    import torch

    if isinstance(raw, (bytes, bytearray)):
        raw = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    flat = raw.view(torch_dtype(dtype))
    if stride is None:
        return flat.reshape(shape)
    return flat.as_strided(shape, stride).clone()
