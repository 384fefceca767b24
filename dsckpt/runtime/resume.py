"""`dsckpt resume`: carry on training from a sharded checkpoint or from one full-weights file.

* ``resume CKPT_DIR``: the engine's ``load_checkpoint`` (weights, optimizer moments, client state),
  same world size only; ``--reshard`` consolidates to a temp file first and loads it as full weights.
* ``resume --full-weights FILE``: ``full_weights.load_full_weights`` at any world size, then the
  client state from the sidecar beside FILE (``FILE.client_state.json``) or ``--client-state``.
* ``--check``: load, then gather every parameter and compare with the file bit-exactly, and compare
  the restored client state with the sidecar; no training.
"""
from __future__ import annotations

import tempfile
import warnings
from pathlib import Path
from typing import Any

import click
import torch
import torch.distributed as dist

from ..errors import VerificationError, WorldSizeMismatchError
from ..sidecar import JSON_SUFFIX, read_sidecar
from . import engine as eng
from .full_weights import get_fp32_master, load_full_weights
from .weights_file import WeightsFile
from .train import Trainer, states_equal


def default_sidecar(weights: Path) -> Path | None:
    candidate = weights.with_name(weights.name + JSON_SUFFIX)
    return candidate if candidate.exists() else None


def resume_full_weights(trainer: Trainer, weights: str, client_state: str | None, strict: bool,
                        strip_prefixes: tuple[str, ...]) -> dict[str, Any] | None:
    stats = load_full_weights(trainer.engine, weights, strict=strict, strip_prefixes=strip_prefixes)
    if eng.rank() == 0:
        warnings.warn("a full-weights file holds no optimizer moments: Adam state starts fresh", stacklevel=2)
    sidecar = Path(client_state) if client_state else default_sidecar(Path(weights))
    client = read_sidecar(sidecar) if sidecar else None
    if client is not None:
        trainer.restore(client)
        trainer.engine.global_steps = trainer.global_step  # tags and schedules continue the count
    if eng.rank() == 0:
        click.echo(f"loaded {stats['loaded']} tensors from {weights}"
                   + (f"; client state from {sidecar} (step {trainer.global_step})" if client is not None else
                      "; no client-state sidecar found, counters start at 0"))
    return client


def resume_sharded(trainer: Trainer, ckpt_dir: str, tag: str | None, reshard: bool, strict: bool) -> None:
    try:
        client = trainer.runtime.load_checkpoint(ckpt_dir, tag=tag)
    except WorldSizeMismatchError:
        if not reshard:
            raise
        from ..convert import consolidate

        with tempfile.TemporaryDirectory(prefix="dsckpt-reshard-", dir=Path(ckpt_dir)) as tmp:
            out = Path(tmp) / "weights.safetensors"
            if eng.rank() == 0:
                consolidate(ckpt_dir, out, tag=tag)
            if eng.world_size() > 1:
                dist.barrier()
            if eng.rank() == 0:
                click.echo("resharding: weights loaded from a consolidated copy; optimizer moments start fresh")
            resume_full_weights(trainer, str(out), None, strict, ())
            if eng.world_size() > 1:
                dist.barrier()
        return
    trainer.restore(client)
    if eng.rank() == 0:
        click.echo(f"resumed {ckpt_dir} at step {trainer.global_step}")


def _max_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got.reshape(want.shape).float() - want.float()).abs().max().item() if want.numel() else 0.0


def check_against_file(trainer: Trainer, weights: str, client: dict[str, Any] | None,
                       strip_prefixes: tuple[str, ...]) -> dict[str, Any]:
    """Gather every parameter on every rank and compare with the file; compare the client state."""
    import deepspeed
    src = WeightsFile(weights, strip_prefixes)  # every rank reads, lazily: this is a check, not a load
    module = trainer.engine.module
    checked, masters, max_diff, master_diff = 0, 0, 0.0, 0.0
    for mod_name, mod in module.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        params = [(prefix + n, p) for n, p in mod.named_parameters(recurse=False) if prefix + n in src.source]
        wanted = {name: src.get(name) for name, _ in params}  # each tensor read once
        with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=None):
            for name, p in params:
                max_diff = max(max_diff, _max_diff(p.detach(), wanted[name].to(p.dtype)))
                checked += 1
        for name, p in params:
            master = get_fp32_master(trainer.engine, p) if p.requires_grad and trainer.engine.optimizer else None
            if master is not None:
                masters += 1
                want = wanted[name] if wanted[name].dtype == torch.float32 else wanted[name].to(p.dtype)
                master_diff = max(master_diff, _max_diff(master, want))
        for n, b in mod.named_buffers(recurse=False):
            if b is not None and prefix + n in src.source:
                max_diff = max(max_diff, _max_diff(b, src.get(prefix + n).to(b.dtype)))
                checked += 1
    restored = []
    if client is not None:
        now = trainer.client_state()  # read before anything draws random numbers
        for key in ("global_step", "epoch", "data_position", "rng", "user"):
            if key in client and not states_equal(now[key], client[key]):
                raise VerificationError(f"client state {key!r}: the restored value differs from the sidecar's")
            restored.append(key)
    report = {"rank": eng.rank(), "tensors_checked": checked, "max_abs_diff": max_diff,
              "fp32_masters_checked": masters, "fp32_master_max_abs_diff": master_diff,
              "client_state_keys_restored": restored}
    if max_diff or master_diff:
        raise VerificationError(f"rank {eng.rank()}: loaded weights differ from {weights} "
                                f"(max abs diff {max_diff}, fp32 masters {master_diff})")
    return report
