"""What ``zero.reader`` checks across a tag's rank files: each finding a ``Problem`` (collected, so ``inspect`` lists
them all; ``Checkpoint.require_complete`` raises the first)."""
from __future__ import annotations

from typing import Any, Callable, Iterator

from . import layout as L
from ..errors import DsckptError, InconsistentCheckpointError, MissingRankError
from ..formats.torchzip import TorchFile
from ..limits import limit


Problem = DsckptError  # found, not raised: ``inspect`` lists them, ``Checkpoint.require_complete`` raises the first


def short(value: Any) -> str:
    """A value for a message: huge ints by size (str() of them is refused beyond 4300 digits)."""
    if isinstance(value, int) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    return f"{value!r:.80}"


def check_same_run(model_files: list[TorchFile], optim_files: list[TorchFile], world: int,
                    problems: list[Problem], expert_groups: dict[int, int] | None = None) -> None:
    """Rank files of another run (another world size) mixed into this tag."""
    for f in model_files[1:]:
        other = f.obj.get(L.DP_WORLD_SIZE) if isinstance(f.obj, dict) else None
        if other != world:
            problems.append(InconsistentCheckpointError(f"records world size {short(other)}, rank 0's model states "
                                                        f"{world}", at=f.path))
    for f in optim_files:
        osd = f.obj.get(L.OPTIMIZER_STATE_DICT) if isinstance(f.obj, dict) else None
        count = osd.get(L.PARTITION_COUNT) if isinstance(osd, dict) else None
        counts = count if isinstance(count, list) else [count]
        expected = [world // (expert_groups or {}).get(g, 1) for g in range(len(counts))]  # experts: W / ep_size
        if counts != expected:
            problems.append(InconsistentCheckpointError(f"partition count {short(count)} differs from world size "
                                                        f"{world}", at=f.path))


def check_ranks(lay: L.Layout, stage: int, world: int, problems: list[Problem], optimizer: bool = True) -> None:
    """Missing and extra rank files; a run of many is one problem (a world size of 10**7 is not 10**7 lines)."""
    expected = range(world)
    groups = [("optimizer", lay.optim_files)] if stage and optimizer else []
    if stage == 3:
        groups.append(("model", lay.model_files))
    for kind, files in groups:
        ranks = {f.dp_rank for f in files}
        missing = (r for r in expected if r not in ranks)  # lazy: world sizes are bounded, still large
        extra = sorted((r for r in ranks if r is None or r >= world), key=str)
        summarized(problems, MissingRankError, missing, world - len(ranks - set(extra)), lay.tag_dir,
                   lambda r: f"{kind}-states file of rank {r} is missing (the checkpoint records world size {world})")
        summarized(problems, InconsistentCheckpointError, iter(extra), len(extra), lay.tag_dir,
                   lambda r: f"extra {kind}-states file for rank {r}, beyond world size {world}")


def summarized(problems: list[Problem], error: type[DsckptError], items: Iterator[Any], count: int, at: object,
               message: Callable[[Any], str]) -> None:
    """One problem per item up to MAX_LISTED_PROBLEMS, then one line for the rest."""
    listed = limit("MAX_LISTED_PROBLEMS")
    for i, item in enumerate(items):
        if i == listed:
            problems.append(error(f"... and {count - listed:,} more like the above"))
            return
        problems.append(error(message(item), at=at))
