"""Pinned host buffers for a background save's snapshot: torch's pinned allocator against pinning in place (issue 54).

The background engine copies a rank's GPU state into pinned host buffers it keeps from save to save, so their size
is the host memory a save costs.  torch's pinned allocator (``torch.empty(..., pin_memory=True)``,
``CachingHostAllocator``) rounds every allocation up to a power of two; ``checkpoint_engine.snapshot.HostPool`` maps each
buffer on pages of its own and pins it in place (``pin_in_place``: ``cudaHostRegister``).  Each method runs in a
fresh process, alternating: the time to allocate and pin buffers of the given sizes, the host memory the system lost
(``MemAvailable`` before and after), and a device-to-host copy into one buffer (pinned memory takes it at the link's
speed, pageable memory far slower).  docs/dev/performance-log.md 34-35.

    python bench/bench_pinning.py --sizes-gb 4.84,4.84,4.84 --rounds 2     (on a GPU host)
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def one(method: str, sizes: list[int]) -> dict:
    import torch

    sys.path.insert(0, str(ROOT))
    from dsckpt.checkpoint_engine.snapshot import HostPool

    torch.cuda.init()
    source = torch.ones(1 << 30, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    pool = HostPool()
    before = available()
    t0 = time.perf_counter()
    if method == "torch":
        buffers = [torch.empty(n, dtype=torch.uint8, pin_memory=True).untyped_storage() for n in sizes]
    else:
        buffers = [pool.take(n, pinned=True) for n in sizes]
        if len(pool.pinned) != len(buffers):
            raise SystemExit("cudaHostRegister refused a buffer: HostPool fell back to torch's allocator")
    pin_s = time.perf_counter() - t0
    lost = before - available()
    host = torch.empty(0, dtype=torch.uint8).set_(buffers[0], 0, (source.numel(),))
    rates = []
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        host.copy_(source, non_blocking=True)
        torch.cuda.synchronize()
        rates.append(source.numel() / 1e9 / (time.perf_counter() - t0))
    pinned = host.is_pinned()  # (asked before the buffers are unpinned)
    pool.close()
    return {"method": method, "pin_s": pin_s, "host_bytes_lost": lost, "state_bytes": sum(sizes),
            "d2h_gbps": max(rates), "is_pinned": pinned}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes-gb", default="4.84,4.84,4.84", help="the buffers of one rank's state, in GB")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child: METHOD
    args = ap.parse_args()
    sizes = [int(float(x) * 1e9) for x in args.sizes_gb.split(",")]
    if args.one:
        print(json.dumps(one(args.one, sizes)))
        return
    rows = []
    for r in range(args.rounds):
        for method in (["torch", "in-place"] if r % 2 == 0 else ["in-place", "torch"]):
            done = subprocess.run([sys.executable, __file__, "--sizes-gb", args.sizes_gb, "--one", method],
                                  capture_output=True, text=True, check=True)
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    state = sum(sizes)
    print(f"{state / 1e9:.2f} GB of buffers ({args.sizes_gb} GB), {args.rounds} rounds, medians:")
    for method in ("torch", "in-place"):
        mine = [r for r in rows if r["method"] == method]
        pin = statistics.median(r["pin_s"] for r in mine)
        lost = statistics.median(r["host_bytes_lost"] for r in mine)
        rate = statistics.median(r["d2h_gbps"] for r in mine)
        print(f"  {method:9s} allocate and pin {pin:.2f} s; host memory taken {lost / 1e9:.2f} GB "
              f"({lost / state:.2f}x the buffers); device-to-host copy {rate:.1f} GB/s; pinned {mine[0]['is_pinned']}")
    if args.json:
        args.json.write_text(json.dumps({"sizes": sizes, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
