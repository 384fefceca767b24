"""Issue 28: consolidate and reshard on N processes of one host, against `cp -r` of the same bytes.

    python bench/bench_parallel.py [--layers 8] [--procs 1 2 4 8] [--runs 2]
    BENCH_DIM=2048 python bench/bench_parallel.py --layers 16 --procs 1 2 4 8   (~1B parameters, 16-core host)

Checkpoints: bench_consolidate.generate (one AdamW step of its transformer, ZeRO-2 and ZeRO-3 at world size 4,
cached under bench/cache/; trained on CPU ranks).  For each N, alternating, each a fresh process tree under a
wrapper that reports the largest peak RSS of any one process (``os.wait4``), dirty pages synced before each
run (untimed), inputs page-cache warm:
  dsckpt reshard CKPT OUT -w 8 --nproc N --no-fsync        then   cp -r OUT (the same bytes)
  dsckpt consolidate CKPT OUT.safetensors --nproc N --no-fsync    then   cp OUT.safetensors
N = 1 runs without --nproc (one process, no torch.distributed).  Prints medians, GB/s and the ratio to cp.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")  # the checkpoints are trained on CPU ranks, also on a GPU host
os.environ.setdefault("DS_ACCELERATOR", "cpu")
from bench_consolidate import PY, generate, settle, timed  # noqa: E402


def size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def fresh(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    for sidecar in path.parent.glob(path.name + ".client_state.*"):
        sidecar.unlink()


def run(cmd: list[str]) -> tuple[float, int]:
    settle()
    wall, rss, _ = timed(cmd)
    return wall, rss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--procs", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--world-size", type=int, default=8, help="reshard target")
    args = ap.parse_args()
    scratch = HERE / "out" / "parallel"
    scratch.mkdir(parents=True, exist_ok=True)
    print(f"{os.cpu_count()} CPUs; dim {os.environ.get('BENCH_DIM', '1024')}, {args.layers} layers; "
          f"{args.runs} alternating runs; medians\n")
    print("| checkpoint | command | N | seconds | GB/s | / cp | peak RSS per process MiB |")
    print("|---|---|---|---|---|---|---|")
    for stage in (2, 3):
        ckpt = generate(stage, args.layers)
        for command in ("reshard", "consolidate"):
            out, copy = scratch / f"{command}_out", scratch / f"{command}_cp"
            if command == "consolidate":
                out, copy = out.with_suffix(".safetensors"), copy.with_suffix(".safetensors")
            for n in args.procs:
                ours, cps, rss = [], [], []
                for _ in range(args.runs):
                    fresh(out)
                    cmd = [PY, "-m", "dsckpt", command, str(ckpt), str(out), "--no-fsync", "-q"]
                    cmd += ["-w", str(args.world_size)] if command == "reshard" else []
                    cmd += ["--nproc", str(n)] if n > 1 else []
                    wall, peak = run(cmd)
                    ours.append(wall)
                    rss.append(peak)
                    fresh(copy)
                    cps.append(run(["cp", "-r", "--reflink=never", str(out), str(copy)])[0])
                nbytes = size(out)
                t, c = statistics.median(ours), statistics.median(cps)
                print(f"| ZeRO-{stage} {size(ckpt) / 2**30:.2f} GiB | {command} | {n} | {t:.2f} | "
                      f"{nbytes / t / 1e9:.2f} | {t / c:.2f}x | {max(rss) / 2**20:,.0f} |", flush=True)
                fresh(out)
                fresh(copy)


if __name__ == "__main__":
    main()
