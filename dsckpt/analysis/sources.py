"""What to read for numerical analysis: the tensors of a checkpoint or a consolidated file as ``Source``s.

A DeepSpeed checkpoint goes through the consolidation plan (fp32 masters, frozen parameters,
buffers; with ``optimizer``, Adam's moments too); a consolidated file through the format registry.
Tied names (``dsckpt.aliases``, ``shared_params``) are listed under every name, so two sides compare
name for name whatever form each is in.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable

from ..errors import UnsupportedCheckpointError
from ..formats import metadata as M
from ..formats.safetensors_file import parse_aliases
from ..api.paths import classify
from ..io.integrity import check_sources
from ..plan.segments import Segment, read_pieces
from .stats import Source


def sources(path: str | Path, tag: str | None = None, optimizer: bool = False, check_crc: bool = True,
            fetch: Callable[[Iterable[object]], None] | None = None) -> list[Source]:
    """Every tensor to analyse; each storage read is CRC-checked first unless ``check_crc`` is False.  ``fetch``:
    a view of a URL (``parallel.view.readable``) gets the bytes the tensors read, and only those."""
    out = _sources(Path(path), tag, optimizer)
    if fetch is not None:
        fetch(p for s in out for p in read_pieces(s))
    check_sources((p for s in out for p in read_pieces(s)), skip=not check_crc)
    return out


def resolved_tag(path: str | Path, tag: str | None) -> str | None:
    """The tag ``sources`` reads (what ``latest`` names when ``tag`` is None); None for a weights file."""
    if not classify(Path(path)).is_checkpoint:
        return None
    from ..zero.layout import discover

    return discover(path, tag).tag


def _sources(p: Path, tag: str | None, optimizer: bool) -> list[Source]:
    kind = classify(p)
    if kind.kind == "weights":
        fmt = kind.reader
        if optimizer:
            raise UnsupportedCheckpointError("a consolidated file holds weights only; --optimizer reads Adam's "
                                             "moments from a ZeRO-1/2/3 checkpoint", hint="drop --optimizer, or pass the checkpoint folder", at=p)
        listing = fmt.read(p)
        out = [Source(t.name, "tensor", t.dtype, t.shape, (Segment(t.path, t.offset, t.span_bytes),))
               for t in listing.tensors if t.stride is None]
        by_name = {s.name: s for s in out}
        for alias, target in parse_aliases(listing.metadata.get(M.ALIASES), p).items():
            if target in by_name and alias not in by_name:
                out.append(Source(alias, "tensor", by_name[target].dtype, by_name[target].shape, by_name[target].pieces))
        return out
    from ..plan.consolidate import build_plan
    from ..zero.reader import open_checkpoint

    ckpt = open_checkpoint(p, tag)
    out = _plan_sources(build_plan(ckpt), prefix="")
    if optimizer and not ckpt.zero_stage:
        raise UnsupportedCheckpointError("a ZeRO-0 checkpoint keeps its optimizer inside the "
                                         "model states as DeepSpeed's own record; --optimizer reads ZeRO-1/2/3 partitions",
                                         hint="drop --optimizer", at=ckpt.layout.tag_dir)
    if optimizer:
        for state in ckpt.optimizer_state_keys():
            out += [Source(f"{state}/{s.name}", state, s.dtype, s.shape, s.pieces)
                    for s in _plan_sources(build_plan(ckpt, state=state), prefix="") if s.kind == "param"]
    return out


def _plan_sources(plan, prefix: str) -> list[Source]:
    out = [Source(prefix + t.name, t.kind, t.src_dtype, t.shape, t.pieces)
           for t in plan.tensors]
    by_name = {s.name: s for s in out}
    for alias, target in plan.aliases.items():
        if target in by_name:
            src = by_name[target]
            out.append(Source(prefix + alias, src.kind, src.dtype, src.shape, src.pieces))
    return out
