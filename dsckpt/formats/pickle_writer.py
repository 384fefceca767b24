"""Write a parsed pickle tree back as the pickle ``torch.save`` would write (protocol 2), without torch.

The inverse of ``pickle_policy``: what it reads - plain data, ``TensorRef``s, ``Opaque`` records of
other classes (DeepSpeed's ``LossScaler``, ``ZeroStageEnum``, ``fragment_address``, a client's own),
``torch.Size`` / dtypes / devices - ``dumps`` writes back as the same opcodes torch would, so a tree
read from a DeepSpeed rank file, edited, and written again loads in ``torch.load`` as the original did.
Nothing is imported: ``Opaque`` records are written from the class path and arguments they recorded.

Tensors are ``TensorRef`` (one that exists in a file: its whole storage is copied) or ``NewTensor``
(bytes the caller supplies).  Storages get keys "0", "1", ... in order of first appearance, as
``torch.save`` numbers them; tensors that shared a storage share it again.  Every opcode used is one
torch's ``weights_only`` unpickler knows (no BINBYTES: bytes go through ``_codecs.encode``, as in
protocol 2).
"""
from __future__ import annotations

import math
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ..dtypes import DTYPES, ITEMSIZE, Shaped
from .pickle_policy import Opaque, StorageRef, TensorRef, TorchDevice, TorchDtype, TorchSize
from .pickle_tree import DATA_CLASSES


@dataclass(frozen=True, eq=False)  # identity matters: one NewTensor named twice is one shared storage
class NewTensor(Shaped):
    """A contiguous tensor with a storage of its own, whose bytes ``source`` describes to the writer."""

    dtype: str  # safetensors name, e.g. "F32"
    shape: tuple[int, ...]
    source: Any
    requires_grad: bool = False
    location: str = "cpu"  # the device torch.load maps it to without map_location (as the original said)


@dataclass(frozen=True)
class StorageOut:
    """One ``data/<key>`` entry of the archive: a TensorRef's whole storage, or a NewTensor's bytes."""

    key: str
    dtype: str
    numel: int
    source: TensorRef | NewTensor

    @property
    def nbytes(self) -> int:
        return self.numel * ITEMSIZE[self.dtype]


def dumps(obj: Any, allow_foreign: bool = False) -> tuple[bytes, list[StorageOut]]:
    """The pickle bytes of ``obj`` and the storages it names, in key order.

    An ``Opaque`` record of a class beyond DeepSpeed's own and numpy's data is refused (``ValueError``) unless
    ``allow_foreign``: the last guard, under every writer's own filtering, against writing a pickle
    that runs code when loaded without ``weights_only``."""
    writer = _Writer(allow_foreign)
    writer.save(obj)
    writer.out += b"."  # STOP
    return bytes(writer.out), writer.storages


