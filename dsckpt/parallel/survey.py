"""What one process sees of a checkpoint folder, and the one rule for what a run refuses in it.

``survey`` lists the regular files in CKPT and one folder down (the tag folders; a ZeRO-Infinity tag's swap files
too) with their sizes, and what is wrong where (a symlink leading out of CKPT, unless trusted; a rank file's name
on something else).
``choose_tag`` is ``zero.layout.discover``'s choice over such a listing (``tag``, else what `latest` names, else
the only tag folder), refused in its words; ``met`` says which problems a run meets: those one process reading
alone would (a top-level file, the chosen tag folder, a rank file in it), so a distributed run or a bucket refuses
exactly what one process refuses, in the same words (``zero.layout.leads_out``).
"""
from __future__ import annotations

import copy
import os
import re
from pathlib import Path

from ..errors import CheckpointNotFoundError, DsckptError, TagError
from ..zero import layout as L
from ..zero.offloaded import OFFLOADED_DIR

Problem = DsckptError  # what is wrong at a path, found by a survey, raised where a process reading alone meets it


def survey(ckpt: Path, trust: bool) -> tuple[dict[str, int], dict[str, Problem]]:
    """Relative path -> size of the regular files seen here (top level and one folder down); relative path ->
    what is wrong there (a top-level folder's key ends in "/")."""
    seen: dict[str, int] = {}
    problems: dict[str, Problem] = {}
    if not ckpt.is_dir():
        return seen, problems
    root = ckpt.resolve()
    for entry in sorted(os.scandir(ckpt), key=lambda e: e.name):
        if entry.name.startswith("."):
            continue
        problem = _link_problem(Path(entry.path), root, ckpt, trust)
        if problem:
            problems[entry.name + ("/" if entry.is_dir() else "")] = problem
            continue
        inner = sorted(os.scandir(entry.path), key=lambda e: e.name) if entry.is_dir() else [entry]
        inner += [e for d in inner if d.name == OFFLOADED_DIR and d.is_dir() for e in _swap_files(Path(d.path))]
        for item in inner:
            path = Path(item.path)
            rel = path.relative_to(ckpt).as_posix()
            problem = _link_problem(path, root, ckpt, trust) or _rank_file_problem(path)
            if problem:
                problems[rel] = problem
            elif item.is_file() and not item.name.startswith("."):
                seen[rel] = item.stat().st_size
    return seen, problems


def _swap_files(folder: Path) -> "list[os.DirEntry[str]]":
    """A ZeRO-Infinity tag's ``offloaded_tensors/rankNN/*`` (two levels further down than the rank files)."""
    ranks = sorted((e for e in os.scandir(folder) if e.is_dir(follow_symlinks=False)), key=lambda e: e.name)
    return [f for r in ranks for f in sorted(os.scandir(r.path), key=lambda e: e.name)]


def met(rel: str, chosen: str | None) -> bool:
    """Whether one process reading CKPT alone meets what is at ``rel`` (a ``survey`` key): a top-level file, the
    chosen tag folder, a rank file in it (``zero.layout``'s checks; no command reads another file there)."""
    top, folder, name = rel.partition("/")
    return not folder or (top == chosen or chosen is None) and (not name or bool(L.RANK_FILE_RE.match(name)))


def refuse(problems: list[Problem]) -> None:
    for problem in problems[:1]:
        raise copy.copy(problem)


def _rank_file_problem(path: Path) -> Problem | None:
    """A rank file's name on something else (a folder, a FIFO, a loop): in ``zero.layout``'s words."""
    kind = L.file_kind(path) if L.RANK_FILE_RE.match(path.name) else None
    return CheckpointNotFoundError(f"expected a rank file, found {kind}", at=path) if kind else None


def _link_problem(path: Path, root: Path, ckpt: Path, trust: bool) -> Problem | None:
    """A symlink leading out of CKPT (unless ``trust``); a loop or a dangling link is left to the reader's words."""
    if not path.is_symlink() or L.file_kind(path) not in (None, "a directory"):
        return None
    if not trust and not L.inside(path.resolve(), root):
        return L.leads_out(path, ckpt)
    return None


def choose_tag(files: dict[str, int], tag: str | None, latest: str | None, ckpt: Path | str) -> str | None:
    """The tag ``zero.layout.discover`` would choose over these files, refused in its words (one process or many)."""
    if any(L.RANK_FILE_RE.match(rel) for rel in files):  # rank files at the top: CKPT is a tag folder
        return None
    tags = sorted({rel.split("/")[0] for rel in files if "/" in rel and L.RANK_FILE_RE.match(rel.split("/")[1])},
                  key=lambda s: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)])
    latest = latest.strip() if latest else None
    if not tag and latest and latest not in tags:
        raise L.stale_latest(ckpt, latest) if len(tags) == 1 else L.several_tags(ckpt, tags)
    chosen = tag or latest or (tags[0] if len(tags) == 1 else None)
    if chosen is None and len(tags) > 1:
        raise L.several_tags(ckpt, tags)
    if chosen is None or chosen not in tags:
        raise TagError(f"{'tag ' + repr(chosen) + ' not found' if chosen else 'no tags'}; tags present: "
                       f"{', '.join(tags) or 'none'}", hint="--tag TAG names one", at=ckpt)
    return chosen
