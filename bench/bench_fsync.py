"""What durability costs: `dsckpt consolidate` with fsync (the default) against `--no-fsync`.

    python bench/bench_fsync.py --layers 26 --runs 5

Uses the ZeRO-3 world-size-4 checkpoint of bench_consolidate.py (generated and cached there).
Runs alternate (fsync, no-fsync, ...); dirty pages are synced before each run (untimed) so no run pays
for another's writeback, and the previous output is removed untimed.  Prints medians and the ratio.
"""
from __future__ import annotations

import argparse
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
    args = ap.parse_args()
    ckpt = generate(3, args.layers)
    out_dir = HERE / "out"
    out_dir.mkdir(exist_ok=True)
    times: dict[str, list[float]] = {"fsync": [], "no-fsync": []}
    for _ in range(args.runs):
        for mode in times:
            out = out_dir / f"fsync_{mode}.safetensors"
            for stale in out_dir.glob(f"fsync_{mode}.safetensors*"):
                stale.unlink()
            subprocess.run(["sync"], check=True)
            extra = ["--no-fsync"] if mode == "no-fsync" else []
            wall, _, _ = timed([PY, "-m", "dsckpt", "consolidate", str(ckpt), str(out), "-q", *extra])
            times[mode].append(wall)
    size = (out_dir / "fsync_fsync.safetensors").stat().st_size
    med = {m: statistics.median(t) for m, t in times.items()}
    print(f"consolidate ZeRO-3 ws4 -> {size / 2**30:.2f} GiB safetensors, {args.runs} alternating runs each")
    for mode, ts in times.items():
        print(f"  {mode:<9} median {med[mode]:.2f} s (min {min(ts):.2f}, max {max(ts):.2f})")
    print(f"  fsync / no-fsync = {med['fsync'] / med['no-fsync']:.2f}x")


if __name__ == "__main__":
    main()
