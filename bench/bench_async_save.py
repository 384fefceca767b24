"""How long a save holds training: DeepSpeed's own `save_checkpoint` against dsckpt's background save (issue 54).

Both on one engine in one run, alternating round by round (bench/jobs/async_save_rank.py).  Reported per mode, as
medians over the rounds: training blocked (`save_checkpoint` until it returns), durable (until every file is flushed:
stock + fsync, or the background commit), the steps run right after the save (the async persist overlaps them)
against the same steps with no save, and the persist's rate against a direct-I/O write of the same bytes (dd, the
disk's own figure: measured before and after the run, the faster taken).  ``--modes stock,async,async-torch,none``
adds the persist through ``torch.save`` (the engine's writer before ``persist.write_snapshot``) and rounds without a
save to the same alternation.

    python bench/bench_async_save.py --nproc 2 --stage 3 --precision bf16 --dim 1024 --layers 8 --rounds 5
    BENCH_DS_WRITER=fast|decoupled: "stock" is DeepSpeed's FastPersist writer or its decoupled engine (async_io op)
    (on a GPU host: --nproc 1; the ranks run over nccl)
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
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def direct_write_rate(folder: Path, nbytes: int) -> float:
    """GB/s of dd writing ``nbytes`` with O_DIRECT into ``folder`` (what the disk allows)."""
    target = folder / "dd.bin"
    count = max(1, nbytes // (16 << 20))
    t0 = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={target}", "bs=16M", f"count={count}", "oflag=direct"],
                   check=True, capture_output=True)
    rate = count * (16 << 20) / 1e9 / (time.perf_counter() - t0)
    target.unlink()
    return rate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--stage", type=int, default=3)
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps-between", type=int, default=3)
    ap.add_argument("--modes", default="stock,async",
                    help="of stock, async, async-torch, async-tN (N persist threads), async-tp (torch's pinned "
                    "allocator), async-rbM (an M MiB read-back buffer), async-small-calls (the persist's calls before "
                    "round 23), async-niceN (the persist threads' nice value raised by N), none (rotated each round)")
    ap.add_argument("--paired", action="store_true", help="after each background save's persist, the same number of "
                    "steps again: the steps during and after a persist compared within one round")
    ap.add_argument("--out", type=Path, default=None, help="folder for the checkpoints (default: a temp folder)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from dsckpt.runtime.launch import run_ranks

    out = args.out or Path(tempfile.mkdtemp(prefix="bench-async-"))
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    report = out / "report.json"
    dd_before = direct_write_rate(out, 4 << 30)  # the disk's figure before and after: the faster is the bar
    env = {"BENCH_DIM": str(args.dim), "BENCH_LAYERS": str(args.layers), "BENCH_VOCAB": str(args.vocab), "BENCH_MODES": args.modes,
           "BENCH_PAIRED": "1" if args.paired else "",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    codes = run_ranks([sys.executable, str(ROOT / "bench" / "jobs" / "async_save_rank.py"), str(out), str(args.stage),
                       args.precision, str(args.rounds), str(args.steps_between), str(report)], args.nproc, env)
    if any(codes):
        raise SystemExit(f"ranks exited {codes}")
    doc = json.loads(report.read_text())
    rows = doc["rows"]
    nbytes = statistics.median(r["nbytes"] for r in rows if r["mode"] == "async")
    dd_after = direct_write_rate(out, int(nbytes) * args.nproc)
    dd = max(dd_before, dd_after)

    modes = args.modes.split(",")

    def med(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in rows if r["mode"] == mode)

    def spread(mode: str, value) -> str:
        values = [value(r) for r in rows if r["mode"] == mode]
        return f"{min(values):.3f}-{max(values):.3f}"

    def rate(mode: str) -> float:
        return nbytes * args.nproc / 1e9 / med(mode, "persist_s")

    doc["summary"] = summary = {
        "async_blocked_s": med("async", "blocked_s"), "async_durable_s": med("async", "durable_s"),
        "async_persist_s": med("async", "persist_s"), "rank_bytes": nbytes, "dd_direct_gbps": dd,
        "first_save_blocked_s": doc["first_save_blocked_s"],
        "first_save_memory_waited_s": doc.get("first_save_memory_waited_s"),
        "dd_direct_before_after_gbps": [dd_before, dd_after], "steps_after_async_s": med("async", "steps_s"),
        "steps_no_save_s": med("none", "steps_s") if "none" in modes else doc["baseline_steps_s"]}
    print(f"{doc['device']}, {doc['params'] / 1e6:.0f}M parameters, ZeRO-{doc['stage']} {doc['precision']}, "
          f"world size {doc['world_size']}, {nbytes / 1e9:.2f} GB a rank, {args.rounds} alternating rounds (medians); "
          f"the first background save, before the rounds, blocked {doc['first_save_blocked_s']:.2f} s "
          f"({doc.get('first_save_memory_waited_s', 0.0):.2f} s of it for pinned memory"
          f"{', allocated in the call: BENCH_NO_RESERVE' if os.environ.get('BENCH_NO_RESERVE') else ''})")
    if "stock" in modes:
        summary.update(stock_blocked_s=med("stock", "blocked_s"), stock_durable_s=med("stock", "durable_s"),
                       steps_after_stock_s=med("stock", "steps_s"))
        writer = doc.get("stock_writer", "torch.save")
        first_steps = [r["each_step_s"][0] for r in rows if r["mode"] == "stock"]
        summary.update(stock_writer=writer, stock_first_step_s=statistics.median(first_steps),
                       stock_durable_gbps=nbytes * args.nproc / 1e9 / summary["stock_durable_s"])
        print(f"  stock's writer: {writer}; the first step after its save {summary['stock_first_step_s']:.2f} s "
              f"(the decoupled engine's commit waits there); stock durable at "
              f"{summary['stock_durable_gbps']:.2f} GB/s")
        print(f"  blocked: stock {summary['stock_blocked_s'] * 1e3:.0f} ms, dsckpt "
              f"{summary['async_blocked_s'] * 1e3:.0f} ms ({summary['async_blocked_s'] / summary['stock_blocked_s']:.3f}x);"
              f" durable: stock + fsync {summary['stock_durable_s']:.2f} s, dsckpt background "
              f"{summary['async_durable_s']:.2f} s")
    print(f"  persist {rate('async'):.2f} GB/s against dd O_DIRECT {dd:.2f} GB/s ({dd / rate('async'):.2f}x the disk's "
          f"time; dd before/after the run {dd_before:.2f}/{dd_after:.2f} GB/s)")
    if "async-torch" in modes:
        summary["torch_writer_persist_s"] = med("async-torch", "persist_s")
        print(f"  persist through torch.save (the engine's writer before): {rate('async-torch'):.2f} GB/s "
              f"({dd / rate('async-torch'):.2f}x the disk's time); durable {med('async-torch', 'durable_s'):.2f} s")
    print(f"  {args.steps_between} steps: no save {summary['steps_no_save_s']:.3f} s, during a dsckpt persist "
          f"{summary['steps_after_async_s']:.3f} s" + (f", right after a stock save {summary['steps_after_stock_s']:.3f}"
                                                       " s" if "stock" in modes else ""))
    if "none" in modes:  # throughput with a save every --steps-between steps: the block and the steps after it
        for mode in (m for m in modes if m.startswith("async")):
            interval = statistics.median(r["blocked_s"] + r["steps_s"] for r in rows if r["mode"] == mode)
            lost = interval / summary["steps_no_save_s"] - 1
            summary[f"{mode}_interval_s"], summary[f"{mode}_lost"] = interval, lost
            with_save = spread(mode, lambda r: r["blocked_s"] + r["steps_s"])
            without = spread("none", lambda r: r["steps_s"])
            print(f"  {mode}: a save every {args.steps_between} steps: block {med(mode, 'blocked_s') * 1e3:.0f} ms, "
                  f"the step's wait for the copies {med(mode, 'step_waited_s') * 1e3:.0f} ms, persist "
                  f"{rate(mode):.2f} GB/s; the save's block and its steps {interval:.3f} s ({with_save}) against "
                  f"{summary['steps_no_save_s']:.3f} s ({without}) without a save in the same rounds: "
                  f"{lost * 100:.1f} % lost")
    if args.paired:  # within each round: the steps during the persist against the same steps right after it
        for mode in (m for m in modes if m.startswith("async")):
            ratios = sorted((r["blocked_s"] + r["steps_s"]) / r["steps_after_persist_s"] - 1 for r in rows
                            if r["mode"] == mode)
            summary[f"{mode}_paired_lost"] = statistics.median(ratios)
            print(f"  {mode}, paired in each round (the save's block and the steps during its persist against the same "
                  f"number right after it): {statistics.median(ratios) * 100:.1f} % lost (rounds "
                  f"{', '.join(f'{x * 100:.1f}' for x in ratios)})")
    if args.paired and "none" in modes:  # where the time goes: the first steps (the copies) or all of them (the persist)
        typical = statistics.median(x for r in rows if r["mode"] == "none" for x in r["each_step_s"])
        for mode in (m for m in modes if m.startswith("async")):
            during = [r["each_step_s"] for r in rows if r["mode"] == mode]
            first = statistics.median(sum(steps[:2]) for steps in during) - 2 * typical
            rest = statistics.median(statistics.median(steps[2:]) for steps in during) / typical - 1
            summary[f"{mode}_first_two_extra_s"], summary[f"{mode}_later_steps_slower"] = first, rest
            print(f"  {mode}, step by step: the first two steps after the call {first * 1e3:.0f} ms over two steps "
                  f"without a save ({typical * 1e3:.0f} ms each); each later step during the persist "
                  f"{rest * 100:+.1f} %")
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1))
    if args.out is None:
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
