"""Where the step after a background save waits for its device-to-host copies (issue 54; GPU host only).

    BENCH_DIM=2048 BENCH_LAYERS=24 python bench/probe_step_sync.py
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    from dsckpt.runtime.launch import run_ranks

    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    codes = run_ranks([sys.executable, str(ROOT / "bench" / "jobs" / "step_sync_rank.py")], 1, env)
    raise SystemExit(max(codes))
