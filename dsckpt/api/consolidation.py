"""Consolidation API: ``consolidate`` writes files, ``load_state_dict`` / ``iter_state_dict`` return tensors.

``consolidate(ckpt, out, group=None)`` steps, the same on one process or every process of a torchrun run
(``api.frame``: each step ends with all processes agreeing):
1. pick OUT's format (``export.registry``: by name or suffix); the view of the checkpoint (``parallel.view``: the
   checkpoint itself for one process) opened (``zero.reader``);
2. build the plan (``plan.consolidate``) and let the format prepare it (``Format.prepare``: names,
   companions, checks that can fail - all before a byte is written);
3. check OUT (not an input, not existing unless ``force``);
4. write through the format into a temp path beside OUT (``_write``: several writers fill one safetensors file or
   deal a folder's shards out; the bytes a writer lacks are sent to it first), the client state beside a file
   OUT or inside a folder OUT; every storage read CRC-checked (``Frame.checked_reads``); with ``verify``, re-read
   and compared with the shards;
5. publish (``parallel.outputs.GroupStaging`` over ``io.output.Staging``); with ``fsync`` (the default) OUT is flushed
   before the rename and its folder after it.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator

from ..dtypes import output_dtype
from ..errors import OutputError, VerificationError
from ..export.registry import Format, Prepared, Request, companion_paths, for_output
from ..export.sidecar import sidecar_paths, write_sidecar
from ..formats.positional import read_range
from ..io.context import WriteContext
from ..io.output import check_output, write_errors
from ..io.read import Reader, check_plan, torch_state_dict
from ..parallel.group import ONE_PROCESS, Group
from ..parallel.readable import readable
from ..progress import Phase, Progress, begin
from .frame import destination, writing
from .options import DEFAULTS, WriteOptions
from ..parallel.outputs import GroupStaging, StorageGroups, storage_groups
from ..parallel.transfer import fetch, fetching, ranges_held_elsewhere
from ..parallel.view import View
from ..plan.consolidate import Plan, TensorPlan, build_plan, master_pieces
from ..plan.names import duplicate_aliases, prefixes, rename_rules, renamed
from ..plan.segments import read_pieces, tree_pieces
from ..zero.reader import Checkpoint, open_checkpoint

DEFAULT_SHARD = "5GB"


@dataclass(frozen=True)
class Result:
    """What ``consolidate`` wrote; the same names as ``dsckpt consolidate --json`` (docs/cli.md)."""
    out: Path
    format: str  # a registered format's name: "safetensors", "torch", "sharded", "hf", "peft", "lightning"
    tag: str
    tensors: int  # tensors written (tied aliases stored once count once)
    bytes: int  # of tensor data
    files: tuple[str, ...]  # every file written, final paths
    client_state: Path | None  # the client-state sidecar, when one was written
    verified: bool | None  # True when verify=True passed
    notes: tuple[str, ...] = ()  # worth telling the user (an unmatched --strip-prefix, how to load tied weights)


def parse_size(text: str | int) -> int:
    """``"5GB"``, ``"500MiB"``, or a number of bytes (as Hugging Face's ``max_shard_size`` takes it)."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 1:
            raise OutputError(f"max shard size {text!r}: expected a positive number of bytes")
        return text
    if not isinstance(text, str):
        raise OutputError(f"max shard size {text!r}: expected a size like 5GB or 500MiB, or a number of bytes")
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)\s*", text, re.I)
    if not m:
        raise OutputError(f"max shard size {text!r}: expected a size like 5GB or 500MiB")
    unit = m.group(2).upper().rstrip("B")
    scale = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}
    return int(float(m.group(1)) * scale[unit])


