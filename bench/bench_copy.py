"""Consolidate against a plain copy of the same byte count (issue 16's yardstick).

    python bench/bench_copy.py --layers 26 --runs 5 [--stages 3 2]

For each stage: the ZeRO checkpoint of bench_consolidate.py (cached), consolidated to one safetensors
file and to a sharded folder (`--no-fsync`, as `cp` does not flush either), alternating with
`cp --reflink=never` of a file of the output's size.  `sync` and removal of old outputs between runs,
untimed; inputs page-cache warm.  Prints medians and the ratio to cp.
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_consolidate import HERE, PY, generate, timed  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=26)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--stages", type=int, nargs="+", default=[3])
    args = ap.parse_args()
    out = HERE / "out"
    out.mkdir(exist_ok=True)
    for stage in args.stages:
        ckpt = generate(stage, args.layers)
        source = out / "copy_source.bin"
        subprocess.run([PY, "-m", "dsckpt", "consolidate", str(ckpt), str(source.with_suffix(".safetensors")), "-q",
                        "--force", "--no-client-state", "--no-fsync"], check=True)
        source.with_suffix(".safetensors").replace(source)
        cases = {"cp": ["cp", "--reflink=never", str(source), str(out / "copy_dest.bin")],
                 "safetensors": [PY, "-m", "dsckpt", "consolidate", str(ckpt), str(out / "c.safetensors"), "-q",
                                 "--no-client-state", "--no-fsync"],
                 "sharded": [PY, "-m", "dsckpt", "consolidate", str(ckpt), str(out / "c_sharded"), "-q",
                             "--no-client-state", "--no-fsync", "--max-shard-size", "2GB"]}
        times: dict[str, list[float]] = {k: [] for k in cases}
        for _ in range(args.runs):
            for name, cmd in cases.items():
                for stale in (out / "copy_dest.bin", out / "c.safetensors", out / "c_sharded"):
                    shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() else stale.unlink(missing_ok=True)
                subprocess.run(["sync"], check=True)
                times[name].append(timed(cmd)[0])
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"ZeRO-{stage}, {source.stat().st_size / 2**30:.2f} GiB, {args.runs} alternating runs (median, min-max):")
        for name, ts in times.items():
            ratio = "" if name == "cp" else f"   {med[name] / med['cp']:.2f}x cp"
            print(f"  {name:<12} {med[name]:.2f} s ({min(ts):.2f}-{max(ts):.2f}){ratio}")
        source.unlink()


if __name__ == "__main__":
    main()
