"""Loss curves: training on after `dsckpt reshard` against the uninterrupted run (issue 13).

    python bench/reshard_curves.py [--steps 10] [--after 40] [--plot docs/reshard_continuation.png]

The odd test model (tests/models/odd_model.py), DeepSpeed's WarmupLR, two param groups, on CPU ranks:
1. train ``--steps`` steps at 2 ranks, save, then go on ``--after`` steps uninterrupted (the reference);
2. `dsckpt reshard` the saved checkpoint to 3 ranks; stock ``engine.load_checkpoint`` at 3 ranks, then
   ``--after`` steps on the same global batches (tests/jobs/reshard_oracle.py does both runs).
Prints the largest loss difference per combination and plots both curves.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PY = sys.executable
COMBOS = ("2:32", "3:32", "3:bf16")


def job(nproc: int, *args, env) -> None:
    subprocess.run([PY, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                    str(ROOT / "tests" / "jobs" / "reshard_oracle.py"), *map(str, args)],
                   check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--after", type=int, default=40)
    ap.add_argument("--plot", type=Path, default=None)
    args = ap.parse_args()
    root = HERE / "out" / "reshard_curves"
    subprocess.run(["rm", "-rf", str(root)], check=True)
    root.mkdir(parents=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RESHARD_STEPS_AFTER": str(args.after),
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests" / "models")])}
    job(2, "train", root, ",".join(COMBOS), args.steps, env=env)
    for combo in COMBOS:
        folder = root / "z{}_{}".format(*combo.split(":"))
        subprocess.run([PY, "-m", "dsckpt", "reshard", str(folder / "ckpt"), str(folder / "ws3"), "-w", "3", "-q"],
                       check=True, cwd=ROOT, env=env)
    job(3, "load", root, ",".join(COMBOS), args.steps, env=env)
    curves = {}
    for combo in COMBOS:
        folder = root / "z{}_{}".format(*combo.split(":"))
        ref = torch.load(folder / "before.pt", weights_only=False)["after"]["losses"]
        got = torch.load(folder / "after_ws3.pt", weights_only=False)["after"]["losses"]
        curves[combo] = (ref, got)
        worst = max(abs(a - b) / abs(a) for a, b in zip(ref, got))
        print(f"ZeRO-{combo.split(':')[0]} {combo.split(':')[1]:>4}: {args.after} steps after step {args.steps}, "
              f"loss {ref[0]:.4f} -> {ref[-1]:.4f} uninterrupted (2 ranks) vs {got[0]:.4f} -> {got[-1]:.4f} "
              f"resharded (3 ranks); largest relative difference {worst:.1e}")
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(COMBOS), figsize=(4.2 * len(COMBOS), 3.4), sharey=True)
        for ax, (combo, (ref, got)) in zip(axes, curves.items()):
            steps = range(args.steps + 1, args.steps + 1 + len(ref))
            ax.plot(steps, ref, lw=3, alpha=0.45, label="uninterrupted, 2 ranks")
            ax.plot(steps, got, lw=1.2, ls="--", color="black", label="resharded to 3 ranks")
            stage, precision = combo.split(":")
            ax.set_title(f"ZeRO-{stage}, {'fp32' if precision == '32' else precision}")
            ax.set_xlabel("step")
        axes[0].set_ylabel("loss (same global batch)")
        axes[0].legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
