"""Benchmark dsckpt against DeepSpeed's zero_to_fp32 on real checkpoints written by the dsckpt runtime.

    python bench/bench_consolidate.py                     # main scenarios + scaling series
    python bench/bench_consolidate.py --layers 26 --runs 5 --scaling 4 12 26 --plot docs/scaling.png

Steps:
1. Generate (cached under bench/cache/) ZeRO-3 and ZeRO-2 checkpoints at world size 4: one real AdamW
   step of an untied transformer (dim 1024, ``--layers`` blocks; 26 blocks = ~330M parameters, the
   largest that fits 24 GiB at world size 4 here).
2. Consolidate, alternating A/B/C, each a whole child process (wall time, peak RSS = ru_maxrss):
   A `dsckpt consolidate CKPT out.safetensors` (also to `.pt`, and with `--dtype bf16`);
   B `python -m deepspeed.utils.zero_to_fp32 CKPT DIR --safe_serialization`; C zero_to_fp32's Python API writing one file
   (`get_fp32_state_dict_from_zero_checkpoint` + `torch.save`).  Dirty pages are synced before every
   run (untimed) so no run pays for the previous one's writeback; inputs stay page-cache warm.
3. Disk floor: `dd` writes and re-reads the output's byte count (16 MiB blocks, page cache as warm as
   for the consolidators); `inspect --json` time and the bytes it read (/proc/self/io rchar).
4. Scaling series at ZeRO-3 over ``--scaling`` block counts; optional PNG plot (matplotlib).
Figures are medians (min-max) of ``--runs`` runs; ratios compare runs of the same invocation.
"""
from __future__ import annotations

import argparse
import json
import math
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
DIM = int(os.environ.get("BENCH_DIM", "1024"))  # bigger hosts: BENCH_DIM=2048 --layers 40 is ~2B parameters
MiB = 2**20

Z2F_API = ("import sys, torch; from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint as g; "
           "torch.save(g(sys.argv[1]), sys.argv[2])")
INSPECT_IO = ("import sys, json; rc = lambda: int(open('/proc/self/io').read().split()[1]); from dsckpt.analysis.inspect import summarize; "
              "a = rc(); summarize(sys.argv[1]); print(rc() - a)")


def timed(cmd: list[str]) -> tuple[float, int, str]:
    """Run ``cmd`` under a tiny wrapper that reports its own child's peak RSS exactly."""
    wall, rss, _, out = timed_cpu(cmd)
    return wall, rss, out


def timed_cpu(cmd: list[str]) -> tuple[float, int, float, str]:
    """``timed``, with the CPU seconds (user + system) of ``cmd``'s process tree."""
    wrapper = ("import os, subprocess, sys, time, json; t = time.perf_counter(); p = subprocess.Popen(sys.argv[1:], "
               "stdout=subprocess.PIPE); out = p.stdout.read(); _, st, ru = os.wait4(p.pid, 0); "
               "c = os.times(); sys.stderr.write(json.dumps([time.perf_counter() - t, ru.ru_maxrss * 1024, "
               "os.waitstatus_to_exitcode(st), c.children_user + c.children_system]) + '\\n'); "
               "sys.stdout.buffer.write(out)")
    proc = subprocess.run([PY, "-c", wrapper, *cmd], capture_output=True, cwd=ROOT)
    wall, rss, code, cpu = json.loads(proc.stderr.decode().strip().splitlines()[-1])
    if code != 0:
        raise SystemExit(f"failed ({code}): {' '.join(cmd)}\n{proc.stderr.decode()[-3000:]}")
    return wall, rss, cpu, proc.stdout.decode()


def generate(stage: int, layers: int) -> Path:
    ckpt = HERE / "cache" / f"z{stage}_d{DIM}_l{layers}_ws4"
    if (ckpt / "latest").exists():
        return ckpt
    shutil.rmtree(ckpt, ignore_errors=True)
    env = {**os.environ, "BENCH_DIM": str(DIM), "BENCH_LAYERS": str(layers), "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    subprocess.run([PY, "-m", "dsckpt", "train", "--model", "bench.models:transformer", "--stage", str(stage),
                    "--nproc", "4", "--steps", "1", "--save-dir", str(ckpt)], check=True, env=env, cwd=ROOT,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return ckpt


