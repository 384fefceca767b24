"""``list_checkpoints(root)`` and ``prune(root, keep)``: the checkpoints a training run has saved, and room made.

A run's ROOT is either a DeepSpeed save folder (``latest`` + one folder per tag) or a Hugging Face Trainer's
``output_dir`` (``checkpoint-N/`` folders, each a DeepSpeed save folder with its own ``latest``).  Steps:
1. the entries: each tag (DeepSpeed) or each ``checkpoint-N`` (HF), in step order - the step the model states
   record (``global_steps``), else the number in the name;
2. each entry's facts from metadata alone (no CRC read: ``dsckpt verify`` does that): ZeRO stage, world size,
   bytes on disk, complete (every rank file the world size needs present and parseable) or not, and whether it is
   the one a resume would pick - the tag ``latest`` names, or the newest ``checkpoint-N``;
3. ``prune``: the complete entries older than the newest ``keep`` go, oldest first; the one a resume picks, an
   incomplete entry, and anything newer than it never do;
4. leftovers of saves that never completed are entries too (``leftover``): a background or blocking save's hidden
   staging folder (``.<tag>.dsckpt-tmp-<pid>-<id>``), an HF Trainer's pending checkpoint, an older dsckpt's
   ``<tag>/.dsckpt-saving``.  One whose process is gone is an "interrupted save" that ``prune`` removes; one whose
   process still runs on this host is a "save in progress", never touched.
"""
from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..errors import CheckpointNotFoundError, DsckptError, OutputError
from ..zero import layout as L
from ..zero.reader import open_checkpoint

HF_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


@dataclass
class Entry:
    path: str  # what prune removes: the tag folder, or the HF checkpoint-N folder
    tag: str
    step: int | None
    zero_stage: int | None
    world_size: int | None
    bytes: int
    complete: bool
    resumes_from: bool  # the one `latest` names (the newest checkpoint-N for an HF output_dir)
    problems: list[str] = field(default_factory=list)
    name: str = ""  # what the other commands take: the tag, or an HF output_dir's checkpoint-N
    leftover: str | None = None  # INTERRUPTED or IN_PROGRESS: a save that is not (yet) a checkpoint
    finite: bool | None = None  # its fp32 masters all finite (checked by a prune that keeps finite ones; else None)


INTERRUPTED, IN_PROGRESS = "interrupted save", "save in progress"
LEGACY_STAGING = ".dsckpt-saving"  # an older dsckpt's per-rank staging folder, inside the tag folder


def _local(root: str | os.PathLike[str], verb: str) -> Path:
    from ..formats.storage import local_only

    return local_only(root, OutputError(f"{verb} works on a local folder of runs",
                                        hint="for a bucket's tags: `dsckpt inspect URL` lists them, "
                                             "`dsckpt verify URL --all-tags` checks each", at=root))


def list_checkpoints(root: str | os.PathLike[str]) -> list[Entry]:
    """Every checkpoint under ``root`` (a DeepSpeed save folder or an HF ``output_dir``), oldest first."""
    root = _local(root, "list")
    if not root.is_dir():
        raise CheckpointNotFoundError("not a folder", hint="pass the folder a run saves into", at=root)
    numbered = {p: int(m.group(1)) for p in root.iterdir() if p.is_dir()
                for m in [HF_CHECKPOINT.match(p.name)] if m is not None and L.list_tags(p)}
    hf = sorted(numbered, key=lambda p: numbered[p])
    if hf:
        entries = [_entry(p, _only_tag(p), p, numbered[p]) for p in hf]
        for e, p in zip(entries, hf):
            e.name = p.name
        entries[-1].resumes_from = True  # transformers' get_last_checkpoint: the highest N
    else:
        tags = L.list_tags(root)
        if not tags and _leftovers(root, []):
            return _leftovers(root, [])
        if not tags:
            runs = L.checkpoints_below(root)
            raise CheckpointNotFoundError(
                f"{root}: no DeepSpeed tag folders and no checkpoint-N folders"
                + (f"; it holds the runs {', '.join(runs[:8])}{' ...' if len(runs) > 8 else ''}" if runs else ""),
                hint=f"list one run at a time, e.g. `dsckpt list {root / runs[0]}`" if runs else None)
        latest = _latest(root)
        entries = [_entry(root, tag, root / tag, None) for tag in tags]
        for e in entries:
            e.resumes_from = e.tag == latest
    entries = sorted(entries, key=lambda e: (e.step is None, e.step if e.step is not None else 0, e.tag))
    return entries + _leftovers(root, hf or [Path(e.path) for e in entries])


