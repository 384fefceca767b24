"""What starting the disk early buys a durable output (``io.writeback``): consolidate and reshard, fsync on, with
the write-back started as each range lands against without it.

    python bench/bench_writeback.py --layers 4 --runs 5

In one process, alternating (on, off, on, ...); ``os.sync()`` before each run (untimed) so no run pays for
another's pages.  "off" is the same code with ``sync_file_range`` unavailable.  Uses the ZeRO-3 world-size-4
checkpoint of bench_consolidate.py (generated and cached there).  Prints medians and the on / off ratio.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_consolidate import HERE, generate  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    import dsckpt
    import dsckpt.io.writeback as writeback

    ckpt = generate(3, args.layers)
    out = HERE / "out" / "writeback"
    bind = writeback._bind
    unavailable = lambda: None  # noqa: E731

    def run(command: str) -> float:
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        os.sync()
        start = time.perf_counter()
        if command == "consolidate":
            dsckpt.consolidate(ckpt, out / "model.safetensors")
        else:
            dsckpt.reshard(ckpt, out / "ws3", 3)
        return time.perf_counter() - start

    print(f"bench_writeback: {ckpt.name}, durable outputs, {args.runs} alternating runs, medians")
    for command in ("consolidate", "reshard"):
        times: dict[str, list[float]] = {"on": [], "off": []}
        for _ in range(args.runs):
            for state in ("on", "off"):
                writeback._bind = bind if state == "on" else unavailable
                times[state].append(run(command))
        on, off = statistics.median(times["on"]), statistics.median(times["off"])
        print(f"  {command:<12} on {on:.3f} s  off {off:.3f} s  on / off {on / off:.2f}x")
    writeback._bind = bind
    shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
