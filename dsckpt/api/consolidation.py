"""Consolidation API: ``consolidate`` writes files, ``load_state_dict`` / ``iter_state_dict`` return tensors.

``consolidate(ckpt, out)`` steps:
1. pick OUT's format (``export.registry``: by name or suffix) and open the checkpoint (``zero.reader``);
2. build the plan (``plan.consolidate``) and let the format prepare it (``Format.prepare``: names,
   companions, checks that can fail - all before a byte is written);
3. check OUT (not an input, not existing unless ``force``); with ``verify``, CRC-check the sources;
4. write through the format into a temp path beside OUT; with ``verify``, re-read it and compare with
   the shards;
5. write the client-state sidecar (temp + rename too), then rename OUT into place; with ``fsync``
   (the default) OUT is flushed before the rename and its folder after it.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from ..errors import OutputError, VerificationError
from ..export.registry import Format, Request, for_output
from ..export.sidecar import sidecar_paths, write_sidecar
from ..formats.positional import read_range
from ..formats.torchzip import check_storage_crcs
from ..io.output import check_output, staged, write_errors
from ..io.read import Reader, torch_state_dict
from ..plan.consolidate import Plan, build_plan, duplicate_aliases
from ..plan.segments import Segment
from ..zero.layout import require_contained
from ..zero.reader import open_checkpoint

DEFAULT_SHARD = "5GB"


@dataclass(frozen=True)
class Result:
    out: Path
    form: str  # a registered format's name: "safetensors", "torch", "sharded", "hf", "peft", "lightning"
    tensors: int
    nbytes: int
    files: tuple[str, ...]
    sidecar: Path | None
    verified: bool | None
    notes: tuple[str, ...] = ()  # worth telling the user (an unmatched --strip-prefix, how to load tied weights)


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)\s*", text, re.I)
    if not m:
        raise OutputError(f"max shard size {text!r}: expected a size like 5GB or 500MiB")
    unit = m.group(2).upper().rstrip("B")
    scale = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}
    return int(float(m.group(1)) * scale[unit])


def consolidate(checkpoint: str | os.PathLike, out: str | os.PathLike, *, tag: str | None = None,
                dtype: str | None = None, exclude_frozen: bool = False, duplicate_tied: bool = False,
                strip_prefixes: tuple[str, ...] = (), max_shard_size: str = DEFAULT_SHARD,
                client_state: bool = True, force: bool = False, verify: bool = False, fsync: bool = True,
                form: str | None = None, config: str | os.PathLike | None = None, trust: bool = False,
                progress: Callable[[int], None] | None = None,
                progress_total: Callable[[int], None] | None = None) -> Result:
    """Gather a ZeRO checkpoint into ``out``; see the module docstring.

    ``form``: a registered format by name ("hf": a folder ``from_pretrained`` loads, with the config and
    tokenizer files found beside the checkpoint or ``config``); default: chosen by OUT's suffix.
    ``trust``: follow symlinks that lead out of the checkpoint (refused by default: they would copy
    files from elsewhere into the output).
    """
    fmt = for_output(out, form)  # a name that contradicts the format is refused before anything is read
    if config is not None and fmt.name != "hf":
        raise OutputError(f"--config {config}: only the Hugging Face export (--hf) writes a config; "
                          f"this output is {fmt.name}", hint="add --hf, or leave --config out")
    request = Request(parse_size(max_shard_size), Path(config) if config is not None else None,
                      tuple(strip_prefixes), duplicate_tied, trust)
    ckpt = open_checkpoint(checkpoint, tag)
    if not trust:
        require_contained(ckpt.layout)
    fmt = fmt.resolve(ckpt.layout.root, request)
    plan = build_plan(ckpt, dtype, exclude_frozen=exclude_frozen or fmt.exclude_frozen,
                      strip_prefixes=tuple(strip_prefixes))
    if duplicate_tied and fmt.duplicates_tied:
        plan = duplicate_aliases(plan)
    prepared = fmt.prepare(ckpt, plan, request)
    fmt, plan = prepared.format, prepared.plan
    out = Path(out)
    inputs = [f.path for f in ckpt.layout.all_files]
    check_output(out, inputs, force, directory=fmt.directory, tree=ckpt.layout.root)
    replaced = fmt.replaced_files(out)
    write_client = bool(client_state and ckpt.client_state) and not fmt.stores_client_state
    for path in sidecar_paths(out):  # a file there would be taken for OUT's client state: same --force rule
        check_output(path, inputs, force)
    if verify:
        check_sources(plan)  # damaged source bytes are caught before anything is written
    if progress_total:
        progress_total(plan.nbytes)
    notes = _notes(ckpt, plan, fmt, strip_prefixes) + prepared.notes
    with staged(fsync) as stage, write_errors(out):
        tmp = stage.temp_for(out, directory=fmt.directory)
        names = fmt.write(prepared, tmp, progress)
        if verify:
            verify_output(plan, tmp, fmt)  # before the rename: a failed check leaves nothing at OUT
        stage.remove_on_commit(out / name for name in replaced if name not in names)
        if write_client:
            write_sidecar(ckpt.client_state, out, stage)
        else:  # (only with --force) a sidecar of the OUT being replaced would restore the wrong counters
            stage.remove_on_commit(p for p in sidecar_paths(out) if os.path.lexists(p))
    written = [out / name for name in names] if fmt.directory else [out]
    sidecars = tuple(p for p in sidecar_paths(out) if p.exists()) if write_client else ()
    return Result(out, fmt.name, len(plan.tensors), plan.nbytes, tuple(str(p) for p in written + list(sidecars)),
                  sidecars[0] if sidecars else None, True if verify else None, notes)


def _notes(ckpt, plan: Plan, fmt: Format, strip_prefixes: tuple[str, ...]) -> tuple[str, ...]:
    notes = []
    names = [n for n in ckpt.module] + list(ckpt.trainable) + list(ckpt.frozen)
    for prefix in strip_prefixes:
        if not any(n.startswith(prefix) for n in names):
            notes.append(f"--strip-prefix {prefix!r} matched no tensor name; nothing was stripped")
    if plan.aliases and not fmt.reties_aliases:
        pairs = ", ".join(f"{a} = {s}" for a, s in list(plan.aliases.items())[:3])
        notes.append(f"tied weights are stored once ({pairs}): load with safetensors.torch.load_model(model, path) "
                     "(it re-ties them); a strict model.load_state_dict(load_file(path)) needs --duplicate-tied")
    return tuple(notes)


def check_sources(plan: Plan) -> None:
    """The zip CRC-32 of every storage the plan reads from (raw copies bypass zipfile's own check)."""
    ranges: dict[Path, list[tuple[int, int]]] = {}
    for t in plan.tensors:
        for p in t.pieces:
            if isinstance(p, Segment):
                ranges.setdefault(p.path, []).append((p.offset, p.nbytes))
    for path, spans in ranges.items():
        check_storage_crcs(path, spans)


def verify_output(plan: Plan, out: Path, fmt: Format) -> None:
    """Re-read OUT through its format's reader and compare every tensor byte for byte with the plan's
    source pieces (tied aliases stored as views of one storage are compared once)."""
    expected = {t.name: t for t in plan.tensors}
    seen = set()
    with Reader() as reader:
        for stored in fmt.read(out).tensors:
            if stored.name in plan.aliases:
                continue
            if stored.name not in expected:
                raise VerificationError(f"{out}: unexpected tensor {stored.name!r}")
            data = read_range(stored.path, stored.offset, stored.span_bytes)
            if stored.stride is not None or data != reader.read(expected[stored.name]):
                raise VerificationError(f"{out}: tensor {stored.name!r} differs from the checkpoint")
            seen.add(stored.name)
    missing = set(expected) - seen
    if missing:
        raise VerificationError(f"{out}: {len(missing)} tensors missing, e.g. {sorted(missing)[0]!r}")


def load_state_dict(checkpoint: str | os.PathLike, tag: str | None = None, dtype: str | None = None,
                    exclude_frozen: bool = False, state: str = "fp32") -> dict[str, Any]:
    """The consolidated state dict as torch tensors in memory (tied names share one tensor).

    ``state="exp_avg"`` / ``"exp_avg_sq"``: Adam's moments of the trainable parameters instead.
    """
    plan = build_plan(open_checkpoint(checkpoint, tag), dtype, exclude_frozen=exclude_frozen, state=state)
    return torch_state_dict(plan)


def iter_state_dict(checkpoint: str | os.PathLike, tag: str | None = None,
                    dtype: str | None = None) -> Iterator[tuple[str, Any]]:
    """Yield ``(name, tensor)`` one full tensor at a time (memory: the largest tensor)."""
    plan = build_plan(open_checkpoint(checkpoint, tag), dtype)
    for t in plan.tensors:
        yield t.name, torch_state_dict(plan, only={t.name})[t.name]
    for alias, target in plan.aliases.items():
        yield alias, torch_state_dict(plan, only={target})[target]
