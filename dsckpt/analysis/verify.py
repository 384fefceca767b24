"""`dsckpt verify`: what an operator runs before deleting the originals - is every tag whole, undamaged, finite and
resumable?

Steps, per tag (``--tag T``, ``latest``'s by default, every tag with ``all_tags``):
1. the layout and the typed model (``zero.reader``): every problem it records - missing or extra rank files, files
   of two runs mixed, partition counts that disagree with the world size - and the files that world size needs;
   then the rank files' steps (``cross-rank``): every model-states file's ``global_steps`` and ``skipped_steps``, and
   each group's optimizer step in every optimizer-states file, the same (files of two saves mixed in one tag);
2. the plans a consolidation builds for the weights and for each optimizer moment (``plan.consolidate``): shapes
   and partition sizes consistent across the ranks;
3. every storage of every rank file against its zip CRC-32, each failure listed (``io.integrity``);
4. finiteness of the fp32 masters, frozen parameters and buffers, and of the optimizer's moments (``stats``);
5. the files beside the tags a trainer needs to resume from the folder: an HF Trainer's ``trainer_state.json`` and
   one ``rng_state_{rank}.pth`` per rank, an Accelerate folder's ``random_states_0.pkl``, a Lightning run's loop
   state in the client state.
A finding is a problem (exit 1); a checkpoint that cannot be read at all is an error (exit 2).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, cast
from pathlib import Path

from ..errors import DsckptError
from ..plan.segments import Segment
from ..formats.torchzip import StorageIndex
from ..io.integrity import crc_failures
from ..plan.consolidate import build_plan
from ..progress import Phase, Progress, advancing, begin
from ..zero.companions import TRAINER_STATE
from ..zero.offloaded import OFFLOADED_DIR, offloaded_files
from ..zero.reader import Checkpoint, open_checkpoint
from .sources import Source
from .stats import compute_stats

HF_CHECKPOINT_DIR = re.compile(r"^checkpoint-\d+$")
ACCELERATE_TAG = "pytorch_model"  # the tag Accelerate's save_state gives DeepSpeed
LIGHTNING_LOOP_KEYS = ("epoch", "global_step", "loops")  # what Trainer.fit(ckpt_path=) restores from


@dataclass
class TagReport:
    tag: str
    zero_stage: int | None = None
    world_size: int | None = None
    files: list[str] = field(default_factory=list)  # the tag's files read, relative to the checkpoint folder
    swap_files: list[str] = field(default_factory=list)  # ZeRO-Infinity's offloaded_tensors/, the same way
    storages_checked: int = 0
    tensors_checked: int = 0
    problems: list[dict[str, str]] = field(default_factory=list)  # {"check", "message"}
    notes: list[str] = field(default_factory=list)  # worth telling, not wrong (a tag folder linked from elsewhere)

    def add(self, check: str, message: str) -> None:
        self.problems.append({"check": check, "message": message})


def verify(path: str | Path, tag: str | None = None, all_tags: bool = False,
           progress: Progress | None = None) -> list[TagReport]:
    """``dsckpt verify``: one ``TagReport`` per tag - ``tag``'s, what ``latest`` names, or every one with
    ``all_tags`` - listing the problems found by each check (``structure``, ``crc``, ``finite``, ``companions``,
    each described at the top of this module).  An empty ``problems`` list everywhere means the checkpoint is whole, undamaged,
    finite and resumable.  Raises a ``DsckptError`` only when nothing can be read at ``path``.  ``progress``
    (``dsckpt.progress``): a bucket's ``FETCH``, then a ``VERIFY`` of the bytes of each storage CRC-checked.
    """
    from ..parallel.readable import readable

    # (a bucket: a local view of it, every byte fetched - the checks read them all)
    with readable(path, tag, whole=True, every_tag=all_tags, check=False, progress=progress) as opened:
        reports = _verify_local(Path(opened.path), opened.tag, all_tags, progress)
        return [TagReport(**opened.alias.renamed(vars(report))) for report in reports]


def _verify_local(path: Path, tag: str | None, all_tags: bool, progress: Progress | None) -> list[TagReport]:
    from ..api.catalog import latest_problem
    from ..zero import layout as L

    if all_tags and tag is None and path.is_dir() and L.list_tags(path):  # every tag by name: `latest` not needed
        begin(progress, Phase.VERIFY, None)
        reports = [_verify_tag(path, t, None, advancing(progress)) for t in L.list_tags(path)]
        broken = latest_problem(path)
        return ([TagReport(L.LATEST_FILE, problems=[{"check": "structure", "message": broken}])] if broken else []) \
            + reports
    first = open_checkpoint(path, tag)  # a path that is no checkpoint at all: the typed error, exit 2
    tags = first.layout.tags if all_tags else (first.layout.tag,)
    begin(progress, Phase.VERIFY, None)
    return [_verify_tag(path, t, first if t == first.layout.tag else None, advancing(progress)) for t in tags]


def _verify_tag(path: Path, tag: str, ckpt: Checkpoint | None, progress: Callable[[int], None] | None) -> TagReport:
    report = TagReport(tag)
    try:
        ckpt = ckpt or open_checkpoint(path, tag)
    except DsckptError as exc:
        report.add("structure", str(exc))
        return report
    report.zero_stage, report.world_size = ckpt.zero_stage, ckpt.world_size
    report.notes = list(ckpt.layout.notes)
    files = [f.path for f in ckpt.layout.all_files] + list(ckpt.layout.expert_files) + list(ckpt.layout.pipeline_files)
    swap_files = offloaded_files(ckpt.layout.tag_dir)
    report.files = [_relative(p, ckpt.layout.root) for p in files]
    report.swap_files = [_relative(p, ckpt.layout.root) for p in swap_files]
    if swap_files:
        report.notes.append(f"{len(swap_files)} NVMe swap files ({OFFLOADED_DIR}/): sizes checked against the "
                            "partition plan and values for finiteness; DeepSpeed records no checksum for them")
    for problem in ckpt.problems:  # step 1
        report.add("structure", str(problem))
    if not ckpt.problems:
        for message in _step_disagreements(ckpt):
            report.add("cross-rank", message)
    sources = _planned_sources(ckpt, report) if not ckpt.problems else []  # step 2
    try:
        failures = crc_failures(files, progress)  # step 3
    except DsckptError as exc:  # a rank file that is no zip at all (one still being written): this tag's problem
        if str(exc) not in (p["message"] for p in report.problems):
            report.add("structure", str(exc))
        return report
    parsed = [f for leaf in ckpt.leaves for f in leaf.model_files + leaf.optim_files]
    report.storages_checked = sum(len(ckpt_file.storages) for ckpt_file in parsed) + _layer_storages(ckpt)
    for failure in failures:
        report.add("crc", str(failure))
    if sources and not failures:  # step 4 (damaged bytes say nothing about finiteness)
        stats = compute_stats(sources)
        report.tensors_checked = len(stats)
        for s in stats:
            if not s.finite:
                report.add("finite", f"{s.name}: {s.nan:,} NaN, {s.inf:,} Inf of {s.count:,} values")
    for message in _companion_problems(ckpt):  # step 5
        report.add("companions", message)
    return report


def _step_disagreements(ckpt: Checkpoint) -> list[str]:
    """Rank files whose recorded steps differ from the first file's (each leaf: a TP or pipeline slice on its own)."""
    from ..formats.pickle_policy import TensorRef
    from ..formats.torchzip import read_tensor_bytes
    from ..zero.optim_state import rank_states

    found: list[str] = []

    def differs(what: str, values: list[tuple[Path, object]]) -> None:
        first_path, first = values[0] if values else (None, None)
        for path, value in values[1:]:
            if value != first:
                found.append(f"{_relative(path, ckpt.layout.root)} records {what} {value}, "
                             f"{_relative(first_path, ckpt.layout.root)} {first}")  # type: ignore[arg-type]
                return

    def number(value: object) -> object:
        if isinstance(value, TensorRef):
            import numpy as np

            from ..dtypes import numpy_dtype
            raw = np.frombuffer(bytes(read_tensor_bytes(value)), dtype=numpy_dtype(value.storage.dtype))
            return raw.item() if raw.size == 1 else tuple(raw.tolist())
        return value

    for leaf in ckpt.leaves:
        models = [f for f in leaf.model_files if isinstance(f.obj, dict)]
        for key in ("global_steps", "skipped_steps"):
            differs(key, [(f.path, f.obj.get(key)) for f in models])
        try:
            states = rank_states(leaf)
        except DsckptError:
            continue  # (the plans of step 2 report a structure they cannot read)
        for g in range(min((len(s.groups) for s in states), default=0)):
            differs(f"group {g}'s optimizer step",
                    [(s.path, number(s.groups[g].step)) for s in states])
    return found


