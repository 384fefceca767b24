"""Shared helpers: the committed fixtures, a CLI runner, and the session's multi-process jobs."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"
FIXTURE_NAMES = sorted(p.name for p in FIXTURES.iterdir() if p.is_dir() and (p / "latest").exists())
JOB_TIMEOUT = 240  # gloo's own timeout is 10 minutes; fail well before


def run_cli(*args, timeout=JOB_TIMEOUT, env=None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    full_env.pop("LOCAL_RANK", None)
    return subprocess.run([sys.executable, "-m", "dsckpt", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=full_env, cwd=ROOT)


def run_job(script: str, nproc: int, *args, timeout=JOB_TIMEOUT) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(ROOT / "tests" / "jobs" / script), *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


@pytest.fixture
def fixture_copy(tmp_path):
    """A writable copy of a committed fixture."""
    def make(name: str) -> Path:
        dst = tmp_path / name
        shutil.copytree(FIXTURES / name, dst)
        return dst
    return make


@pytest.fixture(scope="session")
def trained_z3(tmp_path_factory):
    """One real 2-rank ZeRO-3 run of the demo model, consolidated: shared by the resume tests."""
    root = tmp_path_factory.mktemp("z3run")
    proc = run_cli("train", "--stage", "3", "--nproc", "2", "--steps", "6", "--save-dir", root / "ckpt")
    assert proc.returncode == 0, proc.stderr[-4000:]
    (root / "train.out").write_text(proc.stdout)
    proc = run_cli("consolidate", root / "ckpt", root / "model.safetensors", "-q")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return root


def load_json(path: Path):
    return json.loads(Path(path).read_text())
