"""dsckpt's checkpoint engine: DeepSpeed's saves made in the background, trusted, and loads kept weights-only.

Save side, in the order a save goes through it:
* ``background``: ``enable_async_save(engine)`` and its handle; the training thread's part of a save (the call);
* ``snapshot``: a state's tensors copied to host buffers (pinned, reused) as of the call;
* ``fences``: what waits for the copies left past the call before it rewrites the optimizer's state;
* ``writer``: the writer thread: each file persisted (``persist``: ``torch.save``'s bytes, several threads, read
  back), then the commit;
* ``commit``: the one commit protocol (a tag staged whole in a hidden sibling, published by one rename, ``latest``
  last) for a folder and for a bucket - the runtime's blocking save uses it too;
* ``lifecycle``: the commit's group and timeouts; how the process ends (exit status, SIGTERM, destroy);
* ``kept_parameters``: ZeRO-3's persistent parameters put back after a save without a gather;
* ``integrations``: the one-line callbacks for Lightning and the HF Trainer.
Load side: ``safe_load`` (DeepSpeed's loader made weights-only) and ``planned_load`` (another world size or stage
loaded without a copy).
"""
from typing import Any

__all__ = ["AsyncSave", "enable_async_save"]


def __getattr__(name: str) -> Any:  # (lazily: ``safe_load`` is imported by commands that start no DeepSpeed)
    if name in __all__:
        from . import background

        return getattr(background, name)
    raise AttributeError(name)
