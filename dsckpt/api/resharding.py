"""Reshard API: ``reshard(ckpt, out_dir, world_size)`` writes a native DeepSpeed checkpoint for another
data-parallel world size, optimizer state included; stock ``engine.load_checkpoint(out_dir)`` loads it.

Steps:
1. open the checkpoint (``zero.reader``) and build the plan (``plan.reshard``): no bytes read yet;
2. check OUT_DIR (not an input, not inside the checkpoint, not existing unless ``force``);
3. keep what is written to allowed classes (``carry_only_allowed``): a client-state entry naming any other
   class is left out with a note, anything else refused; links out of the checkpoint are refused
   (``trust`` keeps both, loudly);
4. write ``<tag>/`` rank files and ``latest`` into a temp folder beside OUT_DIR: each file's pickle
   from ``pickle_writer``, its storages streamed by ``io.read.Reader`` from their byte sources
   (unchanged tensors copied whole, partitions assembled from the ranks that held them), up to
   ``WRITE_THREADS`` files at once;
5. copy the files beside the tag (``zero.companions``: a trainer's state, per-rank RNG files renumbered
   for M ranks, configs and tokenizers; pickles of foreign classes left out with a note);
6. re-open the result with dsckpt's reader (complete, world size M), then rename it into place (into an
   existing OUT_DIR with ``force``: ``latest``, the tag folder and the copied files replaced, everything
   else kept).
"""
from __future__ import annotations

import os
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Mapping

from ..errors import InconsistentCheckpointError, UnsafeCheckpointError, UnsupportedCheckpointError
from ..formats.pickle_policy import foreign_classes
from ..formats.pickle_writer import StorageOut, dumps
from ..io.output import check_output, staged, write_errors
from ..io.read import Reader
from ..io.torch_writer import write_pickled
from ..plan.reshard import ReshardPlan
from ..plan.restage import build_restage_plan
from ..zero import layout as L
from ..zero.companions import Copy, plan_companions
from ..zero.reader import open_checkpoint


