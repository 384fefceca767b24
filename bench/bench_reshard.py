"""Benchmark `dsckpt reshard` against DeepSpeed's `ds_to_universal.py` (issue 13).

    python bench/bench_reshard.py                      # ZeRO-2 and ZeRO-3, ~330M parameters, 4 -> 3 ranks
    python bench/bench_reshard.py --layers 4 --runs 1  # a quick look

Steps:
1. Generate (cached under bench/cache/, shared with bench_consolidate.py) ZeRO-2 and ZeRO-3 checkpoints
   at world size 4: one AdamW step of the untied benchmark transformer (dim 1024, 26 blocks = ~330M).
2. Convert, alternating, each a whole child process, after `sync` (untimed), inputs page-cache warm:
   A `dsckpt reshard CKPT OUT --world-size 3 --no-fsync`;
   B `python -m deepspeed.checkpoint.ds_to_universal --input_folder CKPT/TAG --output_folder OUT
     --inject_missing_state` (its defaults: 4 extract and 2 merge worker processes; the flag adds the
     `universal_checkpoint_info` that a checkpoint of a plain model lacks).
   Wall time; peak memory of the whole process tree, sampled every 20 ms as the sum of the processes'
   PSS (proportional set size: ds_to_universal's workers share pages with their parent).
3. Load at world size 3 (bench/jobs/load_at_world_size.py under torchrun, ZeRO stage as saved):
   stock `engine.load_checkpoint` of A's output against `load_universal` of B's; the time of the
   load call alone, per rank, reported as the slowest rank's.
Figures are medians (min-max) of ``--runs`` runs; ratios compare runs of the same invocation.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PY = sys.executable
sys.path.insert(0, str(HERE))
from bench_consolidate import DIM, generate, settle  # noqa: E402  (the same cached checkpoints)

GiB = 2**30


def tree_pss(root_pid: int) -> int:
    """Sum of PSS over ``root_pid`` and its descendants (bytes); processes that vanish are skipped."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    total, stack = 0, [root_pid]
    while stack:
        pid = stack.pop()
        stack.extend(children.get(pid, []))
        try:
            with open(f"/proc/{pid}/smaps_rollup") as fh:
                total += next(int(line.split()[1]) * 1024 for line in fh if line.startswith("Pss:"))
        except (OSError, StopIteration):
            pass
    return total


def run_measured(cmd: list[str]) -> tuple[float, int]:
    """Wall seconds and peak process-tree PSS of ``cmd``."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peak, done = 0, threading.Event()

    def sample():
        nonlocal peak
        while not done.is_set():
            peak = max(peak, tree_pss(proc.pid))
            done.wait(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    _, err = proc.communicate()
    wall = time.perf_counter() - start
    done.set()
    sampler.join()
    if proc.returncode:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{err.decode()[-3000:]}")
    return wall, peak


def commands(ckpt: Path, scratch: Path, world_size: int) -> dict[str, tuple[list[str], Path]]:
    tag = (ckpt / "latest").read_text().strip()
    return {
        "dsckpt": ([PY, "-m", "dsckpt", "reshard", str(ckpt), str(scratch / "dsckpt"), "--world-size", str(world_size),
                    "-q", "--no-fsync", "--force"], scratch / "dsckpt"),
        "ds_to_universal": ([PY, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(ckpt / tag),
                             "--output_folder", str(scratch / "universal" / tag), "--inject_missing_state"],
                            scratch / "universal"),
    }


def convert(ckpt: Path, scratch: Path, runs: int, world_size: int) -> dict[str, list[tuple[float, int]]]:
    cmds = commands(ckpt, scratch, world_size)
    results: dict[str, list[tuple[float, int]]] = {k: [] for k in cmds}
    for _ in range(runs):
        for name, (cmd, out) in cmds.items():  # alternate, so drift hits both alike
            shutil.rmtree(out, ignore_errors=True)  # the previous output, removed untimed
            settle()
            results[name].append(run_measured(cmd))
    tag = (ckpt / "latest").read_text().strip()
    (scratch / "universal" / "latest_universal").write_text(tag)
    return results


def load_times(ckpt: Path, scratch: Path, world_size: int, layers: int) -> dict[str, float]:
    """Slowest rank's seconds inside ``engine.load_checkpoint`` for each converted output."""
    stage = json.loads(subprocess.run([PY, "-m", "dsckpt", "inspect", str(ckpt), "--json"], capture_output=True,
                                      text=True, check=True, cwd=ROOT).stdout)["zero_stage"]
    env = {**os.environ, "BENCH_DIM": str(DIM), "BENCH_LAYERS": str(layers), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    out = {}
    for name, folder, universal in (("dsckpt", scratch / "dsckpt", "0"), ("ds_to_universal", scratch / "universal", "1")):
        report = scratch / f"load_{name}.json"
        settle()
        subprocess.run([PY, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world_size}",
                        str(HERE / "jobs" / "load_at_world_size.py"), str(folder), str(stage), universal, str(report)],
                       check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        out[name] = max(json.loads(report.read_text()))
    return out


def fmt(values: list[float], unit: str = "s", scale: float = 1.0) -> str:
    xs = [v / scale for v in values]
    return f"{statistics.median(xs):.2f} {unit} ({min(xs):.2f}-{max(xs):.2f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=26)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--world-size", type=int, default=3)
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--no-load", action="store_true", help="skip the load-time comparison")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args()
    scratch = HERE / "out" / "reshard"
    figures = {}
    for stage in args.stages:
        ckpt = generate(stage, args.layers)
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir(parents=True)
        conv = convert(ckpt, scratch, args.runs, args.world_size)
        loads = {} if args.no_load else load_times(ckpt, scratch, args.world_size, args.layers)
        ckpt_bytes = sum(f.stat().st_size for f in ckpt.rglob("*.pt"))
        walls = {k: [w for w, _ in v] for k, v in conv.items()}
        mems = {k: [m for _, m in v] for k, v in conv.items()}
        ratio = statistics.median(walls["ds_to_universal"]) / statistics.median(walls["dsckpt"])
        mem_ratio = statistics.median(mems["dsckpt"]) / statistics.median(mems["ds_to_universal"])
        print(f"\nZeRO-{stage}, {ckpt.name} ({ckpt_bytes / GiB:.2f} GiB of rank files), 4 -> {args.world_size} ranks, "
              f"{args.runs} runs each, alternating")
        for name in conv:
            print(f"  {name:16s} wall {fmt(walls[name])}   peak tree PSS {fmt(mems[name], 'GiB', GiB)}")
        print(f"  dsckpt is {ratio:.1f}x faster and uses {mem_ratio:.2f}x the memory of ds_to_universal")
        if loads:
            print(f"  load at {args.world_size} ranks (slowest rank, load_checkpoint call): dsckpt's output "
                  f"{loads['dsckpt']:.2f} s, load_universal {loads['ds_to_universal']:.2f} s")
        figures[f"z{stage}"] = {"ckpt": ckpt.name, "ckpt_bytes": ckpt_bytes, "walls": walls, "pss": mems,
                                "speedup": ratio, "memory_ratio": mem_ratio, "load": loads}
        shutil.rmtree(scratch, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
