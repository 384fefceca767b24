"""The names only a model knows (``plan.from_dcp.ModelNames``) and, for a weights source, the optimizer's param
groups - from the model built on the meta device (a factory, or a Hugging Face folder's ``config.json``): no
weights are computed, a 70B model's names take a second."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError
from ..plan.from_dcp import ModelNames
from ..plan.training_state import ParamGroup
from .train import load_factory

ONE_GROUP, HF_TRAINER_GROUPS = "one", "hf-trainer"
# what torch.optim.AdamW records per group beside the caller's settings (the HF Trainer's defaults for the rest)
ADAMW_DEFAULTS: dict[str, Any] = {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False,
                                  "maximize": False, "foreach": None, "capturable": False, "differentiable": False,
                                  "fused": None, "decoupled_weight_decay": True}


def model_names(spec: str) -> ModelNames:
    """``spec``: "package.module:factory", as ``dsckpt train --model`` takes it."""
    return names_of(meta_model(spec))


def meta_model(spec: str | Path) -> torch.nn.Module:
    """The model of a factory spec, or of a Hugging Face folder (its ``config.json``), on the meta device."""
    folder = Path(spec)
    if (folder / "config.json").is_file():
        import transformers

        config = transformers.AutoConfig.from_pretrained(folder)
        architectures = getattr(config, "architectures", None) or []
        cls = getattr(transformers, architectures[0], None) if architectures else None
        with torch.device("meta"):
            return cls(config) if cls is not None else transformers.AutoModelForCausalLM.from_config(config)
    factory = load_factory(str(spec))
    with torch.device("meta"):
        return factory()


def names_of(model: torch.nn.Module) -> ModelNames:
    first: dict[int, str] = {}
    parameters, ties = [], {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            ties[name] = first[id(param)]
        else:
            first[id(param)] = name
            parameters.append(name)
    state = model.state_dict(keep_vars=True)
    buffers = frozenset(n for n, _ in model.named_buffers() if n in state)
    return ModelNames(tuple(parameters), buffers, ties, {n: tuple(t.shape) for n, t in state.items()})


def weight_groups(model: torch.nn.Module, settings: dict[str, Any], mode: str) -> tuple[ParamGroup, ...]:
    """The optimizer's param groups over ``model``'s trainable parameters in model order: one group, or the HF
    Trainer's two (weight decay on all but biases and norms, as ``Trainer.get_decay_parameter_names`` says)."""
    if "lr" not in settings:
        raise ConfigError("--group-settings: give at least the learning rate, e.g. '{\"lr\": 3e-4}' (a weights file "
                          "records no optimizer); under a warmup schedule, the first step's (0.0) and the peak as "
                          "initial_lr")
    full = {"lr": float(settings["lr"]), **ADAMW_DEFAULTS, **{k: v for k, v in settings.items() if k != "lr"}}
    if isinstance(full.get("betas"), list):
        full["betas"] = tuple(full["betas"])
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    if mode == ONE_GROUP:
        return (ParamGroup(full, tuple(trainable)),)
    if mode != HF_TRAINER_GROUPS:
        raise ConfigError(f"--groups {mode!r}: expected {ONE_GROUP} or {HF_TRAINER_GROUPS}")
    from transformers import Trainer

    decay = set(Trainer.get_decay_parameter_names(None, model))  # (it reads nothing from the Trainer)
    return (ParamGroup(full, tuple(n for n in trainable if n in decay)),
            ParamGroup({**full, "weight_decay": 0.0}, tuple(n for n in trainable if n not in decay)))
