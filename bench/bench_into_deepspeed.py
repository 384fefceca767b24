"""Into DeepSpeed (issue 55): `dsckpt convert DCP OUT --to deepspeed` against what a user does today - build a
DeepSpeed engine at the target world size, step once at lr 0 so Adam's state exists, set every master and moment
from the FSDP2 checkpoint (``dcp_to_torch_save`` + DeepSpeed's ``safe_set_full_*``), ``save_checkpoint``.

Both write page-cache files (dsckpt with --no-fsync; DeepSpeed flushes nothing), alternating, ``--rounds`` times.
Reported: median wall seconds of each way, their ratio, and peak RSS (dsckpt: its one process; the stock way: the
largest rank times the ranks, plus ``dcp_to_torch_save``'s).

    python bench/bench_into_deepspeed.py --world-size 2 --stage 3 --dim 512 --layers 8 --rounds 3
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PEAK = ("import resource, subprocess, sys; code = subprocess.run(sys.argv[1:]).returncode; "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); sys.exit(code)")


def measured(cmd: list[str], env: dict) -> tuple[float, int]:
    """Wall seconds and the peak RSS (bytes) of the largest process ``cmd`` started."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", PEAK, *cmd], env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd[:4])}... failed:\n{proc.stderr[-3000:]}")
    return time.perf_counter() - start, int(proc.stderr.strip().splitlines()[-1]) * 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--stage", type=int, default=3)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-into-ds-"))
    env = {**os.environ, "BENCH_DIM": str(args.dim), "BENCH_LAYERS": str(args.layers), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "bench")])}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.world_size)]
    job = str(ROOT / "bench" / "jobs" / "into_deepspeed_rank.py")
    try:
        subprocess.run([*torchrun, job, "fsdp2", str(work / "dcp")], check=True, env=env, capture_output=True)
        state_bytes = sum(f.stat().st_size for f in (work / "dcp").iterdir())
        rows: dict[str, list] = {"dsckpt": [], "stock": [], "dcp_to_torch_save": []}
        for _ in range(args.rounds):
            for out in ("ours", "theirs"):
                shutil.rmtree(work / out, ignore_errors=True)
            rows["dsckpt"].append(measured([sys.executable, "-m", "dsckpt", "convert", str(work / "dcp"),
                                            str(work / "ours"), "--to", "deepspeed", "-w", str(args.world_size),
                                            "--stage", str(args.stage), "--model", "models:transformer", "-q",
                                            "--no-fsync"], env))
            (work / "full.pt").unlink(missing_ok=True)
            rows["dcp_to_torch_save"].append(measured(
                [sys.executable, "-c", "import sys; from torch.distributed.checkpoint.format_utils import "
                 "dcp_to_torch_save as f; f(sys.argv[1], sys.argv[2])", str(work / "dcp"), str(work / "full.pt")], env))
            rows["stock"].append(measured([*torchrun, job, "stock", str(work / "full.pt"), str(work / "theirs"),
                                           str(args.stage)], env))
        med = {k: statistics.median(s for s, _ in v) for k, v in rows.items()}
        peak = {k: max(p for _, p in v) for k, v in rows.items()}
        stock_total = med["stock"] + med["dcp_to_torch_save"]
        figures = {"world_size": args.world_size, "stage": args.stage, "dcp_bytes": state_bytes,
                   "seconds": med, "peak_rss_bytes": peak, "dsckpt_over_stock": med["dsckpt"] / stock_total,
                   "rounds": args.rounds}
        print(f"DCP of {state_bytes / 1e6:.0f} MB -> ZeRO-{args.stage} at {args.world_size} ranks, median of "
              f"{args.rounds} rounds, alternating")
        print(f"  dsckpt convert --to deepspeed  {med['dsckpt']:7.2f} s   peak RSS {peak['dsckpt'] / 2**20:7.0f} MiB")
        print(f"  stock: dcp_to_torch_save       {med['dcp_to_torch_save']:7.2f} s   peak RSS "
              f"{peak['dcp_to_torch_save'] / 2**20:7.0f} MiB")
        print(f"         engine + set + save     {med['stock']:7.2f} s   peak RSS {peak['stock'] / 2**20:7.0f} MiB "
              f"per rank x {args.world_size}")
        print(f"  ratio dsckpt / stock           {figures['dsckpt_over_stock']:.3f}")
        if args.json:
            args.json.write_text(json.dumps(figures, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
