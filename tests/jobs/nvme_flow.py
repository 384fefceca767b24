"""Run on N ranks: a ZeRO-Infinity run (optimizer and parameters on NVMe) saved, then resumed (issue 70).

ARGS: MODE OUT REPORT [OFFLOAD] [SUB_GROUP_SIZE].  The model and config are the NVMe fixtures' (fixtures/make_nvme_fixtures.py: the
swap threshold lowered so the small model has several swapped sub-groups and one kept in memory).
* ``train``: 3 steps, a save into OUT/ckpt, then 2 more steps; rank 0 writes OUT/reference.pt (masters, moments and
  step gathered from the live engine at the save) and REPORT (every rank's 2 losses after the save);
* ``resume-dsckpt`` / ``resume-stock`` / ``resume-engine``: a fresh engine loads OUT/ckpt through dsckpt's runtime
  (``load_checkpoint``), DeepSpeed's own ``engine.load_checkpoint``, or ``engine.load_checkpoint`` as
  ``enable_async_save`` answers it (with NVME_FLOW_SAVE=background), then the same 2 steps; REPORT: the losses, and whether the masters,
  moments and step right after the load equal the reference bit for bit;
* ``load``: at another world size: dsckpt's load of OUT/ckpt, then the same comparison with the reference.
OFFLOAD: ``nvme`` (default: the optimizer and the parameters), ``nvme-optimizer`` (the optimizer only) or ``cpu``
(the optimizer on the CPU).  NVME_FLOW_LOAD=DIR loads DIR instead of OUT/ckpt.  NVME_FLOW_HPZ=K adds hpZ (``zero_hpz_partition_size``); NVME_FLOW_SAVE=background saves
with dsckpt's background engine, into NVME_FLOW_SAVE_DIR when set (a bucket's URL).
SUB_GROUP_SIZE (default 1000: five sub-groups at 2 ranks, one of them too small to swap) must cut the sub-groups the
same way at both world sizes for ``load`` (dsckpt's reshard does not cut them anew yet).
"""
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent.parent / "fixtures"), str(HERE.parent.parent)]
import make_nvme_fixtures as nvme  # noqa: E402

from dsckpt.runtime.commands import quiet_deepspeed  # noqa: E402
from dsckpt.runtime.engine import rank, shutdown  # noqa: E402
from dsckpt.runtime.train import TrainOptions, Trainer  # noqa: E402


def trainer(swap: Path, offload: str, save_dir: str | None, sub_group_size: int) -> Trainer:
    import deepspeed.runtime.swap_tensor.optimizer_utils as swapper

    swapper.MIN_AIO_BYTES = nvme.MIN_SWAP_BYTES
    config = nvme.nvme_config("32", offload == "nvme", sub_group_size, str(swap))
    if offload == "cpu":
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    if os.environ.get("NVME_FLOW_HPZ"):  # hpZ: DeepSpeed refuses it beside parameters on NVMe
        config["zero_optimization"]["zero_hpz_partition_size"] = int(os.environ["NVME_FLOW_HPZ"])
    path = swap / f"config-{rank()}.json"
    path.write_text(json.dumps(config))
    return Trainer(TrainOptions(model="make_nvme_fixtures:build_nvme_model", config=str(path), steps=3,
                                seed=7, batch_size=4, sync_save=os.environ.get("NVME_FLOW_SAVE") != "background",
                                save_dir=save_dir))


def state(engine) -> dict:
    """Masters, moments (from the live swap files or memory) and step, gathered whole."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out = {name: safe_get_full_fp32_param(p).detach().cpu().clone()
           for name, p in engine.module.named_parameters() if p.requires_grad}
    if engine.optimizer.optimizer_swapper is not None:
        out.update(nvme.moments(engine))
    else:
        out.update({f"{name}::{kind}": safe_get_full_optimizer_state(p, kind).detach().cpu().clone()
                    for name, p in engine.module.named_parameters() if p.requires_grad
                    for kind in ("exp_avg", "exp_avg_sq")})
    steps = {float(s["step"]) for s in engine.optimizer.optimizer.state.values() if "step" in s}
    out["::step"] = torch.tensor(steps.pop() if len(steps) == 1 else float("nan"))
    return out


def gathered_losses(losses: list) -> list:
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, losses)
    return every


def main(mode: str, out: str, report: str, offload: str = "nvme", sub_group_size: str = "1000") -> None:
    quiet_deepspeed()
    out_dir = Path(out)
    with tempfile.TemporaryDirectory(prefix=f"nvme-{rank()}-") as swap:
        save_dir = os.environ.get("NVME_FLOW_SAVE_DIR", str(out_dir / "ckpt"))  # (a bucket's URL: background saves)
        t = trainer(Path(swap), offload, save_dir if mode == "train" else None, int(sub_group_size))
        result: dict = {}
        if mode == "train":
            t.fit(3, progress=False)  # (saves at its end)
            t.runtime.wait_for_saves()
            reference = state(t.engine)
            result["losses"] = gathered_losses([t.step(), t.step()])
            if rank() == 0:
                torch.save(reference, out_dir / "reference.pt")
        else:
            ckpt = os.environ.get("NVME_FLOW_LOAD", str(out_dir / "ckpt"))  # (another: `dsckpt reshard`'s output)
            if mode in ("resume-stock", "resume-engine"):  # (engine: with NVME_FLOW_SAVE=background, dsckpt's)
                _, client = t.engine.load_checkpoint(ckpt)
            else:
                client = t.runtime.load_checkpoint(ckpt)
            t.restore(client)
            now = state(t.engine)
            reference = torch.load(out_dir / "reference.pt")
            result["different"] = sorted(k for k in reference if not torch.equal(reference[k], now[k]))
            result["step"] = float(now["::step"])
            if mode != "load":
                result["losses"] = gathered_losses([t.step(), t.step()])
        if rank() == 0:
            Path(report).write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:])
    shutdown(exit_process=True)
