"""Consolidation API: ``consolidate`` writes files, ``load_state_dict`` / ``iter_state_dict`` return tensors.

``consolidate(ckpt, out)`` steps:
1. open the checkpoint (``reader``) and build the plan (``plan``);
2. check OUT (not an input, not existing unless ``force``); with ``verify``, CRC-check the sources;
3. write weights to a temp path beside OUT; with ``verify``, re-read it and compare with the shards;
4. write the client-state sidecar (temp + rename too), then rename OUT into place; with ``fsync``
   (the default) OUT is flushed before the rename and its folder after it.
"""
from __future__ import annotations

import contextlib
import errno
import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from .errors import CorruptFileError, OutputError, VerificationError
from .formats import metadata as M, peft
from .io.output import TEMP_MARK, check_output, staged
from .plan.consolidate import Plan, TensorPlan, build_plan
from .zero.layout import require_contained
from .zero.reader import open_checkpoint
from .formats.sidecar import sidecar_paths, write_sidecar
from .formats.torchzip import check_storage_crcs
from .io.formats import Format, by_name, for_output
from .io.positional import read_range
from .io.writer import SourceFiles, read_tensor, torch_state_dict

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
    form = fmt.name
    if config is not None and form != "hf":
        raise OutputError(f"--config {config}: only the Hugging Face export (--hf) writes a config; "
                          f"this output is {form}", hint="add --hf, or leave --config out")
    ckpt = open_checkpoint(checkpoint, tag)
    if not trust:
        require_contained(ckpt.layout)
    adapter = form == "hf" and config is None and peft.adapter_config(ckpt.layout.root)
    if adapter:  # a PEFT run: the adapter is the model to export (its base weights were never saved)
        fmt, form, exclude_frozen = by_name("peft"), "peft", True
    plan = build_plan(ckpt, dtype, exclude_frozen=exclude_frozen, strip_prefixes=tuple(strip_prefixes))
    out = Path(out)
    options = {"max_shard_bytes": parse_size(max_shard_size)}
    if adapter:
        from .formats.hf import find_companions

        plan = peft.adapter_plan(plan, ckpt.layout.root)
        options["adapter_config"] = adapter
        options["hf_companions"] = find_companions(ckpt.layout.root, adapter, trust)  # the tokenizer files
    if form == "hf":
        from .formats.hf import check_config_fits, find_companions, ties_embeddings

        options["hf_companions"] = find_companions(ckpt.layout.root, config, trust)  # no config: refused now
        check_config_fits(options["hf_companions"].config, {t.name: t.shape for t in plan.tensors}, plan.aliases)
        if not ties_embeddings(options["hf_companions"]):
            duplicate_tied = True  # the config unties the head: transformers wants both names stored
    lightning_notes: list[str] = []
    if form == "lightning":
        from .formats.lightning import WRAPPER_PREFIX, checkpoint_tree
        from .plan.consolidate import strip_prefix

        if not strip_prefixes and plan.tensors and all(t.name.startswith(WRAPPER_PREFIX) for t in plan.tensors):
            plan = strip_prefix(plan, (WRAPPER_PREFIX,))  # Lightning's wrapper, as its own converter strips it
        options["client_state"] = ckpt.client_state
        _, dropped = checkpoint_tree({}, ckpt.client_state)
        lightning_notes = [f"client-state entry {k!r} left out: it holds objects of {', '.join(sorted(c))}, which "
                           "dsckpt does not load (OUT stays loadable with torch.load(weights_only=True))"
                           for k, c in dropped.items()]
    inputs = [f.path for f in ckpt.layout.all_files]
    check_output(out, inputs, force, directory=fmt.directory, tree=ckpt.layout.root)
    replaced = replaced_weights(out) if fmt.directory and form != "peft" else ()  # (PEFT reads its own file name)
    write_client = bool(client_state and ckpt.client_state) and form != "lightning"  # (lightning: inside OUT)
    for path in sidecar_paths(out):  # a file there would be taken for OUT's client state: same --force rule
        check_output(path, inputs, force)
    if duplicate_tied and form != "torch":
        plan = _duplicate_aliases(plan)
    if verify:
        check_sources(plan)  # damaged source bytes are caught before anything is written
    if progress_total:
        progress_total(plan.nbytes)
    notes = _notes(ckpt, plan, form, strip_prefixes) + tuple(lightning_notes)
    with staged(fsync) as stage, write_errors(out):
        tmp = stage.temp_for(out, directory=fmt.directory)
        names = fmt.write(plan, tmp, options, progress)
        if verify:
            verify_output(plan, tmp, fmt)  # before the rename: a failed check leaves nothing at OUT
        stage.remove_on_commit(out / name for name in replaced if name not in names)
        if write_client:
            write_sidecar(ckpt.client_state, out, stage)
        else:  # (only with --force) a sidecar of the OUT being replaced would restore the wrong counters
            stage.remove_on_commit(p for p in sidecar_paths(out) if os.path.lexists(p))
    written = [out / name for name in names] if fmt.directory else [out]
    sidecars = tuple(p for p in sidecar_paths(out) if p.exists()) if write_client else ()
    return Result(out, form, len(plan.tensors), plan.nbytes, tuple(str(p) for p in written + list(sidecars)),
                  sidecars[0] if sidecars else None, True if verify else None, notes)


