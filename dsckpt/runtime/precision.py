"""Which training precisions this machine can run, checked before any rank starts.

DeepSpeed 0.19.8's CPU accelerator asks oneDNN (``torch.ops.mkldnn._is_mkldnn_fp16_supported()``);
machines of one kind differ (an AMD EPYC and a Xeon seen here both answer "no fp16, bf16 yes"), and
``deepspeed.initialize`` then fails on every rank with "Type fp16 is not supported on your device."
The same question asked once, in the launching process, gives one typed error instead.
"""
from __future__ import annotations

from typing import Any

from ..errors import UnsupportedPrecisionError
from .config import PRESETS_PRECISION_ALIASES

from ..dtypes import PRECISION_DTYPE, label

LABELS = {precision: label(dtype) for precision, dtype in PRECISION_DTYPE.items()}  # "32" -> "fp32"


def supported_precisions(accelerator: Any = None) -> tuple[str, ...]:
    """The precisions ``accelerator`` (default: DeepSpeed's, for this machine) trains in."""
    if accelerator is None:
        from deepspeed.accelerator import get_accelerator

        accelerator = get_accelerator()
    found = ["32"]
    if accelerator.is_bf16_supported():  # the CPU accelerator answers None, not False, for "no"
        found.append("bf16")
    if accelerator.is_fp16_supported():
        found.append("16")
    return tuple(found)


def require_supported(precision: str, accelerator: Any = None) -> None:
    """Raise ``UnsupportedPrecisionError`` when this machine cannot train in ``precision``."""
    precision = PRESETS_PRECISION_ALIASES.get(precision, precision)
    supported = supported_precisions(accelerator)
    if precision not in supported:
        name = accelerator.device_name() if accelerator is not None else _device_name()
        raise UnsupportedPrecisionError(
            f"precision {LABELS.get(precision, precision)} is not supported on this machine's {name} device "
            f"(it supports: {', '.join(LABELS[p] for p in supported)})",
            hint="choose --precision " + " or ".join(LABELS[p] for p in supported))


def _device_name() -> str:
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name()
