"""Per-rank memory of a full-weights load into ZeRO-3: dsckpt vs every-rank-loads-the-file.

    python bench/bench_resume.py [--layers 12] [--nproc 4]

The file is a torch ``.pt`` state dict (as Lightning users have).
B ("every rank loads", Lightning's approach): each rank ``torch.load``s the whole file, then
per module ``GatheredParameters(..., modifier_rank=0)`` and rank 0 copies in.
A (dsckpt): ``load_full_weights`` - only rank 0 opens the file, lazily, one module at a time.
Each rank samples its RSS every 2 ms during the load; the figure is peak-during-load minus RSS
before the load, so engine setup does not count.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PAGE = os.sysconf("SC_PAGE_SIZE")


class RssSampler(threading.Thread):
    def __init__(self):
        super().__init__(daemon=True)
        self.peak, self.running = 0, True

    @staticmethod
    def rss() -> int:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * PAGE

    def run(self):
        while self.running:
            self.peak = max(self.peak, self.rss())
            time.sleep(0.002)


def every_rank_loads(engine, path: str) -> None:
    import deepspeed
    import torch

    state = torch.load(path, map_location="cpu", weights_only=True)  # the whole file, on every rank
    rank = torch.distributed.get_rank()
    for mod_name, mod in engine.module.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        params = list(mod.named_parameters(recurse=False))
        with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=0):
            if rank == 0:
                for n, p in params:
                    p.data.copy_(state[prefix + n])
    engine.optimizer.refresh_fp32_params()


def transformers_loads(engine, path: str) -> None:
    """Transformers' ZeRO-3 path (``from_pretrained`` under an ``HfDeepSpeedConfig``): rank 0 holds the
    whole state dict, per module ``GatheredParameters(modifier_rank=0)`` + ``_load_from_state_dict``."""
    import torch
    from transformers.integrations.deepspeed import _load_state_dict_into_zero3_model

    rank = torch.distributed.get_rank()
    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)  # mmap: nothing read yet
    if rank != 0:  # the other ranks pass meta tensors of the file's names and dtypes, as from_pretrained does
        state = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in state.items()}
    _load_state_dict_into_zero3_model(engine.module, state)
    engine.optimizer.refresh_fp32_params()


def job(approach: str, weights: str, report: str, precision: str = "32") -> None:
    import torch.distributed as dist

    from dsckpt.runtime.commands import quiet_deepspeed
    from dsckpt.runtime.full_weights import load_full_weights
    from dsckpt.runtime.train import TrainOptions, Trainer

    quiet_deepspeed()
    import torch

    trainer = Trainer(TrainOptions(model="bench.models:transformer", stage=3, precision=precision))
    if approach == "transformers":
        from transformers.integrations import HfDeepSpeedConfig

        keep_alive = HfDeepSpeedConfig(trainer.runtime.config)  # noqa: F841  (is_deepspeed_zero3_enabled() reads it)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    dist.barrier()
    sampler = RssSampler()
    before = sampler.rss()
    sampler.start()
    start = time.perf_counter()
    if approach == "dsckpt":
        load_full_weights(trainer.engine, weights)
    elif approach == "transformers":
        transformers_loads(trainer.engine, weights)
    else:
        every_rank_loads(trainer.engine, weights)
    dist.barrier()
    elapsed = time.perf_counter() - start
    sampler.running = False
    sampler.join()
    row = {"rank": dist.get_rank(), "growth": sampler.peak - before, "seconds": elapsed,
           "gpu_peak": torch.cuda.max_memory_allocated() if cuda else 0}
    steps = int(os.environ.get("BENCH_STEPS_AFTER", "0"))
    if steps:  # training speed after the load: 2 warm-up steps, then ``steps`` timed
        for _ in range(2):
            trainer.step()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            trainer.step()
        if cuda:
            torch.cuda.synchronize()
        row["steps_per_s"] = steps / (time.perf_counter() - start)
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if dist.get_rank() == 0:
        Path(report).write_text(json.dumps(rows))
    from dsckpt.runtime.engine import shutdown

    shutdown(exit_process=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--runs", type=int, default=1)
    args = ap.parse_args()
    sys.path.insert(0, str(HERE))
    from bench_consolidate import generate

    ckpt = generate(3, args.layers)
    weights = HERE / "cache" / f"weights_l{args.layers}.pt"
    if not weights.exists():
        subprocess.run([sys.executable, "-m", "dsckpt", "consolidate", str(ckpt), str(weights), "-q", "--no-client-state"],
                       check=True, cwd=ROOT)
    env = {**os.environ, "BENCH_LAYERS": str(args.layers), "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])), "OMP_NUM_THREADS": "1",
           **({"MALLOC_MMAP_THRESHOLD_": os.environ["MMAP_T"]} if os.environ.get("MMAP_T") else {})}
    print(f"file: {weights.stat().st_size / 2**20:.0f} MiB, world size {args.nproc}, ZeRO-3\n")
    print("| approach | rank 0 growth MiB | other ranks growth MiB (max) | load s |\n|---|---|---|---|")
    for _ in range(args.runs):
        for approach in ("dsckpt", "every-rank-loads"):
            report = HERE / "cache" / f"resume_{approach}.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
                   __file__, "--job", approach, str(weights), str(report)]
            for _ in range(3):  # a rendezvous port race now and then; the job itself is deterministic
                if subprocess.run(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0:
                    break
            else:
                raise SystemExit(f"failed three times: {' '.join(cmd)}")
            rows = json.loads(report.read_text())
            others = max(r["growth"] for r in rows[1:])
            print(f"| {approach} | {rows[0]['growth'] / 2**20:.0f} | {others / 2**20:.0f} | {rows[0]['seconds']:.2f} |",
                  flush=True)


if __name__ == "__main__":
    if "--job" in sys.argv:
        i = sys.argv.index("--job")
        job(*sys.argv[i + 1:i + 5])
    else:
        main()
