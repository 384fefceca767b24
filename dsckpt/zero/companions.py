"""Files that live beside a checkpoint's tag folders: what a trainer needs besides the rank files.

An HF Trainer's ``checkpoint-N`` holds ``trainer_state.json``, ``scheduler.pt``, ``training_args.bin``,
the model's config and tokenizer files and one ``rng_state_{rank}.pth`` per rank beside ``global_stepN/``
and ``latest``; Accelerate's ``save_state`` folder holds ``random_states_{rank}.pkl`` and its scheduler
and sampler files.  ``plan_companions`` says, without writing, how each is carried into a checkpoint
for another world size:

1. every regular file (and non-tag folder) at the root that is not ``latest`` or a tag is a companion;
2. per-rank files (``PER_RANK``) are renumbered for ranks 0..M-1: rank r takes source rank ``r % N``'s
   file (a rank beyond the old world size repeats an old rank's random stream; the note says which);
3. a file that holds a pickle is read with the allowlist reader; one naming a class beyond plain data,
   torch's, DeepSpeed's own and numpy's RNG records (``training_args.bin``: HF's ``TrainingArguments``)
   is left out with a note, since loading it without ``weights_only`` runs that class's code;
   ``trust`` carries it;
4. a symlink leading out of the checkpoint is refused (``trust``: followed).

The plan is ``Copy(source, name)`` records; ``resharder`` copies them into the output.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import DsckptError, UnsafeCheckpointError
from ..formats.pickle_tree import DATA_CLASSES, opaque_class_paths

# Per-rank files, by writer: (pattern with the rank as group "rank", the name at world size 1 or None).
PER_RANK = (
    # HF Trainer: rng_state_{process_index}.pth at world size > 1, rng_state.pth at world size 1
    (re.compile(r"^rng_state_(?P<rank>\d+)\.pth$"), "rng_state.pth", "rng_state_{rank}.pth"),
    # Accelerate's save_state: random_states_{process_index}.pkl at every world size
    (re.compile(r"^random_states_(?P<rank>\d+)\.pkl$"), None, "random_states_{rank}.pkl"),
)
PICKLE_START = b"\x80"  # PROTO opcode: a raw pickle (torch.save zips start with PK)


@dataclass(frozen=True)
class Copy:
    source: Path
    name: str  # path relative to the output root


def plan_companions(root: Path, tags: tuple[str, ...], source_world_size: int, world_size: int,
                    trust: bool = False, follow_links: bool = False) -> tuple[list[Copy], list[str]]:
    """What to copy from ``root`` into a checkpoint for ``world_size`` ranks, and notes for the user
    (``follow_links``: links were checked by the caller - the distributed run's view of other hosts' files)."""
    from .layout import LATEST_FILE, TRUST_HINT, inside

    copies: list[Copy] = []
    notes: list[str] = []
    per_rank: dict[int, dict[int, Path]] = {}
    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        path = Path(entry.path)
        if entry.name in tags or entry.name == LATEST_FILE or entry.name.startswith("."):
            continue
        if entry.is_symlink() and not (trust or follow_links) and not inside(path.resolve(), root):
            raise UnsafeCheckpointError(f"a symlink to {path.resolve()}, outside the checkpoint; not copied",
                                        hint=TRUST_HINT, at=path)
        rank_file = per_rank_file(entry.name)
        if rank_file is not None:
            per_rank.setdefault(rank_file[0], {})[rank_file[1]] = path
            continue
        files = [path] if not entry.is_dir() else sorted(
            Path(folder, f) for folder, _, names in os.walk(path) for f in names)  # (links inside: not followed)
        for file in files:
            name = file.relative_to(root).as_posix()
            why = None if trust else _foreign_pickle(file)
            if why:
                notes.append(f"{name} left out: {why} (--trust-checkpoint carries it)")
            elif file.is_file():
                copies.append(Copy(file, name))
    for index, by_rank in per_rank.items():
        found, note = _renumber(index, by_rank, source_world_size, world_size, trust)
        copies += found
        notes += note
    return copies, notes


def per_rank_file(name: str) -> tuple[int, int] | None:
    """(pattern index, rank) of a per-rank file name; rank 0 for HF's world-size-1 name."""
    for i, (pattern, single, _) in enumerate(PER_RANK):
        if name == single:
            return i, 0
        match = pattern.match(name)
        if match:
            return i, int(match.group("rank"))
    return None


