"""PyTorch Lightning checkpoints: what ``LightningModule.load_from_checkpoint`` and ``Trainer.fit(ckpt_path=)`` read.

Lightning's ``DeepSpeedStrategy`` saves a folder: DeepSpeed's shards, with Lightning's own checkpoint dict
(``epoch``, ``global_step``, ``pytorch-lightning_version``, ``hyper_parameters``, ``loops``,
``callbacks``, ``lr_schedulers``, ...) as the client state.  Earlier Lightning versions prefixed the module's names
with their wrapper's (``_forward_module.``); 2.6 hands the module over bare.  ``consolidate --format lightning``
writes the one-file checkpoint Lightning's CPU/GPU strategies read: that dict, plus ``state_dict`` (fp32 unless
``--dtype``).
"""
from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Any

from ..errors import UnsupportedCheckpointError
from ..formats.pickle_tree import opaque_class_paths
from ..io.context import WriteContext
from .registry import Format, Listing, Prepared, Request, register

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


class LightningFormat(Format):
    name = "lightning"
    suffixes = (".ckpt",)
    accepts = (".pt", ".pth")  # a Lightning checkpoint is a torch file
    stores_client_state = True  # Lightning's dict is the checkpoint's client state
    reties_aliases = True
    summary = "one Lightning .ckpt: the client state (epoch, loops, hparams) + state_dict"

    def prepare(self, ckpt, plan, request: Request) -> Prepared:
        from ..plan.names import strip_prefix

        if not request.strip_prefixes and plan.tensors and all(t.name.startswith(WRAPPER_PREFIX) for t in plan.tensors):
            plan = strip_prefix(plan, (WRAPPER_PREFIX,))  # Lightning's wrapper, as its own converter strips it
        from ..formats.pickle_writer import NewTensor, dumps

        tensors = {t.name: NewTensor(t.dtype, t.shape, t) for t in plan.tensors}
        state = OrderedDict(tensors)
        for alias, src in plan.aliases.items():
            state[alias] = tensors[src]
        tree, dropped = checkpoint_tree(state, ckpt.client_state or {})
        try:  # pickled here, once: a value the format cannot hold is refused before a byte is written
            pickled = dumps(tree)
        except ValueError as exc:
            raise UnsupportedCheckpointError(f"client state: {exc}; it cannot be "
                                             "written into a Lightning checkpoint",
                                             hint="write another format (model.safetensors): its client state goes to a sidecar", at=ckpt.model_files[0].path) from None
        notes = tuple(f"client-state entry {k!r} left out: it holds objects of {', '.join(sorted(c))}, which dsckpt "
                      "does not load (OUT stays loadable with torch.load(weights_only=True))" for k, c in dropped.items())
        return Prepared(self, plan, request, client_state=ckpt.client_state, notes=notes, pickled=pickled)

    def write(self, prepared: Prepared, path: Path, context: WriteContext) -> list[str]:
        """One .ckpt: Lightning's checkpoint dict from the client state, plus ``state_dict``."""
        from ..io.read import Reader
        from ..io.torch_writer import write_pickled

        with Reader(context) as reader:  # (client-state tensors are copied as stored: their storages' bytes)
            write_pickled(path, prepared.pickled, reader, context)
        return [path.name]

    def read(self, path: Path) -> Listing:
        from .torch_file import read_torch

        return read_torch(path)


register(LightningFormat())