SHADOWING_WEIGHTS = ("model.safetensors",)  # from_pretrained reads this before any index: it would hide ours


def replaced_weights(out: Path) -> tuple[str, ...]:
    """In an existing folder OUT (``--force``): the shards its current index names, which the new output
    replaces (anything else there stays).  Refuses a weights file that would be loaded instead of ours."""
    if not out.is_dir():
        return ()
    for name in SHADOWING_WEIGHTS:
        if (out / name).exists():
            raise OutputError(f"{out}: holds {name}, which from_pretrained would load instead of the sharded "
                              "weights written beside it; dsckpt does not delete files it did not write",
                              hint=f"move {shlex.quote(str(out / name))} away, or write to another folder")
    from .io.formats_builtin import INDEX_NAME
    from .formats.safetensors_file import read_index

    if not (out / INDEX_NAME).is_file():
        return ()
    try:
        _, weight_map = read_index(out / INDEX_NAME)
    except CorruptFileError:
        return ()  # replaced by name; shards it might have named stay
    return tuple(sorted({n for n in weight_map.values() if "/" not in n and (out / n).is_file()}))


def _notes(ckpt, plan: Plan, form: str, strip_prefixes: tuple[str, ...]) -> tuple[str, ...]:
    notes = []
    names = [n for n in ckpt.module] + list(ckpt.trainable) + list(ckpt.frozen)
    for prefix in strip_prefixes:
        if not any(n.startswith(prefix) for n in names):
            notes.append(f"--strip-prefix {prefix!r} matched no tensor name; nothing was stripped")
    if plan.aliases and form not in ("torch", "hf", "lightning"):  # (hf: transformers ties them from the config)
        pairs = ", ".join(f"{a} = {s}" for a, s in list(plan.aliases.items())[:3])
        notes.append(f"tied weights are stored once ({pairs}): load with safetensors.torch.load_model(model, path) "
                     "(it re-ties them); a strict model.load_state_dict(load_file(path)) needs --duplicate-tied")
    return tuple(notes)


@contextlib.contextmanager
def write_errors(out: Path):
    """A failing write (disk full, file too large, I/O error) is a typed error naming OUT."""
    try:
        yield
    except OSError as exc:
        if exc.filename and TEMP_MARK not in Path(exc.filename).name:  # not ours: an input
            raise CorruptFileError(f"{exc.filename}: reading failed ({exc.strerror or exc}); nothing was left at {out}") from None
        if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS):
            raise OutputError(f"{out}: writing failed ({exc.strerror or exc}); nothing was left at OUT") from None
        raise OutputError(f"{out}: copying into OUT failed ({exc.strerror or exc}: a source or the destination); "
                          "nothing was left at OUT") from None


def _duplicate_aliases(plan: Plan) -> Plan:
    by_name = {t.name: t for t in plan.tensors}
    extra = tuple(TensorPlan(a, by_name[s].shape, by_name[s].src_dtype, by_name[s].dtype, by_name[s].kind,
                             by_name[s].pieces) for a, s in plan.aliases.items())
    meta = {k: v for k, v in plan.metadata.items() if k != M.ALIASES}
    return Plan(plan.tensors + extra, {}, meta)


def check_sources(plan: Plan) -> None:
    """The zip CRC-32 of every storage the plan reads from (raw copies bypass zipfile's own check)."""
    ranges: dict[Path, list[tuple[int, int]]] = {}
    for t in plan.tensors:
        for p in t.pieces:
            ranges.setdefault(p.path, []).append((p.offset, p.nbytes))
    for path, spans in ranges.items():
        check_storage_crcs(path, spans)


def verify_output(plan: Plan, out: Path, fmt: Format) -> None:
    """Re-read OUT through its format's reader and compare every tensor byte for byte with the plan's
    source pieces (tied aliases stored as views of one storage are compared once)."""
    expected = {t.name: t for t in plan.tensors}
    seen = set()
    with SourceFiles() as src:
        for stored in fmt.read(out).tensors:
            if stored.name in plan.aliases:
                continue
            if stored.name not in expected:
                raise VerificationError(f"{out}: unexpected tensor {stored.name!r}")
            data = read_range(stored.path, stored.offset, stored.span_bytes)
            if stored.stride is not None or data != read_tensor(src, expected[stored.name]):
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
