"""A checkpoint as a grid of ranks over (tp, pp, dp, ep), and the one place rank file names are spelled.

DeepSpeed names each rank's files by its coordinates: ``mp_rank_{tp:02d}`` (model parallel = tensor
parallel), ``zero_pp_rank_{dp}`` (the ZeRO data-parallel partition; "pp" is historical, it is not the
pipeline stage), ``layer_{l}_expert_{e}`` / ``expp_rank_{ep}`` for mixture-of-experts files, and
``layer_{l}-model_{tp:02d}`` for pipeline layers.  ``rank_file_name`` builds every such name, so plans
never spell one; ``zero.layout`` parses them with the regular expressions beside its constants.

ZeRO's data-parallel slices of a parameter are flat partitions (``partitioning`` says which elements each
rank holds); tensor-parallel slices join by the split each parameter records (``tensor_parallel``).  dsckpt
fills dp, ep and tp; pp is recognised and refused by name.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

MODEL_STATES_SUFFIX = "_model_states.pt"
OPTIM_STATES_SUFFIX = "_optim_states.pt"
BF16_PREFIX = "bf16_"  # DeepSpeed's bf16 optimizer (BF16_Optimizer, ZeRO-0/1 with bf16) prefixes its files


@dataclass(frozen=True, order=True)
class Coord:
    """A rank's place in the grid; 0 on an axis the run did not use."""
    tp: int = 0
    pp: int = 0
    dp: int = 0
    ep: int = 0


@dataclass(frozen=True)
class GridShape:
    """How many ranks along each axis wrote files (the checkpoint's world, factored)."""
    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1

    def describe(self) -> str:
        """The axes in use, for a message: "tp 2 x dp 4"."""
        used = [f"{axis} {size}" for axis, size in (("tp", self.tp), ("pp", self.pp), ("dp", self.dp), ("ep", self.ep))
                if size > 1 or axis == "dp"]
        return " x ".join(used)


def rank_file_name(kind: Literal["model", "optim"], coord: Coord = Coord(), *, per_dp_rank: bool = True,
                   bf16: bool = False) -> str:
    """DeepSpeed's name for a rank's file.

    ``per_dp_rank``: the file belongs to one data-parallel rank (every optimizer file; model files at
    ZeRO-3) - ``zero_pp_rank_{dp}_mp_rank_{tp:02d}_...``; else rank 0's one model file at ZeRO 0-2,
    ``mp_rank_{tp:02d}_model_states.pt``.  ``bf16``: the ``bf16_`` prefix of the bf16 optimizer's files.
    """
    suffix = MODEL_STATES_SUFFIX if kind == "model" else OPTIM_STATES_SUFFIX
    dp = f"zero_pp_rank_{coord.dp}_" if per_dp_rank or kind == "optim" else ""
    return f"{BF16_PREFIX if bf16 else ''}{dp}mp_rank_{coord.tp:02d}{suffix}"
