"""Where DeepSpeed puts things: file names, keys, and tag/rank discovery (no file contents).

A checkpoint root looks like::

    root/latest                                   text file holding the newest tag
    root/<tag>/mp_rank_00_model_states.pt         stage 0-2: rank 0 writes the module + metadata
    root/<tag>/zero_pp_rank_<r>_mp_rank_00_model_states.pt   stage 3: every rank writes one
    root/<tag>/[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt  stage 1-3: one per dp rank
"""
from __future__ import annotations

import errno
import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from ..errors import (AmbiguousRankError, CheckpointNotFoundError, DsckptError, InconsistentCheckpointError, TagError,
                      UnreadableFileError, UnsafeCheckpointError)

# --- file names -----------------------------------------------------------------------------
LATEST_FILE = "latest"  # text: the tag of the newest checkpoint
PUBLISHING = "dsckpt-publishing.json"  # in a bucket's tag while its objects are copied into place (a cut one keeps it)
from .grid import MODEL_STATES_SUFFIX, OPTIM_STATES_SUFFIX  # noqa: E402  (names are built in grid.rank_file_name)
# mp_rank_XX_model_states.pt (stage 0-2) | zero_pp_rank_R_mp_rank_XX_model_states.pt (stage 3)
# [bf16_]zero_pp_rank_R_mp_rank_XX_optim_states.pt; layer_* files belong to pipeline parallelism.
RANK_FILE_RE = re.compile(
    r"^(?P<bf16>bf16_)?(?:zero_pp_rank_(?P<dp>\d+)_)?mp_rank_(?P<mp>\d+)_(?P<kind>model|optim)_states\.pt$"
)
PIPELINE_LAYER_RE = re.compile(r"^layer_(?P<layer>\d+)(?:-model_(?P<mp>\d+))?-model_states\.pt$")
# Mixture-of-experts: expert weights live outside `module`, one file per expert (older: expert_E_...),
# their optimizer state in expp_rank_R_... files.
EXPERT_MODEL_FILE_RE = re.compile(r"^(?:layer_(?P<layer>\d+)_)?expert_(?P<expert>\d+)_mp_rank_(?P<mp>\d+)_model_states\.pt$")
EXPERT_OPTIM_FILE_RE = re.compile(r"^expp_rank_\d+_mp_rank_\d+_optim_states\.pt$")  # ZeRO-0: per ep rank


def is_expert_file(name: str) -> bool:
    return bool(EXPERT_MODEL_FILE_RE.match(name) or EXPERT_OPTIM_FILE_RE.match(name))

# ds_to_universal's output: the rank model-states files as they were, no optimizer-states files, and
# zero/<parameter name>/{fp32,exp_avg,exp_avg_sq,step}.pt - each the whole parameter (flat at stage 3;
# a bare tensor or {"param": tensor, "cat_dim": ...}), trainable parameters only at stage 3.
UNIVERSAL_DIR = "zero"
UNIVERSAL_PARAM_KEY = "param"
UNIVERSAL_CAT_DIM_KEY = "cat_dim"  # stage 1/2: the dimension tensor-parallel slices were joined on (0 without TP)
UNIVERSAL_STEP_FILE = "step.pt"  # stage 1/2: Adam's step as the optimizer held it
UNIVERSAL_OPTIMIZER_FILE = "optimizer_state.pt"  # rank 0's optimizer state less the partitions (stage 3: all of it)
UNIVERSAL_PARAM_GROUPS = "param_groups"  # added to it: the torch optimizer's param groups
LATEST_UNIVERSAL_FILE = "latest_universal"  # the tag engine.load_checkpoint opens with checkpoint.load_universal
UNIVERSAL_STATE_FILES = {"fp32": "fp32.pt", "exp_avg": "exp_avg.pt", "exp_avg_sq": "exp_avg_sq.pt"}

