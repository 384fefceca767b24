"""Bodies of the runtime's commands (train, resume): a preflight in the launching process, then the
work on every rank.

``preflight_*`` check everything that needs no rank (flag combinations, the config, the machine's
precisions, input files, world sizes) so a mistake costs no DeepSpeed start-up and is reported once.
``run_*`` run on every rank; results go through ``console.result`` (rank 0, stdout only).
"""
from __future__ import annotations

import contextlib
import logging
import shlex
import os
from pathlib import Path
from typing import Any, Callable

from ..errors import ConfigError, WorldSizeMismatchError
from . import console

NO_CLIENT_STATE = "none"  # --client-state none: restore nothing


def quiet_deepspeed(verbose: bool = False) -> None:
    import sys
    import warnings

    ds_logger = logging.getLogger("DeepSpeed")
    for handler in ds_logger.handlers:  # DeepSpeed logs to stdout, which carries results only
        if isinstance(handler, logging.StreamHandler):
            handler.setStream(sys.stderr)
    if verbose:
        return
    ds_logger.setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's deprecation notes inside DeepSpeed
    # nccl: DeepSpeed's barriers name no device_id; harmless, printed at every barrier on a GPU
    warnings.filterwarnings("ignore", message=r"barrier\(\): using the device under current context")


RUN_FLAGS = ("as_json", "verbose", "strict", "skip_crc_check")  # how a run reads or reports: not training options


def _options(kwargs: dict[str, Any]):
    from .config import TrainOptions

    return TrainOptions(**{k: v for k, v in kwargs.items() if k not in RUN_FLAGS})


def _stage_of_checkpoint(kwargs: dict[str, Any], ckpt) -> None:
    """Resuming a sharded checkpoint with no --stage/--preset/--config: train at the checkpoint's stage
    (DeepSpeed loads a stage's files only into an engine of that stage)."""
    if kwargs.get("stage") is None and not kwargs.get("preset") and not kwargs.get("config"):
        kwargs["stage"] = ckpt.zero_stage


def _require_supported_precision(config: dict[str, Any]) -> None:
    from .config import precision_of

    precision = precision_of(config)
    if precision == "32":
        return  # every accelerator trains in fp32: no torch import (a `--nproc` parent stays light)
    import torch

    if "DS_ACCELERATOR" not in os.environ:  # named up front: DeepSpeed's logger would print its choice to stdout
        os.environ["DS_ACCELERATOR"] = "cuda" if torch.cuda.is_available() else "cpu"
    from .precision import require_supported

    if not torch.cuda.is_available():  # on a GPU host the ranks check (asking here would hold a CUDA context)
        require_supported(precision)


def preflight_train(*, saves: bool = True, **kwargs) -> None:
    """Refuse a training configuration before any rank starts (``kwargs``: the command's options)."""
    opts = _options(kwargs)
    _require_supported_precision(opts.deepspeed_config())  # a bad config or preset fails here
    if opts.save_every and not opts.save_dir:
        raise ConfigError("--save-every needs --save-dir")
    if saves and not opts.save_dir:
        console.note("no --save-dir given: this run trains and saves nothing")
    if saves and opts.save_dir:
        require_writable_folder(Path(opts.save_dir))


def require_writable_folder(folder: Path) -> None:
    """Create ``folder`` if needed and prove a file can be written there (made and removed), before any
    rank spends minutes training for a save that would fail."""
    from ..errors import OutputError

    probe = folder / f".dsckpt-probe-{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise OutputError(f"cannot save checkpoints there ({exc.strerror or exc})",
                          hint="choose a --save-dir this user can write to", at=folder) from None


@contextlib.contextmanager
def interruptible(save_dir: str | None):
    """Ctrl-C (or a launcher's SIGINT/SIGTERM) in a run: partial saves removed, ``Interrupted`` for
    ``main()`` to report once as ``Aborted.``, exit 130."""
    from ..errors import Interrupted

    try:
        yield
    except BaseException as exc:  # torch elastic's SignalException by name: importing it costs a torch import
        signal_ended_it = Interrupted.signalled or type(exc).__name__ == "SignalException"
        if not isinstance(exc, (KeyboardInterrupt, Interrupted)) and not signal_ended_it:
            raise
        if int(os.environ.get("RANK", "0")) == 0:
            remove_partial_saves(save_dir)
        raise Interrupted from None


def remove_partial_saves(save_dir: str | None) -> None:
    """After an interrupted run: the hidden staging folders of its saves that never completed, and of dead processes
    (the published tags and `latest` are untouched: a save becomes visible only by a rename once every rank is done)."""
    from pathlib import Path

    from ..formats.storage import TEMP_MARK
    from ..io.output import dead_temps, remove_path

    if save_dir and os.path.isdir(save_dir):
        mine = f"{TEMP_MARK}{os.getpid()}-"
        for entry in os.scandir(save_dir):
            if entry.name.startswith(".") and mine in entry.name:
                remove_path(Path(entry.path))
        for path in dead_temps(Path(save_dir)):
            remove_path(path)


