"""A torch ``.pt`` / ``.pth`` / ``.bin`` state dict (``torch.load(weights_only=True)`` loads it), written and
read without torch; tied names share one storage, as in the module."""
from __future__ import annotations

from pathlib import Path

from ..errors import CorruptFileError
from ..zero.layout import RANK_FILE_RE
from ..io.context import WriteContext
from .registry import Format, Listing, Prepared, Stored, register


def read_torch(path: Path) -> Listing:
    """A state dict, or a training checkpoint's ``state_dict`` entry (Lightning), via dsckpt's reader."""
    from ..formats.pickle_policy import TensorRef
    from ..formats.torchzip import TorchFile

    tf = TorchFile(path)
    obj, extra = tf.obj, {}
    if isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
        extra = {k: v for k, v in obj.items() if k != "state_dict"}
        obj = obj["state_dict"]
    if not isinstance(obj, dict):
        raise CorruptFileError("not a state dict", at=path)
    tensors = []
    for name, ref in obj.items():
        if isinstance(ref, TensorRef):
            loc = tf.locate(ref.storage)
            tensors.append(Stored(str(name), ref.dtype, ref.shape, path, loc.offset + ref.offset * ref.storage.itemsize,
                                  None if ref.is_contiguous() else ref.stride))
    return Listing(tensors, {}, [path], extra)


class TorchFormat(Format):
    name = "torch"
    suffixes = (".pt", ".pth", ".bin")
    reties_aliases = True  # shared storage
    duplicates_tied = False
    summary = "a torch state dict (loads with weights_only=True)"

    def write(self, prepared: Prepared, path: Path, context: WriteContext) -> list[str]:
        from ..io.torch_writer import write_torch

        write_torch(prepared.plan, path, context)
        return [path.name]

    def read(self, path: Path) -> Listing:
        return read_torch(path)

    def reads(self, path: Path) -> bool:
        return super().reads(path) and not RANK_FILE_RE.match(path.name)  # a DeepSpeed rank file is no state dict


register(TorchFormat())
