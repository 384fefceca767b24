"""Per-rank memory of a full-weights load into ZeRO-3: dsckpt vs every-rank-loads-the-file.

    python bench/bench_resume.py [--layers 12] [--nproc 4] [--runs N] [--from-init] [--profile]
                                 [--approaches dsckpt,dsckpt-heap,dsckpt-32,every-rank-loads,transformers]

The file is a torch ``.pt`` state dict (as Lightning users have).
B ("every rank loads", Lightning's approach): each rank ``torch.load``s the whole file, then
per module ``GatheredParameters(..., modifier_rank=0)`` and rank 0 copies in.
A (dsckpt): ``load_full_weights`` - only rank 0 opens the file, lazily, one module at a time.
Each rank samples its RSS every 2 ms during the load; the figure is peak-during-load minus RSS
before the load, so engine setup does not count.  ``--profile`` adds rank 0's seconds per phase
(``Phases``); ``dsckpt-heap`` / ``dsckpt-<MiB>`` run dsckpt under another glibc mmap threshold
(docs/dev/performance-log.md section 6: how the 1 MiB setting cost 15 %); ``dsckpt-serial`` reads every tensor
on one thread (issue 25's comparison); ``floor`` copies the file's bytes to the GPU and nothing else.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PAGE = os.sysconf("SC_PAGE_SIZE")


class RssSampler(threading.Thread):
    def __init__(self):
        super().__init__(daemon=True)
        self.peak, self.running = 0, True

    @staticmethod
    def rss() -> int:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * PAGE

    def run(self):
        while self.running:
            self.peak = max(self.peak, self.rss())
            time.sleep(0.002)


def every_rank_loads(engine, path: str) -> None:
    import deepspeed
    import torch

    state = load_state(path, mmap=False)  # the whole file, on every rank
    rank = torch.distributed.get_rank()
    for mod_name, mod in engine.module.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        params = list(mod.named_parameters(recurse=False))
        with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=0):
            if rank == 0:
                for n, p in params:
                    p.data.copy_(state[prefix + n])
    engine.optimizer.refresh_fp32_params()


def load_state(path: str, mmap: bool) -> dict:
    """The whole file as a state dict, as the peers read it: ``torch.load`` (mmap or not) or, for a
    ``.safetensors`` file, safetensors' ``load_file`` (which maps the file)."""
    import torch

    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)


