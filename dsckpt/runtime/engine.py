"""A DeepSpeed engine with the strategy's behaviour: distributed setup, zero.Init, save/load.

Steps of a run:
1. ``init_distributed()`` fills a single-process environment if none is set (``RANK``...) and starts
   the process group: gloo on CPU, nccl on CUDA.
2. ``Runtime.setup(factory, optimizer_factory)`` builds the model (inside ``deepspeed.zero.Init``
   at stage 3, with the config's remote device and dtype) and ``deepspeed.initialize``s it.
3. ``save_checkpoint`` / ``load_checkpoint`` go through the engine; the client state is the
   caller's dict, checked against DeepSpeed's own top-level keys.
4. ``shutdown()`` at the end of a successful run: a barrier, then the process group is destroyed
   (and, for a finished command, the process ends without interpreter teardown; see there).
"""
from __future__ import annotations

import logging
import os
import shlex
import sys
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import torch

from ..errors import CheckpointNotFoundError, ConfigError, UnsupportedPrecisionError, WorldSizeMismatchError
from ..zero.layout import DEEPSPEED_KEYS
from .config import precision_of

log = logging.getLogger("dsckpt")
ENGINE_OWNED_KEYS = ("state_dict", "optimizer_states")  # the engine saves these itself
MUON_MODULE = "deepspeed.runtime.zero.muon.muon_optimizer"


def init_distributed() -> None:
    """Start the process group from the standard environment (torchrun, deepspeed launcher)."""
    import deepspeed

    if "RANK" not in os.environ:  # a plain `python` run: a world of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        from .launch import free_port

        os.environ.setdefault("MASTER_PORT", str(free_port()))
    if torch.distributed.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        # bound to its GPU: NCCL otherwise guesses the device from the global rank (and warns of a hang);
        # DeepSpeed's init_distributed (which takes no device) then adopts this group
        torch.distributed.init_process_group(backend, device_id=device)
    deepspeed.init_distributed(dist_backend=backend, verbose=False)


def shutdown(exit_process: bool = False, before_exit: Callable[[], object] | None = None) -> None:
    """Leave the process group cleanly; with ``exit_process``, end the process right after.

    Measured on 2-3 rank CPU jobs: without the barrier + destroy, ~1 run in 12 died with SIGABRT at
    exit; with them, a rarer "terminate called without an active exception" remained (a C++ thread
    of the communication stack still joinable when static destructors run).  All files are closed
    by then, so a finished CLI command skips interpreter teardown with ``os._exit``.
    """
    if "dsckpt.checkpoint_engine.lifecycle" in sys.modules:  # saves still persisting finish first (a failure is raised)
        sys.modules["dsckpt.checkpoint_engine.lifecycle"].close_all()
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    if exit_process:
        if before_exit is not None:  # what the caller would have cleaned up on the way out (a URL's scratch copy)
            before_exit()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def world_size() -> int:
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def data_parallel(engine: Any) -> tuple[int, int]:
    """(rank, ranks) over the replicas that see different batches: an AutoTP model's TP ranks share one."""
    autotp = getattr(engine, "autotp_size", None)
    if callable(autotp) and autotp() > 1:
        from deepspeed.utils import groups

        return groups.get_data_parallel_rank(), groups.get_data_parallel_world_size()
    return rank(), world_size()


def model_dtype(config: Mapping[str, Any]) -> torch.dtype:
    from ..dtypes import PRECISION_DTYPE, torch_dtype

    return torch_dtype(PRECISION_DTYPE[precision_of(config)])


def check_model_dtype(module: torch.nn.Module, wanted: torch.dtype) -> None:
    """Refuse to train in another precision than the config asks for (see ``build_model``)."""
    found = {p.dtype for p in module.parameters() if p.is_floating_point()}
    if found and found != {wanted}:
        raise UnsupportedPrecisionError(
            f"the model's parameters are {sorted(str(d) for d in found)} but the DeepSpeed config asks for "
            f"{wanted}", hint="a model factory must not cast its parameters itself")


def _barrier() -> None:
    if torch.distributed.is_initialized() and world_size() > 1:
        torch.distributed.barrier()


def full_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every rank gets the module's full state dict (ZeRO-3 parameters gathered; a no-op below)."""
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
        return {k: v.detach().clone() for k, v in module.state_dict().items()}


def import_muon_uncompiled(optimizer: Any) -> None:
    """Import DeepSpeed's Muon module with ``torch.compile`` off, unless ``optimizer`` may be a Muon one.

    DeepSpeed 0.19.8 imports that module in every ``deepspeed.initialize`` (ZeRO's supported-optimizer check,
    stage 3's and the bf16 optimizer's ``isinstance`` checks), whatever the optimizer; its ``@torch.compile``
    decorators import ``torch._inductor`` then, about a second of each rank's start-up
    (docs/dev/performance-log.md section 19).  Its kernels run only for a Muon optimizer; for any other one, the decorators left as the identity
    (``TORCHDYNAMO_DISABLE``, read at decoration) change nothing but the time.
    """
    if optimizer is None or MUON_MODULE in sys.modules or "muon" in type(optimizer).__module__.lower():
        return  # None: DeepSpeed builds the config's optimizer, which may be Muon
    before = os.environ.get("TORCHDYNAMO_DISABLE")
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    try:
        __import__(MUON_MODULE)
    except ImportError:
        pass  # an older DeepSpeed without Muon: nothing to import
    finally:
        if before is None:
            del os.environ["TORCHDYNAMO_DISABLE"]
        else:
            os.environ["TORCHDYNAMO_DISABLE"] = before