# --- keys of the model-states file ------------------------------------------------------------
MODULE = "module"  # state dict: full at stage 0-2, buffers + empty placeholders at stage 3
BUFFER_NAMES = "buffer_names"  # persistent buffers, in module order
PARAM_SHAPES = "param_shapes"  # list (per param group) of ordered name -> shape; trainable only
FROZEN_PARAM_SHAPES = "frozen_param_shapes"  # name -> shape, stage 2/3 only (None at stage 1)
FROZEN_PARAM_FRAGMENTS = "frozen_param_fragments"  # name -> full (stage 2) / partition (stage 3)
SHARED_PARAMS = "shared_params"  # alias -> source name (tied weights)
DS_CONFIG = "ds_config"
DS_VERSION = "ds_version"
GLOBAL_STEPS = "global_steps"
DP_WORLD_SIZE = "dp_world_size"
MP_WORLD_SIZE = "mp_world_size"
OPTIMIZER = "optimizer"  # stage 0: the optimizer state dict itself (holds fp32 groups)
# Everything DeepSpeed itself writes at the top level; any other key is the client's.
DEEPSPEED_KEYS = frozenset({
    MODULE, BUFFER_NAMES, PARAM_SHAPES, FROZEN_PARAM_SHAPES, FROZEN_PARAM_FRAGMENTS, SHARED_PARAMS,
    DS_CONFIG, DS_VERSION, GLOBAL_STEPS, DP_WORLD_SIZE, MP_WORLD_SIZE, OPTIMIZER, "lr_scheduler",
    "data_sampler", "random_ltd", "sparse_tensor_module_names", "skipped_steps", "global_samples",
    "checkpoint_parallel_dims", "checkpoint_parallel_dimensions", "universal_checkpoint_info",
    "num_experts", "ds_autoep_layers",  # mixture-of-experts runs (zero/experts.py)
})

# --- keys of the optimizer-states file ---------------------------------------------------------
OPTIMIZER_STATE_DICT = "optimizer_state_dict"
ZERO_STAGE = "zero_stage"
PARTITION_COUNT = "partition_count"  # int (stage 3) or list per group (stage 1/2)
SINGLE_PARTITION_OF_FP32_GROUPS = "single_partition_of_fp32_groups"  # stage 1/2 flat partitions
FP32_FLAT_GROUPS = "fp32_flat_groups"  # stage 3 flat partitions
PARAM_ALIGNMENT_PADDINGS = "param_alignment_paddings"  # optional per-param padding (stage 1/2)
GROUP_PADDINGS = "group_paddings"  # stage 1/2, per group: tail padding trimmed from this rank's saved fp32
PARAM_SLICE_MAPPINGS = "param_slice_mappings"  # stage 1/2, per group: name -> fragment_address(numel, start)
ELASTIC_OPTIMIZER_STATE_STEP = "base_optimizer_state_step"  # present only in elastic (lean) checkpoints
BASE_OPTIMIZER_STATE = "base_optimizer_state"  # stage 1/2: the torch optimizer's state (Adam moments)
LOSS_SCALER = "loss_scaler"  # DeepSpeed's LossScaler / DynamicLossScaler (cur_scale, ...)


@dataclass(frozen=True)
class RankFile:
    path: Path
    kind: str  # "model" | "optim"
    dp_rank: int | None  # None for stage 0-2 mp_rank_XX_model_states.pt
    mp_rank: int
    size: int