OUTPUTS = {"dsckpt": lambda d: d / "d.safetensors", "z2f_cli": lambda d: d / "z2f", "z2f_api": lambda d: d / "z2f_api.bin",
           "dsckpt_pt": lambda d: d / "d.pt", "dsckpt_bf16": lambda d: d / "d_bf16.safetensors"}


def consolidators(ckpt: Path, scratch: Path) -> dict[str, list[str]]:
    # --no-fsync: zero_to_fp32 (torch.save / safetensors) returns before its data reaches the disk, so
    # dsckpt is compared the same way; what fsync adds is measured by bench_fsync.py.
    return {
        "dsckpt": [PY, "-m", "dsckpt", "consolidate", str(ckpt), str(scratch / "d.safetensors"), "--force", "-q",
                   "--no-client-state", "--no-fsync"],
        "z2f_cli": [PY, "-m", "deepspeed.utils.zero_to_fp32", str(ckpt), str(scratch / "z2f"), "--safe_serialization"],
        "z2f_api": [PY, "-c", Z2F_API, str(ckpt), str(scratch / "z2f_api.bin")],
        "dsckpt_pt": [PY, "-m", "dsckpt", "consolidate", str(ckpt), str(scratch / "d.pt"), "--force", "-q",
                      "--no-client-state", "--no-fsync"],
        "dsckpt_bf16": [PY, "-m", "dsckpt", "consolidate", str(ckpt), str(scratch / "d_bf16.safetensors"), "--force",
                        "-q", "--no-client-state", "--no-fsync", "--dtype", "bf16"],
    }


def measure(ckpt: Path, runs: int, scratch: Path,
            which=("dsckpt", "z2f_cli", "z2f_api", "dsckpt_pt", "dsckpt_bf16")) -> dict:
    cmds = consolidators(ckpt, scratch)
    results: dict[str, list[tuple[float, int]]] = {k: [] for k in which}
    for _ in range(runs):
        for name in which:  # alternate, so drift hits every tool alike
            old = OUTPUTS[name](scratch)  # a tool's previous output is removed untimed, for every tool alike:
            shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink(missing_ok=True)  # (unlink+discard ~1 s)
            settle()
            wall, rss, _ = timed(cmds[name])
            results[name].append((wall, rss))
    out_bytes = sum(math.prod(i["shape"]) * 4 for k, i in _header(scratch / "d.safetensors").items() if k != "__metadata__")
    inspect = [timed([PY, "-m", "dsckpt", "inspect", str(ckpt), "--json"])[0] for _ in range(runs)]
    inspect_read = int(timed([PY, "-c", INSPECT_IO, str(ckpt)])[2].strip())
    dd = dd_floor(out_bytes, scratch)
    ckpt_bytes = sum(f.stat().st_size for f in ckpt.rglob("*.pt"))
    return {"ckpt": ckpt.name, "ckpt_bytes": ckpt_bytes, "out_bytes": out_bytes, "results": results,
            "inspect": inspect, "inspect_read": inspect_read, "dd": dd}


def _header(path: Path) -> dict:
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        return json.loads(fh.read(n))


def settle() -> None:
    """Same start for every run: no dirty pages left by the previous tool's output (not timed).

    Without it a run pays for the previous run's writeback (dirty-page throttling), which is noise
    about the order of runs, not about the tool.  Inputs stay in the page cache (warm), as in the notes.
    """
    os.sync()