def _renumber(index: int, by_rank: dict[int, Path], source_ws: int, world_size: int,
              trust: bool) -> tuple[list[Copy], list[str]]:
    _, single, numbered = PER_RANK[index]
    have = sorted(by_rank)
    for rank, path in by_rank.items():
        why = None if trust else _foreign_pickle(path)
        if why:
            return [], [f"{path.name} (one per rank) left out: {why} (--trust-checkpoint carries them)"]
    copies, reused = [], []
    for rank in range(world_size):
        source_rank = rank if rank in by_rank else have[rank % len(have)]
        if source_rank != rank:
            reused.append(f"{rank} <- {source_rank}")
        name = single if world_size == 1 and single else numbered.format(rank=rank)
        copies.append(Copy(by_rank[source_rank], name))
    kind = numbered.format(rank="{rank}")
    notes = [f"{kind}: ranks {', '.join(reused)} took an old rank's file (their random streams repeat that "
             "rank's)"] if reused else []
    dropped = [r for r in have if r >= world_size]
    if dropped:
        notes.append(f"{kind}: the files of old ranks {', '.join(map(str, dropped))} are not carried "
                     f"(the new world size is {world_size})")
    if len(have) != source_ws:
        notes.append(f"{kind}: {len(have)} files for {source_ws} source ranks")
    return copies, notes


def _foreign_pickle(path: Path) -> str | None:
    """Why ``path`` may not be carried (it pickles a class beyond the allowed ones), or None."""
    with open(path, "rb") as fh:
        head = fh.read(2)
    if head[:2] != b"PK" and head[:1] != PICKLE_START:
        return None  # JSON, text, a tokenizer model: data, copied as it is
    try:
        classes = _pickle_classes(path, zipped=head[:2] == b"PK")
    except DsckptError as exc:
        return f"not readable as a pickle ({exc})"
    foreign = sorted(classes - set(DATA_CLASSES))
    if foreign:
        return f"it holds objects of {', '.join(foreign[:3])}, whose pickle code would run when loaded"
    return None


def _pickle_classes(path: Path, zipped: bool) -> set[str]:
    from ..limits import check
    from ..formats.pickle_policy import unpickle
    from ..formats.torchzip import TorchFile

    if zipped:
        return opaque_class_paths(TorchFile(path).obj)
    check("MAX_PICKLE_BYTES", path.stat().st_size, str(path), "the pickle's size")
    try:
        return opaque_class_paths(unpickle(path.read_bytes(), None))
    except Exception as exc:  # a hostile or broken pickle: every failure is a format error
        from ..errors import CorruptFileError

        raise CorruptFileError(f"{type(exc).__name__}: {exc}"[:300], at=path) from None


TRAINER_STATE = "trainer_state.json"  # an HF Trainer's checkpoint-N: global_step, epoch, log_history


def trainer_summary(root: Path) -> dict[str, Any] | None:
    """``trainer_state.json``'s global step, epoch and last logged loss, if the folder has one."""
    from ..formats.json_file import read_json_object

    path = Path(root) / TRAINER_STATE
    if not path.is_file():
        return None
    try:
        state = read_json_object(path, "JSON file")
    except DsckptError:
        return {"error": f"{path.name} is not readable JSON"}
    losses = [e["loss"] for e in state.get("log_history") or []
              if isinstance(e, dict) and isinstance(e.get("loss"), (int, float))]
    return {"global_step": state.get("global_step"), "epoch": state.get("epoch"),
            "last_loss": losses[-1] if losses else None, "max_steps": state.get("max_steps")}
