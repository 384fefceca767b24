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
FIXTURE_NAMES = sorted(p.name for p in FIXTURES.iterdir() if p.is_dir() and (p / "latest").exists()
                       and not p.name.startswith("moe_"))  # the demo model's runs (reference.pt: its state dict)
MOE_FIXTURE_NAMES = sorted(p.name for p in FIXTURES.glob("moe_*") if (p / "latest").exists())  # make_moe_fixtures.py
JOB_TIMEOUT = 240  # gloo's own timeout is 10 minutes; fail well before


MODELS = ROOT / "tests" / "models"  # test-only models, importable as `--model odd_model:build`
PYTHONPATH = os.pathsep.join([str(ROOT), str(MODELS), *filter(None, [os.environ.get("PYTHONPATH")])])
sys.path.insert(0, str(MODELS))  # the test models import in-process too (load_into, Lightning's load_from_checkpoint)


def run_cli(*args, timeout=JOB_TIMEOUT, env=None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": PYTHONPATH, **(env or {})}
    full_env.pop("LOCAL_RANK", None)
    return subprocess.run([sys.executable, "-m", "dsckpt", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=full_env, cwd=ROOT)


def run_job(script: str, nproc: int, *args, timeout=JOB_TIMEOUT) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(ROOT / "tests" / "jobs" / script), *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": PYTHONPATH})
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
    (root / "ckpt").mkdir()
    (root / "ckpt" / "README.md").write_text("kept\n")  # a file dsckpt did not write: the save goes beside it
    proc = run_cli("train", "--stage", "3", "--nproc", fit_ranks(2), "--steps", "6", "--save-dir", root / "ckpt")
    assert proc.returncode == 0, proc.stderr[-4000:]
    (root / "train.out").write_text(proc.stdout)
    (root / "train.err").write_text(proc.stderr)
    proc = run_cli("consolidate", root / "ckpt", root / "model.safetensors", "-q")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return root


def load_json(path: Path):
    return json.loads(Path(path).read_text())


def _capabilities() -> tuple[str, ...]:
    from dsckpt.runtime.precision import supported_precisions

    return supported_precisions()


def skip_unless_supported(precision: str) -> None:
    """Machines differ: a precision this CPU (or GPU) cannot train in is skipped, with the reason."""
    if precision not in _capabilities():
        pytest.skip(f"precision {precision!r} is not supported by this machine's DeepSpeed accelerator "
                    f"(supported: {', '.join(_capabilities())})")


def skip_beyond_devices(nproc: int) -> None:
    """On a GPU host every rank needs its own GPU (nccl); on a CPU, gloo runs any small world size."""
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() < nproc:
        pytest.skip(f"{nproc} ranks need {nproc} GPUs; this host has {torch.cuda.device_count()}")


def fit_ranks(nproc: int) -> int:
    """``nproc`` ranks, or as many as this host has GPUs (a fixture that any world size can use)."""
    import torch

    return min(nproc, torch.cuda.device_count()) if torch.cuda.is_available() else nproc


def demo_counts(**model_kwargs) -> dict[str, int]:
    """What the demo model's checkpoints hold, derived from the model itself (no hard-coded counts).

    ``state_dict``: names in a full state dict (tied names both); ``written``: tensors a consolidated
    file stores (tied ones once); ``trainable_names``: trainable parameters counted per module name,
    as ``--check`` walks them (a tied weight twice).
    """
    from dsckpt.runtime.demo_model import TinyCausalLM

    model = TinyCausalLM(**model_kwargs)
    state = model.state_dict()
    storages = {t.data_ptr() for t in state.values()}
    trainable = sum(1 for _, m in model.named_modules() for p in m.parameters(recurse=False) if p.requires_grad)
    return {"state_dict": len(state), "written": len(storages), "trainable_names": trainable}


# --- `make test-fast`: the edit loop without process groups -----------------------------------------
# Tests that start dsckpt's DeepSpeed runtime in a subprocess (a 2-rank job costs ~4-5 s; even a resume refused
# before its ranks start imports DeepSpeed, ~1.5 s) are marked `runtime`: whole modules below, any test using a
# fixture that trains, and tests marked by hand.
RANK_MODULES = {"test_runtime_resume", "test_runtime_any_model", "test_trainer_flows"}
RANK_FIXTURES = {"trained_z3", "oracle", "restaged", "hf_run", "lightning_run", "other_setups", "large_checkpoint",
                 "odd_weights", "hf_reference"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.module.__name__.rpartition(".")[2]
        if module in RANK_MODULES or RANK_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.runtime)
