"""Consolidating a tensor-parallel (AutoTP) checkpoint: the row-parallel joins against `cp` of the same bytes.

    python bench/bench_tp.py [--hidden 768] [--layers 8] [--runs 3]

Generates once (cached under bench/cache/) a real DeepSpeed AutoTP checkpoint of a Llama at tp 2 x dp 1, ZeRO-1,
fp32 (one training step on 2 CPU ranks), then, alternating in one process (each round runs every job, the next
in reverse order), with the output deleted and dirty pages synced before every run and the checkpoint read once
(warm):
  consolidate --no-fsync --skip-crc-check     against   `cp` of the file it writes
  consolidate --no-fsync (CRC checks on)      against   the same without them
Prints the medians, the ratios measured in the same rounds, the peak RSS of consolidate, and how many byte runs
the dim-1 (row-parallel) joins make (each a positional read of one row of one TP rank's slice).
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
DSCKPT = [sys.executable, "-m", "dsckpt"]

RANK = """
import sys, torch, deepspeed
from transformers import LlamaConfig, LlamaForCausalLM
hidden, layers, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
deepspeed.init_distributed(dist_backend="gloo", verbose=False)
torch.manual_seed(0)
config = LlamaConfig(vocab_size=8000, hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 64 * 64,
                     num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 128,
                     tie_word_embeddings=False)
model = LlamaForCausalLM(config)
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
    "train_micro_batch_size_per_gpu": 1, "tensor_parallel": {"autotp_size": 2}, "zero_optimization": {"stage": 1},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "steps_per_print": 10**9})
ids = torch.randint(0, 8000, (1, 16), generator=torch.Generator().manual_seed(1))
engine.backward(engine(input_ids=ids, labels=ids).loss)
engine.step()
engine.save_checkpoint(out, tag="step1")
"""


def generate(hidden: int, layers: int) -> Path:
    out = HERE / "cache" / f"tp2_llama_h{hidden}_l{layers}"
    if (out / "latest").exists():
        return out
    shutil.rmtree(out, ignore_errors=True)
    script = HERE / "cache" / "tp_rank.py"
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(RANK)
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script),
                    str(hidden), str(layers), str(out)], check=True, cwd=ROOT)
    for helper in ("zero_to_fp32.py", "zero_to_torch.py"):
        (out / helper).unlink(missing_ok=True)
    return out


def timed(cmd: list[str]) -> float:
    """Wall seconds of ``cmd`` as a fresh process."""
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    return time.perf_counter() - start


def _peak_rss(cmd: list[str]) -> int:
    """Peak RSS (bytes) of ``cmd`` alone: a helper process waits for it, so no earlier child counts."""
    probe = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL, "
             "stderr=subprocess.DEVNULL); print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    return int(subprocess.run([sys.executable, "-c", probe, *cmd], check=True, capture_output=True, text=True,
                              cwd=ROOT).stdout) * 1024


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    ckpt = generate(args.hidden, args.layers)
    scratch = HERE / "out" / "tp"
    scratch.mkdir(parents=True, exist_ok=True)
    out, copy = scratch / "model.safetensors", scratch / "copy.safetensors"
    jobs = {
        "consolidate": DSCKPT + ["consolidate", str(ckpt), str(out), "--no-fsync", "--skip-crc-check", "-q"],
        "consolidate crc": DSCKPT + ["consolidate", str(ckpt), str(out), "--no-fsync", "-q"],
        "cp": ["cp", str(out), str(copy)],
    }
    out.unlink(missing_ok=True)
    subprocess.run(jobs["consolidate"], check=True, cwd=ROOT, capture_output=True)  # the file cp copies; warms the input
    for path in ckpt.rglob("*.pt"):
        path.read_bytes()
    times: dict[str, list[float]] = {k: [] for k in jobs}
    for round_ in range(args.runs):
        for name in (list(jobs) if round_ % 2 == 0 else list(reversed(jobs))):
            (copy if name == "cp" else out).unlink(missing_ok=True)  # no run pays for freeing the last one's pages
            os.sync()
            times[name].append(timed(jobs[name]))
    from dsckpt.plan.consolidate import build_plan
    from dsckpt.plan.segments import Interleaved
    from dsckpt.zero.reader import open_checkpoint

    plan = build_plan(open_checkpoint(ckpt))
    rows = sum(sum(1 for _ in t.pieces) for t in plan.tensors if isinstance(t.pieces, Interleaved))
    out.unlink()
    peak = _peak_rss(jobs["consolidate"])
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {"checkpoint": str(ckpt), "output_bytes": out.stat().st_size, "runs": args.runs,
              "median_s": med, "consolidate / cp": med["consolidate"] / med["cp"],
              "consolidate crc / no-crc": med["consolidate crc"] / med["consolidate"],
              "row_parallel_runs": rows, "consolidate_peak_rss_bytes": peak}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