def consolidate(checkpoint: str | os.PathLike[str], out: str | os.PathLike[str], *, tag: str | None = None,
                dtype: str | None = None, exclude_frozen: bool = False, duplicate_tied: bool = False,
                strip_prefixes: str | tuple[str, ...] = (), rename: Any = (), max_shard_size: str | int = DEFAULT_SHARD,
                client_state: bool = True, verify: bool = False, form: str | None = None,
                config: str | os.PathLike[str] | None = None, base: str | os.PathLike[str] | None = None,
                options: WriteOptions = DEFAULTS) -> Result:
    """Gather a ZeRO 0-3 checkpoint's shards into one file or folder (what ``dsckpt consolidate`` does).

    Args:
        checkpoint: the checkpoint folder, a tag folder, or a rank file.
        out: the output; its suffix picks the format (``.safetensors``; ``.pt``/``.pth``/``.bin``; ``.ckpt``
            Lightning; no known suffix: a sharded folder) unless ``form`` names one.
        tag: default what ``latest`` names.
        dtype: cast floating-point tensors: ``"fp32"``, ``"bf16"``, ``"fp16"`` (or ``"bfloat16"``..., or a torch
            dtype); default the fp32 masters and buffers as stored.  Anything else: ``ConfigError``.
        exclude_frozen: leave frozen parameters out.
        duplicate_tied: write a tied weight under each of its names (safetensors stores it once by default).
        strip_prefixes: a name prefix (or several) to remove, e.g. ``"module."``.
        rename: ``{pattern: replacement}`` (or ``"PATTERN=REPLACEMENT"`` strings): each name the first pattern
            matches in full becomes the replacement (``\\1`` groups expand) - a pipeline run's ``3.up`` onto an
            HF architecture's ``model.layers.2.mlp.up_proj.weight``; applied after ``strip_prefixes``.
        max_shard_size: for folder outputs, e.g. ``"5GB"``, ``"500MiB"``, or a number of bytes.
        client_state: write the client state beside OUT (``OUT.client_state.json``) for formats that do not hold it.
        verify: re-read OUT and compare it byte for byte with the shards before publishing it.
        form: a registered format by name: ``"safetensors"``, ``"torch"``, ``"sharded"``, ``"hf"`` (a folder
            ``from_pretrained`` loads; ``config``: its ``config.json`` when none is beside the checkpoint),
            ``"peft"``, ``"lightning"``.
        base: with ``form="hf"`` and a PEFT (LoRA) run: the base model's folder or weights file; OUT is the base
            with the adapter merged in, as PEFT's ``merge_and_unload`` makes it (format ``"merged"``).
        options: ``WriteOptions`` - ``force`` (replace an existing OUT; in a folder only the files dsckpt
            writes), ``fsync``, ``trust`` (follow links out of the checkpoint, copy pickled objects of any class),
            ``check_crc``, ``group`` (the processes of a torchrun run: ``dsckpt.parallel.group.init_group()``;
            every process gets the same result or the same error), ``progress`` (``dsckpt.progress.Progress``:
            a bucket's ``FETCH``, then the ``WRITE`` of OUT's tensor bytes).

    Returns:
        ``Result``: ``out``, ``form``, ``tensors`` (count), ``bytes``, ``files`` written, ``client_state`` (the
        sidecar's path or None), ``verified``, ``notes``.

    Raises:
        a ``DsckptError`` subclass naming the file at fault; nothing is left at OUT.
    """
    group, force, trust = options.group or ONE_PROCESS, options.force, options.trust
    output_dtype(dtype)  # a dtype no output can have is refused before anything is read
    fmt = for_output(os.fspath(out), form)  # a name that contradicts the format is refused before anything is read
    if config is not None and not fmt.takes_config:
        raise OutputError(f"--config {config}: only the Hugging Face export (--hf) writes a config; "
                          f"this output is {fmt.name}", hint="add --hf, or leave --config out")
    if base is not None and fmt.name != "hf":
        raise OutputError(f"--base {base}: merging a PEFT run into its base model writes a Hugging Face folder; "
                          f"this output is {fmt.name}", hint="add --hf")
    request = Request(parse_size(max_shard_size), Path(config) if config is not None else None,
                      prefixes(strip_prefixes), duplicate_tied, trust, rename_rules(rename),
                      Path(base) if base is not None else None)
    with destination(group, out, force, stream=not verify) as place:  # (verify re-reads the staged file)
        out = place.path
        with writing(group, checkpoint, tag, place, trust) as frame:
            view = frame.view
            ckpt, prepared, notes = group.step(lambda: _prepare(view, fmt, dtype, exclude_frozen, request))
            fmt, plan = prepared.format, prepared.plan
            if verify and fmt.computes:
                raise OutputError(f"--verify compares OUT with the checkpoint's bytes; a {fmt.name} output holds "
                                  "values computed from them", hint="leave --verify out")
            inputs = [view.real_path(f.path) for f in ckpt.layout.all_files]
            write_client = bool(client_state and ckpt.client_state) and not fmt.stores_client_state
            tree = view.real_path(ckpt.layout.root)
            group.step(lambda: _check_out(out, inputs, force, fmt.directory, tree) if group.rank == 0 else None)
            sources = [p for t in plan.tensors for p in read_pieces(t)]
            sources += tree_pieces(ckpt.client_state) if write_client else []
            groups = storage_groups(group, out)
            staged = frame.stage(GroupStaging(group, groups, out, directory=fmt.directory, fsync=options.fsync,
                                              publishing={groups.of[0]}))
            with frame.checked_reads(sources, options.check_crc, plan.replicas, options.progress,
                                     master_pieces(plan)) as (context, crc_notes):
                names, mine = _write(group, groups, view, ckpt, prepared, staged, write_client, out, context,
                                     options.progress)
            notes += tuple(crc_notes)
            if verify:  # before the rename (a failed check leaves nothing at OUT); each writer reads back its own
                group.step(lambda: verify_output(plan, staged.tmp, fmt, {t.name for t in mine}) if mine else None)
            replaced = fmt.replaced_files(out) if group.rank == 0 else ()
            stale = [out / name for name in replaced if name not in names]
            if group.rank == 0 and not write_client:  # (with --force) an old sidecar would restore the wrong counters
                stale += [p for p in sidecar_paths(out, fmt.directory) if os.path.lexists(p)]
            with write_errors(out):
                staged.publish(stale)
        written = [out / name for name in names] if fmt.directory else [out]
        sidecars = tuple(p for p in sidecar_paths(out, fmt.directory) if p.exists()) if write_client else ()
        result = Result(out, fmt.name, ckpt.layout.tag, len(plan.tensors), plan.nbytes,
                        tuple(str(p) for p in written + list(sidecars)), sidecars[0] if sidecars else None,
                        True if verify else None, notes)
    return place.named(result)