class Runtime:
    """One DeepSpeed engine and its checkpoint I/O."""

    def __init__(self, config: Mapping[str, Any], async_save: bool = True):
        self.config = dict(config)
        self.async_save = async_save  # saves persist in the background (checkpoint_engine.background); False: stock, blocking
        self.saver: Any = None
        self.remote_device = self.config.pop("dsckpt_remote_device", None)
        self.stage = int(self.config.get("zero_optimization", {}).get("stage", 0))
        self.engine: Any = None  # deepspeed.DeepSpeedEngine, once setup() ran
        self._warned_sharded = False

    def build_model(self, factory: Callable[[], torch.nn.Module]) -> torch.nn.Module:
        # AutoTP: under zero.Init, DeepSpeed 0.19.8 partitions the parameters it leaves whole over every rank, TP
        # ranks included, and records their shape as [0] (docs/format.md); built whole, they are ZeRO's as usual
        if self.stage != 3 or (self.config.get("tensor_parallel") or {}).get("autotp_size", 1) > 1:
            return factory()
        import deepspeed

        offload = self.config.get("zero_optimization", {}).get("offload_param", {}).get("device")
        remote = self.remote_device or (offload if offload in ("cpu", "nvme") else None)
        # zero.Init patches torch.Tensor.__new__; a factory that imports transformers inside itself
        # triggers the first `import torch._dynamo` under that patch, which fails ("Signature mismatch
        # between <function get_new_tensor_fn_for_dtype.<locals>.new_tensor ...>").  Import it first.
        import torch._dynamo  # noqa: F401

        # dtype=None, not the config's dtype: DeepSpeed 0.19.8's `Init._set_dtype` evaluates
        # `dtype or torch.float16 if is_fp16_supported() else torch.bfloat16 ...` as
        # `(dtype or fp16) if ... else bf16`, so on a CPU without fp16 any explicit dtype gives a bf16
        # model.  With dtype=None it takes the config's bf16/fp16 flags (fp32 when neither is on).
        with deepspeed.zero.Init(remote_device=remote, config_dict_or_path=self.config, dtype=None):
            return factory()

    def setup(self, factory: Callable[[], torch.nn.Module],
              optimizer_factory: Callable[[Iterable[torch.nn.Parameter]], Any]):
        """Build the model and engine; ``optimizer_factory`` gets the trainable parameters (a DeepSpeed-MoE
        model's: as param groups, its experts in groups of their own, ``runtime.moe``).  A config with an
        ``"optimizer"`` section wins over the factory, as in Lightning: DeepSpeed builds that one (with
        ``offload_optimizer``, its CPU Adam), where a client optimizer would make it ignore the section."""
        import deepspeed

        init_distributed()
        model = self.build_model(factory)
        from .moe import optimizer_groups

        groups = optimizer_groups(model, [p for p in model.parameters() if p.requires_grad])
        optimizer = None if "optimizer" in self.config else optimizer_factory(groups)
        if isinstance(optimizer, (list, tuple)):
            if len(optimizer) != 1:
                raise ConfigError(f"DeepSpeed supports exactly one optimizer, got {len(optimizer)}")
            optimizer = optimizer[0]
        import_muon_uncompiled(optimizer)
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=self.config,
                                               model_parameters=groups if optimizer is None else None)
        check_model_dtype(self.engine.module, model_dtype(self.config))
        if self.async_save:
            from ..checkpoint_engine import enable_async_save
            from .console import info

            self.saver = enable_async_save(self.engine, report=info)
        return self.engine

    # -- checkpoints ---------------------------------------------------------------------------
    def save_checkpoint(self, save_dir: str | os.PathLike, client_state: Mapping[str, Any] | None = None,
                        tag: str | None = None) -> str:
        """Save through the engine; returns the tag (``step<N>`` by default)."""
        state = {k: v for k, v in (client_state or {}).items() if k not in ENGINE_OWNED_KEYS}
        clash = sorted(set(state) & DEEPSPEED_KEYS)
        if clash:
            raise ConfigError(f"client state keys {clash} collide with DeepSpeed's own checkpoint keys; rename them")
        tag = tag or f"step{self.engine.global_steps}"
        if self.saver is not None:  # files staged and `latest` moved by the background commit, once all are durable
            self.engine.save_checkpoint(str(save_dir), tag=tag, client_state=state)
            self._note_sharded(save_dir, tag)
            return tag
        # DeepSpeed's blocking save through the same commit as the background one (checkpoint_engine.commit): the tag
        # written into a hidden sibling, renamed into place by rank 0 once every rank is done, `latest` after it
        from ..checkpoint_engine.commit import LocalTarget, new_owner, require_plain_tag, staging_name

        require_plain_tag(tag, save_dir)

        target = LocalTarget(str(save_dir))
        owner = [new_owner()]
        if torch.distributed.is_initialized() and world_size() > 1:
            torch.distributed.broadcast_object_list(owner, src=0)
        staging = staging_name(tag, owner[0])
        if rank() == 0:
            os.makedirs(save_dir, exist_ok=True)
            target.prepare(tag, staging)
        _barrier()
        try:
            self.engine.save_checkpoint(str(save_dir), tag=staging, client_state=state, save_latest=False)
        except BaseException:
            target.discard(tag, staging, [], leader=rank() == 0)  # (a kill leaves it for the next save or `prune`)
            raise
        _barrier()
        if rank() == 0:
            target.publish(tag, staging, [], leader=True)
            target.publish_latest(tag)
        _barrier()
        self._note_sharded(save_dir, tag)
        return tag

    def wait_for_saves(self) -> None:
        """Every save so far durable, `latest` moved (a background failure raised here)."""
        if self.saver is not None:
            self.saver.wait()

    def _note_sharded(self, save_dir: str | os.PathLike, tag: str) -> None:
        if self.stage == 3 and world_size() > 1 and rank() == 0 and not self._warned_sharded:
            from .console import note

            self._warned_sharded = True
            note(f"{Path(save_dir) / tag} is a ZeRO-3 checkpoint sharded over {world_size()} ranks; "
                 f"`dsckpt consolidate {shlex.quote(str(save_dir))} model.safetensors` makes one file of it")

    def loads_resharded(self, ckpt: Any, trust: bool) -> bool:
        """Whether ``ckpt`` is at another data-parallel size or ZeRO stage (or the engine's optimizer is on NVMe) that
        ``load_checkpoint`` answers from the reshard plan (ZeRO 1-3 both sides, no tensor or pipeline parallelism, no foreign classes to keep)."""
        from ..checkpoint_engine.offloaded_load import offloads_to_nvme

        other = (ckpt.world_size, ckpt.zero_stage) != (data_parallel(self.engine)[1], self.stage) \
            or offloads_to_nvme(self.engine)  # (DeepSpeed's own load of an NVMe optimizer is not exact)
        return (other and not trust and ckpt.zero_stage in (1, 2, 3) and self.stage in (1, 2, 3)
                and ckpt.grid.tp == 1 and not ckpt.pp_slices and not ckpt.universal)

    def load_checkpoint(self, load_dir: str | os.PathLike, tag: str | None = None,
                        load_optimizer: bool = True, trust: bool = False, ckpt=None) -> dict[str, Any]:
        """Restore module (+ optimizer when training continues) and return the client state.

        No pickle code runs unless ``trust``: the files are checked for foreign classes with dsckpt's
        reader, and DeepSpeed's loader is replaced by a ``weights_only`` one (``safe_load``).
        """
        from ..saves_in_flight import settle
        from ..zero.reader import open_checkpoint
        from ..checkpoint_engine import safe_load

        settle()  # a tag this process is still writing is not loadable yet (``ckpt`` may be opened already)
        ckpt = ckpt or open_checkpoint(load_dir, tag=tag)  # ``ckpt``: already opened by the caller
        if not trust:
            safe_load.check_checkpoint_classes(ckpt)
        safe_load.install(self.engine, trust)
        kwargs: dict[str, Any] = dict(load_optimizer_states=load_optimizer, load_lr_scheduler_states=load_optimizer)
        if self.loads_resharded(ckpt, trust):
            from ..checkpoint_engine.planned_load import load_resharded

            path, client = load_resharded(self.engine, load_dir, ckpt.layout.tag, checkpoint=ckpt, **kwargs)
        elif ckpt.world_size * ckpt.grid.tp != world_size():
            raise WorldSizeMismatchError(
                f"saved at {ckpt.grid.describe()} ({ckpt.world_size * ckpt.grid.tp} ranks), "
                f"but this run has world size {world_size()}; DeepSpeed cannot reshard it",
                hint=f"run `dsckpt consolidate {shlex.quote(str(load_dir))} model.safetensors`, then "
                     "`dsckpt resume --full-weights model.safetensors` at any world size", at=ckpt.layout.tag_dir)
        else:
            path, client = self.engine.load_checkpoint(str(load_dir), tag=ckpt.layout.tag, **kwargs)
        if path is None or client is None:
            raise CheckpointNotFoundError("not a DeepSpeed checkpoint DeepSpeed could load",
                                          hint="for a single weights file use --full-weights", at=load_dir)
        return {k: v for k, v in client.items() if k not in DEEPSPEED_KEYS}
