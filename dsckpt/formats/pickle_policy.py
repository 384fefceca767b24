"""The pickle policy: which globals a checkpoint may name, and what each becomes.

Nothing named by a checkpoint is ever imported or called.  ``SafeUnpickler.find_class`` maps:

* tensor rebuild functions and storage types of torch -> inert builders of ``TensorRef``
  (no torch import, no tensor data read);
* plain data constructors (``collections.OrderedDict``, ``builtins.set`` ...) -> the same builtins;
* ``torch.Size`` -> a tuple, ``torch.<dtype>`` -> its name, ``torch.device`` -> its string (subclasses
  that remember what they were, so ``pickle_writer`` can write them back);
* every other global - DeepSpeed's ``LossScaler`` / ``ZeroStageEnum`` / ``fragment_address``, a
  client's own classes, and hostile ones like ``os.system`` - -> an ``Opaque`` placeholder type
  that only records its class path, arguments and state.  It has no behaviour, so a malicious
  ``__reduce__`` is recorded, not run.
"""
from __future__ import annotations

import _compat_pickle
import codecs
import io
import math
import pickle
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

from ..dtypes import BY_STORAGE, BY_TORCH_NAME


# Published allowlist: (module, name) pairs that are *interpreted*, not imported.
TENSOR_REBUILDERS = {("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_tensor"),
                     ("torch._utils", "_rebuild_parameter"), ("torch._utils", "_rebuild_parameter_with_state"),
                     ("torch._tensor", "_rebuild_from_type_v2")}


def _bounded(kind: type) -> Callable[..., Any]:
    """``kind(arg)`` only when it cannot allocate more than MAX_CONTAINER_ITEMS (``bytearray(3 * 10**9)``
    is one tiny opcode, ``frozenset(range(2 * 10**7))`` two)."""
    def build(*args: Any) -> Any:
        from ..limits import limit

        size = args[0] if args and isinstance(args[0], int) else len(args[0]) if args and hasattr(args[0], "__len__") else 0
        if size > limit("MAX_CONTAINER_ITEMS"):
            raise pickle.UnpicklingError(f"a {kind.__name__} of {size:,} items (limit {limit('MAX_CONTAINER_ITEMS'):,}; "
                                         "DSCKPT_MAX_CONTAINER_ITEMS raises it)")
        return kind(*args)
    build.__name__ = kind.__name__
    return build


PLAIN_BUILTINS = {("collections", "OrderedDict"): OrderedDict, ("builtins", "set"): _bounded(set),
                  ("builtins", "frozenset"): _bounded(frozenset), ("builtins", "slice"): slice,
                  ("builtins", "complex"): complex, ("builtins", "bytearray"): _bounded(bytearray),
                  ("builtins", "range"): range}


class _Sealed:
    """A pickle's BUILD opcode would rewrite a checked reference's fields: refuse it."""

    def __setstate__(self, state: object) -> None:
        raise pickle.UnpicklingError(f"BUILD on a {type(self).__name__} (a reference may not be altered once checked)")


@dataclass(frozen=True)
class StorageRef(_Sealed):
    key: str
    dtype: str  # safetensors name, e.g. "F32"
    itemsize: int
    numel: int
    location: str  # device it was saved from ("cpu", "cuda:0"): irrelevant to us, shown in inspect


class TensorRef(_Sealed):
    """A tensor inside a torch file: metadata now, bytes on demand (see ``torchzip``).

    Immutable: its fields are checked once, when the pickle builds it (offset and strides
    non-negative, the view inside its storage), and nothing may change them afterwards.
    ``requires_grad`` / ``parameter`` only matter to ``pickle_writer``, which writes them back.
    """

    __slots__ = ("file", "storage", "offset", "shape", "stride", "requires_grad", "parameter")
    file: Any  # the torchzip.StorageIndex the tensor was read from (its ``path`` and ``locate``)
    storage: StorageRef
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    requires_grad: bool
    parameter: bool

    def __init__(self, file: Any, storage: StorageRef, offset: int, shape: tuple[int, ...], stride: tuple[int, ...],
                 requires_grad: bool = False, parameter: bool = False) -> None:
        for name, value in (("file", file), ("storage", storage), ("offset", offset), ("shape", shape),
                            ("stride", stride), ("requires_grad", requires_grad is True), ("parameter", parameter)):
            object.__setattr__(self, name, value)

    def as_parameter(self, requires_grad: bool) -> "TensorRef":
        return TensorRef(self.file, self.storage, self.offset, self.shape, self.stride, requires_grad is True, True)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"TensorRef is immutable (tried to set {name!r})")

    @property
    def dtype(self) -> str:
        return self.storage.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.storage.itemsize

    def is_contiguous(self) -> bool:
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride)):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True

    def __repr__(self) -> str:
        return f"TensorRef({self.dtype}, shape={list(self.shape)})"


