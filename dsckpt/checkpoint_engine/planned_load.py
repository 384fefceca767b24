"""Loading a checkpoint at another data-parallel world size or ZeRO stage without writing a copy of it.

DeepSpeed's own ``load_checkpoint`` runs, and every file it asks its checkpoint engine for is answered from the
reshard plan (``plan.reshard``: per file of the checkpoint at this world size and stage, the tree of the source
file it derives from with its partitions as byte ranges of the original files).  Order, on every rank:

1. ``load_resharded(engine, load_dir, tag)`` opens the checkpoint with dsckpt's reader (refusing pickles of foreign
   classes) and builds the plan for the engine's data-parallel size and stage: pure, no tensor byte read.
2. ``engine.load_checkpoint`` runs with two answers swapped in for its duration: the checkpoint engine's ``load``
   (a planned file is rendered into an anonymous in-memory file, its byte ranges CRC-checked, then unpickled
   weights-only with its tensors mapped from it; any other file is read from disk, weights-only) and the engine's list of model-states files (DeepSpeed globs the tag
   folder for them, and the planned ones are not on disk).
3. Each rank reads the ranges of the files it loads: its own optimizer partition and the model states, as a
   stock load of a checkpoint of this world size would.
"""
from __future__ import annotations

import fnmatch
import os
from typing import TYPE_CHECKING, Any, Callable

from ..errors import UnsupportedCheckpointError
from .offloaded_load import load_offloaded, offloads_to_nvme
from .safe_load import check_agreed, check_checkpoint_classes, reads_file, safe_torch_load

if TYPE_CHECKING:
    from ..zero.reader import Checkpoint


def load_resharded(engine: Any, load_dir: str | os.PathLike, tag: str | None = None, *,
                   load: Callable[..., Any] | None = None, check_crc: bool = True,
                   checkpoint: Checkpoint | None = None, **load_kwargs: Any) -> tuple[str | None, dict[str, Any] | None]:
    """``engine.load_checkpoint(load_dir, tag, **load_kwargs)`` at any data-parallel world size and ZeRO stage 1-3
    of the checkpoint: its fp32 masters, optimizer moments, step, scheduler and client state as a checkpoint
    written at this world size would give them.  ``load``: the engine's own ``load_checkpoint`` where it is
    wrapped.  ``check_crc``: check every source storage a planned file reads against its CRC-32 (at ZeRO-1/2 a
    partition's storage is read whole for it, beyond the ranges the file takes).  ``checkpoint``: ``load_dir``
    already opened by the caller (``other_layout``'s answer).  Returns DeepSpeed's ``(path, client_state)``."""
    from ..api.resharding import carry_only_allowed
    from ..plan.reshard import build_reshard_plan
    from ..zero.reader import open_checkpoint

    ckpt = checkpoint or open_checkpoint(load_dir, tag=tag)
    check_checkpoint_classes(ckpt)
    if offloads_to_nvme(engine):  # DeepSpeed loads the rest; the optimizer's part is load_offloaded's
        def rest() -> tuple[str | None, dict[str, Any] | None]:
            return load_resharded(engine, load_dir, tag, load=load, check_crc=check_crc, checkpoint=ckpt,
                                  **load_kwargs)
        return load_offloaded(engine, ckpt, rest, load_kwargs.get("load_optimizer_states", True), check_crc)
    ranks, stage = engine.dp_world_size, engine.zero_optimization_stage()  # (DeepSpeed names its files by these)
    if ckpt.grid.tp > 1 or ckpt.pp_slices:
        raise UnsupportedCheckpointError("a tensor- or pipeline-parallel checkpoint",
                                         hint="`dsckpt reshard` it first, then load the copy", at=ckpt.layout.tag_dir)
    load = load or engine.load_checkpoint
    loader = engine.checkpoint_engine
    stock_load = loader.load
    if (ckpt.world_size, ckpt.zero_stage) == (ranks, stage):
        loader.load = safe_torch_load
        try:
            return load(str(load_dir), tag=ckpt.layout.tag, **load_kwargs)
        finally:
            loader.load = stock_load
    plan, _ = carry_only_allowed(build_reshard_plan(ckpt, ranks, stage))
    if check_crc:
        check_agreed(engine, [f for f in plan.files if reads_file(f.name, engine)])
    tag_dir = os.path.abspath(ckpt.layout.tag_dir)
    planned = {f.name: f for f in plan.files}
    stand_ins: dict[str, Any] = {}  # an existing file's path handed to DeepSpeed, which asserts it exists
    rendered: dict[str, int] = {}  # DeepSpeed loads the first model-states file twice (its mp_world_size check)

    def answer(path: str, map_location: Any = None) -> Any:
        path = os.path.abspath(path)
        f = stand_ins.get(path) or (planned.get(os.path.basename(path)) if os.path.dirname(path) == tag_dir else None)
        if f is None:
            return safe_torch_load(path, map_location=map_location)
        if f.name not in rendered:
            rendered[f.name] = _render(f)
        # the tensors map the rendered file's pages: nothing is copied a second time
        return safe_torch_load(f"/proc/self/fd/{rendered[f.name]}", map_location=map_location, mmap=True,
                               name=os.path.join(tag_dir, f.name))

    def model_files(checkpoints_path: str, tag: str) -> list[str]:
        pattern = os.path.basename(stock_names(checkpoints_path, tag, mp_placeholder="*"))
        names = []
        for name in sorted(n for n in planned if fnmatch.fnmatch(n, pattern)):
            stand_in = os.path.abspath(planned[name].template)
            stand_ins[stand_in] = planned[name]
            names.append(stand_in)
        return names

    stock_names, stock_list = engine._get_ckpt_name, engine._get_all_ckpt_names
    loader.load, engine._get_all_ckpt_names = answer, model_files
    try:
        return load(str(load_dir), tag=ckpt.layout.tag, **load_kwargs)
    finally:
        loader.load, engine._get_all_ckpt_names = stock_load, stock_list
        for fd in rendered.values():
            os.close(fd)  # (a mapped tensor keeps its pages)


