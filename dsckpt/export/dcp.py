"""A ``torch.distributed.checkpoint`` (DCP) folder from a training-state plan, one tensor in memory at a time.

The layout is what ``torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer)`` gives for
the same model and ``torch.optim.AdamW`` (measured on torch 2.13 with an FSDP2 ``fully_shard`` model)::

    {"model": {fqn: tensor},                        # parameters (frozen too), persistent buffers, tied names
     "optim": {"state": {fqn: {"step": 0-d float32, "exp_avg": ..., "exp_avg_sq": ...}},
               "param_groups": [{"lr": ..., "betas": ..., ..., "params": [fqn, ...]}]}}

which DCP stores flattened ("model.<fqn>", "optim.state.<fqn>.exp_avg", "optim.param_groups.0.lr").
``weights_only`` writes the "model" half.

How: torch's own ``dcp.save`` with no process group (one writer, whole tensors; a loader at any world size
reads the slices it needs) plans the save and writes ``.metadata``; it sees a state dict of *meta* tensors
(shapes and dtypes, no bytes).  The bytes go through ``StreamingWriter.write_data``: each tensor item is
streamed from the checkpoint (``io.read``) as a ``torch.save`` archive (``io.torch_writer``) into one
``.distcp`` file, at the offset the metadata records - what DCP's reader ``torch.load``s back.
torch's own FileSystemWriter keeps every tensor of a data file alive until the file is done, so its memory grows
with the model (docs/dev/performance-log.md 13).
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from ..dtypes import torch_dtype
from ..errors import DsckptError, MissingExtraError, OutputError, missing_modules
from .targets import ConvertRequest, PreparedConversion, Target, register_target

if TYPE_CHECKING:  # (the plans and writers load with the first conversion, not with --help)
    from ..io.context import WriteContext
    from ..io.output import Staging
    from ..plan.consolidate import TensorPlan
    from ..plan.training_state import TrainingState

MODEL_KEY, OPTIM_KEY = "model", "optim"  # the top-level keys of get_state_dict's pair, as users save them
DATA_FILE_SUFFIX = ".distcp"  # torch's name for a DCP data file: <prefix><n>.distcp


def step_plan(step: Any) -> TensorPlan | float | None:
    """Adam's step as torch.optim.AdamW keeps it: a 0-d float32 tensor (from a stored tensor or a number)."""
    from ..formats.pickle_policy import TensorRef
    from ..plan.consolidate import TensorPlan
    from ..plan.segments import ref_segments

    if isinstance(step, TensorRef):
        return TensorPlan("step", (), step.dtype, "F32", "step", ref_segments(step))
    return float(step) if isinstance(step, (int, float)) else None


class _Window:
    """A binary file seen from its current position on: a ``torch.save`` archive in the middle of a ``.distcp``
    file must hold offsets relative to its own start (DCP's reader loads the slice on its own)."""

    def __init__(self, f):
        self.f, self.base = f, f.tell()

    def tell(self) -> int:
        return self.f.tell() - self.base

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        return self.f.seek(self.base + pos if whence == os.SEEK_SET else pos, whence) - self.base

    def write(self, data) -> int:
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


class _SinkWindow(_Window):
    """A ``_Window`` on a ``ZipSink`` (a data file streamed to object storage): the zip writer's holds and mirror
    switch reach the sink, at its own offsets."""

    def hold(self, pos: int) -> None:
        self.f.hold(self.base + pos)

    def release(self, pos: int) -> None:
        self.f.release(self.base + pos)

    @property
    def mirror(self) -> bool:
        return self.f.mirror

    @mirror.setter
    def mirror(self, on: bool) -> None:
        self.f.mirror = on


def _state_dict(state: TrainingState, lazy: Callable[[TensorPlan], Any]) -> dict[str, Any]:
    import torch

    from ..plan.consolidate import TensorPlan

    tensors = {t.name: lazy(t) for t in state.model.tensors}
    root: dict[str, Any] = {MODEL_KEY: {**tensors, **{a: tensors[s] for a, s in state.model.aliases.items()}}}
    if state.params:
        optim_state = {}
        for p in state.params:
            step = step_plan(p.step)
            entry: dict[str, Any]
            if isinstance(p.step, int) and "use_muon" in state.groups[p.group].settings:
                entry = {"step": p.step}  # DeepSpeed's Muon counts its Adam steps in a Python int, as it saved them
            elif step is not None:
                entry = {"step": lazy(step) if isinstance(step, TensorPlan) else torch.tensor(step, dtype=torch.float32)}
            else:
                entry = {}
            optim_state[p.name] = {**entry, **{k: lazy(t) for k, t in p.moments.items()}}
        groups = [{**_torch_settings(g.settings), "params": list(g.params)} for g in state.groups]
        root[OPTIM_KEY] = {"state": optim_state, "param_groups": groups}
    return root


