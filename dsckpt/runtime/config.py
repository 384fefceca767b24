"""DeepSpeed configuration: presets, building from arguments, and the config sources.

Sources, strongest first: an explicit dict or JSON path passed by the caller, the JSON file named
by ``$DSCKPT_DEEPSPEED_CONFIG``, then a config built from arguments (a preset fills the arguments'
defaults).  Only keys the user did not set are filled in afterwards (batch size, precision).
"""
from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from ..dtypes import PRECISION_WORDS, TRAINING_PRECISION
from ..errors import ConfigError
from ..formats.json_file import read_json_object

CONFIG_ENV_VAR = "DSCKPT_DEEPSPEED_CONFIG"
PRECISIONS = ("32", "16", "bf16")  # what ZeRO trains with; fp64/int8 are not supported by ZeRO

# Named presets, as in Lightning's strategy registry: name -> build_config() arguments.
PRESETS: dict[str, dict[str, Any]] = {
    "deepspeed": {"stage": 2},
    "deepspeed_stage_1": {"stage": 1},
    "deepspeed_stage_2": {"stage": 2},
    "deepspeed_stage_2_offload": {"stage": 2, "offload_optimizer": True},
    "deepspeed_stage_3": {"stage": 3},
    "deepspeed_stage_3_offload": {"stage": 3, "offload_optimizer": True, "offload_parameters": True},
    "deepspeed_stage_3_offload_nvme": {
        "stage": 3, "offload_optimizer": True, "offload_parameters": True, "remote_device": "nvme",
        "offload_params_device": "nvme", "offload_optimizer_device": "nvme",
    },
}


def build_config(
    stage: int = 2,
    *,
    precision: str = "32",
    offload_optimizer: bool = False,
    offload_parameters: bool = False,
    remote_device: str | None = None,
    offload_params_device: str = "cpu",
    offload_optimizer_device: str = "cpu",
    nvme_path: str = "/local_nvme",
    params_buffer_count: int = 5,
    params_buffer_size: int = 100_000_000,
    max_in_cpu: int = 1_000_000_000,
    optimizer_buffer_count: int = 4,
    block_size: int = 1_048_576,
    queue_depth: int = 8,
    single_submit: bool = False,
    overlap_events: bool = True,
    thread_count: int = 1,
    pin_memory: bool = False,
    sub_group_size: int = 1_000_000_000_000,
    contiguous_gradients: bool = True,
    overlap_comm: bool = True,
    allgather_partitions: bool = True,
    reduce_scatter: bool = True,
    allgather_bucket_size: int = 200_000_000,
    reduce_bucket_size: int = 200_000_000,
    partition_activations: bool = False,
    cpu_checkpointing: bool = False,
    contiguous_memory_optimization: bool = False,
    synchronize_checkpoint_boundary: bool = False,
    loss_scale: float = 0,
    initial_scale_power: int = 16,
    loss_scale_window: int = 1000,
    hysteresis: int = 2,
    min_loss_scale: float = 1,
    train_micro_batch_size_per_gpu: int = 1,
    gradient_accumulation_steps: int | None = None,
    gradient_clip_val: float | None = None,
) -> dict[str, Any]:
    """A complete DeepSpeed config from arguments (the Lightning strategy's parameters)."""
    if stage not in (0, 1, 2, 3):
        raise ConfigError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
    _check_precision(precision, stage)
    zero: dict[str, Any] = {
        "stage": stage,
        "contiguous_gradients": contiguous_gradients,
        "overlap_comm": overlap_comm,
        "allgather_partitions": allgather_partitions,
        "reduce_scatter": reduce_scatter,
        "allgather_bucket_size": allgather_bucket_size,
        "reduce_bucket_size": reduce_bucket_size,
        "sub_group_size": sub_group_size,
    }
    nvme = {"nvme_path": nvme_path}
    if offload_optimizer:
        zero["offload_optimizer"] = {
            "device": offload_optimizer_device, "pin_memory": pin_memory,
            "buffer_count": optimizer_buffer_count,
            **(nvme if offload_optimizer_device == "nvme" else {}),
        }
    if offload_parameters:
        if stage != 3:
            raise ConfigError("offload_parameters needs ZeRO stage 3")
        zero["offload_param"] = {
            "device": offload_params_device, "pin_memory": pin_memory, "buffer_count": params_buffer_count,
            "buffer_size": params_buffer_size, "max_in_cpu": max_in_cpu,
            **(nvme if offload_params_device == "nvme" else {}),
        }
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": train_micro_batch_size_per_gpu,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": zero,
        "activation_checkpointing": {
            "partition_activations": partition_activations,
            "cpu_checkpointing": cpu_checkpointing,
            "contiguous_memory_optimization": contiguous_memory_optimization,
            "synchronize_checkpoint_boundary": synchronize_checkpoint_boundary,
        },
    }
    if "nvme" in (offload_params_device if offload_parameters else "", offload_optimizer_device if offload_optimizer else "") or remote_device == "nvme":
        config["aio"] = {"block_size": block_size, "queue_depth": queue_depth, "single_submit": single_submit,
                         "overlap_events": overlap_events, "thread_count": thread_count}
    if offload_optimizer:
        # dsckpt's trainer brings a client torch AdamW (no JIT build); DeepSpeed refuses that with
        # offload unless told otherwise. For speed, pass a config with DeepSpeedCPUAdam instead.
        config["zero_force_ds_cpu_optimizer"] = False
    if remote_device is not None:
        config["dsckpt_remote_device"] = remote_device  # consumed by zero.Init, removed before initialize
    _apply_precision(config, precision, loss_scale=loss_scale, initial_scale_power=initial_scale_power,
                     loss_scale_window=loss_scale_window, hysteresis=hysteresis, min_loss_scale=min_loss_scale)
    if gradient_accumulation_steps is not None:
        config["gradient_accumulation_steps"] = gradient_accumulation_steps
    if gradient_clip_val is not None:
        config["gradient_clipping"] = gradient_clip_val
    return config


