"""`dsckpt convert` against DeepSpeed's ds_to_universal (issue 27): time and peak memory, alternating runs.

    python bench/bench_convert.py [--layers 4] [--runs 3] [--workers 2]

On bench_consolidate.py's transformer (cached ZeRO-2 and ZeRO-3 checkpoints at world size 4, page-cache warm,
dirty pages synced before every run, untimed), each run a fresh process under /usr/bin/time (wall seconds,
peak RSS of the largest process):
  dsckpt convert --to universal --no-fsync   vs   ds_to_universal --inject_missing_state (--num_*_workers W;
                                                  it does not fsync)
  dsckpt convert --to dcp --no-fsync         vs   cp -r of the folder it wrote (the same bytes)
Prints medians and their ratios, and the largest tensor (what a tensor-by-tensor writer must hold).
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from bench_consolidate import generate, settle  # noqa: E402

PY = sys.executable


def timed(cmd: list[str]) -> tuple[float, float]:
    """(wall seconds, peak RSS MiB) of one command in a fresh process."""
    settle()
    proc = subprocess.run(["/usr/bin/time", "-f", "%e %M", *cmd], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{cmd[:4]} failed:\n{proc.stderr[-3000:]}")
    wall, kib = proc.stderr.strip().splitlines()[-1].split()
    return float(wall), int(kib) / 1024


def fresh(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    for sidecar in path.parent.glob(path.name + ".client_state.*"):  # beside a DCP folder
        sidecar.unlink()


def size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    scratch = HERE / "out" / "convert"
    scratch.mkdir(parents=True, exist_ok=True)
    from dsckpt import open_checkpoint

    for stage in (2, 3):
        ckpt = generate(stage, args.layers)
        opened = open_checkpoint(ckpt)
        tag = opened.layout.tag
        largest = max(__import__("math").prod(s) for g in opened.param_groups for s in g.values()) * 4 / 2**20
        ours_u, theirs_u, ours_d, copy_d = (scratch / n for n in ("ours_u", "ds_u", "ours_dcp", "cp_dcp"))
        runs = {k: [] for k in ("dsckpt universal", "ds_to_universal", "dsckpt dcp", "cp of the dcp folder")}
        for _ in range(args.runs):
            fresh(ours_u)
            runs["dsckpt universal"].append(timed([PY, "-m", "dsckpt", "convert", str(ckpt), str(ours_u), "--to",
                                                   "universal", "-q", "--no-fsync"]))
            fresh(theirs_u)
            runs["ds_to_universal"].append(timed([PY, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                                                  str(ckpt / tag), "--output_folder", str(theirs_u / tag), "--inject_missing_state",
                                                  "--num_extract_workers", str(args.workers),
                                                  "--num_merge_workers", str(args.workers)]))
            fresh(ours_d)
            runs["dsckpt dcp"].append(timed([PY, "-m", "dsckpt", "convert", str(ckpt), str(ours_d), "--to", "dcp",
                                             "-q", "--no-fsync"]))
            fresh(copy_d)
            runs["cp of the dcp folder"].append(timed(["cp", "-r", "--reflink=never", str(ours_d), str(copy_d)]))
        med = {k: (statistics.median(w for w, _ in v), max(m for _, m in v)) for k, v in runs.items()}
        print(f"\nZeRO-{stage}, {args.layers} layers, world size 4: input {size(ckpt / tag) / 2**20:,.0f} MiB, "
              f"universal {size(ours_u) / 2**20:,.0f} MiB, dcp {size(ours_d) / 2**20:,.0f} MiB, "
              f"largest tensor {largest:,.0f} MiB (fp32); {args.runs} alternating runs")
        for k, (wall, rss) in med.items():
            print(f"  {k:22s} {wall:7.2f} s  (all: {', '.join(f'{w:.2f}' for w, _ in runs[k])})   peak RSS {rss:7.0f} MiB")
        print(f"  ds_to_universal / dsckpt universal: {med['ds_to_universal'][0] / med['dsckpt universal'][0]:.1f}x time, "
              f"{med['ds_to_universal'][1] / med['dsckpt universal'][1]:.1f}x memory;  "
              f"dsckpt dcp / cp: {med['dsckpt dcp'][0] / med['cp of the dcp folder'][0]:.2f}x")
        for p in (ours_u, theirs_u, ours_d, copy_d):
            fresh(p)


if __name__ == "__main__":
    main()