def _torch_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """A param group of DeepSpeed's own Adam (FusedAdam / DeepSpeedCPUAdam: ``bias_correction``, no ``amsgrad``)
    with torch AdamW's other defaults added: DCP's loader wants every key the loading optimizer's groups have, and
    DeepSpeed's Adam is AdamW unless ``adam_w_mode`` is off (refused: no torch optimizer does that)."""
    if "bias_correction" not in settings or "amsgrad" in settings or "use_muon" in settings:
        return dict(settings)
    import torch

    if settings.get("adam_w_mode") is False:
        from ..errors import UnsupportedCheckpointError

        raise UnsupportedCheckpointError("DeepSpeed Adam with adam_w_mode off (L2 weight decay) has no torch "
                                         "optimizer counterpart", hint="--weights-only converts the weights")
    defaults = dict(torch.optim.AdamW([torch.zeros(1, requires_grad=True)]).param_groups[0])
    defaults.pop("params")
    return {**defaults, **settings}


def write_dcp(state: TrainingState, out: Path, context: WriteContext, fsync: bool = True) -> None:
    """Write ``state`` as a DCP folder at ``out``."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult
    from torch.futures import Future

    from ..formats.pickle_writer import NewTensor
    from ..io import stream
    from ..io.read import Reader
    from ..io.torch_writer import write_archive
    from ..plan.consolidate import TensorPlan

    sources: dict[int, TensorPlan] = {}

    def lazy(t: TensorPlan):
        meta = torch.empty(t.shape, dtype=torch_dtype(t.dtype), device="meta")
        sources[id(meta)] = t
        return meta

    class StreamingWriter(dcp.FileSystemWriter):
        """torch's folder writer, but the data file is written by dsckpt, tensor by tensor (module docstring)."""

        def write_data(self, plan, planner):
            name = f"{plan.storage_data.prefix}0{DATA_FILE_SUFFIX}"
            path = Path(self.path) / name
            streamed = context.stream_target(path)  # OUT in object storage: the data file goes up as it is written
            window = _SinkWindow if streamed else _Window
            results = []
            with (stream.ZipSink(*streamed, path) if streamed else open(path, "wb")) as f, Reader(context) as reader:
                for item in plan.items:
                    offset = f.tell()
                    planned = sources.get(id(planner.lookup_object(item.index)))
                    if item.type == WriteItemType.BYTE_IO:
                        f.write(planner.resolve_data(item).getbuffer())
                    elif planned is None:  # a tensor made here (a step count that was a number)
                        torch.save(planner.resolve_data(item), window(f))
                    else:
                        write_archive(window(f), NewTensor(planned.dtype, planned.shape, planned), reader, context)
                    length = f.tell() - offset
                    results.append(WriteResult(item.index, length, _StorageInfo(name, offset, length)))
                if fsync and not streamed:
                    f.flush()
                    os.fsync(f.fileno())
            done: Future = Future()
            done.set_result(results)
            return done

    from torch.distributed.checkpoint.api import CheckpointException

    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized, assuming ... a single process"
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        try:
            dcp.save(_state_dict(state, lazy), storage_writer=StreamingWriter(str(out), sync_files=fsync),
                     no_dist=True)
        except CheckpointException as exc:  # torch wraps the writer's own error: raise that one (a full disk...)
            causes = [f[0] if isinstance(f, tuple) else f for f in exc.failures.values()]
            cause = next((c for c in causes if isinstance(c, BaseException)), None)
            if isinstance(cause, (OSError, DsckptError)):
                raise cause from None
            raise OutputError(f"torch.distributed.checkpoint could not write it ({cause!r})", at=out) from None


class DcpTarget(Target):
    name = "dcp"
    summary = "a torch.distributed.checkpoint folder (FSDP2, any world size)"

    def check(self, request: ConvertRequest) -> None:
        if missing_modules("torch"):
            raise MissingExtraError("--to dcp writes through torch.distributed.checkpoint: torch is not installed",
                                    hint="pip install torch  (--to universal needs no torch)")

    def prepare(self, ckpt, state: TrainingState, request: ConvertRequest) -> PreparedConversion:
        from ..plan.consolidate import TensorPlan
        from ..plan.segments import read_pieces

        moments = [t for p in state.params for t in p.moments.values()]
        steps = [s for p in state.params if isinstance(s := step_plan(p.step), TensorPlan)]
        tensors = len(state.model.tensors) + sum(1 + len(p.moments) for p in state.params)
        nbytes = state.model.nbytes + sum(t.nbytes for t in moments)
        pieces = tuple(piece for t in list(state.model.tensors) + moments + steps for piece in read_pieces(t))
        notes = ("weights only: no optimizer state written",) if request.weights_only else ()
        return PreparedConversion(self, ckpt.layout.tag_dir.name, tensors, nbytes, notes, pieces, (), state)

    def write(self, prepared: PreparedConversion, tmp: Path, staging: Staging, context: WriteContext) -> list[str]:
        tmp.rmdir()  # torch's writer makes its own folder
        write_dcp(prepared.detail, tmp, context, staging.fsync)
        return sorted(p.name for p in tmp.iterdir())


register_target(DcpTarget())
