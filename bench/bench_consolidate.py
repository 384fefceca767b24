"""Benchmark dsckpt consolidate / inspect against DeepSpeed's zero_to_fp32 on real checkpoints.

    python bench/bench_consolidate.py [--dim 1024 --layers 8] [--runs 3] [--stages 3 2]

1. Generates (and caches under bench/cache/) ZeRO-3 and ZeRO-2 checkpoints at world size 4 with the
   dsckpt runtime: one real AdamW step of a transformer-shaped model.
2. Measures, alternating A and B, each command as a whole child process: wall time and peak RSS
   (the child's ru_maxrss from os.wait4): `dsckpt consolidate CKPT out.safetensors` vs
   `python -m deepspeed.utils.zero_to_fp32 CKPT OUTDIR --safe_serialization`.
3. Measures `dd` sequential read/write of the same byte count and `dsckpt inspect --json`.
Prints a markdown table of medians and min-max; ratios are within the same run.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PY = sys.executable


def run(cmd: list[str], env=None) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes) of one child process."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd=ROOT)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{proc.stderr.read().decode()[-2000:]}")
    return wall, usage.ru_maxrss * 1024


def generate(stage: int, dim: int, layers: int) -> Path:
    ckpt = HERE / "cache" / f"z{stage}_d{dim}_l{layers}_ws4"
    if (ckpt / "latest").exists():
        return ckpt
    shutil.rmtree(ckpt, ignore_errors=True)
    env = {**os.environ, "BENCH_DIM": str(dim), "BENCH_LAYERS": str(layers), "PYTHONPATH": str(ROOT)}
    subprocess.run([PY, "-m", "dsckpt", "train", "--model", "bench.models:transformer", "--stage", str(stage),
                    "--nproc", "4", "--steps", "1", "--save-dir", str(ckpt)], check=True, env=env, cwd=ROOT)
    return ckpt


def dd_rate(nbytes: int, scratch: Path) -> tuple[float, float]:
    """Sequential write then read of nbytes (16 MiB blocks); returns (write s, read s)."""
    count = max(1, nbytes // (16 << 20))
    f = scratch / "dd.bin"
    w, _ = run(["dd", "if=/dev/zero", f"of={f}", "bs=16M", f"count={count}", "conv=fsync"])
    r, _ = run(["dd", f"if={f}", "of=/dev/null", "bs=16M"])
    f.unlink()
    return w, r


def fmt(values: list[float], scale: float = 1.0, unit: str = "") -> str:
    vs = [v / scale for v in values]
    return f"{statistics.median(vs):.2f}{unit} ({min(vs):.2f}-{max(vs):.2f})"


def bench(ckpt: Path, runs: int, scratch: Path) -> dict:
    out = scratch / "dsckpt.safetensors"
    ds_out = scratch / "z2f"
    ours_cmd = [PY, "-m", "dsckpt", "consolidate", str(ckpt), str(out), "--force", "-q", "--no-client-state"]
    theirs_cmd = [PY, "-m", "deepspeed.utils.zero_to_fp32", str(ckpt), str(ds_out), "--safe_serialization"]
    ours, theirs = [], []
    for _ in range(runs):
        ours.append(run(ours_cmd))
        shutil.rmtree(ds_out, ignore_errors=True)
        theirs.append(run(theirs_cmd))
    size = out.stat().st_size
    inspect = [run([PY, "-m", "dsckpt", "inspect", str(ckpt), "--json"]) for _ in range(runs)]
    w, r = dd_rate(size, scratch)
    return {"ckpt": ckpt.name, "bytes": size, "ours": ours, "theirs": theirs, "inspect": inspect, "dd": (w, r)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--stages", type=int, nargs="+", default=[3, 2])
    args = ap.parse_args()
    scratch = HERE / "out"
    scratch.mkdir(exist_ok=True)
    print("| checkpoint | output | dsckpt s | zero_to_fp32 s | speed-up | dsckpt RSS MiB | z2f RSS MiB | RSS ratio | disk-bound % | inspect s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for stage in args.stages:
        r = bench(generate(stage, args.dim, args.layers), args.runs, scratch)
        ot, tt = [w for w, _ in r["ours"]], [w for w, _ in r["theirs"]]
        orss, trss = [m for _, m in r["ours"]], [m for _, m in r["theirs"]]
        # bytes that must move: fp32 weights read + output written, at dd's measured rates
        floor = r["dd"][0] + r["dd"][1]
        print(f"| {r['ckpt']} | {r['bytes'] / 2**20:.0f} MiB | {fmt(ot)} | {fmt(tt)} | "
              f"{statistics.median(tt) / statistics.median(ot):.1f}x | {fmt(orss, 2**20)} | {fmt(trss, 2**20)} | "
              f"{statistics.median(orss) / statistics.median(trss):.2f} | {100 * floor / statistics.median(ot):.0f} | "
              f"{fmt([w for w, _ in r['inspect']])} |")
    shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
