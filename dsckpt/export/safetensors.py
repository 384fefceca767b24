"""One ``.safetensors`` file: tied weights stored once, their aliases in ``__metadata__``."""
from __future__ import annotations

from pathlib import Path

from ..formats.safetensors_file import METADATA_KEY, read_header, tensor_entries
from .registry import Format, Listing, Prepared, Progress, Stored, register


def read_safetensors(path: Path) -> Listing:
    header, start = read_header(path)
    tensors = [Stored(name, info["dtype"], tuple(info["shape"]), path, start + info["data_offsets"][0])
               for name, info in tensor_entries(header).items()]
    return Listing(tensors, dict(header.get(METADATA_KEY, {})), [path])


class SafetensorsFormat(Format):
    name = "safetensors"
    suffixes = (".safetensors",)
    summary = "one .safetensors file (tied weights once, aliases in __metadata__)"

    def write(self, prepared: Prepared, path: Path, progress: Progress | None) -> list[str]:
        from ..io.safetensors_writer import write_safetensors

        write_safetensors(list(prepared.plan.tensors), path, prepared.plan.metadata, progress)
        return [path.name]

    def read(self, path: Path) -> Listing:
        return read_safetensors(path)


register(SafetensorsFormat())
