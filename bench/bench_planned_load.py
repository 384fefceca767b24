"""Loading at another world size without a copy (issue 54): DeepSpeed's load of a checkpoint written at M ranks,
against the load of one written at N ranks answered from the reshard plan (checkpoint_engine.planned_load), alternating.

The N-rank checkpoint is trained here (dsckpt train, the benchmark transformer); the M-rank one is `dsckpt reshard`
of it, so both hold the same state.  Reported: median seconds of the slowest rank, and per rank the bytes read
against the rank's share of the M-rank checkpoint (its own files).

    python bench/bench_planned_load.py --from 2 --to 3 --stage 3 --dim 512 --layers 8 --rounds 5
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
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--from", dest="source", type=int, default=2)
    ap.add_argument("--to", type=int, default=3)
    ap.add_argument("--stage", type=int, default=3)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from dsckpt.runtime.launch import run_ranks

    work = Path(tempfile.mkdtemp(prefix="bench-planned-"))
    env = {**os.environ, "BENCH_DIM": str(args.dim), "BENCH_LAYERS": str(args.layers),
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "bench")])}
    dsckpt = [sys.executable, "-m", "dsckpt"]
    try:
        subprocess.run([*dsckpt, "train", "--model", "models:transformer", "--stage", str(args.stage), "--nproc",
                        str(args.source), "--steps", "1", "--save-dir", str(work / "n")],
                       check=True, env=env, capture_output=True)
        subprocess.run([*dsckpt, "reshard", str(work / "n"), str(work / "m"), "-w", str(args.to)], check=True,
                       env=env, capture_output=True)
        report = work / "report.json"
        codes = run_ranks([sys.executable, str(ROOT / "bench" / "jobs" / "planned_load_rank.py"), str(work / "m"),
                           str(work / "n"), str(args.stage), str(args.rounds), str(report)], args.to, env)
        if any(codes):
            raise SystemExit(f"ranks exited {codes}")
        rows = json.loads(report.read_text())
        tag = (work / "m" / "latest").read_text().strip()
        files = sorted((work / "m" / tag).iterdir())
        share = [sum(f.stat().st_size for f in files if f"_rank_{r}_" in f.name or f.name.startswith("mp_rank"))
                 for r in range(args.to)]
        modes = ("stock", "planned", "planned-no-crc")
        med = {m: statistics.median(r["seconds"] for r in rows if r["mode"] == m) for m in modes}
        read = {m: [statistics.median(r["bytes"][k] for r in rows if r["mode"] == m) for k in range(args.to)]
                for m in modes}
        print(f"ZeRO-{args.stage}, {args.source} -> {args.to} ranks, {args.rounds} alternating rounds (medians)")
        print(f"  load: stock of the {args.to}-rank copy {med['stock']:.3f} s, planned from the {args.source}-rank "
              f"files {med['planned']:.3f} s ({med['planned'] / med['stock']:.2f}x), without the CRC check "
              f"{med['planned-no-crc']:.3f} s ({med['planned-no-crc'] / med['stock']:.2f}x)")
        for k in range(args.to):
            print(f"  rank {k}: read stock {read['stock'][k] / 1e6:.1f} MB (its files: {share[k] / 1e6:.1f} MB), "
                  f"planned {read['planned'][k] / 1e6:.1f} MB ({read['planned'][k] / read['stock'][k]:.2f}x stock), "
                  f"without the CRC check {read['planned-no-crc'][k] / 1e6:.1f} MB "
                  f"({read['planned-no-crc'][k] / read['stock'][k]:.2f}x)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
