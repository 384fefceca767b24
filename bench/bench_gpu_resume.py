"""Issue 16 part 2: `resume --full-weights` of a ~1.2B-parameter fp32 file into ZeRO-3 bf16 on a GPU, against the peers.

    python bench/bench_gpu_resume.py --out $OUT [--runs 2] [--nproc 1] [--formats pt,safetensors]
    python bench/bench_gpu_resume.py --out /tmp/g --dim 64 --layers 2 --vocab 101 --cpu   # dry run
    python bench/bench_gpu_resume.py --out $OUT --dim 4096 --layers 32 --vocab 32000 --file-dtype bf16 \
        --formats safetensors --steps 0 --approaches dsckpt,transformers,floor       # 6.7B, a bf16 release file

The benchmark transformer (``--dim 2048 --layers 20 --vocab 50257``: ~1.2B parameters, a 4.8 GB fp32 ``.pt``)
is written once; then, alternating, each approach in its own torchrun job (bench_resume.py's ``--job``):
  dsckpt        ``load_full_weights`` - rank 0 reads the file lazily, module by module;
  every-rank    every rank ``torch.load``s the whole file, per-module ``GatheredParameters`` (Lightning's
                ``load_full_weights`` path);
  transformers  Transformers' ``_load_state_dict_into_zero3_model`` (what ``from_pretrained`` does under ZeRO-3).
Per rank: seconds until loaded, peak host RSS growth (sampled every 2 ms), peak GPU memory; and, after
dsckpt's load, training steps/s.  Writes ``report.md`` under ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PY = sys.executable


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--formats", default="pt,safetensors", help="input files to load: pt, safetensors (same tensors)")
    ap.add_argument("--file-dtype", choices=("fp32", "bf16"), default="fp32", help="dtype of the weights file")
    ap.add_argument("--approaches", default="dsckpt,every-rank-loads,transformers,floor")
    ap.add_argument("--profile", action="store_true", help="rank 0's seconds per phase (bench_resume.Phases) per line")
    ap.add_argument("--offload", choices=("pinned", "pageable"),
                    help="fp32 masters and Adam's state on the host (offload_optimizer, DeepSpeed's CPU Adam)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "BENCH_DIM": str(args.dim), "BENCH_LAYERS": str(args.layers), "BENCH_VOCAB": str(args.vocab),
           "OMP_NUM_THREADS": "4", "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if args.profile:
        env["BENCH_PROFILE"] = "1"
    if args.offload:
        env["BENCH_OFFLOAD"] = args.offload
    if args.cpu:
        env.update({"CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
    files = {fmt: args.out / f"weights_{args.file_dtype}.{fmt}" for fmt in args.formats.split(",")}
    if not all(f.exists() for f in files.values()):
        code = ("import torch, sys; sys.path.insert(0, sys.argv[1]); import bench.models; torch.manual_seed(0); "
                "torch.set_default_dtype(getattr(torch, sys.argv[2])); sd = bench.models.transformer().state_dict(); "
                "from safetensors.torch import save_file; "
                "[torch.save(sd, f) if f.endswith('.pt') else save_file(sd, f) for f in sys.argv[3:]]")
        subprocess.run([PY, "-c", code, str(ROOT), {"fp32": "float32", "bf16": "bfloat16"}[args.file_dtype],
                        *map(str, files.values())], check=True, env=env, cwd=ROOT)
    sizes = ", ".join(f"{f.stat().st_size / 2**20:,.0f} MiB {args.file_dtype} .{fmt}" for fmt, f in files.items())
    lines = [f"# bench_gpu_resume: `{' '.join(sys.argv)}`", "",
             f"files: {sizes}; ZeRO-3 bf16, world size {args.nproc}"
             f"{f', optimizer offloaded ({args.offload} host memory)' if args.offload else ''}; {args.runs} alternating runs; "
             "floor = the file's bytes page cache -> pinned -> GPU (8 threads), no parsing, no DeepSpeed", "",
             "| input | approach | run | load s (slowest rank) | host RSS growth MiB (max rank) | peak GPU MiB (max rank) | steps/s |",
             "|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    results = {}
    for run, (fmt, weights), approach in ((r, f, a) for r in range(args.runs) for f in files.items()
                                           for a in args.approaches.split(",")):
        if approach == "floor" and args.cpu:
            continue
        report = args.out / f"{approach}.json"
        cmd = [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
               str(HERE / "bench_resume.py"), "--job", approach, str(weights), str(report), "bf16"]
        first_format = fmt == next(iter(files))
        job_env = {**env, "BENCH_STEPS_AFTER": str(args.steps if approach == "dsckpt" and first_format else 0)}
        report.unlink(missing_ok=True)
        proc = subprocess.run(cmd, env=job_env, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode and report.exists():  # loaded, then failed in the training steps after the load
            (args.out / f"{approach}.{fmt}.stderr").write_text(proc.stderr)
        if proc.returncode and not report.exists():
            # torchrun's summary ends in a ==== rule: name the exception line, keep the whole stderr beside
            errors = [l for l in proc.stderr.splitlines() if "Error" in l or "Exception" in l] or proc.stderr.splitlines()
            why = errors[-1].strip()[:160] if errors else "?"
            (args.out / f"{approach}.{fmt}.stderr").write_text(proc.stderr)
            line = f"| .{fmt} | {approach} | {run + 1} | failed: {why} | | | |"
        else:
            rows = json.loads(report.read_text())
            results.setdefault(f"{fmt} {approach}", []).append(rows)
            steps = rows[0].get("steps_per_s")
            trained = "steps failed (.stderr)" if proc.returncode else f"{steps:.2f}" if steps else "-"
            if steps:
                trained += (f", peak GPU {max(r['gpu_peak_training'] for r in rows) / 2**30:.1f} GiB, peak host RSS "
                            f"{max(r.get('host_peak_training', 0) for r in rows) / 2**30:.1f} GiB")
            line = (f"| .{fmt} | {approach} | {run + 1} | {max(r['seconds'] for r in rows):.2f} | "
                    f"{max(r['growth'] for r in rows) / 2**20:,.0f} | {max(r['gpu_peak'] for r in rows) / 2**20:,.0f} | "
                    f"{trained} |")
            if rows[0].get("phases"):
                line += " rank 0 phases s: " + " ".join(f"{k} {v:.2f}" for k, v in sorted(rows[0]["phases"].items()))
        lines.append(line)
        print(line, flush=True)
    (args.out / "report.md").write_text("\n".join(lines) + "\n")
    (args.out / "report.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