@dataclass(frozen=True)
class Layout:
    """The files of one tag of one checkpoint."""

    root: Path  # folder holding tag folders (may equal tag_dir.parent)
    tag: str
    tag_dir: Path
    tags: tuple[str, ...]
    latest: str | None  # what `latest` says, if present
    model_files: tuple[RankFile, ...]
    optim_files: tuple[RankFile, ...]
    pipeline_files: tuple[Path, ...] = field(default=())
    expert_files: tuple[Path, ...] = field(default=())
    problems: tuple[DsckptError, ...] = field(default=())  # found, not raised: inspect lists them, readers raise the first
    notes: tuple[str, ...] = field(default=())  # worth telling, not wrong (a tag linked from elsewhere)

    @property
    def all_files(self) -> tuple[RankFile, ...]:
        return self.model_files + self.optim_files

    def model_parallel_ranks(self) -> list[int]:
        """The ``mp_rank_XX`` values the rank files carry (tensor-parallel ranks; pipeline stages x TP ranks)."""
        return sorted({f.mp_rank for f in self.all_files})

    def for_mp_rank(self, mp: int) -> "Layout":
        """The files of one model-parallel rank: a data-parallel checkpoint of its own (one TP slice)."""
        return self.for_mp_ranks((mp,))

    def for_mp_ranks(self, ranks: Iterable[int]) -> "Layout":
        """The files of some model-parallel ranks (a pipeline stage's TP ranks)."""
        from dataclasses import replace

        ranks = set(ranks)
        return replace(self, model_files=tuple(f for f in self.model_files if f.mp_rank in ranks),
                       optim_files=tuple(f for f in self.optim_files if f.mp_rank in ranks))


def file_kind(path: Path | str) -> str | None:
    """None for a regular file (links followed); else what it is, for a message."""
    import stat

    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        return "a symlink loop" if exc.errno == errno.ELOOP else f"unreadable ({exc.strerror})"
    if stat.S_ISREG(mode):
        return None
    return ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else
            "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode) else
            "not a regular file")


def _scan_tag_dir(tag_dir: Path, problems: list[DsckptError]
                  ) -> tuple[list[RankFile], list[RankFile], list[Path], list[Path]]:
    model: list[RankFile] = []
    optim: list[RankFile] = []
    pipeline: list[Path] = []
    experts: list[Path] = []
    claimed: dict[tuple[str, int | None, int], Path] = {}
    for entry in sorted(os.scandir(tag_dir), key=lambda e: e.name):
        match = RANK_FILE_RE.match(entry.name)
        if match:
            kind = file_kind(entry.path)
            if kind is not None:
                raise CheckpointNotFoundError(f"expected a rank file, found {kind}", at=entry.path)
            dp = match.group("dp")
            rank_file = RankFile(
                path=Path(entry.path), kind=match.group("kind"), dp_rank=None if dp is None else int(dp),
                mp_rank=int(match.group("mp")), size=os.stat(entry.path).st_size,
            )
            slot = (rank_file.kind, rank_file.dp_rank, rank_file.mp_rank)
            if slot in claimed:  # zero_pp_rank_0 beside zero_pp_rank_00, or a stale bf16_ copy
                problems.append(AmbiguousRankError(f"{claimed[slot].name} and {entry.name} both claim "
                                                   f"{rank_file.kind}-states rank {rank_file.dp_rank or 0}; remove the "
                                                   "stale one", at=tag_dir))
                continue
            claimed[slot] = rank_file.path
            (model if rank_file.kind == "model" else optim).append(rank_file)
        elif PIPELINE_LAYER_RE.match(entry.name):
            pipeline.append(Path(entry.path))
        elif is_expert_file(entry.name):
            experts.append(Path(entry.path))
        elif entry.name == PUBLISHING:
            problems.append(InconsistentCheckpointError(
                "its publish into the bucket was cut while its objects were copied into place: it may hold files of "
                "two saves until the next save into this folder finishes it from the staged objects",
                hint="read an older tag until then (--tag)", at=entry.path))
    key = lambda f: (f.mp_rank, -1 if f.dp_rank is None else f.dp_rank)
    return sorted(model, key=key), sorted(optim, key=key), pipeline, experts


def is_tag_dir(path: Path) -> bool:
    """A folder holding DeepSpeed rank files."""
    try:
        return any(RANK_FILE_RE.match(name) for name in os.listdir(path))
    except (NotADirectoryError, PermissionError, FileNotFoundError):
        return False


DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's index of a folder (a pickle: never read here)


def checkpoints_below(folder: Path) -> list[str]:
    """Sub-folders that are checkpoint roots (HF Trainer's output_dir/checkpoint-500/global_step500/...), sorted
    naturally - for a hint when ``folder`` itself is none."""
    try:
        entries = [e for _, e in zip(range(1000), os.scandir(folder))]  # an error path: a bounded look
        found = [e.name for e in entries if e.is_dir() and not e.name.startswith(".") and list_tags(Path(e.path))]
    except OSError:
        return []
    return sorted(found, key=lambda s: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)])