def dd_floor(nbytes: int, scratch: Path) -> float:
    """Seconds for dd to write then read ``nbytes`` (16 MiB blocks), under the same conditions."""
    f = scratch / "dd.bin"
    count = max(1, nbytes // (16 * MiB))
    totals = []
    for _ in range(3):  # dd is noisy here: the median of three
        f.unlink(missing_ok=True)
        settle()
        w = timed(["dd", "if=/dev/zero", f"of={f}", "bs=16M", f"count={count}"])[0]
        settle()
        r = timed(["dd", f"if={f}", "of=/dev/null", "bs=16M"])[0]
        totals.append(w + r)
    f.unlink()
    return med(totals)


def med(xs):
    return statistics.median(xs)


def span(xs, scale=1.0, digits=2):
    xs = [x / scale for x in xs]
    return f"{med(xs):.{digits}f} ({min(xs):.{digits}f}–{max(xs):.{digits}f})"


def report(m: dict) -> list[str]:
    r = m["results"]
    ours_t = [w for w, _ in r["dsckpt"]]
    ours_m = [s for _, s in r["dsckpt"]]
    lines = []
    for name in r:
        t, s = [w for w, _ in r[name]], [x for _, x in r[name]]
        ratio_t = med(t) / med(ours_t)
        ratio_m = med(ours_m) / med(s)
        lines.append(f"| {m['ckpt']} | {name} | {span(t)} | {span(s, MiB, 0)} | "
                     + ("–" if name == "dsckpt" else f"{ratio_t:.1f}× slower / dsckpt RSS {ratio_m:.2f}×") + " |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=26, help="blocks of the main scenario (26: ~330M params)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--stages", type=int, nargs="+", default=[3, 2])
    ap.add_argument("--scaling", type=int, nargs="*", default=[4, 12, 26], help="block counts of the ZeRO-3 series")
    ap.add_argument("--plot", default=None, help="write the scaling plot (PNG) here")
    ap.add_argument("--json", default=None, help="also dump raw figures as JSON here")
    args = ap.parse_args()
    scratch = HERE / "out"
    scratch.mkdir(exist_ok=True)
    raw = {"main": [], "scaling": []}
    print(f"machine: {os.cpu_count()} cores; python {sys.version.split()[0]}; {time.strftime('%Y-%m-%d')}")
    print("\n| checkpoint | tool | wall s | peak RSS MiB | vs dsckpt |\n|---|---|---|---|---|")
    for stage in args.stages:
        m = measure(generate(stage, args.layers), args.runs, scratch)
        raw["main"].append(m)
        print("\n".join(report(m)), flush=True)
    print("\n| checkpoint | output | dsckpt s | dd write+read s | dsckpt throughput / dd's | inspect s | inspect bytes read |")
    print("|---|---|---|---|---|---|---|")
    for m in raw["main"]:
        t = med([w for w, _ in m["results"]["dsckpt"]])
        print(f"| {m['ckpt']} ({m['ckpt_bytes'] / 2**30:.2f} GiB) | {m['out_bytes'] / MiB:.0f} MiB | {t:.2f} | "
              f"{m['dd']:.2f} | {100 * m['dd'] / t:.0f} % | {span(m['inspect'])} | {m['inspect_read'] / 1024:.0f} KiB |")
    if args.scaling:
        print("\n| ZeRO-3 blocks | params (M) | dsckpt s | z2f s | dsckpt RSS MiB | z2f RSS MiB |\n|---|---|---|---|---|---|")
        for layers in args.scaling:
            m = measure(generate(3, layers), args.runs, scratch, which=("dsckpt", "z2f_cli"))
            raw["scaling"].append({"layers": layers, **m})
            r = m["results"]
            print(f"| {layers} | {m['out_bytes'] / 4e6:.0f} | {span([w for w, _ in r['dsckpt']])} | "
                  f"{span([w for w, _ in r['z2f_cli']])} | {span([s for _, s in r['dsckpt']], MiB, 0)} | "
                  f"{span([s for _, s in r['z2f_cli']], MiB, 0)} |", flush=True)
        if args.plot:
            plot(raw["scaling"], Path(args.plot))
    if args.json:
        Path(args.json).write_text(json.dumps(raw, indent=1))
    shutil.rmtree(scratch, ignore_errors=True)


def plot(series: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [m["out_bytes"] / 4e6 for m in series]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for tool, label in (("dsckpt", "dsckpt consolidate"), ("z2f_cli", "zero_to_fp32 --safe_serialization")):
        a.plot(sizes, [med([w for w, _ in m["results"][tool]]) for m in series], "o-", label=label)
        b.plot(sizes, [med([s for _, s in m["results"][tool]]) / MiB for m in series], "o-", label=label)
    a.set(xlabel="parameters (M)", ylabel="wall time (s, median)", title="ZeRO-3, world size 4: time")
    b.set(xlabel="parameters (M)", ylabel="peak RSS (MiB, median)", title="ZeRO-3, world size 4: memory")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
