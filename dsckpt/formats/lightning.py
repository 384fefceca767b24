"""PyTorch Lightning checkpoints: what ``LightningModule.load_from_checkpoint`` and ``Trainer.fit(ckpt_path=)`` read.

Lightning's ``DeepSpeedStrategy`` saves a folder: DeepSpeed's shards, with Lightning's own checkpoint dict
(``epoch``, ``global_step``, ``pytorch-lightning_version``, ``hyper_parameters``, ``loops``,
``callbacks``, ``lr_schedulers``, ...) as the client state, and the module's names prefixed by its
wrapper (``_forward_module.``).  ``consolidate --format lightning`` writes the one-file checkpoint
Lightning's CPU/GPU strategies read: that dict, plus ``state_dict`` (fp32 unless ``--dtype``).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any

from ..formats.pickle_policy import opaque_class_paths

WRAPPER_PREFIX = "_forward_module."  # Lightning's _LightningModuleWrapperBase around the user's module
STATE_DICT = "state_dict"
# A weights checkpoint for Trainer.fit(ckpt_path=): empty lists restore nothing (fresh optimizer and
# schedulers), where a missing key makes Lightning refuse the file ("contains only the model").
EMPTY_TRAINING_STATE = ("optimizer_states", "lr_schedulers")


def checkpoint_tree(state_dict: "OrderedDict[str, Any]", client_state: dict[str, Any]) -> tuple[dict, dict[str, set[str]]]:
    """The checkpoint dict and the client-state entries left out (key -> the foreign classes inside it).

    An entry holding an object of a class dsckpt does not load is left out whole: written back, it would
    make the file unloadable with ``torch.load(weights_only=True)`` (and run that class's code otherwise).
    """
    tree: dict[str, Any] = {}
    dropped: dict[str, set[str]] = {}
    for key, value in client_state.items():
        classes = opaque_class_paths(value)
        if classes:
            dropped[str(key)] = classes
        elif key != STATE_DICT:
            tree[key] = value
    for key in EMPTY_TRAINING_STATE:
        tree.setdefault(key, [])
    tree[STATE_DICT] = state_dict
    return tree, dropped