def list_tags(root: Path) -> list[str]:
    """Sub-folders of ``root`` that hold DeepSpeed rank files, sorted naturally."""
    # hidden folders are dsckpt's in-progress saves (.<tag>.dsckpt-partial), not tags
    found = [e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith(".") and is_tag_dir(Path(e.path))]
    return sorted(found, key=lambda s: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)])


def stale_latest(root: Path | str, latest: str) -> InconsistentCheckpointError:
    """`latest` names a tag that is not there: the one error for it, whoever finds it (a process, a view of many:
    ``root`` a folder, or a URL as the user spelled it)."""
    return InconsistentCheckpointError(f"names tag {latest!r}, which is not a tag folder beside it",
                                       at=f"{str(root).rstrip('/')}/{LATEST_FILE}")


def several_tags(root: Path | str, tags: list[str]) -> TagError:
    return TagError(f"several tags and no usable 'latest': {', '.join(tags)}",
                    hint="pick one with --tag (dsckpt.open_checkpoint(path, tag=...))", at=root)


def read_latest(root: Path) -> str | None:
    """The tag `latest` names: a short text file inside the root (a link may not lead elsewhere)."""
    latest = root / LATEST_FILE
    if not os.path.lexists(latest):
        return None
    if latest.is_symlink() and not inside(latest.resolve(), root):
        raise TagError(f"is a symlink to {os.readlink(latest)!r}, outside the checkpoint; not read", at=latest)
    kind = file_kind(latest)
    if kind is not None:
        raise TagError(f"expected a text file naming a tag, found {kind}", at=latest)
    from ..limits import limit

    with open(latest, "rb") as fh:
        data = fh.read(limit("MAX_LATEST_BYTES") + 1)
    if len(data) > limit("MAX_LATEST_BYTES"):
        raise TagError(f"longer than {limit('MAX_LATEST_BYTES')} bytes; expected one tag name", at=latest)
    tag = data.decode("utf-8", errors="backslashreplace").strip()
    if tag and (os.sep in tag or tag in (".", "..") or not tag.isprintable()):
        raise TagError(f"'{repr(data.strip()[:80])[2:-1]}' is not a tag folder name", at=latest,
                       hint=f"name a tag with --tag (`dsckpt list {shlex.quote(str(root))}` shows them)")
    return tag or None


def inside(path: Path, root: Path) -> bool:
    """``path`` (resolved) is ``root`` or below it: what may be read into an output without trust."""
    root = root.resolve()
    return path == root or root in path.parents


def links_outside(layout: Layout) -> list[Path]:
    """The tag folder or rank files that are symlinks resolving outside the checkpoint root.

    Reading through them is fine for a look (``inspect`` notes it); copying what they point at into
    an output is not, unless the user trusts the checkpoint: a downloaded checkpoint whose
    ``global_step5 -> /home/me/other_run`` would export someone else's files.
    """
    root = layout.root.resolve()
    found = []
    for path in (layout.tag_dir, *(f.path for f in layout.all_files)):
        if path.is_symlink() or path == layout.tag_dir:
            target = path.resolve()
            if not inside(target, root):
                found.append(path)
    return found


def leads_out(path: Path, root: Path) -> UnsafeCheckpointError:
    """The refusal of a link out of the checkpoint ``root``, in one set of words whoever finds it (one process's
    reader, a distributed run's survey)."""
    return UnsafeCheckpointError(f"{path} -> {path.resolve()}: a symlink leading outside the checkpoint {root}; "
                                 "its files are not copied into an output", hint=TRUST_HINT)


TRUST_HINT = "if you trust whoever wrote the checkpoint, pass --trust-checkpoint (trust=True in the API)"


