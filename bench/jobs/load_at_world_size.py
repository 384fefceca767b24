"""Run under torchrun: time ``engine.load_checkpoint`` of one checkpoint folder at this world size.

    load_at_world_size.py FOLDER STAGE UNIVERSAL(0|1) REPORT.json

The benchmark transformer (BENCH_DIM / BENCH_LAYERS), fp32, ZeRO stage STAGE; UNIVERSAL=1 sets
DeepSpeed's ``checkpoint.load_universal``.  Both formats load through dsckpt's weights-only loader
(``safe_load.install``), so the figures compare the formats, not the unpicklers.  Rank 0 writes the
per-rank seconds of the load call alone.
"""
import json
import sys
import time

import torch
import torch.distributed as dist

from dsckpt.checkpoint_engine import safe_load
from dsckpt.runtime.commands import quiet_deepspeed
from dsckpt.runtime.engine import Runtime, rank, shutdown, world_size
from dsckpt.runtime.train import TrainOptions


def main(folder: str, stage: str, universal: str, report: str) -> None:
    import bench.models

    quiet_deepspeed()
    torch.set_num_threads(1)
    config = TrainOptions(stage=int(stage)).deepspeed_config()
    if universal == "1":
        config["checkpoint"] = {"load_universal": True}
    runtime = Runtime(config)
    runtime.setup(bench.models.transformer, lambda params: torch.optim.AdamW(params, lr=1e-4))
    safe_load.install(runtime.engine, trust=False)
    dist.barrier()
    start = time.perf_counter()
    path, _ = runtime.engine.load_checkpoint(folder)
    seconds = time.perf_counter() - start
    assert path is not None, f"nothing loaded from {folder}"
    gathered = [None] * world_size()
    dist.all_gather_object(gathered, seconds)
    if rank() == 0:
        with open(report, "w") as fh:
            json.dump(gathered, fh)


if __name__ == "__main__":
    main(*sys.argv[1:5])
    shutdown(exit_process=True)
