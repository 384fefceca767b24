"""What a plan is made of: the tensors to write (``TensorPlan``: a name, a shape, dtypes and where its bytes are),
the copies to compare (``Replica``) and the whole (``Plan``).  Built by ``plan.consolidate``, joined by
``plan.joins``, read by every writer."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..dtypes import Shaped
from .segments import ByteSource, Interleaved, Piece, TensorSource


@dataclass(frozen=True)
class TensorPlan(Shaped):
    name: str
    shape: tuple[int, ...]
    src_dtype: str
    dtype: str  # output dtype
    kind: str  # "param" | "frozen" | "buffer"
    pieces: tuple[Piece, ...] | Interleaved  # in src_dtype, back to back (a plan.segments.ByteSource)


@dataclass(frozen=True)
class Replica:
    """A TP rank's copy of a replicated parameter (a pipeline stage's of a tied one), which must equal the copy
    written."""
    name: str
    rank: int
    source: ByteSource
    written: ByteSource
    axis: str = "TP rank"


@dataclass(frozen=True)
class Plan:
    tensors: tuple[TensorPlan, ...]
    aliases: dict[str, str] = field(default_factory=dict)  # tied name -> name of the written tensor
    metadata: dict[str, str] = field(default_factory=dict)
    replicas: tuple[Replica, ...] = ()  # tensor parallel: copies to compare (plan.tensor_parallel)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def stored(t: TensorPlan) -> TensorSource:
    """A slice's bytes as stored (replicas are compared uncast)."""
    return TensorSource(t.src_dtype, t.src_dtype, tuple(t.pieces))