def require_contained(layout: Layout) -> None:
    """Writers' rule: copy nothing into an output through a link that leads out of the checkpoint."""
    outside = links_outside(layout)
    if outside:
        raise leads_out(outside[0], layout.root)


def discover(path: str | os.PathLike[str], tag: str | None = None) -> Layout:
    """Resolve a user's path to one tag's files.

    Accepts (1) a checkpoint root with or without ``latest``, (2) a tag folder, or (3) one rank
    file inside a tag folder.  The tag is ``tag`` if given, else what ``latest`` names, else the
    only tag present; anything else is a ``TagError`` that lists the tags found.
    """
    p = Path(path)
    if not os.path.lexists(p):
        raise CheckpointNotFoundError("no such file or directory", at=p)
    kind = file_kind(p)
    if kind not in (None, "a directory"):
        raise CheckpointNotFoundError(f"is {kind}, not a checkpoint folder or rank file", at=p)
    if p.is_file():
        if not RANK_FILE_RE.match(p.name):
            raise CheckpointNotFoundError(
                "not a DeepSpeed rank file (expected *_model_states.pt or *_optim_states.pt)", at=p)
        p = p.parent
    if not os.access(p, os.R_OK | os.X_OK):
        raise UnreadableFileError("permission denied", at=p)
    problems: list[DsckptError] = []
    if is_tag_dir(p):  # a tag folder: the root is its parent; it is the tag unless --tag names another
        root, tag = p.parent, tag or p.name
    else:
        root = p
    tags = list_tags(root)
    if root != p and p.name not in tags:
        tags.append(p.name)  # e.g. a hidden in-progress save named explicitly
    notes = []
    try:
        latest = read_latest(root)
    except TagError as exc:
        if tag is None:
            raise
        latest = None  # a tag named explicitly never needs `latest` (the way around a broken one)
        notes.append(f"{exc}; not used: tag {tag!r} was named")
    if latest is not None and latest not in tags:
        if tag is None:
            problems.append(stale_latest(root, latest))
        else:
            notes.append(f"{stale_latest(root, latest)}; not used: tag {tag!r} was named")
    if tag is None:
        if latest in tags:
            tag = latest
        elif len(tags) == 1:
            tag = tags[0]
        elif not tags:
            if latest is not None:
                raise TagError(f"names tag {latest!r}, but {root} holds no tags", at=root / LATEST_FILE)
            if (root / DCP_METADATA).is_file():
                raise CheckpointNotFoundError(
                    f"a torch.distributed.checkpoint (DCP) folder ({DCP_METADATA}), not a DeepSpeed checkpoint",
                    hint="FSDP2 loads it: dcp.load(state, checkpoint_id=...) then set_state_dict(model, optimizer, ...)", at=root)
            nested = checkpoints_below(root)
            raise CheckpointNotFoundError(
                f"{root}: no DeepSpeed checkpoint found (no rank files, no tag folders)"
                + (f"; it holds checkpoints in {', '.join(nested[:5])}{' ...' if len(nested) > 5 else ''}" if nested else ""),
                hint=f"pass one of them, e.g. {shlex.quote(str(root / nested[-1]))} (the last in natural order)" if nested else None)
        else:
            raise several_tags(root, tags)
    elif tag not in tags:
        raise TagError(f"tag {tag!r} not found; tags present: {', '.join(tags) or 'none'}", at=root)
    tag_dir = root / tag
    if tag_dir.is_symlink() and not inside(tag_dir.resolve(), root):
        notes.append(f"{tag_dir}: a symlink to {tag_dir.resolve()}, outside {root}; followed")
    model, optim, pipeline, experts = _scan_tag_dir(tag_dir, problems)
    if not model:
        raise CheckpointNotFoundError("no *_model_states.pt file", at=tag_dir)
    return Layout(root=root, tag=tag_dir.name, tag_dir=tag_dir, tags=tuple(tags), latest=latest,
                  model_files=tuple(model), optim_files=tuple(optim), pipeline_files=tuple(pipeline),
                  expert_files=tuple(experts), problems=tuple(problems), notes=tuple(notes))
