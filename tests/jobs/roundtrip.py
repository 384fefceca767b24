"""Run under torchrun: train, save, reload into a fresh engine, compare; rank 0 writes a JSON report.

Checks that a sharded save -> load_checkpoint at the same world size restores weights bit for bit,
the client state exactly, and that the next step's loss equals an uninterrupted run's.
"""
import json
import sys

import torch

from dsckpt.runtime.commands import quiet_deepspeed
from dsckpt.runtime.engine import full_state_dict, rank, shutdown
from dsckpt.runtime.train import TrainOptions, Trainer, states_equal


def main(stage_or_preset: str, save_dir: str, report: str) -> None:
    quiet_deepspeed()
    user = {"nested": {"list": [1, (2, 3)], "t": torch.arange(4)}, "name": "run"}
    which = {"stage": int(stage_or_preset)} if stage_or_preset.isdigit() else {"preset": stage_or_preset}
    opts = dict(model="dsckpt.runtime.demo_model:build_small_model", save_dir=save_dir, seed=3, batch_size=4, **which)
    first = Trainer(TrainOptions(**opts, user_state=user))
    first.fit(3, progress=False)
    saved_client = first.client_state()
    weights = full_state_dict(first.engine.module)
    moments = {}  # the live job's gathered Adam moments: the oracle for dsckpt's moment plans
    if stage_or_preset != "0":
        from deepspeed.utils import safe_get_full_optimizer_state

        for name, p in first.engine.module.named_parameters():
            if p.requires_grad:
                for key in ("exp_avg", "exp_avg_sq"):
                    moments[f"{key}/{name}"] = safe_get_full_optimizer_state(p, key).detach().cpu().clone()
    second = Trainer(TrainOptions(**{**opts, "seed": 99}, user_state={}))
    client = second.runtime.load_checkpoint(save_dir)
    second.restore(client)
    reloaded = full_state_dict(second.engine.module)
    loss_uninterrupted = first.step()
    loss_resumed = second.step()
    if rank() == 0:
        Path = __import__("pathlib").Path
        torch.save(moments, Path(report).with_suffix(".moments.pt"))
        Path(report).write_text(json.dumps({
            "weights_equal": weights.keys() == reloaded.keys() and all(torch.equal(weights[k], reloaded[k]) for k in weights),
            "client_equal": states_equal(saved_client, {k: client[k] for k in saved_client}),
            "loss_uninterrupted": loss_uninterrupted, "loss_resumed": loss_resumed,
        }))


if __name__ == "__main__":
    # leave the process group and skip teardown explicitly (see dsckpt.runtime.engine.shutdown)
    main(sys.argv[1], sys.argv[2], sys.argv[3])
    shutdown(exit_process=True)  # only after success: a barrier after a failure would wait for gone peers