class Opaque:
    """Inert stand-in for any class a pickle names that is not on the allowlist.

    Records how the pickle made it - ``via`` "newobj" (``cls.__new__(cls, *args)``, then BUILD with
    ``state``: plain objects, dataclasses) or "reduce" (``cls(*args)``: enums) - the items a list or dict
    subclass was filled with (APPENDS / SETITEMS: a ``defaultdict``, a user's ``class Config(dict)``) in
    ``listitems`` / ``dictitems``, and nothing else.
    """

    class_path = "?"
    pickle_global: tuple[str, str]  # (module, name): how a pickle names the class
    args: tuple[Any, ...]
    state: Any
    via: str
    listitems: list[Any]
    dictitems: list[tuple[Any, Any]]

    def __new__(cls, *args: Any, **kwargs: Any) -> "Opaque":
        obj = object.__new__(cls)
        obj.args, obj.state, obj.via, obj.listitems, obj.dictitems = args, None, "newobj", [], []
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # only REDUCE calls cls(*args); nothing to do but note it
        self.via = "reduce"

    def __setstate__(self, state: Any) -> None:  # BUILD: record, never apply
        self.state = state

    def append(self, item: Any) -> None:  # APPENDS / APPEND: record
        self.listitems.append(item)

    def extend(self, items: Any) -> None:
        self.listitems.extend(items)

    def __setitem__(self, key: Any, value: Any) -> None:  # SETITEMS / SETITEM: record
        self.dictitems.append((key, value))

    def children(self) -> list[Any]:
        """Every value the record holds (what a walk of the parsed tree descends into)."""
        return [*self.args, self.state, *self.listitems, *(x for pair in self.dictitems for x in pair)]

    def __repr__(self) -> str:
        return f"<opaque {self.class_path}>"


_opaque_types: dict[str, type[Opaque]] = {}


def opaque_type(module: str, name: str) -> type[Opaque]:
    path = f"{module}.{name}"
    if path not in _opaque_types:
        _opaque_types[path] = type(name, (Opaque,), {"class_path": path, "__module__": "dsckpt.opaque",
                                                     "pickle_global": (module, name)})
    return _opaque_types[path]


class TorchSize(tuple[int, ...]):
    """A ``torch.Size`` as read: a tuple that remembers it was one."""


class TorchDtype(str):
    """A ``torch.<dtype>`` as read: its safetensors name ("F32"), remembering torch's attribute name."""
    torch_name: str

    def __new__(cls, name: str, torch_name: str) -> "TorchDtype":
        obj = super().__new__(cls, name)
        obj.torch_name = torch_name
        return obj


class TorchDevice(str):
    """A ``torch.device(...)`` as read: "cuda:0", remembering the constructor's arguments."""
    args: tuple[Any, ...]

    def __new__(cls, *args: Any) -> "TorchDevice":
        obj = super().__new__(cls, ":".join(str(x) for x in args))
        obj.args = args
        return obj


class _StorageType:
    def __init__(self, name: str):
        self.dtype, self.itemsize = BY_STORAGE[name].name, BY_STORAGE[name].itemsize


def _latin1_encode(text: Any, encoding: str = "utf-8") -> bytes:
    # protocol 2 pickles bytes as _codecs.encode(str, 'latin1'); allow exactly that
    if not isinstance(text, str) or codecs.lookup(encoding).name not in ("iso8859-1", "utf-8"):
        raise pickle.UnpicklingError("_codecs.encode used for something other than bytes")
    return text.encode(encoding)


