"""One ``.safetensors`` file: tied weights stored once, their aliases in ``__metadata__``."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..formats.safetensors_file import METADATA_KEY, read_header, tensor_entries
from ..io.context import WriteContext
from .registry import Format, Listing, Prepared, Stored, register

if TYPE_CHECKING:
    from ..plan.consolidate import TensorPlan


def read_safetensors(path: Path) -> Listing:
    header, start = read_header(path)
    tensors = [Stored(name, info["dtype"], tuple(info["shape"]), path, start + info["data_offsets"][0])
               for name, info in tensor_entries(header).items()]
    return Listing(tensors, dict(header.get(METADATA_KEY, {})), [path])


class SafetensorsFormat(Format):
    name = "safetensors"
    suffixes = (".safetensors",)
    splits = True
    streams_tensors = True
    summary = "one .safetensors file (tied weights once, aliases in __metadata__)"

    def write(self, prepared: Prepared, path: Path, context: WriteContext) -> list[str]:
        from ..io.safetensors_writer import write_safetensors

        write_safetensors(list(prepared.plan.tensors), path, prepared.plan.metadata, context)
        return [path.name]

    def share(self, prepared: Prepared, k: int, n: int, streamed: bool) -> list[TensorPlan]:
        """Streamed to a URL: the tensors in writer k's run of the file's parts (``io.stream.my_parts``)."""
        if not streamed:
            return super().share(prepared, k, n, streamed)
        from ..io import stream
        from ..io.safetensors_writer import safetensors_header

        plan = prepared.plan
        header, offsets = safetensors_header(list(plan.tensors), plan.metadata)
        return stream.tensors_in(header, list(plan.tensors), offsets, stream.my_parts(len(header) + plan.nbytes, k, n))

    def begin(self, prepared: Prepared, path: Path, context: WriteContext) -> str | None:
        """The file at its final size, header written (streamed: the upload started, its id returned)."""
        from ..io.safetensors_writer import create_safetensors

        return create_safetensors(list(prepared.plan.tensors), path, prepared.plan.metadata, context)

    def write_part(self, prepared: Prepared, path: Path, context: WriteContext, part: tuple[int, int],
                   begun: str | None) -> list[str]:
        from ..io.safetensors_writer import fill_safetensors

        fill_safetensors(list(prepared.plan.tensors), path, prepared.plan.metadata, context, part, begun)
        return [path.name]

    def read(self, path: Path) -> Listing:
        return read_safetensors(path)


register(SafetensorsFormat())
