"""Forging hostile torch checkpoints: pickles that torch.save would never write.

``save_forged(obj, path)`` is ``torch.save`` with a pickler that turns marker objects into raw
reduce calls, so a test can plant exactly one lie in an otherwise real checkpoint:

* ``Forge(tensor, offset=, shape=, stride=, state=)``: a tensor whose geometry (or a BUILD after it)
  is whatever the test says, on the real tensor's storage;
* ``Call(callable, *args)``: any reduce call, e.g. ``Call(bytearray, 3 * 10**9)`` or ``Call(os.system, ...)``.
"""
from __future__ import annotations

import io
import pickle
import zipfile
import zlib
from collections import OrderedDict
from pathlib import Path

import torch


class Forge:
    def __init__(self, tensor, offset=None, shape=None, stride=None, state=None):
        self.tensor, self.offset, self.shape, self.stride, self.state = tensor, offset, shape, stride, state


class Call:
    def __init__(self, fn, *args):
        self.fn, self.args = fn, args


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj):
        if isinstance(obj, Forge):
            t = obj.tensor
            storage = torch.storage.TypedStorage(wrap_storage=t.untyped_storage(), dtype=t.dtype, _internal=True)
            args = (storage, t.storage_offset() if obj.offset is None else obj.offset,
                    tuple(t.shape) if obj.shape is None else obj.shape,
                    tuple(t.stride()) if obj.stride is None else obj.stride, False, OrderedDict())
            return (torch._utils._rebuild_tensor_v2, args) + ((obj.state,) if obj.state is not None else ())
        if isinstance(obj, Call):
            return (obj.fn, obj.args)
        return NotImplemented


class _PickleModule:
    Pickler = _Pickler
    Unpickler = pickle.Unpickler
    load = pickle.load
    dump = pickle.dump


def save_forged(obj, path: Path) -> None:
    torch.save(obj, path, pickle_module=_PickleModule)


def replace_data_pkl(path: Path, data: bytes, compress: bool = False) -> None:
    """Rewrite ``path`` (a torch zip) with ``data`` as its data.pkl; storages kept."""
    with zipfile.ZipFile(path) as zf:
        entries = [(i, zf.read(i)) for i in zf.infolist()]
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as out:
        for info, content in entries:
            if info.filename.endswith("data.pkl"):
                out.writestr(info.filename, data, zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED)
            else:
                out.writestr(info, content)
    path.write_bytes(buf.getvalue())


def nested_lists_pickle(depth: int) -> bytes:
    """A pickle of lists nested ``depth`` deep, built from opcodes (pickle.dumps would recurse)."""
    return b"\x80\x02" + b"]" * depth + b"a" * (depth - 1) + b"."


def rewrite_tree(path: Path, edit) -> Path:
    """Rewrite the torch file ``path`` with ``edit(tree)`` applied to its parsed tree (``dsckpt``'s own
    writer: storages, shared ones included, stay as recorded - ``torch.save`` would re-key them)."""
    from dsckpt.formats.torchzip import TorchFile
    from dsckpt.formats.positional import read_range
    from dsckpt.io.torch_writer import write_archive

    source = TorchFile(path)
    tree = edit(dict(source.obj))

    class WholeStorages:  # each storage's bytes as recorded, in one chunk (io.torch_writer.StorageBytes)
        def storage_chunks(self, storage, then=None):
            loc = source.locate(storage.source.storage)
            data = read_range(path, loc.offset, loc.nbytes)
            yield data, zlib.crc32(data)

        def copy_storage(self, *args):
            return None

    forged = path.with_name(path.name + ".forged")
    write_archive(forged, tree, WholeStorages(), allow_foreign=True)  # forging is what tests do
    forged.replace(path)
    return path


def add_client_entry(ckpt_dir: Path, key: str, class_path: str, state: dict) -> Path:
    """Rewrite the first model-states file of ``ckpt_dir`` with one more client-state entry: an object
    of ``class_path`` (a class nobody here can import), recorded as ``NEWOBJ`` + ``BUILD(state)``."""
    from dsckpt.formats.pickle_policy import opaque_type

    module, _, name = class_path.rpartition(".")
    obj = opaque_type(module, name).__new__(opaque_type(module, name))
    obj.state = state
    return rewrite_tree(sorted(Path(ckpt_dir).glob("*/*model_states.pt"))[0], lambda tree: {**tree, key: obj})
