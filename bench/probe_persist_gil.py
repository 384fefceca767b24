"""Does the background persist slow a Python-bound training thread through the GIL (issue 54's throughput)?

A spin loop's rate on the main thread while ``persist.write_snapshot`` of PROBE_GB of CPU tensors runs on threads of
this process, against the same persist run by another process (no GIL shared), for 4 and 1 persist threads; each
figure is the loop's rate against its rate alone.  Run where cores are ample (the GPU host): on 2 cores the persist's
CPU use dominates.

    PROBE_GB=4 python bench/probe_persist_gil.py
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import torch

from dsckpt.runtime import persist

GB = float(os.environ.get("PROBE_GB", "4"))
CHILD_OUT, OUT = "/tmp/probe_persist_gil_child.pt", "/tmp/probe_persist_gil.pt"


def make_state() -> dict[str, torch.Tensor]:
    return {key: torch.ones(int(GB * 1e9 / 4 / 3), dtype=torch.float32) for key in "abc"}


def spin_until(done) -> float:
    """Loop iterations a second until ``done()``."""
    n, t0 = 0, time.perf_counter()
    while not done():
        n += 1
    return n / (time.perf_counter() - t0)


def child(threads: int) -> None:
    persist.THREADS = threads
    state = make_state()
    print("ready", flush=True)
    sys.stdin.readline()
    persist.write_snapshot(state, CHILD_OUT)


def main() -> None:
    state = make_state()
    end = time.perf_counter() + 2.0
    alone = spin_until(lambda: time.perf_counter() > end)
    for threads in (4, 1):
        persist.THREADS = threads
        for _ in range(2):
            writer = threading.Thread(target=persist.write_snapshot, args=(state, OUT))
            t0 = time.perf_counter()
            writer.start()
            rate = spin_until(lambda: not writer.is_alive())
            print(f"threads {threads}: in-process persist {time.perf_counter() - t0:.2f} s, main loop "
                  f"{rate / alone:.2f}x", flush=True)
            os.remove(OUT)
            proc = subprocess.Popen([sys.executable, __file__, "child", str(threads)], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, text=True)
            proc.stdout.readline()  # its state made
            t0 = time.perf_counter()
            proc.stdin.write("go\n")
            proc.stdin.flush()
            rate = spin_until(lambda: proc.poll() is not None)
            print(f"threads {threads}: subprocess persist {time.perf_counter() - t0:.2f} s, main loop "
                  f"{rate / alone:.2f}x", flush=True)
            os.remove(CHILD_OUT)


if __name__ == "__main__":
    child(int(sys.argv[2])) if sys.argv[1:2] == ["child"] else main()