def preflight_resume(world_size: int, checkpoint, full_weights, client_state, tag, strip_prefix, check,
                     reshard, trust_checkpoint, **kwargs) -> None:
    if bool(checkpoint) == bool(full_weights):
        raise ConfigError("give either CKPT_DIR or --full-weights FILE, not both or neither")
    if check and not full_weights:
        raise ConfigError("--check compares the loaded model with a --full-weights file; give one")
    if reshard and not checkpoint:
        raise ConfigError("--reshard applies to a sharded CKPT_DIR; a --full-weights file loads at any world size")
    if client_state and client_state != NO_CLIENT_STATE and not os.path.isfile(client_state):
        raise ConfigError(f"--client-state {client_state}: no such file (or 'none' to restore nothing)")
    if full_weights:
        from ..api.weights import WeightsFile

        WeightsFile(full_weights, tuple(strip_prefix))  # a missing or broken file fails now
        if client_state != NO_CLIENT_STATE:
            from .client_state import read_client_state

            read_client_state(Path(full_weights), client_state, check_only=True)  # so does a broken sidecar
    else:
        from ..zero.reader import open_checkpoint

        ckpt = open_checkpoint(checkpoint, tag=tag)
        ckpt.require_complete(tensor_parallel=True)
        if not kwargs.get("skip_crc_check"):  # DeepSpeed's loader reads every storage without checking them
            from ..io.integrity import check_files

            check_files(f.path for f in ckpt.layout.all_files)
        _stage_of_checkpoint(kwargs, ckpt)
        if not trust_checkpoint:  # --reshard too: its copy goes through DeepSpeed's loader
            from ..checkpoint_engine.safe_load import check_checkpoint_classes

            check_checkpoint_classes(ckpt)
        if ckpt.world_size * ckpt.grid.tp != world_size and not reshard:
            tp = f" x tensor parallel {ckpt.grid.tp} ({ckpt.world_size * ckpt.grid.tp} ranks)" if ckpt.grid.tp > 1 else ""
            raise WorldSizeMismatchError(
                f"saved at data-parallel world size {ckpt.world_size}{tp}, but this run has "
                f"world size {world_size}; DeepSpeed cannot reshard it",
                hint=f"add --reshard, or run `dsckpt consolidate {shlex.quote(str(checkpoint))} model.safetensors`, then "
                     "`dsckpt resume --full-weights model.safetensors` at any world size", at=ckpt.layout.tag_dir)
    preflight_train(saves=not check, **kwargs)


def run_train(as_json: bool = False, verbose: bool = False, **kwargs) -> None:
    from . import engine as eng
    from .train import Trainer

    console.claim_stdout(verbose)
    quiet_deepspeed(verbose)
    trainer = Trainer(_options(kwargs))
    losses = trainer.fit(trainer.opts.steps)
    trainer.runtime.wait_for_saves()  # "saved to" below means durable
    summary = {"steps": len(losses), "zero_stage": trainer.runtime.stage, "world_size": eng.world_size(),
               "first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None,
               "save_dir": trainer.opts.save_dir}
    console.result(_json(summary) if as_json else
                   f"trained {_steps(len(losses))} (stage {summary['zero_stage']}, world size {summary['world_size']}): "
                   f"loss {_fmt(losses)}" + (f", saved to {trainer.opts.save_dir}" if trainer.opts.save_dir else ""))
    eng.shutdown(exit_process=True)


def _json(doc: dict[str, Any]) -> str:
    from .console import json_document

    return json_document(**doc)


def _steps(n: int) -> str:
    return f"{n} step" if n == 1 else f"{n} steps"


def _fmt(losses: list[float]) -> str:
    return f"{losses[0]:.4f} -> {losses[-1]:.4f}" if losses else "n/a (0 steps)"


def run_resume(checkpoint, full_weights, client_state, tag, strict, strip_prefix, check, reshard, trust_checkpoint,
               as_json, verbose: bool = False, before_exit: Callable[[], object] | None = None, **kwargs) -> None:
    from . import engine as eng
    from .resume import check_against_file, resume_full_weights, resume_sharded
    from .train import Trainer

    console.claim_stdout(verbose)
    quiet_deepspeed(verbose)
    if checkpoint:
        from ..zero.reader import open_checkpoint

        _stage_of_checkpoint(kwargs, open_checkpoint(checkpoint, tag=tag))
    trainer = Trainer(_options(kwargs))
    skip_client = client_state == NO_CLIENT_STATE
    if full_weights:
        restored = resume_full_weights(trainer, full_weights, None if skip_client else client_state, strict,
                                       tuple(strip_prefix), skip_client=skip_client)
    else:
        restored = resume_sharded(trainer, checkpoint, tag, reshard, strict, skip_client=skip_client,
                                  trust=trust_checkpoint)
    if check:
        report = check_against_file(trainer, full_weights, restored, tuple(strip_prefix))
        console.result(_json(report) if as_json else
                       f"check passed: {report['tensors_checked']} tensors identical to {console.shown(full_weights)} on every rank "
                       f"(max abs diff 0; {report['fp32_masters_checked']} fp32 masters equal); client state "
                       f"restored: {', '.join(report['client_state_keys_restored']) or 'none'}")
        trainer.runtime.wait_for_saves()
        eng.shutdown(exit_process=True, before_exit=before_exit)
        return
    start = trainer.global_step
    losses = trainer.fit(trainer.opts.steps)
    trainer.runtime.wait_for_saves()  # "saved to" below means durable
    summary = {"start_step": start, "end_step": trainer.global_step, "first_loss": losses[0] if losses else None,
               "last_loss": losses[-1] if losses else None, "save_dir": trainer.opts.save_dir,
               "client_state_keys_restored": restored.restored if restored else [],
               "client_state_keys_left_alone": restored.left_alone if restored else []}
    console.result(_json(summary) if as_json else
                   f"resumed training: steps {start} -> {trainer.global_step} ({_steps(len(losses))}), loss {_fmt(losses)}"
                   + (f", saved to {trainer.opts.save_dir}" if trainer.opts.save_dir else ""))
    eng.shutdown(exit_process=True, before_exit=before_exit)
