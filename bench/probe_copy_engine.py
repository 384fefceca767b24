"""Is the first step after a background save slowed by the copy engines (issue 54; one GPU)?

A snapshot's device-to-host copies (PROBE_GB into pinned host memory) are queued on a side stream; then on the
current stream one operation is timed to completion: a matmul (SMs only), a device-to-device copy, an NCCL
all-gather at world size 1 (what ZeRO-3's parameter fetch runs on one GPU), a pageable host-to-device copy, a
scalar read (``.item()``: a small device-to-host copy) and a pinned device-to-host copy; each
against the same operation with nothing queued, and with the copies queued in PROBE_PIECE_MB pieces, each piece
queued once the one before it finished (what pacing the copies would do).

    PROBE_GB=8 python bench/probe_copy_engine.py
"""
from __future__ import annotations

import os
import threading
import time

import torch
import torch.distributed as dist

GB = float(os.environ.get("PROBE_GB", "8"))
PIECE = int(os.environ.get("PROBE_PIECE_MB", "256")) << 20


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1)
    n = int(GB * 1e9) // 4
    source = torch.ones(n, device="cuda")
    host = torch.empty(n, pin_memory=True)
    side = torch.cuda.Stream()
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    d_src, d_dst = torch.ones(50_000_000, device="cuda"), torch.empty(50_000_000, device="cuda")
    gathered, shard = torch.empty(50_000_000, device="cuda"), torch.ones(50_000_000, device="cuda")
    pageable = torch.ones(10_000_000)
    scalar, pinned_small = torch.ones(1, device="cuda"), torch.empty(10_000_000, pin_memory=True)
    operations = {
        "matmul x20": lambda: [a @ a for _ in range(20)],
        "device-to-device copy 200 MB": lambda: d_dst.copy_(d_src),
        "all-gather, world size 1, 200 MB": lambda: dist.all_gather_into_tensor(gathered, shard),
        "pageable host-to-device 40 MB": lambda: pageable.to("cuda"),
        "a scalar read, .item()": lambda: scalar.item(),
        "pinned device-to-host 40 MB": lambda: pinned_small.copy_(d_src[:10_000_000], non_blocking=True),
    }

    def copies_whole() -> None:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            host.copy_(source, non_blocking=True)

    def copies_paced() -> threading.Thread:
        side.wait_stream(torch.cuda.current_stream())

        def pace() -> None:
            with torch.cuda.stream(side):
                for at in range(0, n, PIECE // 4):
                    host[at:at + PIECE // 4].copy_(source[at:at + PIECE // 4], non_blocking=True)
                    side.synchronize()
        thread = threading.Thread(target=pace)
        thread.start()
        return thread

    def timed(operation) -> float:
        t0 = time.perf_counter()
        operation()
        torch.cuda.current_stream().synchronize()
        return time.perf_counter() - t0

    for op in operations.values():
        timed(op)
    t0 = time.perf_counter()
    copies_whole()
    side.synchronize()
    print(f"{GB:.1f} GB device-to-host alone: {time.perf_counter() - t0:.3f} s", flush=True)
    for name, op in operations.items():
        torch.cuda.synchronize()
        quiet = timed(op)
        copies_whole()
        behind_whole = timed(op)
        side.synchronize()
        thread = copies_paced()
        time.sleep(0.01)
        behind_paced = timed(op)
        thread.join()
        print(f"{name}: alone {quiet * 1e3:.1f} ms, beside the copies queued whole {behind_whole * 1e3:.1f} ms, "
              f"paced in {PIECE >> 20} MiB pieces {behind_paced * 1e3:.1f} ms", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
