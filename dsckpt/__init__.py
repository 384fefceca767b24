"""dsckpt: read, inspect, consolidate, reshard and resume DeepSpeed ZeRO checkpoints.

The library side (reader, inspect, consolidate, reshard) imports neither torch nor DeepSpeed, so it
starts in milliseconds; ``load_into`` needs torch and ``dsckpt.runtime`` (training, resume) both.
The operations live in ``dsckpt.api``; they are re-exported here.
"""
from ._version import __version__

__all__ = ["__version__", "consolidate", "convert", "load_state_dict", "iter_state_dict", "open_checkpoint", "reshard",
           "load_into", "classify", "verify", "enable_async_save", "into_deepspeed", "WriteOptions", "list_tags", "prune"]


def __getattr__(name: str):  # lazy: keep `import dsckpt` cheap
    if name == "open_checkpoint":
        from .api.paths import open_local_checkpoint
        return open_local_checkpoint
    if name == "enable_async_save":  # torch + DeepSpeed: the runtime extra
        from .checkpoint_engine.background import enable_async_save
        return enable_async_save
    if name == "verify":
        from .analysis.verify import verify
        return verify
    if name == "prune":  # with the check that keeps the last finite checkpoints
        from .analysis.finiteness import prune
        return prune
    if name in __all__:
        from . import api
        return getattr(api, name)
    raise AttributeError(name)
