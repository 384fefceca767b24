"""Run as one plain process (no launcher, no shutdown call): a script that ends right after a background save.

ARGS: OUT.  Builds the odd model at ZeRO-3 with dsckpt's runtime (background saves on), saves tag ``x`` and returns;
the interpreter's exit must wait for the files and `latest` (its thread pools stop during shutdown).
"""
import sys

import torch

from dsckpt.runtime.commands import quiet_deepspeed
from dsckpt.runtime.config import resolve_config
from dsckpt.runtime.engine import Runtime

if __name__ == "__main__":
    import odd_model

    quiet_deepspeed()
    config = resolve_config(None, precision="32", stage=3)
    config["train_micro_batch_size_per_gpu"] = 1
    config.pop("train_batch_size", None)
    engine = Runtime(config).setup(odd_model.build, lambda params: torch.optim.AdamW(params, lr=1e-4))
    engine.save_checkpoint(sys.argv[1], tag="x")