def _prepare(view: View, fmt: Format, dtype: str | None, exclude_frozen: bool,
             request: Request) -> tuple[Checkpoint, Prepared, tuple[str, ...]]:
    """The checkpoint, the format's prepared plan and the notes: the same on every process."""
    ckpt = view.open(request.trust)
    if not view.direct:  # each host's survey refused links out of the checkpoint; the view's own links lead out
        request = replace(request, trust=True)
    with view.real_names():
        fmt = fmt.resolve(ckpt.layout.root, request)
        plan = build_plan(ckpt, dtype, exclude_frozen=exclude_frozen or fmt.exclude_frozen,
                          strip_prefixes=request.strip_prefixes)
        unmatched: list[str] = []
        if request.renames:
            plan, unmatched = renamed(plan, request.renames)
        if request.duplicate_tied and fmt.duplicates_tied:
            plan = duplicate_aliases(plan)
        prepared = fmt.prepare(ckpt, plan, request)
    notes = tuple(f"--rename {p!r} matched no tensor name" for p in unmatched)
    return ckpt, prepared, _notes(ckpt, prepared.plan, prepared.format, request.strip_prefixes) + notes + prepared.notes


def _check_out(out: Path, inputs: list[Path], force: bool, directory: bool, tree: Path) -> None:
    check_output(out, inputs, force, directory=directory, tree=tree)
    for path in () if directory else sidecar_paths(out):  # taken for OUT's client state: the same --force rule
        check_output(path, inputs, force)


