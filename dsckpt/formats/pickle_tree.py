"""Questions asked of a parsed pickle tree (``pickle_policy``'s output): which classes it names beyond DeepSpeed's own,
which tensors it holds, the int inside an enum record.  Nothing here reads a file."""
from __future__ import annotations

from typing import Any

from .pickle_policy import Opaque, TensorRef


def opaque_class_paths(obj: Any) -> set[str]:
    """Class paths of every ``Opaque`` record anywhere in a parsed pickle (their arguments and state too)."""
    found, stack = set(), [obj]
    while stack:
        value = stack.pop()
        if isinstance(value, Opaque):
            found.add(value.class_path)
            stack.extend(value.children())
        elif isinstance(value, dict):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, (list, tuple, set, frozenset)):
            stack.extend(value)
    return found


# The classes DeepSpeed itself pickles into its checkpoint files (found in every fixture kind:
# stage 1-3, fp32/bf16/fp16); each is a plain record or enum whose unpickling runs no user code.
# Together with plain containers and torch's tensors, sizes, dtypes and devices (never ``Opaque``)
# they are all that dsckpt reads into DeepSpeed's loader or writes into a file.
DEEPSPEED_CLASSES = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
    "deepspeed.checkpoint.universal_checkpoint.SubparamShape",  # a universal checkpoint's fused sub-parameters
)


def tensor_refs(value: Any) -> list[TensorRef]:
    """Every tensor in a parsed tree (dicts, lists, tuples), in order."""
    if isinstance(value, TensorRef):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensor_refs(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensor_refs(v)]
    return []


# numpy's arrays, scalars and dtypes (np.random.get_state() in a client state: Megatron-DeepSpeed and GPT-NeoX save
# one): numpy's own rebuilders of plain data, under both of numpy's module names (``core`` before 2.0).
NUMPY_CLASSES = tuple(f"numpy.{core}.multiarray.{name}" for core in ("core", "_core") for name in ("_reconstruct", "scalar")) \
    + ("numpy.ndarray", "numpy.dtype")
# Plain records a trainer keeps in its client state (Megatron and GPT-NeoX save their arguments): rebuilt from their
# fields, no code of theirs runs
RECORD_CLASSES = ("argparse.Namespace",)
DATA_CLASSES = DEEPSPEED_CLASSES + NUMPY_CLASSES + RECORD_CLASSES  # what dsckpt writes back and lets DeepSpeed's load rebuild


def foreign_classes(obj: Any) -> set[str]:
    """Class paths in a parsed pickle beyond DeepSpeed's own and numpy's data: loading them with full pickle
    semantics (DeepSpeed's loader, a torch.load without weights_only) would import and call them."""
    return opaque_class_paths(obj) - set(DATA_CLASSES)


def opaque_int(value: Any) -> Any:
    """The int inside an enum placeholder (DeepSpeed's ZeroStageEnum(3)) or the value itself."""
    if isinstance(value, Opaque) and len(value.args) == 1 and isinstance(value.args[0], int):
        return value.args[0]
    return value