Pickled = tuple[bytes, list[StorageOut]]  # a rank file's pickle and the storages it names (``dumps``)
# Rank files written at once, each by its own thread and Reader.  One stream of writes into the page cache runs
# at ~3.2 GB/s (its write calls take 175-185 ms of a 54M ZeRO-3 reshard on the 16-core host, cp's whole copy
# 170-213 ms); on 2 cores the CRC and read-ahead threads already take the second core.
WRITE_THREADS = max(1, min(4, (os.cpu_count() or 1) // 2))


@dataclass(frozen=True)
class ReshardResult:
    out: Path
    tag: str
    stage: int
    source_world_size: int
    world_size: int
    files: tuple[str, ...]  # final paths
    nbytes: int
    notes: tuple[str, ...] = ()
    source_stage: int | None = None


def reshard(checkpoint: str | os.PathLike, out_dir: str | os.PathLike, world_size: int, *, tag: str | None = None,
            stage: int | None = None, ep_size: int | None = None, force: bool = False, fsync: bool = True,
            trust: bool = False,
            progress: Callable[[int], None] | None = None,
            progress_total: Callable[[int], None] | None = None) -> ReshardResult:
    """Write ``checkpoint`` (one tag) as a DeepSpeed checkpoint at ``world_size`` (and ZeRO ``stage``, default
    its own: ``plan.restage``) into ``out_dir``; ``ep_size``: a mixture-of-experts run's new expert-parallel size
    (``plan.experts``).

    ``trust``: copy pickled objects of any class as recorded and follow links out of the checkpoint
    (whoever loads OUT_DIR with DeepSpeed then runs that pickle code).
    """
    ckpt = open_checkpoint(checkpoint, tag)
    if not trust:
        L.require_contained(ckpt.layout)
    prepared = prepare_reshard(ckpt, world_size, stage, ep_size, trust)
    plan, companions = prepared.plan, prepared.companions
    out = Path(out_dir)
    check_output(out, [f.path for f in ckpt.layout.all_files], force, directory=True, tree=ckpt.layout.root)
    if progress_total:
        progress_total(prepared.total)
    with staged(fsync) as stage, write_errors(out):
        tmp = stage.temp_for(out, directory=True)
        write_files(plan, tmp, plan.files, companions, prepared.pickled, progress)
        (tmp / L.LATEST_FILE).write_text(plan.tag)
        check_written(tmp, plan)
    files = tuple(str(out / plan.tag / f.name) for f in plan.files) + (str(out / L.LATEST_FILE),)
    files += tuple(str(out / copy.name) for copy in companions)
    return ReshardResult(out, plan.tag, plan.stage, plan.source_world_size, plan.world_size, files, prepared.total,
                         prepared.notes, ckpt.zero_stage)


@dataclass(frozen=True)
class PreparedReshard:
    plan: ReshardPlan  # only allowed classes left in its trees
    companions: tuple[Copy, ...]  # the files beside the tag, as OUT_DIR gets them
    notes: tuple[str, ...]
    total: int  # bytes of tensor data to write
    pickled: Mapping[str, Pickled]  # file name -> its pickle and storages (``dumps``), made once


def prepare_reshard(ckpt, world_size: int, stage: int | None, ep_size: int | None, trust: bool,
                    links_checked: bool = False) -> PreparedReshard:
    """Everything decided before a byte is written (``links_checked``: the caller has refused links out of the
    checkpoint already, as the distributed run does on each host's own files)."""
    plan = build_restage_plan(ckpt, world_size, stage, ep_size)
    plan, notes = carry_only_allowed(plan, trust)
    companions, companion_notes = plan_companions(ckpt.layout.root, ckpt.layout.tags, plan.source_world_size,
                                                  world_size, trust, follow_links=links_checked)
    pickled = {f.name: _pickle(f, trust) for f in plan.files}  # every tree writable before a byte moves
    total = sum(s.nbytes for _, storages in pickled.values() for s in storages)
    return PreparedReshard(plan, tuple(companions), notes + tuple(companion_notes), total, pickled)


def carry_only_allowed(plan: ReshardPlan, trust: bool = False) -> tuple[ReshardPlan, tuple[str, ...]]:
    """The plan with every client-state entry that names a class beyond DeepSpeed's own (and plain data,
    tensors) left out, and notes saying which.  Such a class in DeepSpeed's own entries or an optimizer
    file is refused: leaving it out would break the checkpoint.  ``trust``: everything kept, one warning."""
    if trust:
        return plan, trusted_notes([f.tree for f in plan.files], "DeepSpeed's load_checkpoint of OUT_DIR")
    dropped: dict[str, set[str]] = {}
    files = []
    for f in plan.files:
        tree = allowed_tree(f.tree, f.template, f.name.endswith(L.OPTIM_STATES_SUFFIX), dropped)
        files.append(replace(f, tree=tree))
    return replace(plan, files=tuple(files)), dropped_notes(dropped)


def allowed_tree(tree, where, optimizer: bool, dropped: dict[str, set[str]]):
    """``tree`` (a rank file's) without its client-state entries that name foreign classes (recorded in
    ``dropped``); such a class under one of DeepSpeed's own keys, or anywhere in an optimizer file, is refused."""
    if not isinstance(tree, dict):
        return tree
    kept = type(tree)()
    for key, value in tree.items():
        found = foreign_classes(value)
        if found:
            if key in L.DEEPSPEED_KEYS or optimizer:
                raise UnsafeCheckpointError(
                    f"{where}: entry {str(key)[:80]!r} names {', '.join(sorted(found)[:3])}, beyond "
                    "DeepSpeed's own classes; writing it would carry its pickle code", hint=L.TRUST_HINT)
            dropped.setdefault(str(key), set()).update(found)
            continue
        kept[key] = value
    return kept


def dropped_notes(dropped: dict[str, set[str]]) -> tuple[str, ...]:
    return tuple(f"client-state entry {k!r} left out: it holds objects of {', '.join(sorted(c)[:3])}, whose "
                 "pickles would run code when DeepSpeed loads OUT_DIR (--trust-checkpoint keeps it)"
                 for k, c in sorted(dropped.items()))


def trusted_notes(trees, loader: str) -> tuple[str, ...]:
    found = sorted({c for tree in trees for c in foreign_classes(tree)})
    return (f"--trust-checkpoint: objects of {', '.join(found[:5])} copied as recorded; {loader} runs their "
            "pickle code",) if found else ()


def _pickle(f, trust: bool) -> Pickled:
    """``dumps(f.tree)``, a value the pickle format cannot hold named as the file's."""
    try:
        return dumps(f.tree, allow_foreign=trust)
    except ValueError as exc:
        raise UnsupportedCheckpointError(f"{f.template}: {exc}; it cannot be written back") from None


def write_files(plan: ReshardPlan, root: Path, files, companions, pickled: Mapping[str, Pickled],
                progress: Callable[[int], None] | None = None) -> None:
    """``files`` (of ``plan.files``, pickled as ``PreparedReshard.pickled``) under ``root/<tag>/`` and the
    ``companions`` beside it (root must exist)."""
    tag_dir = root / plan.tag
    tag_dir.mkdir(exist_ok=True)
    report = _serialized(progress)

    def write(f) -> None:
        with Reader() as reader:
            write_pickled(tag_dir / f.name, pickled[f.name], reader.storage_chunks, report)
    biggest_first = sorted(files, key=lambda f: -sum(s.nbytes for s in pickled[f.name][1]))
    with ThreadPoolExecutor(WRITE_THREADS) as pool:
        for done in [pool.submit(write, f) for f in biggest_first]:
            done.result()
    for copy in companions:  # the trainer's files beside the tag (trainer_state.json, rng_state_{r}.pth, ...)
        (root / copy.name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(copy.source, root / copy.name)


def _serialized(progress: Callable[[int], None] | None) -> Callable[[int], None] | None:
    """``progress``, called by one writer thread at a time."""
    if progress is None:
        return None
    lock = threading.Lock()

    def report(n: int) -> None:
        with lock:
            progress(n)
    return report


def check_written(root: Path, plan: ReshardPlan) -> None:
    """What DeepSpeed will look for: one complete tag at world size M (read back with dsckpt's reader)."""
    written = open_checkpoint(root)
    written.require_complete()
    if written.world_size != plan.world_size or written.zero_stage != plan.stage:
        raise InconsistentCheckpointError(f"{root}: wrote stage {written.zero_stage} at world size "
                                          f"{written.world_size}, meant stage {plan.stage} at {plan.world_size}")
