"""One rank of bench_planned_load.py: DeepSpeed's load of a checkpoint written at this world size, against the load
of one written at another world size answered from the reshard plan (checkpoint_engine.planned_load), alternating.

ARGS: NATIVE OTHER STAGE ROUNDS REPORT.  Rank 0 writes per round and mode the slowest rank's seconds and every
rank's bytes read (``/proc/self/io`` rchar: what the process read, page cache or disk).
"""
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from models import transformer  # noqa: E402

from dsckpt.checkpoint_engine import safe_load  # noqa: E402
from dsckpt.runtime.engine import Runtime, rank, shutdown, world_size  # noqa: E402
from dsckpt.checkpoint_engine.planned_load import load_resharded  # noqa: E402
from dsckpt.runtime.train import TrainOptions  # noqa: E402


def rchar() -> int:
    return int(next(line for line in Path("/proc/self/io").read_text().splitlines()
                    if line.startswith("rchar:")).split()[1])


def main(native: str, other: str, stage: str, rounds: str, report: str) -> None:
    torch.set_num_threads(1)
    runtime = Runtime(TrainOptions(stage=int(stage)).deepspeed_config(), async_save=False)
    engine = runtime.setup(transformer, lambda params: torch.optim.AdamW(params, lr=1e-4))
    safe_load.install(engine)
    rows = []
    for r in range(int(rounds)):
        for mode in (("stock", "planned", "planned-no-crc") if r % 2 == 0 else ("planned-no-crc", "planned", "stock")):
            dist.barrier()
            t0, b0 = time.perf_counter(), rchar()
            if mode == "stock":
                path, _ = engine.load_checkpoint(native)
            else:
                path, _ = load_resharded(engine, other, check_crc=mode == "planned")
            seconds, nbytes = time.perf_counter() - t0, rchar() - b0
            assert path is not None
            gathered = [None] * world_size()
            dist.all_gather_object(gathered, (seconds, nbytes))
            rows.append({"round": r, "mode": mode, "seconds": max(s for s, _ in gathered),
                         "bytes": [b for _, b in gathered]})
    if rank() == 0:
        Path(report).write_text(json.dumps(rows))


if __name__ == "__main__":
    main(*sys.argv[1:6])
    shutdown(exit_process=True)