def resolve_config(
    config: Mapping[str, Any] | str | os.PathLike | None = None,
    *,
    preset: str | None = None,
    precision: str = "32",
    gradient_accumulation_steps: int | None = None,
    gradient_clip_val: float | None = None,
    gradient_clip_algorithm: str = "norm",
    **build_kwargs: Any,
) -> dict[str, Any]:
    """The DeepSpeed config to run with, from whichever source is strongest.

    1. ``config`` (a dict, or a path to a JSON file), else the file named by ``$DSCKPT_DEEPSPEED_CONFIG``.
    2. Otherwise ``build_config(**PRESETS[preset], **build_kwargs)``.
    3. Fill in what a user config leaves out (micro batch size, precision), and check conflicts.
    """
    if gradient_clip_algorithm != "norm" and gradient_clip_val is not None:
        raise ConfigError(
            f"gradient clipping by {gradient_clip_algorithm!r} is not supported: DeepSpeed clips by norm only "
            "(use gradient_clip_algorithm='norm')")
    if config is None and os.environ.get(CONFIG_ENV_VAR):
        config = os.environ[CONFIG_ENV_VAR]
    if config is None:
        kwargs = dict(PRESETS[_preset(preset)]) if preset else {}
        kwargs.update(build_kwargs)
        return build_config(precision=precision, gradient_accumulation_steps=gradient_accumulation_steps,
                            gradient_clip_val=gradient_clip_val, **kwargs)
    user = load_config(config)
    if gradient_accumulation_steps is not None and "gradient_accumulation_steps" in user:
        raise ConfigError(
            "gradient_accumulation_steps is set both in the DeepSpeed config "
            f"({user['gradient_accumulation_steps']}) and as an argument ({gradient_accumulation_steps}); set it in one place")
    stage = int(user.get("zero_optimization", {}).get("stage", 0))
    _check_precision(precision, stage)
    if "bf16" not in user and "fp16" not in user:  # a user config's own precision block wins
        _apply_precision(user, precision)
    user.setdefault("train_micro_batch_size_per_gpu", 1)
    user.setdefault("zero_allow_untested_optimizer", True)
    if gradient_accumulation_steps is not None:
        user["gradient_accumulation_steps"] = gradient_accumulation_steps
    if gradient_clip_val is not None:
        user.setdefault("gradient_clipping", gradient_clip_val)
    return user


