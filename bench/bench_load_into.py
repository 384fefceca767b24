"""Peak memory of ``dsckpt.load_into`` against DeepSpeed's ``load_state_dict_from_zero_checkpoint`` (issue 14).

    python bench/bench_load_into.py [--layers 26]

The benchmark transformer (~328M parameters at 26 blocks) and its cached ZeRO-3 world-size-4 checkpoint
(bench_consolidate.py makes it).  Each variant runs in its own process: A builds the model on the meta
device and calls ``dsckpt.load_into(model, CKPT)``; B builds it on the CPU and calls
``deepspeed.utils.zero_to_fp32.load_state_dict_from_zero_checkpoint(model, CKPT)``.  Reported: peak RSS
during the load (sampled every 2 ms) above the RSS before it, against the model's own bytes and its
largest tensor - the issue's bound is "the model plus the largest tensor".
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
sys.path.insert(0, str(HERE))
from bench_consolidate import generate  # noqa: E402

CHILD = r"""
import json, os, sys, threading, time, torch
sys.path.insert(0, {root!r})
import bench.models
PAGE = os.sysconf("SC_PAGE_SIZE")
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * PAGE
variant, ckpt = sys.argv[1], sys.argv[2]
torch.set_num_threads(1)
if variant == "dsckpt":
    with torch.device("meta"):
        model = bench.models.transformer()
else:
    model = bench.models.transformer()
before, peak, running = rss(), [0], [True]
def sample():
    while running[0]:
        peak[0] = max(peak[0], rss()); time.sleep(0.002)
t = threading.Thread(target=sample, daemon=True); t.start()
start = time.perf_counter()
if variant == "dsckpt":
    import dsckpt
    report = dsckpt.load_into(model, ckpt)
    assert not report.missing_keys and not report.unexpected_keys
else:
    from deepspeed.utils.zero_to_fp32 import load_state_dict_from_zero_checkpoint
    load_state_dict_from_zero_checkpoint(model, ckpt)
seconds = time.perf_counter() - start
running[0] = False; t.join()
tensors = list(model.state_dict().values())
print(json.dumps({{"seconds": seconds, "growth": max(peak[0], rss()) - before, "before": before,
                   "model_bytes": sum(x.numel() * x.element_size() for x in tensors),
                   "largest_bytes": max(x.numel() * x.element_size() for x in tensors)}}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=26)
    args = ap.parse_args()
    ckpt = generate(3, args.layers)
    env = {**os.environ, "BENCH_LAYERS": str(args.layers), "OMP_NUM_THREADS": "1"}
    MiB = 2**20
    for variant in ("dsckpt", "deepspeed"):
        os.sync()
        out = subprocess.run([sys.executable, "-c", CHILD.format(root=str(ROOT)), variant, str(ckpt)], env=env,
                             capture_output=True, text=True, check=True, cwd=ROOT).stdout
        r = json.loads(out.strip().splitlines()[-1])
        print(f"{variant:10s} load {r['seconds']:.2f} s   RSS growth during the load {r['growth'] / MiB:,.0f} MiB   "
              f"(model {r['model_bytes'] / MiB:,.0f} MiB, largest tensor {r['largest_bytes'] / MiB:,.0f} MiB, "
              f"RSS before {r['before'] / MiB:,.0f} MiB)")


if __name__ == "__main__":
    main()