def load_any_layout(engine: Any, load: Callable[..., Any], load_dir: str | os.PathLike, tag: str | None = None,
                    **load_kwargs: Any) -> tuple[str | None, dict[str, Any] | None]:
    """What an engine given ``enable_async_save`` answers for ``load_checkpoint``: DeepSpeed's own ``load`` of a
    local folder, through the reshard plan when the checkpoint is at another data-parallel size or stage."""
    from ..errors import ConfigError
    from ..formats.storage import local_only

    hint = f"`dsckpt resume {load_dir}` reads a bucket; or copy it to a folder first"
    local_only(load_dir, ConfigError("DeepSpeed's load_checkpoint reads a local folder", hint=hint, at=load_dir))
    checkpoint = other_layout(engine, load_dir, tag)
    if checkpoint is not None:
        loaded = load_resharded(engine, load_dir, tag, load=load, checkpoint=checkpoint, **load_kwargs)
        if getattr(engine, "global_rank", 0) == 0:  # (a trainer's resume says nothing of it otherwise)
            import sys

            nvme = " into an optimizer on NVMe, every sub-group's masters, moments and step set from it" \
                if offloads_to_nvme(engine) else ""
            print(f"dsckpt: loaded {checkpoint.layout.tag_dir}, saved at {checkpoint.world_size} ranks ZeRO-"
                  f"{checkpoint.zero_stage}, for {engine.dp_world_size} ranks ZeRO-{engine.zero_optimization_stage()}"
                  f"{nvme} through the reshard plan (no copy written)", file=sys.stderr, flush=True)
        return loaded
    return load(load_dir, tag=tag, **load_kwargs)


def other_layout(engine: Any, load_dir: str | os.PathLike, tag: str | None) -> Checkpoint | None:
    """The checkpoint, opened, when it is dsckpt-readable, ZeRO 1-3, and at another data-parallel size or stage than
    ``engine`` (what ``load_resharded`` adds to a stock load), or ``engine`` keeps its optimizer on NVMe; None
    otherwise, and for anything it cannot tell."""
    from ..errors import DsckptError
    from ..zero.reader import open_checkpoint

    try:
        ckpt = open_checkpoint(load_dir, tag=tag)
    except DsckptError:
        return None
    stage = engine.zero_optimization_stage()
    if offloads_to_nvme(engine) and not ckpt.universal and ckpt.grid.tp == 1 and not ckpt.pp_slices:
        return ckpt  # DeepSpeed's own load of it is not exact at any world size (offloaded_load)
    other = (ckpt.world_size, ckpt.zero_stage) != (engine.dp_world_size, stage) and \
        ckpt.zero_stage in (1, 2, 3) and stage in (1, 2, 3) and ckpt.grid.tp == 1 and not ckpt.pp_slices and \
        not ckpt.universal
    return ckpt if other else None


def _render(f: Any) -> int:
    """One planned file as the torch zip a copy on disk would hold, in an anonymous in-memory file (``memfd``: no
    path, gone with its last mapping); its source ranges were CRC-checked before (``safe_load.check_agreed``).  Returns
    the descriptor."""
    from pathlib import Path

    from ..formats.pickle_writer import dumps
    from ..io.read import Reader
    from ..io.torch_writer import write_pickled

    fd = os.memfd_create(f.name)
    try:
        with Reader() as reader:
            write_pickled(Path(f"/proc/self/fd/{fd}"), dumps(f.tree), reader)
    except BaseException:
        os.close(fd)
        raise
    return fd
