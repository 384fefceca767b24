"""One rank of bench_async_save.py: stock `save_checkpoint` against dsckpt's background save, alternating, one engine.

ARGS: OUT STAGE PRECISION ROUNDS STEPS_BETWEEN REPORT.  Each round runs every mode of BENCH_MODES (default
"stock,async"), the order rotating from round to round: "stock" saves with DeepSpeed's own engine (then flushes its
files, for the durable figure), "async" with checkpoint_engine.background, "async-torch" with it writing through torch.save (the
persist before persist.write_snapshot), "async-tN" with N persist threads, "async-rbM" with a read-back buffer of M MiB,
"async-tp" with the snapshot's buffers from torch's pinned allocator (before they were pinned in place),
"async-small-calls" with the persist's calls before round 23 (1 MiB pwrites, 8 MiB read-backs), "async-niceN" with
the persist threads' nice value raised by N,
"none" does not save.  BENCH_DS_WRITER=fast|decoupled makes "stock" DeepSpeed's FastPersist writer or its decoupled
engine (a writer process per rank; the next step waits for its commit) instead of `torch.save`.  After each, STEPS_BETWEEN training steps run, timed
(an async save's persist overlaps them).  A first background save before the rounds allocates the host buffers
the others reuse (its block is reported apart).  Rank 0 writes REPORT (JSON).
"""
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from models import transformer  # noqa: E402

from dsckpt.checkpoint_engine.background import AsyncSave  # noqa: E402
from dsckpt.runtime.engine import Runtime, rank, shutdown  # noqa: E402
from dsckpt.checkpoint_engine import persist as persist_module, snapshot as snapshot_module  # noqa: E402
from dsckpt.checkpoint_engine.persist import write_snapshot  # noqa: E402
from dsckpt.runtime.config import resolve_config  # noqa: E402
from dsckpt.runtime.demo_model import synthetic_batch  # noqa: E402


def sync() -> None:
    """What the training waits for: its own stream (the snapshot's deferred copies run on another one)."""
    if torch.cuda.is_available():
        torch.cuda.current_stream().synchronize()


def fsync_tree(folder: Path) -> None:
    for path in sorted(folder.rglob("*")):
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


