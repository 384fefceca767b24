"""Issue 42: consolidate and reshard on 1, 2, 4, 8 processes against what the disk itself allows.

    python bench/bench_scaling.py --layers 26 --procs 1 2 4 8 --out DIR            (330M, ZeRO-3 at world size 4)
    BENCH_DIM=2048 python bench/bench_scaling.py --layers 36 --procs 1 2 4 8 --out DIR   (1.8B: 21.7 GB of rank files)
    python bench/bench_scaling.py --plot DIR/scaling.json [more.json] --png docs/scaling_16core.png

1. The checkpoint: bench_consolidate.generate (one real AdamW step, ZeRO-3, world size 4, CPU ranks), cached.
2. Each round, for each N, alternating: the disk's own sequential bandwidth, measured with dd on 1 GiB in
   16 MiB blocks with O_DIRECT (write, then read back) so the page cache plays no part; then
   `dsckpt reshard CKPT OUT -w 8 --nproc N` and `dsckpt consolidate CKPT OUT.safetensors --nproc N`, durable
   (fsync before publishing, the default), inputs page-cache warm, dirty pages synced before each run.
3. "disk allows" = output bytes / the dd write bandwidth of that round (the input is already in memory);
   the ratio is the command's seconds over that.  Medians over rounds; JSON for the plot.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")  # the checkpoints are trained on CPU ranks, also on a GPU host
os.environ.setdefault("DS_ACCELERATOR", "cpu")
from bench_consolidate import PY, generate, settle, timed  # noqa: E402
from bench_parallel import fresh, size  # noqa: E402

PROBE_BYTES = 1 << 30


def disk_bandwidth(scratch: Path) -> tuple[float, float]:
    """Sequential write and read bandwidth of the disk under ``scratch`` in bytes/s (O_DIRECT: no page cache)."""
    probe = scratch / "dd_probe.bin"
    fresh(probe)
    settle()
    count = PROBE_BYTES // (16 << 20)
    start = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={probe}", "bs=16M", f"count={count}", "oflag=direct", "conv=fsync"],
                   check=True, capture_output=True)
    write = PROBE_BYTES / (time.perf_counter() - start)
    start = time.perf_counter()
    subprocess.run(["dd", f"if={probe}", "of=/dev/null", "bs=16M", "iflag=direct"], check=True, capture_output=True)
    read = PROBE_BYTES / (time.perf_counter() - start)
    fresh(probe)
    return write, read


def command(name: str, ckpt: Path, out: Path, n: int) -> list[str]:
    cmd = [PY, "-m", "dsckpt", name, str(ckpt), str(out), "-q"]
    cmd += ["--no-client-state"] if name == "consolidate" else []
    cmd += ["-w", "8"] if name == "reshard" else []
    return cmd + (["--nproc", str(n)] if n > 1 else [])


def measure(args: argparse.Namespace) -> dict:
    ckpt = generate(3, args.layers)
    scratch = args.out / "scratch"
    scratch.mkdir(parents=True, exist_ok=True)
    outputs = {"reshard": scratch / "resharded", "consolidate": scratch / "model.safetensors"}
    rows: list[dict] = []
    for round_ in range(args.runs):
        for n in (args.procs if round_ % 2 == 0 else args.procs[::-1]):
            write_bw, read_bw = disk_bandwidth(scratch)
            for name, out in outputs.items():
                fresh(out)
                settle()
                wall, rss, _ = timed(command(name, ckpt, out, n))
                nbytes = size(out)
                fresh(out)
                rows.append({"command": name, "n": n, "seconds": wall, "peak_rss": rss, "out_bytes": nbytes,
                             "write_bw": write_bw, "read_bw": read_bw, "round": round_})
                print(f"round {round_ + 1} N={n} {name}: {wall:.2f} s, {nbytes / wall / 1e9:.2f} GB/s out; "
                      f"disk {write_bw / 1e9:.2f} GB/s write, {read_bw / 1e9:.2f} GB/s read", flush=True)
    from dsckpt.formats.crc import crc32

    return {"checkpoint": str(ckpt), "checkpoint_bytes": size(ckpt), "cpus": os.cpu_count(),
            "dim": int(os.environ.get("BENCH_DIM", "1024")), "layers": args.layers, "rows": rows,
            "crc32": crc32.__module__}  # isal's or zlib's: every CRC costs ~10x more without isal


def table(result: dict) -> str:
    lines = [f"checkpoint: ZeRO-3, world size 4, {result['checkpoint_bytes'] / 1e9:.2f} GB of rank files "
             f"(dim {result['dim']}, {result['layers']} layers); {result['cpus']} CPUs; CRC-32 from "
             f"{result.get('crc32', 'not recorded')}; medians over rounds", "",
             "| command | N | seconds | GB/s out | disk write GB/s | disk allows s | / disk | peak RSS per process MiB |",
             "|---|---|---|---|---|---|---|---|"]
    for name in ("consolidate", "reshard"):
        for n in sorted({r["n"] for r in result["rows"]}):
            rs = [r for r in result["rows"] if r["command"] == name and r["n"] == n]
            secs = statistics.median(r["seconds"] for r in rs)
            bw = statistics.median(r["write_bw"] for r in rs)
            floor = rs[0]["out_bytes"] / bw
            lines.append(f"| {name} | {n} | {secs:.2f} | {rs[0]['out_bytes'] / secs / 1e9:.2f} | {bw / 1e9:.2f} | "
                         f"{floor:.2f} | {secs / floor:.2f}x | {max(r['peak_rss'] for r in rs) / 2**20:,.0f} |")
    return "\n".join(lines)


def plot(results: list[dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4), squeeze=False)
    for ax, result in zip(axes[0], results):
        for name, marker in (("consolidate", "o"), ("reshard", "s")):
            ns = sorted({r["n"] for r in result["rows"]})
            ratios = []
            for n in ns:
                rs = [r for r in result["rows"] if r["command"] == name and r["n"] == n]
                ratios.append(statistics.median(r["seconds"] * r["write_bw"] / r["out_bytes"] for r in rs))
            ax.plot(ns, ratios, marker=marker, label=name)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.axhline(1.2, color="grey", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.set_xlabel("processes (--nproc)")
        ax.set_ylabel("time / what the disk allows")
        ax.set_title(f"{result['checkpoint_bytes'] / 1e9:.1f} GB ZeRO-3 checkpoint, {result['cpus']} cores")
        ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=26)
    ap.add_argument("--procs", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--out", type=Path, default=HERE / "out" / "scaling")
    ap.add_argument("--plot", type=Path, nargs="+", help="JSON results of earlier runs: draw them, measure nothing")
    ap.add_argument("--png", type=Path, default=Path("scaling.png"))
    args = ap.parse_args()
    if args.plot:
        results = [json.loads(p.read_text()) for p in args.plot]
        for result in results:
            print(table(result) + "\n")
        plot(results, args.png)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    result = measure(args)
    name = f"scaling_d{result['dim']}_l{args.layers}"
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=1))
    text = table(result)
    (args.out / f"{name}.md").write_text(f"# `{' '.join(sys.argv)}`\n\n{text}\n")
    print(text)


if __name__ == "__main__":
    main()