def _leftovers(root: Path, checkpoints: list[Path]) -> list[Entry]:
    """Saves that never completed, in ``root``, in an HF output_dir's pending folder, and inside the tag folders."""
    from ..formats.storage import TEMP_MARK
    from ..io.output import dead_temps

    dead = set(dead_temps(root))
    found = [(Path(e.path), Path(e.path) in dead) for e in os.scandir(root)
             if e.name.startswith(".") and TEMP_MARK in e.name and e.is_dir(follow_symlinks=False)]
    for pending in [p for p, _ in found if p.name.startswith(".dsckpt-pending")]:
        gone = pending in dead
        found += [(p, gone) for p in pending.iterdir() if p.is_dir()]
        found += [(p, True) for p in dead_temps(pending)]  # (a tag staged inside an HF checkpoint being written)
    for folder in checkpoints:
        legacy = [*folder.glob(LEGACY_STAGING), *folder.glob(f"*/{LEGACY_STAGING}")]  # (a tag; an HF checkpoint's)
        found += [(p, True) for p in dead_temps(folder) + legacy]
    entries = []
    for path, gone in sorted(set(found)):
        if path.name.startswith(".dsckpt-pending") and any(p.parent == path for p, _ in found):
            continue  # (its checkpoints are listed one by one)
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())
        name = path.relative_to(root).as_posix()
        entries.append(Entry(str(path), name, None, None, None, size, False, False, name=name,
                             leftover=INTERRUPTED if gone else IN_PROGRESS))
    return entries


def list_tags(root: str | os.PathLike[str]) -> list[Entry]:
    """``dsckpt.list_tags(root)``: every checkpoint a run saved under ``root`` (a DeepSpeed save folder or an HF
    Trainer ``output_dir``), oldest first, as the ``Entry`` rows ``dsckpt list`` prints: path, tag, step, ZeRO stage,
    world size, bytes, complete, whether a resume picks it, problems, and what interrupted saves left
    (``leftover``).  The newest complete one a resume script wants is ``[e for e in rows if e.complete][-1]``."""
    return list_checkpoints(root)


def prune(root: str | os.PathLike[str], keep: int, dry_run: bool = False,
          finite: Callable[[Entry], bool] | None = None) -> tuple[list[Entry], list[Entry]]:
    """Remove all but the newest ``keep`` complete checkpoints (see the module docstring); (removed, kept).
    ``finite``: whether an entry's fp32 masters are finite - then the ``keep`` newest *finite* ones are kept (and
    every newer one), so that a run gone to NaN never loses its last good checkpoints (``Entry.finite`` says)."""
    if type(keep) is not int or keep < 1:
        raise ValueError(f"keep={keep!r}: at least 1")
    _local(root, "prune")
    everything = list_checkpoints(root)
    entries = [e for e in everything if e.leftover is None]
    resumed = next((i for i, e in enumerate(entries) if e.resumes_from), len(entries) - 1)
    candidates = [e for e in entries[:resumed] if e.complete]  # older than the one a resume picks
    complete = [e for e in entries if e.complete]
    newest_kept = {id(e) for e in complete[-keep:]}
    if finite is not None:
        newest_kept, good = set(), 0
        for e in reversed(complete):  # newest first, until `keep` finite ones are kept (checked only that far)
            if good == keep:
                break
            newest_kept.add(id(e))
            e.finite = finite(e)
            good += e.finite
    removed = [e for e in candidates if id(e) not in newest_kept]
    removed += [e for e in everything if e.leftover == INTERRUPTED]
    entries = everything
    if not dry_run:
        for e in removed:
            shutil.rmtree(e.path, ignore_errors=e.leftover is not None)
    return removed, [e for e in entries if e not in removed]


def _entry(root: Path, tag: str, path: Path, hf_step: int | None) -> Entry:
    size = sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file() and not f.is_symlink())
    entry = Entry(str(path), tag, hf_step, None, None, size, False, False, name=tag)
    try:
        ckpt = open_checkpoint(root, tag)
    except DsckptError as exc:
        entry.problems.append(str(exc))
        entry.step = entry.step if entry.step is not None else _number(tag)
        return entry
    entry.zero_stage, entry.world_size = ckpt.zero_stage, ckpt.world_size
    entry.problems = [str(p) for p in ckpt.problems]
    entry.complete = not ckpt.problems
    if entry.step is None:
        entry.step = ckpt.global_steps if isinstance(ckpt.global_steps, int) else _number(tag)
    return entry


def _only_tag(folder: Path) -> str:
    return _latest(folder) or L.list_tags(folder)[-1]


def latest_problem(root: str | os.PathLike[str]) -> str | None:
    """What is wrong with a save folder's `latest` (unreadable, or naming no tag folder); None when nothing is, or
    for an HF output_dir (each checkpoint-N has its own)."""
    folder = Path(root)
    if not L.list_tags(folder):
        return None
    try:
        latest = L.read_latest(folder)
    except DsckptError as exc:
        return str(exc)
    return str(L.stale_latest(folder, latest)) if latest is not None and latest not in L.list_tags(folder) else None


def _latest(root: Path) -> str | None:
    try:
        return L.read_latest(root)
    except DsckptError:
        return None


def _number(name: str) -> int | None:
    found = re.findall(r"\d+", name)
    return int(found[-1]) if found else None
