"""Does the background persist slow a Python-bound training thread, and how (issue 54's throughput)?

A loop of small torch operations (Python-bound, as ZeRO-3's step is) on the main thread while
``persist.write_snapshot`` of PROBE_GB of CPU tensors runs: on threads of this process (the GIL shared), in another
process (no GIL shared), in another process at nice 19, and against as many busy processes that do no I/O; for 4
and 1 persist threads.  Each line gives the work's time and the loop's rate against its rate alone; every loop tests
the same plain flag and every child is started before the timing, so the rates compare.  Run where cores are ample
(the GPU host): on 2 cores the persist's own CPU use dominates.

    PROBE_GB=4 python bench/probe_persist_gil.py
    PROBE_GB=4 PROBE_WORKING_SET_MB=200 PROBE_THREADS=4 python bench/probe_persist_gil.py   (the cache's share)
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from typing import Callable

import torch

from dsckpt.checkpoint_engine import persist

GB = float(os.environ.get("PROBE_GB", "4"))
CHILD_OUT, OUT = "/tmp/probe_persist_gil_child.pt", "/tmp/probe_persist_gil.pt"


def make_state() -> dict[str, torch.Tensor]:
    return {key: torch.ones(int(GB * 1e9 / 4 / 3), dtype=torch.float32) for key in "abc"}


# PROBE_WORKING_SET_MB > 0: the loop also walks that many MB of Python objects, as an interpreter running ZeRO-3's
# hooks does, so a persist that streams its bytes through the last-level cache would show (a tight loop fits in L1)
WORKING_SET = [float(i) for i in range(int(os.environ.get("PROBE_WORKING_SET_MB", "0")) * 1_000_000 // 32)]
STRIDE = 4096


def loop_rate_while(work: Callable[[], object]) -> tuple[float, float]:
    """The main loop's iterations a second while ``work()`` runs on a thread, and the time ``work`` took."""
    done, took, small, at = [False], [0.0], torch.zeros(8), 0

    def run() -> None:
        t0 = time.perf_counter()
        work()
        took[0], done[0] = time.perf_counter() - t0, True

    thread = threading.Thread(target=run)
    n, t0 = 0, time.perf_counter()
    thread.start()
    while not done[0]:
        small.add_(1.0).mul_(0.5)
        if WORKING_SET:
            sum(WORKING_SET[at:at + STRIDE])
            at = (at + STRIDE) % len(WORKING_SET)
        n += 1
    rate = n / (time.perf_counter() - t0)
    thread.join()
    return rate, took[0]


def child(threads: int, nice: int) -> None:
    os.nice(nice)
    persist.THREADS = threads
    state = make_state()
    print("ready", flush=True)
    sys.stdin.readline()
    persist.write_snapshot(state, CHILD_OUT)


def ready_child(threads: int, nice: int = 0) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, __file__, "child", str(threads), str(nice)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"  # its state made
    return proc


def go(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.write("go\n")
    proc.stdin.flush()
    proc.wait()


def busy(processes: int, seconds: float) -> None:
    """``processes`` pure-Python spinners (no I/O, no shared GIL) for ``seconds``."""
    spin = f"import time\nend = time.time() + {seconds}\nwhile time.time() < end: pass"
    for proc in [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(processes)]:
        proc.wait()


def machine() -> str:
    quota = "/sys/fs/cgroup/cpu.max"
    cpu_max = open(quota).read().strip() if os.path.exists(quota) else "n/a"
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                 "?")
    return f"{os.cpu_count()} CPUs ({len(os.sched_getaffinity(0))} usable), cgroup cpu.max {cpu_max}, {model}"


def main() -> None:
    print(machine(), flush=True)
    state = make_state()
    alone, _ = loop_rate_while(lambda: time.sleep(2.0))
    print(f"alone: {alone:.0f} loops/s", flush=True)
    for threads in [int(t) for t in os.environ.get("PROBE_THREADS", "4,1").split(",")]:
        persist.THREADS = threads
        for _ in range(2):
            rate, took = loop_rate_while(lambda: persist.write_snapshot(state, OUT))
            print(f"threads {threads}: in-process persist {took:.2f} s, main loop {rate / alone:.2f}x", flush=True)
            os.remove(OUT)
            for nice in (0, 19):
                proc = ready_child(threads, nice)
                rate, took = loop_rate_while(lambda: go(proc))
                print(f"threads {threads}: subprocess persist at nice {nice} {took:.2f} s, main loop "
                      f"{rate / alone:.2f}x", flush=True)
                os.remove(CHILD_OUT)
            rate, took = loop_rate_while(lambda: busy(threads, 1.5))
            print(f"threads {threads}: {threads} busy processes (no I/O) {took:.2f} s, main loop {rate / alone:.2f}x",
                  flush=True)


if __name__ == "__main__":
    child(int(sys.argv[2]), int(sys.argv[3])) if sys.argv[1:2] == ["child"] else main()