class _Policy:
    """The allowlist, shared by both unpicklers below (it only overrides lookups, never opcodes)."""

    def __init__(self, stream: Any, torch_file: Any) -> None:
        super().__init__(stream)  # type: ignore[call-arg]  # (the Unpickler this mixin precedes)
        self._file = torch_file

    def find_class(self, module: str, name: str) -> Any:
        # protocol 2 (torch.save's) names Python 2 modules: __builtin__.set is builtins.set (the C
        # unpickler maps these only in its own find_class, which this one replaces)
        module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
        module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        if (module, name) in TENSOR_REBUILDERS:
            return getattr(self, name)
        if (module, name) in PLAIN_BUILTINS:
            return PLAIN_BUILTINS[module, name]
        if module == "torch":
            if name in BY_STORAGE:
                return _StorageType(name)
            if name == "Size":
                return TorchSize
            if name in BY_TORCH_NAME:
                return TorchDtype(BY_TORCH_NAME[name], name)
            if name == "device":
                return TorchDevice
        if (module, name) == ("_codecs", "encode"):
            return _latin1_encode
        return opaque_type(module, name)

    def persistent_load(self, pid: Any) -> StorageRef:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"unsupported persistent id {pid!r:.80}")
        _, storage_type, key, location, numel = pid
        if not isinstance(storage_type, _StorageType):
            raise pickle.UnpicklingError(f"unsupported storage type {storage_type!r:.80}")
        if not (isinstance(key, str) and _is_count(numel) and isinstance(location, str)):
            raise pickle.UnpicklingError(f"malformed storage record {pid!r:.120}")
        return StorageRef(key, storage_type.dtype, storage_type.itemsize, numel, location)

    # -- tensor rebuilders: build references, touch no data ------------------------------------
    def _rebuild_tensor_v2(self, storage: Any, storage_offset: Any, size: Any, stride: Any, requires_grad: Any = False,
                           hooks: Any = None, metadata: Any = None) -> TensorRef:
        if not isinstance(storage, StorageRef):
            raise pickle.UnpicklingError("tensor rebuilt from something that is not a storage")
        if not (isinstance(size, tuple) and isinstance(stride, tuple) and len(size) == len(stride)
                and all(map(_is_count, size + stride)) and _is_count(storage_offset)):
            raise pickle.UnpicklingError(f"tensor with malformed geometry: offset {storage_offset!r:.40}, "
                                         f"shape {size!r:.80}, stride {stride!r:.80}")
        ref = TensorRef(self._file, storage, storage_offset, tuple(size), tuple(stride), requires_grad)
        if ref.numel and storage_offset + _span(size, stride) > storage.numel:
            raise pickle.UnpicklingError(f"tensor of shape {list(size)} at offset {storage_offset} does not fit "
                                         f"its storage of {storage.numel} elements")
        return ref

    def _rebuild_tensor(self, storage: Any, storage_offset: Any, size: Any, stride: Any) -> TensorRef:
        return self._rebuild_tensor_v2(storage, storage_offset, size, stride)

    def _rebuild_parameter(self, data: Any, requires_grad: Any = False, hooks: Any = None) -> Any:
        return data.as_parameter(requires_grad) if isinstance(data, TensorRef) else data

    def _rebuild_parameter_with_state(self, data: Any, requires_grad: Any = False, hooks: Any = None,
                                      state: Any = None) -> Any:
        return self._rebuild_parameter(data, requires_grad)

    def _rebuild_from_type_v2(self, func: Any, new_type: Any, args: Any, state: Any) -> Any:
        return func(*args) if callable(func) and not isinstance(func, type) else opaque_type("torch", "Tensor")(*args)


class SafeUnpickler(_Policy, pickle._Unpickler):
    """The allowlist on the pure-Python unpickler, whose memo is a dict.

    CPython's C unpickler keeps its memo in an array that one ``LONG_BINPUT 4294967295`` opcode grows
    to 2**33 slots (tests/test_fuzz_readers.py found it: 24 GB, then the OOM killer).
    """


