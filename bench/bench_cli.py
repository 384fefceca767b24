"""What a command costs as a user types it (issue 56): start-up, and consolidate against `cp` of the same bytes.

    python bench/bench_cli.py [--runs 15] [--layers 26] [--big-runs 5]

Every figure is a fresh process started the way a shell starts it (the installed `dsckpt` script beside this
interpreter), median of ``--runs``, the jobs of a set alternating (each round in the reverse order of the last):
  start-up       the bare interpreter (`python -c pass`), `dsckpt --version`, `inspect` and `consolidate` of a
                 committed fixture (fixtures/z3_ws2_fp32): the fixed cost, the interpreter's share beside it
  330M ZeRO-3    `consolidate --no-fsync -q` of bench_consolidate.py's checkpoint (``--layers`` 26: 1.3 GB out,
                 generated once, cached) against `cp` of the file it writes; the input warm, the output removed
                 and dirty pages synced before every run; with and without ``--skip-crc-check``
Targets (issue 56): consolidate of a tiny checkpoint under 0.08 s, `inspect` within 0.1 s of the bare
interpreter, the 330M consolidate within 1.25x `cp`.  ``--json FILE`` writes the figures.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

DSCKPT = str(Path(sys.executable).parent / "dsckpt")
FIXTURE = ROOT / "fixtures" / "z3_ws2_fp32"


def timed(cmd: list[str], before=None) -> float:
    if before is not None:
        before()
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    return time.perf_counter() - start


def alternating(jobs: dict[str, tuple[list[str], object]], runs: int) -> dict[str, float]:
    """Median seconds of each job, its rounds alternating in order."""
    times: dict[str, list[float]] = {name: [] for name in jobs}
    for round_ in range(runs):
        for name in (list(jobs) if round_ % 2 == 0 else list(reversed(jobs))):
            cmd, before = jobs[name]
            times[name].append(timed(cmd, before))
    return {name: statistics.median(values) for name, values in times.items()}


def removing(*paths: Path):
    def clear() -> None:
        for path in paths:
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
        os.sync()
    return clear


def start_up(scratch: Path, runs: int) -> dict[str, float]:
    tiny = scratch / "tiny.safetensors"
    sidecars = [scratch / "tiny.safetensors.client_state.json", scratch / "tiny.safetensors.client_state.safetensors"]
    return alternating({
        "python -c pass": ([sys.executable, "-c", "pass"], None),
        "dsckpt --version": ([DSCKPT, "--version"], None),
        "inspect (fixture)": ([DSCKPT, "inspect", str(FIXTURE)], None),
        "consolidate (fixture)": ([DSCKPT, "consolidate", str(FIXTURE), str(tiny)], removing(tiny, *sidecars)),
    }, runs)


def big(scratch: Path, layers: int, runs: int) -> dict[str, float]:
    from bench_consolidate import generate

    ckpt = generate(3, layers)
    out, copy = scratch / "big.safetensors", scratch / "copy.safetensors"
    consolidate = [DSCKPT, "consolidate", str(ckpt), str(out), "--no-fsync", "-q", "--no-client-state"]
    subprocess.run(consolidate, check=True, cwd=ROOT, capture_output=True)  # the file cp copies
    for path in ckpt.rglob("*.pt"):
        path.read_bytes()  # warm
    figures = alternating({
        "consolidate": (consolidate, removing(out)),
        "consolidate --skip-crc-check": (consolidate + ["--skip-crc-check"], removing(out)),
        "cp": (["cp", str(out), str(copy)], removing(copy)),
    }, runs)
    figures["output_bytes"] = out.stat().st_size
    removing(out, copy)()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=15, help="start-up runs of each command")
    parser.add_argument("--layers", type=int, default=26, help="blocks of the large checkpoint (0: none)")
    parser.add_argument("--big-runs", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    scratch = HERE / "out" / "cli"
    scratch.mkdir(parents=True, exist_ok=True)
    timed([DSCKPT, "inspect", str(FIXTURE)])  # (compiled, cached)
    s = start_up(scratch, args.runs)
    result: dict[str, object] = {"start_up_s": s}
    bare = s["python -c pass"]
    print(f"start-up, median of {args.runs} (ms): " + ", ".join(f"{k} {v * 1e3:.0f}" for k, v in s.items()))
    print(f"  consolidate of a fixture {s['consolidate (fixture)'] * 1e3:.0f} ms (target < 80), "
          f"{(s['consolidate (fixture)'] - bare) * 1e3:.0f} ms over the bare interpreter; "
          f"inspect +{(s['inspect (fixture)'] - bare) * 1e3:.0f} ms over it (target < 100)")
    if args.layers:
        b = big(scratch, args.layers, args.big_runs)
        result["big_s"] = b
        print(f"{b['output_bytes'] / 1e9:.2f} GB out, median of {args.big_runs}: consolidate {b['consolidate']:.3f} s, "
              f"--skip-crc-check {b['consolidate --skip-crc-check']:.3f} s, cp {b['cp']:.3f} s: "
              f"{b['consolidate'] / b['cp']:.2f}x cp ({b['consolidate --skip-crc-check'] / b['cp']:.2f}x without the "
              f"CRC checks; target 1.25x)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
