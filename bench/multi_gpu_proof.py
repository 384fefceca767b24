"""Issue 17: train, consolidate, resume and reshard over nccl at world sizes 2-4, one command, one report.

    python bench/multi_gpu_proof.py --out $OUT                       # on a 4-GPU host: ~1B params, bf16, ZeRO-3
    python bench/multi_gpu_proof.py --out /tmp/p --cpu --moves 2:3 3:2 --dim 64 --layers 2 --vocab 101   # dry run

For each move N -> M (default 4 -> 3 and 2 -> 4), with the benchmark transformer (``--dim`` / ``--layers``;
``--vocab 50257`` so the embedding divides no world size), bf16, ZeRO-3:
1. train at N and save with a client state (tests/jobs/reshard_oracle.py ``train``), recording the live
   gathered fp32 masters, Adam moments, steps and the next steps' losses;
2. ``dsckpt inspect`` (world size N) and ``dsckpt consolidate --verify``; the consolidated file against
   the live masters, bit for bit;
3. ``dsckpt reshard`` to M (time, peak RSS), then stock ``engine.load_checkpoint`` at M (the oracle's
   ``load``): masters, moments, steps bit for bit, and training on (loss within the bf16 tolerance);
4. ``dsckpt resume --full-weights`` of the consolidated file at M with ``--check``, then 3 steps;
5. full-weights load figures at M (bench_resume.py's job): time, peak host RSS growth and peak GPU memory
   per rank, dsckpt against every rank ``torch.load``ing the file (Lightning's ``load_full_weights`` way).
Writes ``report.md`` and ``report.json`` under ``--out``; exits non-zero if any check fails.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PY = sys.executable
STEPS = 3


class Report:
    def __init__(self, out: Path):
        self.out, self.lines, self.data, self.failed = out, [], {}, False

    def check(self, name: str, ok: bool, detail: str = "") -> None:
        self.failed |= not ok
        self.lines.append(f"- {'PASS' if ok else 'FAIL'} {name}" + (f": {detail}" if detail else ""))
        print(self.lines[-1], flush=True)

    def note(self, text: str) -> None:
        self.lines.append(text)
        print(text, flush=True)

    def write(self) -> None:
        (self.out / "report.md").write_text("\n".join(self.lines) + "\n")
        (self.out / "report.json").write_text(json.dumps(self.data, indent=1, default=str))


def run(cmd: list[str], env: dict, log: Path) -> tuple[float, subprocess.CompletedProcess]:
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    log.write_text(f"$ {' '.join(cmd)}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
    return time.perf_counter() - start, proc


def torchrun(nproc: int, script: Path, *args) -> list[str]:
    return [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(script), *map(str, args)]


def tensors_equal(a: dict, b: dict) -> list[str]:
    import torch

    return [k for k in a if k not in b or a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--moves", nargs="+", default=["4:3", "2:4"], help="N:M world-size pairs")
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=20)  # 12 * 2048^2 * 20 + 2 * 50257 * 2048 = ~1.2B
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--cpu", action="store_true", help="dry run on CPU ranks over gloo (no GPU needed)")
    args = ap.parse_args()
    import torch

    args.out.mkdir(parents=True, exist_ok=True)
    logs = args.out / "logs"
    logs.mkdir(exist_ok=True)
    env = {**os.environ, "BENCH_DIM": str(args.dim), "BENCH_LAYERS": str(args.layers), "BENCH_VOCAB": str(args.vocab),
           "RESHARD_MODEL": "bench.models:transformer", "RESHARD_GLOBAL_BATCH": "12", "OMP_NUM_THREADS": "4",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), str(ROOT / "tests" / "models"), os.environ.get("PYTHONPATH")]))}
    if args.cpu:
        env.update({"CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
    rep = Report(args.out)
    gpus = 0 if args.cpu else torch.cuda.device_count()
    rep.note(f"# multi_gpu_proof ({time.strftime('%Y-%m-%d %H:%M')})\n\n`{' '.join(sys.argv)}`; "
             f"{'CPU ranks (gloo)' if args.cpu else f'{gpus} GPU(s): {torch.cuda.get_device_name(0)} (nccl)'}; "
             f"model dim {args.dim}, {args.layers} blocks, vocab {args.vocab}; {args.precision}, ZeRO-3\n")
    oracle = ROOT / "tests" / "jobs" / "reshard_oracle.py"
    combo = f"3:{args.precision}"
    for move in args.moves:
        n, m = map(int, move.split(":"))
        if not args.cpu and max(n, m) > gpus:
            rep.check(f"{n} -> {m}", False, f"needs {max(n, m)} GPUs, this host has {gpus}")
            continue
        root = args.out / f"move_{n}to{m}"
        folder = root / f"z3_{args.precision}"
        rep.note(f"\n## {n} -> {m} ranks")
        secs, proc = run(torchrun(n, oracle, "train", root, combo, STEPS), env, logs / f"{n}to{m}_train.log")
        rep.check(f"train at {n} ranks + save with client state", proc.returncode == 0, f"{secs:.1f} s")
        if proc.returncode:
            continue
        before = torch.load(folder / "before.pt", map_location="cpu", weights_only=False)  # written by our own job
        ckpt = folder / "ckpt"
        _, proc = run([PY, "-m", "dsckpt", "inspect", str(ckpt), "--json"], env, logs / f"{n}to{m}_inspect.log")
        ok = proc.returncode == 0 and json.loads(proc.stdout)["world_size"] == n
        rep.check(f"inspect reports world size {n}", ok)
        secs, proc = run([PY, "-m", "dsckpt", "consolidate", str(ckpt), str(root / "model.safetensors"), "--verify", "-q"],
                         env, logs / f"{n}to{m}_consolidate.log")
        rep.check("consolidate --verify", proc.returncode == 0, f"{secs:.1f} s")
        if proc.returncode == 0:
            from safetensors.torch import load_file

            written = load_file(root / "model.safetensors")
            bad = tensors_equal(before["masters"], written)
            rep.check("consolidated file = live gathered fp32 masters, bit for bit", not bad, f"{len(bad)} differ" if bad else
                      f"{len(before['masters'])} tensors")
        secs, proc = run([PY, "-c", "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True); "
                          "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)",
                          PY, "-m", "dsckpt", "reshard", str(ckpt), str(folder / f"ws{m}"), "-w", str(m), "-q"],
                         env, logs / f"{n}to{m}_reshard.log")
        rss = int(proc.stdout.strip().splitlines()[-1]) / 1024 if proc.returncode == 0 else None
        rep.check(f"dsckpt reshard {n} -> {m}", proc.returncode == 0, f"{secs:.1f} s, peak RSS {rss:.0f} MiB" if rss else "")
        rep.data[f"{n}to{m}"] = {"reshard_seconds": secs, "reshard_peak_rss_mib": rss}
        secs, proc = run(torchrun(m, oracle, "load", root, combo, STEPS), env, logs / f"{n}to{m}_load.log")
        rep.check(f"stock engine.load_checkpoint at {m} ranks", proc.returncode == 0, f"{secs:.1f} s")
        if proc.returncode == 0:
            after = torch.load(folder / f"after_ws{m}.pt", map_location="cpu", weights_only=False)
            for key in ("masters", "moments"):
                bad = tensors_equal(before[key], after[key])
                rep.check(f"{key} after the load = before, bit for bit", not bad, f"{len(bad)} differ" if bad else "")
            rep.check("Adam steps, global steps, client state", before["steps"] == after["steps"]
                      and before["global_steps"] == after["global_steps"] and after["client"].get("note") == "resharded")
            worst = max(abs(a - b) / abs(a) for a, b in zip(before["after"]["losses"], after["after"]["losses"]))
            rep.check(f"{STEPS} more steps track the uninterrupted run", worst <= 1e-2, f"largest relative loss difference {worst:.1e}")
        weights = root / "model.safetensors"
        secs, proc = run([PY, "-m", "dsckpt", "resume", "--full-weights", str(weights), "--nproc", str(m), "--stage", "3",
                          "--precision", args.precision, "--model", "bench.models:transformer", "--check", "--json"],
                         env, logs / f"{n}to{m}_resume_check.log")
        rep.check(f"resume --full-weights at {m} ranks --check", proc.returncode == 0, f"{secs:.1f} s")
        secs, proc = run([PY, "-m", "dsckpt", "resume", "--full-weights", str(weights), "--nproc", str(m), "--stage", "3",
                          "--precision", args.precision, "--model", "bench.models:transformer", "--steps", "3"],
                         env, logs / f"{n}to{m}_resume_train.log")
        rep.check(f"resume --full-weights at {m} ranks, 3 steps", proc.returncode == 0, proc.stdout.strip()[-120:])
        figures = {}
        for approach in ("dsckpt", "every-rank-loads"):
            out = root / f"load_{approach}.json"
            _, proc = run(torchrun(m, HERE / "bench_resume.py", "--job", approach, weights, out, args.precision),
                          env, logs / f"{n}to{m}_load_{approach}.log")
            if proc.returncode == 0:
                figures[approach] = json.loads(out.read_text())
        rep.data[f"{n}to{m}"]["full_weights_load"] = figures
        if figures:
            rep.note(f"\nfull-weights load at {m} ranks (per rank: seconds, host RSS growth MiB, peak GPU MiB):")
            for approach, rows in figures.items():
                cells = "; ".join(f"r{r['rank']}: {r['seconds']:.1f} s, {r['growth'] / 2**20:.0f}, {r.get('gpu_peak', 0) / 2**20:.0f}"
                                  for r in rows)
                rep.note(f"- {approach}: {cells}")
            size = weights.stat().st_size / 2**20
            grown = [r["growth"] / 2**20 for r in figures.get("dsckpt", [])[1:]]
            # (under 64 MiB counts as not growing: allocator noise on a dry run's tiny file)
            rep.check(f"dsckpt: ranks > 0 do not grow by the file size ({size:.0f} MiB)",
                      all(g < max(size / 2, 64) for g in grown), f"largest {max(grown):.0f} MiB" if grown else "")
    rep.write()
    sys.exit(1 if rep.failed else 0)


if __name__ == "__main__":
    main()