def load_config(config: Mapping[str, Any] | str | os.PathLike) -> dict[str, Any]:
    """A deep copy of a dict, or the parsed JSON file at a path."""
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    path = Path(config)
    if not path.is_file():
        raise ConfigError("DeepSpeed config file not found", at=path)
    return read_json_object(path, "JSON DeepSpeed config")


def precision_of(config: Mapping[str, Any]) -> str:
    if config.get("bf16", {}).get("enabled"):
        return "bf16"
    if config.get("fp16", {}).get("enabled"):
        return "16"
    return "32"


def _preset(name: str) -> str:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}")
    return name


def _check_precision(precision: str, stage: int) -> None:
    if precision not in PRESETS_PRECISION_ALIASES:
        raise ConfigError(f"ZeRO stage {stage} does not support precision {precision!r}; use fp32, bf16 or fp16")


PRESETS_PRECISION_ALIASES = {"32-true": "32", "16-mixed": "16", "bf16-mixed": "bf16",  # Lightning's spellings
                             **{w: TRAINING_PRECISION[label] for w, label in PRECISION_WORDS.items()}}


def _apply_precision(config: dict[str, Any], precision: str, *, loss_scale: float = 0, initial_scale_power: int = 16,
                     loss_scale_window: int = 1000, hysteresis: int = 2, min_loss_scale: float = 1) -> None:
    precision = PRESETS_PRECISION_ALIASES[precision]
    if precision == "16":
        config["fp16"] = {"enabled": True, "loss_scale": loss_scale, "initial_scale_power": initial_scale_power,
                          "loss_scale_window": loss_scale_window, "hysteresis": hysteresis,
                          "min_loss_scale": min_loss_scale}
    elif precision == "bf16":
        config["bf16"] = {"enabled": True}


@dataclass
class TrainOptions:
    """What `dsckpt train`/`resume` are asked for (torch-free: a `--nproc` parent builds it to check the config)."""
    model: str | None = None  # "package.module:factory"; None = built-in TinyCausalLM
    preset: str | None = None
    stage: int | None = None
    config: str | None = None
    precision: str = "32"
    steps: int = 20
    save_dir: str | None = None
    save_every: int = 0  # 0: save once at the end
    sync_save: bool = False  # True: DeepSpeed's own blocking save instead of checkpoint_engine.background
    seed: int = 1234
    batch_size: int = 8
    lr: float = 3e-3
    freeze: bool = False  # built-in model: freeze the first block
    offload_optimizer: bool | None = None  # None: as the preset says
    offload_parameters: bool | None = None
    gradient_accumulation_steps: int | None = None
    gradient_clip_val: float | None = None
    user_state: dict[str, Any] = field(default_factory=dict)

    def deepspeed_config(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {} if self.stage is None else {"stage": self.stage}
        for key in ("offload_optimizer", "offload_parameters"):
            if getattr(self, key) is not None:
                kwargs[key] = getattr(self, key)
        preset = self.preset or (None if self.stage is not None or self.config else "deepspeed_stage_3")
        return resolve_config(self.config, preset=preset, precision=self.precision,
                              gradient_accumulation_steps=self.gradient_accumulation_steps,
                              gradient_clip_val=self.gradient_clip_val, **kwargs)
