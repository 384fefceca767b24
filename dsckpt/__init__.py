"""dsckpt: read, inspect, consolidate and resume DeepSpeed ZeRO checkpoints.

The library side (reader, inspect, consolidate) imports neither torch nor DeepSpeed, so it starts
in milliseconds; ``dsckpt.runtime`` (training, resume) needs both.
"""
from ._version import __version__

__all__ = ["__version__", "consolidate", "load_state_dict", "iter_state_dict", "open_checkpoint", "reshard", "load_into"]


def __getattr__(name: str):  # lazy: keep `import dsckpt` cheap
    if name in ("consolidate", "load_state_dict", "iter_state_dict"):
        from . import convert as _c
        return getattr(_c, name)
    if name == "load_into":  # needs torch (dsckpt[runtime])
        from .runtime.load_into import load_into
        return load_into
    if name == "reshard":
        from .resharder import reshard
        return reshard
    if name == "open_checkpoint":
        from .zero.reader import open_checkpoint
        return open_checkpoint
    raise AttributeError(name)
