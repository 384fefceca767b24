"""A folder of sharded safetensors in Hugging Face's layout: ``model-0000i-of-0000N.safetensors`` and
``model.safetensors.index.json`` (the folder format of an OUT named without a known suffix)."""
from __future__ import annotations

import shlex
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import CorruptFileError, OutputError
from ..formats.safetensors_file import INDEX_NAME, INDEX_SUFFIX, SHADOWING_WEIGHTS, check_shard_names, read_index
from ..io.context import WriteContext
from .registry import Format, Listing, Prepared, register
from .safetensors import read_safetensors

if TYPE_CHECKING:
    from ..plan.consolidate import TensorPlan



def read_sharded(path: Path) -> Listing:
    index = path if path.is_file() else next(path.glob(f"*{INDEX_SUFFIX}"), None)
    if index is None:
        raise CorruptFileError("folder holds no *.index.json", at=path)
    metadata, weight_map = read_index(index)
    tensors, files = [], []
    for shard in sorted(set(weight_map.values())):
        listing = read_safetensors(index.parent / shard)
        check_shard_names(index, weight_map, shard, [t.name for t in listing.tensors])
        tensors += listing.tensors
        files.append(index.parent / shard)
        metadata = {**listing.metadata, **{k: str(v) for k, v in metadata.items()}}
    return Listing(tensors, metadata, files)


def replaced_shards(out: Path) -> tuple[str, ...]:
    """In an existing folder OUT (``--force``): the shards its current index names, which the new output
    replaces (anything else there stays).  Refuses a weights file that would be loaded instead of ours."""
    if not out.is_dir():
        return ()
    for name in SHADOWING_WEIGHTS:
        if (out / name).exists():
            raise OutputError(f"holds {name}, which from_pretrained would load instead of the sharded "
                              "weights written beside it; dsckpt does not delete files it did not write",
                              hint=f"move {shlex.quote(str(out / name))} away, or write to another folder", at=out)
    if not (out / INDEX_NAME).is_file():
        return ()
    try:
        _, weight_map = read_index(out / INDEX_NAME)
    except CorruptFileError:
        return ()  # replaced by name; shards it might have named stay
    return tuple(sorted({n for n in weight_map.values() if "/" not in n and (out / n).is_file()}))


class ShardedFormat(Format):
    name = "sharded"
    directory = True
    default_for_folders = True
    summary = "a folder: sharded safetensors + model.safetensors.index.json"
    splits = True
    streams_tensors = True

    def write(self, prepared: Prepared, folder: Path, context: WriteContext) -> list[str]:
        return self.write_part(prepared, folder, context, (0, 1), None)

    def share(self, prepared: Prepared, k: int, n: int, streamed: bool) -> list[TensorPlan]:
        """Whole shards dealt out by bytes."""
        from ..io.safetensors_writer import shard
        from ..plan.deal import dealt

        shards = shard(prepared.plan.tensors, prepared.request.max_shard_bytes)
        owners = dealt([sum(t.nbytes for t in tensors) for tensors in shards], n)
        return [t for tensors, owner in zip(shards, owners) if owner == k for t in tensors]

    def write_part(self, prepared: Prepared, folder: Path, context: WriteContext, part: tuple[int, int],
                   begun: None) -> list[str]:
        """Writer k's shards, and with k == 0 the index."""
        from ..io.safetensors_writer import write_sharded

        return write_sharded(prepared.plan, folder, prepared.request.max_shard_bytes, context, part) + [INDEX_NAME]

    def read(self, path: Path) -> Listing:
        return read_sharded(path)

    def reads(self, path: Path) -> bool:
        return path.name.endswith(INDEX_SUFFIX) if path.is_file() else path.is_dir() and any(path.glob(f"*{INDEX_SUFFIX}"))

    def replaced_files(self, out: Path) -> tuple[str, ...]:
        return replaced_shards(out)


register(ShardedFormat())