def _write(group: Group, groups: StorageGroups, view: View, ckpt: Checkpoint, prepared: Prepared, staged: GroupStaging,
           write_client: bool, out: Path, context: WriteContext,
           progress: Progress | None) -> tuple[list[str], list[TensorPlan]]:
    """Write OUT's parts into ``staged.tmp``; the names written (the same on every process) and the tensors
    this process wrote.

    The writers are the processes of rank 0's storage group.  A format that splits, with several writers: each
    writes its share (``Format.share``/``begin``/``write_part``: a single ``.safetensors`` file filled in parts, a
    sharded folder's shards dealt out).  Any other format (``.pt``, ``--hf``, Lightning: their zip CRCs run in one
    order) and one process: rank 0 writes it whole.  Each writer first receives the source bytes it lacks
    (``transfer.fetch``: a bucket's bytes told to ``progress``; a checkpoint in a bucket written to one by a format
    that streams its tensors: while it writes, ``transfer.fetching``); rank 0 stages the client-state sidecar.
    """
    fmt, plan = prepared.format, prepared.plan
    writers = groups.members(groups.of[0])
    split = fmt.splits and len(writers) > 1
    part = (writers.index(group.rank), len(writers)) if group.rank in writers else None
    streamed = fmt.streams_tensors and context.stream_target(staged.tmp) is not None
    if split and part:
        mine = fmt.share(prepared, *part, streamed)
    else:
        mine = list(plan.tensors) if group.rank == 0 else []
    extra = companion_paths(prepared.companions) if group.rank == 0 else []
    clients = tree_pieces(ckpt.client_state) if group.rank == 0 else []
    tensors = [p for t in mine for p in read_pieces(t)]
    if streamed:
        # in object storage both ends: the tensors' bytes arrive while the first parts already go up
        fetch(group, view, ranges_held_elsewhere(view, clients, extra))
        begin(progress, Phase.WRITE, prepared.plan.nbytes)
        with fetching(group, view, ranges_held_elsewhere(view, tensors), context) as arriving:
            return _write_parts(group, groups, ckpt, prepared, staged, write_client, out, arriving, part), mine
    fetch(group, view, ranges_held_elsewhere(view, tensors + clients, extra), progress)
    begin(progress, Phase.WRITE, prepared.plan.nbytes)
    return _write_parts(group, groups, ckpt, prepared, staged, write_client, out, context, part), mine


def _write_parts(group: Group, groups: StorageGroups, ckpt: Checkpoint, prepared: Prepared, staged: GroupStaging,
                 write_client: bool, out: Path, context: WriteContext, part: tuple[int, int] | None) -> list[str]:
    """``_write``'s steps once the bytes are there (or arriving): OUT's files, then the client-state sidecar."""
    fmt = prepared.format
    split = fmt.splits and len(groups.members(groups.of[0])) > 1

    def run(step: Callable[[], Any]) -> Any:
        def guarded() -> Any:
            with write_errors(out):
                return step()
        return group.step(guarded)

    names: list[str]
    if split:
        begun = group.broadcast(run(lambda: fmt.begin(prepared, staged.tmp, context) if group.rank == 0 else None), 0)
        names = group.broadcast(run(lambda: fmt.write_part(prepared, staged.tmp, context, part, begun)
                                    if part else None), 0)
    else:
        names = group.broadcast(run(lambda: fmt.write(prepared, staged.tmp, context) if group.rank == 0 else None), 0)
    into = staged.tmp if fmt.directory else None  # a folder's client state goes inside it
    run(lambda: write_sidecar(ckpt.client_state, out, staged.own, context, into) if write_client and group.rank == 0
        else None)
    return names


