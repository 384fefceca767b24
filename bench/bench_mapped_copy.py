"""Issue 25: consolidate's two ways of moving same-dtype bytes, and `cp` of what it writes.

    python bench/bench_mapped_copy.py [--layers 4] [--runs 7] [--stage 3]

In one process, alternating (the order reversed every other round), the output removed and dirty pages synced
before each run, the inputs warm (this script reads nothing else):
* ``mapped``: what ``io/writer._copy_range`` does - copy_file_range where source and destination offsets are
  in step within a page, a populated mapping of the source and ``pwrite`` where they are not;
* ``copy_file_range``: every piece with copy_file_range (the mapped path switched off);
* ``cp``: `cp --reflink=never` of the safetensors file consolidate wrote.
Prints each one's median and fastest run and the ratios of the medians.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from bench_consolidate import generate  # noqa: E402

import dsckpt  # noqa: E402
import dsckpt.io.writer as writer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--stage", type=int, default=3)
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()
    ckpt = generate(args.stage, args.layers)
    scratch = HERE / "out" / "mapped"
    scratch.mkdir(parents=True, exist_ok=True)
    out, copy = scratch / "c.safetensors", scratch / "c_cp.safetensors"
    mapped = writer._copy_mapped

    def consolidate(use_map: bool) -> float:
        writer._copy_mapped = mapped if use_map else (lambda src, dst, n, s, d, path: (n, s, d))
        out.unlink(missing_ok=True)
        os.sync()
        start = time.perf_counter()
        dsckpt.consolidate(ckpt, out, fsync=False, client_state=False)
        return time.perf_counter() - start

    def cp() -> float:
        copy.unlink(missing_ok=True)
        os.sync()
        start = time.perf_counter()
        subprocess.run(["cp", "--reflink=never", str(out), str(copy)], check=True)
        return time.perf_counter() - start

    ways = {"mapped": lambda: consolidate(True), "copy_file_range": lambda: consolidate(False), "cp": cp}
    consolidate(True)  # untimed: imports, and cp's input
    times: dict[str, list[float]] = {name: [] for name in ways}
    for run in range(args.runs):
        for name in (list(ways) if run % 2 else list(ways)[::-1]):
            times[name].append(ways[name]())
    med = {name: statistics.median(v) for name, v in times.items()}
    print(f"{ckpt.name}: consolidate to {out.stat().st_size / 2**20:,.0f} MiB, {args.runs} alternating runs, "
          f"{os.cpu_count()} CPUs")
    for name, v in times.items():
        print(f"  {name:<16} median {med[name]:.3f} s  fastest {min(v):.3f} s  ({', '.join(f'{x:.3f}' for x in v)})")
    print(f"  mapped / copy_file_range {med['mapped'] / med['copy_file_range']:.2f}x   mapped / cp "
          f"{med['mapped'] / med['cp']:.2f}x   copy_file_range / cp {med['copy_file_range'] / med['cp']:.2f}x")
    out.unlink(missing_ok=True)
    copy.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