def _layer_storages(ckpt: Checkpoint) -> int:
    """Storages in a pipeline run's layer files (an unreadable one is reported by the structure check)."""
    count = 0
    for path in ckpt.layout.pipeline_files:
        try:
            count += len(StorageIndex(path).storages)
        except DsckptError:
            pass
    return count


def _planned_sources(ckpt: Checkpoint, report: TagReport) -> list[Source]:
    try:
        states = ("fp32",) + (ckpt.optimizer_state_keys() if not ckpt.universal else ())
    except DsckptError as exc:
        report.add("structure", f"optimizer state: {exc}")
        states = ("fp32",)
    out = []
    for state in states:
        try:
            plan = build_plan(ckpt, state=state)
        except DsckptError as exc:
            report.add("structure", f"{state}: {exc}")
            continue
        prefix = "" if state == "fp32" else f"{state}/"
        out += [Source(prefix + t.name, t.kind if state == "fp32" else state, t.src_dtype, t.shape,
                       cast("tuple[Segment, ...]", t.pieces))  # (a whole tensor: its bytes, never padding)
                for t in plan.tensors if state == "fp32" or t.kind == "param"]
    return out


def _companion_problems(ckpt: Checkpoint) -> list[str]:
    root, world = ckpt.layout.root, ckpt.world_size
    names = {p.name for p in root.iterdir()} if root.is_dir() else set()
    out = []
    hf = TRAINER_STATE in names or HF_CHECKPOINT_DIR.match(root.name)
    if hf:
        if TRAINER_STATE not in names:
            out.append(f"{root}: no {TRAINER_STATE}; Trainer.train(resume_from_checkpoint=) reads it")
        wanted = ["rng_state.pth"] if world == 1 else [f"rng_state_{r}.pth" for r in range(world)]
        missing = [n for n in wanted if n not in names]
        if missing:
            out.append(f"{root}: {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''} missing; the Trainer "
                       "resumes those ranks with fresh random states (not the uninterrupted run's)")
    if ckpt.layout.tag == ACCELERATE_TAG and any(n.startswith("random_states_") for n in names) \
            and "random_states_0.pkl" not in names:
        out.append(f"{root}: no random_states_0.pkl; Accelerate's load_state restores the random states from it")
    client = ckpt.client_state or {}
    if "pytorch-lightning_version" in client:
        missing = [k for k in LIGHTNING_LOOP_KEYS if k not in client]
        if missing:
            out.append(f"{ckpt.layout.tag_dir}: a Lightning checkpoint without {', '.join(missing)} in its client "
                       "state; Trainer.fit(ckpt_path=) cannot restore the loop")
    if ckpt.layout.latest is None and not (ckpt.layout.root / "latest").exists():  # (a broken one: a layout note)
        out.append(f"{root}: no `latest` file; DeepSpeed's load_checkpoint(DIR) needs it, or an explicit tag")
    return out


def _relative(path: Path, root: Path) -> str:
    """A file's name as the user sees it under the checkpoint they named (the same for a bucket's local view)."""
    return str(path.relative_to(root)) if path.is_relative_to(root) else str(path)