def floor_copy(path: str) -> None:
    """The floor: the file's bytes, page cache -> pinned host memory -> one GPU buffer, 64 MiB pieces read on 8
    threads and copied without waiting - no parsing, no DeepSpeed.  What any loader of this file pays at least."""
    import torch
    from concurrent.futures import ThreadPoolExecutor

    size, piece = os.path.getsize(path), 64 << 20
    device = torch.empty(size, dtype=torch.uint8, device="cuda")
    staging = [torch.empty(piece, dtype=torch.uint8, pin_memory=True) for _ in range(8)]
    events = [None] * len(staging)
    fd = os.open(path, os.O_RDONLY)

    def read(i: int) -> int:
        start, slot = i * piece, i % len(staging)
        if events[slot] is not None:
            events[slot].synchronize()  # the last copy out of this buffer is done
        n = os.preadv(fd, [memoryview(staging[slot].numpy())[:min(piece, size - start)]], start)
        return n

    try:
        with ThreadPoolExecutor(len(staging)) as pool:
            for first in range(0, -(-size // piece), len(staging)):
                batch = range(first, min(first + len(staging), -(-size // piece)))
                for i, n in zip(batch, pool.map(read, batch)):
                    slot = i % len(staging)
                    device[i * piece:i * piece + n].copy_(staging[slot][:n], non_blocking=True)
                    events[slot] = torch.cuda.Event()
                    events[slot].record()
    finally:
        os.close(fd)


def transformers_loads(engine, path: str) -> None:
    """Transformers' ZeRO-3 path (``from_pretrained`` under an ``HfDeepSpeedConfig``): rank 0 holds the
    whole state dict, per module ``GatheredParameters(modifier_rank=0)`` + ``_load_from_state_dict``."""
    import torch
    from transformers.integrations.deepspeed import _load_state_dict_into_zero3_model

    rank = torch.distributed.get_rank()
    state = load_state(path, mmap=True)  # mapped: nothing read yet
    if rank != 0:  # the other ranks pass meta tensors of the file's names and dtypes, as from_pretrained does
        state = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in state.items()}
    _load_state_dict_into_zero3_model(engine.module, state)
    engine.optimizer.refresh_fp32_params()


class Phases:
    """Seconds per phase of one load on this rank (BENCH_PROFILE=1): where a gap between approaches lies.

    gather_enter: ``GatheredParameters`` allgathers; gather_exit: rank 0's broadcast + re-partition;
    read: dsckpt's reads (on its helper thread, so they overlap the rest); wait_read: the loading thread
    waiting for them; masters: the fp32 master copies (16-bit runs); torch_load: the peers' load.  What the
    phases leave of the load's time is the copies into the gathered parameters (to the device, cast).
    """

    def __init__(self):
        self.seconds: dict[str, float] = {}

    def add(self, key: str, since: float) -> None:
        self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - since

    def install(self) -> None:
        import deepspeed
        import torch

        from dsckpt.runtime import full_weights

        original_gather, original_get, original_load, phases = (deepspeed.zero.GatheredParameters,
                                                                  full_weights.WeightsFile.get, torch.load, self)

        class TimedGather:
            def __init__(self, *args, **kwargs):
                self.inner = original_gather(*args, **kwargs)

            def __enter__(self):
                t = time.perf_counter()
                out = self.inner.__enter__()
                phases.add("gather_enter", t)
                return out

            def __exit__(self, *exc):
                t = time.perf_counter()
                out = self.inner.__exit__(*exc)
                phases.add("gather_exit", t)
                return out

        def timed_get(src, *args, **kwargs):  # (name, pin)
            t = time.perf_counter()
            out = original_get(src, *args, **kwargs)
            phases.add("read", t)
            return out

        def timed_load(*args, **kwargs):
            t = time.perf_counter()
            out = original_load(*args, **kwargs)
            phases.add("torch_load", t)
            return out

        original_set = full_weights._MasterSetter.set

        def timed_set(setter, *args):
            t = time.perf_counter()
            out = original_set(setter, *args)
            phases.add("masters", t)
            return out

        class TimedPool(full_weights.ThreadPoolExecutor):  # times the loading thread's wait for each read
            def submit(self, *args, **kwargs):
                future = super().submit(*args, **kwargs)
                original_result = future.result

                def result(timeout=None):
                    t = time.perf_counter()
                    out = original_result(timeout)
                    phases.add("wait_read", t)
                    return out
                future.result = result
                return future

        deepspeed.zero.GatheredParameters = TimedGather
        full_weights._MasterSetter.set = timed_set
        full_weights.ThreadPoolExecutor = TimedPool
        full_weights.WeightsFile.get = timed_get
        torch.load = timed_load


def job(approach: str, weights: str, report: str, precision: str = "32") -> None:
    import torch.distributed as dist

    from dsckpt.runtime.commands import quiet_deepspeed
    from dsckpt.runtime.full_weights import load_full_weights
    from dsckpt.runtime.train import TrainOptions, Trainer

    quiet_deepspeed()
    import torch

    if os.environ.get("BENCH_OFFLOAD"):  # Adam's state on the host: DeepSpeed's CPU Adam, from the config
        config = Path(report).with_suffix(".config.json")
        config.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_optimizer": {
            "device": "cpu", "pin_memory": os.environ["BENCH_OFFLOAD"] == "pinned"}},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}))
        options = TrainOptions(model="bench.models:transformer", config=str(config), precision=precision)
    else:
        options = TrainOptions(model="bench.models:transformer", stage=3, precision=precision)
    trainer = Trainer(options)
    phases = Phases()
    if os.environ.get("BENCH_PROFILE"):
        phases.install()
    if approach == "dsckpt-serial":  # every tensor read on one thread, as before issue 25's parallel reads
        import dsckpt.formats.positional as positional

        positional.PARALLEL_READ_BYTES = 1 << 62
    elif approach.startswith("dsckpt-"):  # dsckpt-heap: glibc's own (dynamic) mmap threshold; dsckpt-<MiB>: that one
        import dsckpt.runtime.full_weights as full_weights

        variant = approach.split("-", 1)[1]
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        full_weights.release_memory_promptly = (lambda: None) if variant == "heap" else \
            (lambda: libc.mallopt(-3, int(variant) << 20))  # M_MMAP_THRESHOLD
    if approach == "transformers":
        from transformers.integrations import HfDeepSpeedConfig

        keep_alive = HfDeepSpeedConfig(trainer.runtime.config)  # noqa: F841  (is_deepspeed_zero3_enabled() reads it)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    dist.barrier()
    sampler = RssSampler()
    before = sampler.rss()
    sampler.start()
    profile_to = os.environ.get("BENCH_CPROFILE")  # a path prefix: rank 0's cProfile of the load, as text
    if profile_to and dist.get_rank() == 0:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    start = time.perf_counter()
    if approach.startswith("dsckpt"):
        load_full_weights(trainer.engine, weights)
    elif approach == "transformers":
        transformers_loads(trainer.engine, weights)
    elif approach == "floor":
        floor_copy(weights)
    else:
        every_rank_loads(trainer.engine, weights)
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    elapsed = time.perf_counter() - start
    if profile_to and dist.get_rank() == 0:
        import io
        import pstats

        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
        Path(f"{profile_to}.{approach}.txt").write_text(text.getvalue())
    sampler.running = False
    sampler.join()
    row = {"rank": dist.get_rank(), "growth": sampler.peak - before, "seconds": elapsed,
           "gpu_peak": torch.cuda.max_memory_allocated() if cuda else 0, "phases": phases.seconds}
    def publish(row: dict) -> None:
        rows = [None] * dist.get_world_size()
        dist.all_gather_object(rows, row)
        if dist.get_rank() == 0:
            Path(report).write_text(json.dumps(rows))

    publish(row)  # the load's figures stand even if the training steps after it run out of memory
    steps = int(os.environ.get("BENCH_STEPS_AFTER", "0"))
    if steps:  # training speed after the load: 2 warm-up steps, then ``steps`` timed
        for _ in range(2):
            trainer.step()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            trainer.step()
        if cuda:
            torch.cuda.synchronize()
        row["steps_per_s"] = steps / (time.perf_counter() - start)
        row["gpu_peak_training"] = torch.cuda.max_memory_allocated() if cuda else 0
        row["host_peak_training"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10  # the process's peak
        publish(row)
    from dsckpt.runtime.engine import shutdown

    shutdown(exit_process=True)


def weights_from_init(layers: int) -> Path:
    """A ``torch.save``d state dict of the benchmark model as initialised (no training run needed)."""
    import torch

    weights = HERE / "cache" / f"weights_init_d{os.environ.get('BENCH_DIM', '1024')}_l{layers}.pt"
    if not weights.exists():
        weights.parent.mkdir(exist_ok=True)
        os.environ["BENCH_LAYERS"] = str(layers)
        from bench.models import transformer

        torch.save(transformer().state_dict(), weights)
    return weights


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--approaches", default="dsckpt,every-rank-loads",
                    help="comma-separated: dsckpt, dsckpt-heap (glibc's dynamic mmap threshold), dsckpt-<MiB> (that "
                         "threshold), every-rank-loads, transformers")
    ap.add_argument("--from-init", action="store_true",
                    help="torch.save the initialised model instead of consolidating a trained ws-4 checkpoint")
    ap.add_argument("--profile", action="store_true", help="per-phase seconds on rank 0 (gather, read, torch.load)")
    args = ap.parse_args()
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(ROOT))
    if args.from_init:
        weights = weights_from_init(args.layers)
    else:
        from bench_consolidate import generate

        ckpt = generate(3, args.layers)
        weights = HERE / "cache" / f"weights_l{args.layers}.pt"
        if not weights.exists():
            subprocess.run([sys.executable, "-m", "dsckpt", "consolidate", str(ckpt), str(weights), "-q",
                            "--no-client-state"], check=True, cwd=ROOT)
    env = {**os.environ, "BENCH_LAYERS": str(args.layers), "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])), "OMP_NUM_THREADS": "1",
           **({"MALLOC_MMAP_THRESHOLD_": os.environ["MMAP_T"]} if os.environ.get("MMAP_T") else {}),
           **({"BENCH_PROFILE": "1"} if args.profile else {})}
    print(f"file: {weights.stat().st_size / 2**20:.0f} MiB, world size {args.nproc}, ZeRO-3\n")
    print("| approach | rank 0 growth MiB | other ranks growth MiB (max) | load s | rank 0 phases s |\n|---|---|---|---|---|")
    for _ in range(args.runs):
        for approach in args.approaches.split(","):
            report = HERE / "cache" / f"resume_{approach}.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
                   __file__, "--job", approach, str(weights), str(report)]
            for _ in range(3):  # a rendezvous port race now and then; the job itself is deterministic
                if subprocess.run(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0:
                    break
            else:
                raise SystemExit(f"failed three times: {' '.join(cmd)}")
            rows = json.loads(report.read_text())
            others = max(r["growth"] for r in rows[1:]) if len(rows) > 1 else 0
            phases = " ".join(f"{k} {v:.2f}" for k, v in sorted(rows[0].get("phases", {}).items()))
            print(f"| {approach} | {rows[0]['growth'] / 2**20:.0f} | {others / 2**20:.0f} | {rows[0]['seconds']:.2f} | {phases} |",
                  flush=True)


if __name__ == "__main__":
    if "--job" in sys.argv:
        i = sys.argv.index("--job")
        job(*sys.argv[i + 1:i + 5])
    else:
        main()