class _Writer:
    def __init__(self, allow_foreign: bool = False):
        self.allow_foreign = allow_foreign
        self.out = bytearray(b"\x80\x02")  # PROTO 2
        self.storages: list[StorageOut] = []
        self._keys: dict[Any, str] = {}

    # -- scalars --------------------------------------------------------------------------------
    def global_(self, module: str, name: str) -> None:
        self.out += b"c" + f"{module}\n{name}\n".encode()

    def string(self, s: str) -> None:
        raw = s.encode("utf-8", "surrogatepass")
        self.out += b"X" + struct.pack("<I", len(raw)) + raw  # BINUNICODE

    def int_(self, v: int) -> None:
        if -2**31 <= v < 2**31:
            self.out += b"J" + struct.pack("<i", v)  # BININT
            return
        raw = v.to_bytes((v.bit_length() + 8) // 8, "little", signed=True)  # two's complement, sign bit room
        if len(raw) > 255:
            raise ValueError(f"an integer of {v.bit_length()} bits is too large to write")
        self.out += b"\x8a" + bytes([len(raw)]) + raw  # LONG1

    def call(self, module: str, name: str, args: tuple[Any, ...]) -> None:
        """``module.name(*args)``: GLOBAL, the args tuple, REDUCE."""
        self.global_(module, name)
        self.save(tuple(args))
        self.out += b"R"

    # -- the tree ----------------------------------------------------------------------------------
    def save(self, obj: Any) -> None:  # noqa: C901 - one branch per type, in the order they must be tested
        if obj is None:
            self.out += b"N"
        elif obj is True or obj is False:
            self.out += b"\x88" if obj else b"\x89"
        elif isinstance(obj, TorchDtype):
            self.global_("torch", obj.torch_name)
        elif isinstance(obj, TorchDevice):
            self.call("torch", "device", obj.args)
        elif type(obj) is int:
            self.int_(obj)
        elif type(obj) is float:
            self.out += b"G" + struct.pack(">d", obj)  # BINFLOAT
        elif type(obj) is str:
            self.string(obj)
        elif isinstance(obj, (TensorRef, NewTensor)):
            self.tensor(obj)
        elif isinstance(obj, TorchSize):
            self.call("torch", "Size", (tuple(obj),))
        elif type(obj) is tuple:
            self.out += b"("
            for item in obj:
                self.save(item)
            self.out += b"t"
        elif type(obj) is list:
            self.out += b"]"
            if obj:
                self.out += b"("
                for item in obj:
                    self.save(item)
                self.out += b"e"  # APPENDS
        elif type(obj) in (dict, OrderedDict):
            if type(obj) is OrderedDict:
                self.call("collections", "OrderedDict", ())
            else:
                self.out += b"}"
            if obj:
                self.out += b"("
                for key, value in obj.items():
                    self.save(key)
                    self.save(value)
                self.out += b"u"  # SETITEMS
        elif isinstance(obj, Opaque):
            self.opaque(obj)
        elif isinstance(obj, type) and issubclass(obj, Opaque):
            self.global_(*obj.pickle_global)  # a class stored as a value
        elif type(obj) is bytes:
            self.call("_codecs", "encode", (obj.decode("latin1"), "latin1"))
        elif type(obj) is bytearray:
            self.call("builtins", "bytearray", (bytes(obj),))
        elif type(obj) in (set, frozenset):
            self.call("builtins", type(obj).__name__, (list(obj),))
        elif type(obj) is complex:
            self.call("builtins", "complex", (obj.real, obj.imag))
        elif type(obj) is slice:
            self.call("builtins", "slice", (obj.start, obj.stop, obj.step))
        elif type(obj) is range:
            self.call("builtins", "range", (obj.start, obj.stop, obj.step))
        else:
            raise TypeError(f"cannot write a {type(obj).__name__} into a torch pickle")

    def opaque(self, obj: Opaque) -> None:
        if not self.allow_foreign and obj.class_path not in DATA_CLASSES:
            raise ValueError(f"an object of {obj.class_path} would be written (its pickle runs code when loaded)")
        self.global_(*type(obj).pickle_global)
        self.save(tuple(obj.args))
        self.out += b"\x81" if obj.via == "newobj" else b"R"  # NEWOBJ: cls.__new__(cls, *args) | REDUCE: cls(*args)
        if obj.listitems:  # (pickle's own order: the object, its items, then its state)
            self.out += b"("
            for item in obj.listitems:
                self.save(item)
            self.out += b"e"  # APPENDS
        if obj.dictitems:
            self.out += b"("
            for key, value in obj.dictitems:
                self.save(key)
                self.save(value)
            self.out += b"u"  # SETITEMS
        if obj.state is not None:
            self.save(obj.state)
            self.out += b"b"  # BUILD

    def tensor(self, t: TensorRef | NewTensor) -> None:
        if isinstance(t, TensorRef):
            storage: StorageRef = t.storage
            identity, dtype, numel, location = (id(t.file), storage.key), storage.dtype, storage.numel, storage.location
            offset, shape, stride = t.offset, t.shape, t.stride
        else:
            identity, dtype, numel, location = (id(t), ""), t.dtype, t.numel, t.location
            offset, shape = 0, t.shape
            stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
        key = self._keys.get(identity)
        if key is None:
            key = self._keys[identity] = str(len(self.storages))
            self.storages.append(StorageOut(key, dtype, numel, t))
        parameter = isinstance(t, TensorRef) and t.parameter
        if parameter:
            self.global_("torch._utils", "_rebuild_parameter")
            self.out += b"("
        self.global_("torch._utils", "_rebuild_tensor_v2")
        self.out += b"(("  # MARK args, MARK persistent id ('storage', storage type, key, location, numel)
        self.string("storage")
        self.global_("torch", DTYPES[dtype].storage)
        self.string(key)
        self.string(location)
        self.int_(numel)
        self.out += b"tQ"  # TUPLE, BINPERSID
        self.int_(offset)
        self.save(tuple(shape))
        self.save(tuple(stride))
        self.out += b"\x88" if t.requires_grad else b"\x89"
        self.call("collections", "OrderedDict", ())  # backward hooks
        self.out += b"tR"
        if parameter:
            self.out += b"\x88" if t.requires_grad else b"\x89"
            self.call("collections", "OrderedDict", ())
            self.out += b"tR"