def main(out: str, stage: str, precision: str, rounds: str, steps_between: str, report: str) -> None:
    torch.manual_seed(0)
    config = resolve_config(None, preset=None, precision=precision, stage=int(stage))
    config["train_micro_batch_size_per_gpu"] = 1
    config.pop("train_batch_size", None)
    ds_writer = os.environ.get("BENCH_DS_WRITER")
    if ds_writer:
        config["checkpoint"] = {"writer": {"type": "fast", "decoupled": ds_writer == "decoupled",
                                           "data_parallel": "replica"}}
        for name, value in (("CROSS_RANK", "0"), ("CROSS_SIZE", "1"), ("LOCAL_SIZE", os.environ["WORLD_SIZE"])):
            os.environ.setdefault(name, value)  # the `deepspeed` launcher's variables, which the fast writer reads
    runtime = Runtime(config, async_save=False)
    engine = runtime.setup(transformer, lambda p: torch.optim.AdamW(p, lr=1e-4))
    model = engine.module

    def step(i: int) -> None:
        tokens = synthetic_batch(i, seed=0, batch_size=1, seq_len=model.seq_len, vocab_size=model.vocab_size)
        loss = engine(tokens.to(engine.device))
        engine.backward(loss)
        engine.step()

    each_step: list[float] = []  # the last timed_steps' step-by-step host times, to see where a save's loss falls

    def timed_steps(n: int, start: int) -> float:
        sync()
        t0 = time.perf_counter()
        each_step.clear()
        for i in range(n):
            t1 = time.perf_counter()
            step(start + i)
            each_step.append(round(time.perf_counter() - t1, 4))
        sync()
        return time.perf_counter() - t0

    for i in range(2):
        step(i)
    stock_save, stock_engine = engine.save_checkpoint, engine.checkpoint_engine
    saver = AsyncSave(engine, report=lambda text: None)
    if os.environ.get("BENCH_NO_RESERVE"):  # the control: the first save allocates its pinned buffers in the call
        saver.reserve = "off"
    async_save, async_engine = engine.save_checkpoint, engine.checkpoint_engine
    n, rows, root = int(steps_between), [], Path(out)
    threads, read_back, write_piece = persist_module.THREADS, persist_module._READ_BACK, persist_module.WRITE_PIECE
    nice = persist_module._NICE
    baseline = timed_steps(n, 100)  # no save at all
    modes = os.environ.get("BENCH_MODES", "stock,async").split(",")
    t0 = time.perf_counter()  # the first background save allocates the host buffers every later one reuses
    async_save(str(root / "first"), tag="first")
    sync()
    first_blocked = time.perf_counter() - t0
    saver.wait()
    first_memory = saver.records[0].memory_waited_s
    if rank() == 0:
        shutil.rmtree(root / "first")
    in_place, own_pool, torch_pool = snapshot_module.PINNED_IN_PLACE, saver.pool, snapshot_module.HostPool()

    def use_pool(mode: str) -> None:
        torch_pinned = mode == "async-tp"
        snapshot_module.PINNED_IN_PLACE = 1 << 62 if torch_pinned else in_place
        saver.pool = torch_pool if torch_pinned else own_pool
    if "async-tp" in modes:  # its buffers allocated before the rounds too
        use_pool("async-tp")
        async_save(str(root / "first"), tag="first")
        saver.wait()
        if rank() == 0:
            shutil.rmtree(root / "first")
    for r in range(int(rounds)):
        for mode in modes[r % len(modes):] + modes[:r % len(modes)]:
            tag = f"{mode}{r}"
            torch.distributed.barrier()
            if mode == "none":
                rows.append({"round": r, "mode": mode, "steps_s": timed_steps(n, 400 + r), "each_step_s": each_step[:]})
                continue
            if mode == "stock":
                engine.checkpoint_engine = stock_engine
                t0 = time.perf_counter()
                stock_save(str(root / mode), tag=tag)
                sync()
                blocked = time.perf_counter() - t0
                if ds_writer == "decoupled":  # its writer process is done once the next step's commit returns
                    steps = timed_steps(n, 200 + r)
                    durable = blocked + each_step[0]
                else:
                    fsync_tree(root / mode / tag)
                    durable = time.perf_counter() - t0
                    steps = timed_steps(n, 200 + r)
                persist = step_waited = after = None
                during = each_step[:]
            else:
                engine.checkpoint_engine = async_engine
                saver.writer.write = torch.save if mode == "async-torch" else write_snapshot
                use_pool(mode)
                persist_module.THREADS = int(mode[7:]) if mode.startswith("async-t") and mode[7:].isdigit() else threads
                persist_module._READ_BACK = int(mode[8:]) << 20 if mode.startswith("async-rb") else read_back
                persist_module.WRITE_PIECE = write_piece
                persist_module._NICE = int(mode[10:]) if mode.startswith("async-nice") else nice
                if mode == "async-small-calls":
                    persist_module._READ_BACK, persist_module.WRITE_PIECE = 8 << 20, 1 << 20
                t0 = time.perf_counter()
                async_save(str(root / mode), tag=tag)
                sync()  # the snapshot's device-to-host copies are queued, not done, when the call returns
                blocked = time.perf_counter() - t0
                steps = timed_steps(n, 300 + r)
                during = each_step[:]
                saver.wait()
                durable = time.perf_counter() - t0
                after = timed_steps(n, 500 + r) if os.environ.get("BENCH_PAIRED") else None
                persist = saver.records[-1].persist_s
                step_waited = saver.records[-1].step_waited_s
            torch.distributed.barrier()
            if rank() == 0:
                shutil.rmtree(root / mode / tag)  # a large model's tags would fill the disk
            rows.append({"round": r, "mode": mode, "blocked_s": blocked, "durable_s": durable, "steps_s": steps,
                         "persist_s": persist, "step_waited_s": step_waited, "steps_after_persist_s": after,
                         "each_step_s": during, "each_step_after_s": each_step[:] if after is not None else None,
                         "nbytes": saver.records[-1].nbytes if mode != "stock" else None})
    saver.close()
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    if rank() == 0:
        Path(report).write_text(json.dumps({"rows": rows, "baseline_steps_s": baseline, "first_save_blocked_s": first_blocked,
                                            "first_save_memory_waited_s": first_memory, "steps_between": n,
                                            "stage": int(stage), "precision": precision,
                                            "stock_writer": ds_writer or "torch.save",
                                            "params": sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel()
                                                          for p in model.parameters()),
                                            "world_size": torch.distributed.get_world_size(),
                                            "device": torch.cuda.get_device_name() if torch.cuda.is_available()
                                            else "cpu", "gpu_peak_bytes": peak}))


if __name__ == "__main__":
    main(*sys.argv[1:7])
    shutdown(exit_process=True)