class _FastSafeUnpickler(_Policy, pickle.Unpickler):
    """The allowlist on the C unpickler (several times faster than the Python one); used only after ``largest_memo_index`` has shown every memo index to be small."""


MAX_FAST_MEMO_INDEX = 1 << 20  # memo array of the C unpickler: at most ~2M slots (16 MB)


def largest_memo_index(data: bytes) -> int | None:
    """The largest index a PUT / BINPUT / LONG_BINPUT in ``data`` names (None: not walkable).

    Walks opcodes and skips their arguments without decoding them (~1 ms per 10,000 opcodes).
    """
    sizes = _SIZES or _build_sizes()
    pos, end, largest = 0, len(data), 0
    while pos < end:
        op = data[pos]
        n = sizes[op]
        pos += 1
        if n >= 0:
            if op == _BINPUT:
                largest = data[pos] if data[pos] > largest else largest
            elif op == _LONG_BINPUT:
                index = int.from_bytes(data[pos:pos + 4], "little")
                largest = index if index > largest else largest
            elif op == _STOP:
                return largest
            pos += n
        elif n == _LINE:
            nl = data.find(b"\n", pos)
            if nl < 0:
                return None
            if op == _PUT:
                arg = data[pos:nl]
                if not arg.isdigit():
                    return None
                largest = max(largest, int(arg))
            elif op == _GLOBAL:  # module and name: two lines
                nl = data.find(b"\n", nl + 1)
                if nl < 0:
                    return None
            pos = nl + 1
        elif n == _UNKNOWN:
            return None
        else:  # a length prefix of 1, 4 or 8 bytes, then that many bytes
            width = -n
            size = int.from_bytes(data[pos:pos + width], "little")
            pos += width + size
    return None


_SIZES: list[int] = []
_LINE, _UNKNOWN = -100, -200
_BINPUT, _LONG_BINPUT, _PUT, _GLOBAL, _STOP = ord("q"), ord("r"), ord("p"), ord("c"), ord(".")


def _build_sizes() -> list[int]:
    """Per opcode byte: its fixed argument size, -w for a w-byte length prefix, _LINE, or _UNKNOWN."""
    import pickletools as pt

    prefix = {pt.TAKEN_FROM_ARGUMENT1: -1, pt.TAKEN_FROM_ARGUMENT4: -4, pt.TAKEN_FROM_ARGUMENT4U: -4,
              pt.TAKEN_FROM_ARGUMENT8U: -8, pt.UP_TO_NEWLINE: _LINE}
    sizes = [_UNKNOWN] * 256
    for op in pt.opcodes:
        n = op.arg.n if op.arg else 0
        sizes[ord(op.code)] = n if n >= 0 else prefix[n]
    _SIZES.extend(sizes)
    return _SIZES


# A byte that could open a LONG_BINPUT naming 2**20 or more, or a PUT of 7 digits or more.  Bytes inside other
# opcodes' arguments match too: no match proves every memo index small without walking the opcodes.
_LARGE_MEMO_INDEX = re.compile(rb"r..(?:[\x10-\xff].|[\x00-\x0f][\x01-\xff])|p\d{7}", re.DOTALL)


def unpickle(data: bytes, torch_file: Any) -> Any:
    """Load ``data`` with the allowlist: the C unpickler when every memo index is small, else the
    pure-Python one (also for anything the opcode walk cannot follow: it then raises properly)."""
    if _LARGE_MEMO_INDEX.search(data) is None:
        largest: int | None = 0
    else:
        largest = largest_memo_index(data)
    cls = _FastSafeUnpickler if largest is not None and largest <= MAX_FAST_MEMO_INDEX else SafeUnpickler
    return cls(io.BytesIO(data), torch_file).load()


def _is_count(value: Any) -> bool:
    """A non-negative int (not a bool, not a float, not a string): sizes, strides, offsets."""
    return type(value) is int and value >= 0


def _span(shape: tuple[int, ...], stride: tuple[int, ...]) -> int:
    return 1 + sum((s - 1) * st for s, st in zip(shape, stride))