def _notes(ckpt: Checkpoint, plan: Plan, fmt: Format, strip_prefixes: tuple[str, ...]) -> tuple[str, ...]:
    notes = []
    names = [n for n in ckpt.module] + list(ckpt.trainable) + list(ckpt.frozen)
    for prefix in strip_prefixes:
        if not any(n.startswith(prefix) for n in names):
            notes.append(f"--strip-prefix {prefix!r} matched no tensor name; nothing was stripped")
    if plan.aliases and not fmt.reties_aliases and not fmt.directory:  # (a folder's loader re-ties them itself)
        pairs = ", ".join(f"{a} = {s}" for a, s in list(plan.aliases.items())[:3])
        notes.append(f"tied weights are stored once ({pairs}): load with safetensors.torch.load_model(model, path) "
                     "(it re-ties them); a strict model.load_state_dict(load_file(path)) needs --duplicate-tied")
    return tuple(notes)


def verify_output(plan: Plan, out: Path, fmt: Format, only: set[str] | None = None) -> None:
    """Re-read OUT through its format's reader and compare every tensor (or those named in ``only``) byte for
    byte with the plan's source pieces (tied aliases stored as views of one storage are compared once)."""
    expected = {t.name: t for t in plan.tensors if only is None or t.name in only}
    others = {t.name for t in plan.tensors} - set(expected)  # another writer's
    seen = set()
    with Reader() as reader:
        for stored in fmt.read(out).tensors:
            if stored.name in plan.aliases or stored.name in others:
                continue
            if stored.name not in expected:
                raise VerificationError(f"unexpected tensor {stored.name!r}", at=out)
            data = read_range(stored.path, stored.offset, stored.span_bytes)
            if stored.stride is not None or data != reader.read(expected[stored.name]):
                raise VerificationError(f"tensor {stored.name!r} differs from the checkpoint", at=out)
            seen.add(stored.name)
    missing = set(expected) - seen
    if missing:
        raise VerificationError(f"{len(missing)} tensors missing, e.g. {sorted(missing)[0]!r}", at=out)


def load_state_dict(checkpoint: str | os.PathLike[str], tag: str | None = None, dtype: str | None = None,
                    exclude_frozen: bool = False, state: str = "fp32", check_crc: bool = True) -> dict[str, Any]:
    """The consolidated state dict as torch tensors in memory (tied names share one tensor).

    ``tag``: default what ``latest`` names.  ``dtype``: ``"fp32"``, ``"bf16"``, ``"fp16"`` (or a torch dtype) for
    floating-point tensors; None keeps the fp32 masters and the buffers' types.  ``exclude_frozen``: leave frozen
    parameters out.  ``state="exp_avg"`` / ``"exp_avg_sq"``: Adam's moments of the trainable parameters instead.
    Every storage read is checked against its CRC-32 first (``check_crc=False`` skips it).
    """
    with readable(checkpoint, tag) as source:  # (a URL: a local view, the plan's storages fetched)
        plan = build_plan(open_checkpoint(source.path, source.tag), dtype, exclude_frozen=exclude_frozen, state=state)
        source.fetch(p for t in plan.tensors for p in read_pieces(t))
        check_plan(plan, skip=not check_crc)
        return torch_state_dict(plan)


def iter_state_dict(checkpoint: str | os.PathLike[str], tag: str | None = None,
                    dtype: str | None = None, check_crc: bool = True) -> Iterator[tuple[str, Any]]:
    """Yield ``(name, tensor)``, one full consolidated tensor at a time, then each tied alias under its own name.

    Memory: the largest tensor.  ``tag``: default what ``latest`` names.  ``dtype``: ``"fp32"``, ``"bf16"``,
    ``"fp16"`` (or a torch dtype) for floating-point tensors; None keeps the fp32 masters and the buffers' types.
    Every storage read is checked against its CRC-32 first (``check_crc=False`` skips it).
    """
    with readable(checkpoint, tag) as source:
        plan = build_plan(open_checkpoint(source.path, source.tag), dtype)
        source.fetch(p for t in plan.tensors for p in read_pieces(t))
        check_plan(plan, skip=not check_crc)
        for t in plan.tensors:
            yield t.name, torch_state_dict(plan, only={t.name})[t.name]
        for alias, target in plan.aliases.items():
            yield alias, torch_state_dict(plan, only={target})[target]
