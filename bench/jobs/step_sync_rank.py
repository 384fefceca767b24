"""Where does the step after a background save wait for the snapshot's device-to-host copies?  (issue 54, GPU only)

One rank: the bench transformer (BENCH_DIM, BENCH_LAYERS) under ZeRO-3 bf16, a background save, then one step with
its forward, backward and optimizer step each timed on the host (no sync between them) and CUDA's synchronising
calls reported with the Python stack that made them (``torch.cuda.set_sync_debug_mode``); the same for a step
without a save before it.  Run by bench/probe_step_sync.py.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from models import transformer  # noqa: E402

from dsckpt.checkpoint_engine.background import AsyncSave  # noqa: E402
from dsckpt.runtime.config import resolve_config  # noqa: E402
from dsckpt.runtime.demo_model import synthetic_batch  # noqa: E402
from dsckpt.runtime.engine import Runtime, shutdown  # noqa: E402


def main() -> None:
    torch.manual_seed(0)
    config = resolve_config(None, preset=None, precision="bf16", stage=3)
    config["train_micro_batch_size_per_gpu"] = 1
    config.pop("train_batch_size", None)
    engine = Runtime(config, async_save=False).setup(transformer, lambda p: torch.optim.AdamW(p, lr=1e-4))
    model = engine.module
    seen: list[str] = []

    def shown(message, category, filename, lineno, file=None, line=None) -> None:
        if "synchroniz" not in str(message):
            return
        stack = "".join(traceback.format_stack(limit=12)[:-2])
        seen.append(f"{message}\n{stack}")

    counters = ("num_alloc_retries", "num_sync_all_streams", "num_device_alloc", "num_device_free")

    def allocator() -> dict[str, int]:
        stats = torch.cuda.memory_stats()
        return {key: int(stats.get(key, 0)) for key in counters}

    def timed_step(i: int) -> dict[str, float]:
        tokens = synthetic_batch(i, seed=0, batch_size=1, seq_len=model.seq_len, vocab_size=model.vocab_size)
        tokens = tokens.to(engine.device)
        times, t0 = {}, time.perf_counter()
        loss = engine(tokens)
        times["forward_s"] = time.perf_counter() - t0
        engine.backward(loss)
        times["backward_s"] = time.perf_counter() - t0 - times["forward_s"]
        engine.step()
        times["step_s"] = time.perf_counter() - t0 - times["forward_s"] - times["backward_s"]
        torch.cuda.synchronize()
        times["total_s"] = time.perf_counter() - t0
        return times

    for i in range(3):
        timed_step(i)
    saver = AsyncSave(engine, report=lambda text: None)
    out = tempfile.mkdtemp(prefix="step-sync-")
    engine.save_checkpoint(out, tag="first")  # pins the buffers
    saver.wait()
    for i in range(3):
        timed_step(10 + i)
    warnings.showwarning = shown
    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode("warn")
    before = allocator()
    plain = timed_step(20)
    plain_allocator = {k: v - before[k] for k, v in allocator().items()}
    plain_syncs, seen[:] = list(seen), []
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    engine.save_checkpoint(out, tag="second")
    call_s, pending = time.perf_counter() - t0, bool(saver.staging)
    settle = os.environ.get("PROBE_SETTLE", "")
    if settle == "copies":  # the device-to-host copies done, the persist still running: is the wait the copies?
        torch.cuda.synchronize()
    elif settle == "persist":  # the whole save done first: the step as it runs with nothing beside it
        saver.wait()
    elif settle == "measure":  # what waits while the copies run: Python (the GIL), a fresh stream, this one, the device
        waits = {}
        for name, wait in (("python loop", lambda: sum(range(2_000_000))),
                           ("fresh stream sync", lambda: torch.cuda.Stream().synchronize()),
                           ("current stream sync", lambda: torch.cuda.current_stream().synchronize()),
                           ("device sync", torch.cuda.synchronize)):
            t1 = time.perf_counter()
            wait()
            waits[name] = round(time.perf_counter() - t1, 4)
        t1 = time.perf_counter()
        sum(range(2_000_000))
        waits["python loop, copies done"] = round(time.perf_counter() - t1, 4)
        print("right after the save call:", waits)
    print(f"settled before the step: {settle or 'nothing'} ({time.perf_counter() - t0:.3f} s after the call began)")
    before = allocator()
    after = timed_step(21)
    after_allocator = {k: v - before[k] for k, v in allocator().items()}
    torch.cuda.set_sync_debug_mode(0)
    saver.wait()
    print(f"save call {call_s:.3f} s; copies pending after it: {pending}")
    print("step without a save:", {k: round(v, 3) for k, v in plain.items()})
    print("step after the save:", {k: round(v, 3) for k, v in after.items()})
    print("caching allocator in the step without a save:", plain_allocator)
    print("caching allocator in the step after the save:", after_allocator)
    print("allocator settings:", torch.cuda.memory.get_allocator_backend(),
          f"reserved {torch.cuda.memory_reserved() / 1e9:.1f} GB of {torch.cuda.mem_get_info()[1] / 1e9:.1f} GB")
    for name, syncs in (("without a save", plain_syncs), ("after the save", seen)):
        print(f"--- synchronising calls in the step {name}: {len(syncs)}")
        for text in dict.fromkeys(syncs):
            print(text)
    shutil.rmtree(out, ignore_errors=True)
    shutdown(engine)


if __name__ == "__main__":
    main()
