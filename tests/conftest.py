"""Shared helpers: the committed fixtures, a CLI runner, and the session's multi-process jobs."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

import pytest

from dsckpt.formats.pickle_policy import Opaque, TensorRef
from dsckpt.formats.pickle_writer import NewTensor
from dsckpt.formats.torchzip import read_tensor_bytes
from dsckpt.plan.segments import Zeros

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"
FIXTURE_NAMES = sorted(p.name for p in FIXTURES.iterdir() if p.is_dir() and (p / "latest").exists()
                       and not p.name.startswith(("moe_", "tp", "pp", "nvme_")))  # the demo model's runs (reference.pt: its state dict)
MOE_FIXTURE_NAMES = sorted(p.name for p in FIXTURES.glob("moe_*") if (p / "latest").exists())  # make_moe_fixtures.py
NVME_FIXTURE_NAMES = sorted(p.name for p in FIXTURES.glob("nvme_*") if (p / "latest").exists())  # make_nvme_fixtures.py
TP_FIXTURE_NAMES = sorted(p.name for p in FIXTURES.glob("tp*") if (p / "latest").exists())  # make_tp_fixtures.py
JOB_TIMEOUT = 240  # gloo's own timeout is 10 minutes; fail well before


MODELS = ROOT / "tests" / "models"  # test-only models, importable as `--model odd_model:build`
PYTHONPATH = os.pathsep.join([str(ROOT), str(MODELS), *filter(None, [os.environ.get("PYTHONPATH")])])
sys.path.insert(0, str(MODELS))  # the test models import in-process too (load_into, Lightning's load_from_checkpoint)


IN_PROCESS = {"inspect", "consolidate", "reshard", "convert", "diff", "check-finite", "verify", "list", "prune"}


def run_cli(*args, timeout=JOB_TIMEOUT, env=None, cwd=ROOT) -> subprocess.CompletedProcess:
    """``dsckpt ARGS`` as a user runs it, from ``cwd`` (the repository root).  The commands that start no process
    group and import no DeepSpeed run in this process, through the CLI's own entry (``dsckpt.cli.app.run``: the
    same parsing, errors and exit codes, without an interpreter start per call); the others as a subprocess."""
    args = [str(a) for a in args]
    if args and args[0] in IN_PROCESS and "--nproc" not in args and not env:
        from malformed import run_in_process

        here = os.getcwd()
        os.chdir(cwd)
        try:
            return run_in_process(args)
        finally:
            os.chdir(here)
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": PYTHONPATH, **(env or {})}
    full_env.pop("LOCAL_RANK", None)
    return subprocess.run([sys.executable, "-m", "dsckpt", *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env, cwd=cwd)


def run_job(script: str, nproc: int, *args, timeout=JOB_TIMEOUT, env=None) -> subprocess.CompletedProcess:
    """``tests/jobs/<script>`` on ``nproc`` local ranks, started as `--nproc` starts them (torchrun's
    environment, no torchrun agent: ~1.7 s less per job on 2 cores); rank outputs interleave."""
    from dsckpt.runtime.launch import run_ranks

    cmd = [sys.executable, str(ROOT / "tests" / "jobs" / script), *map(str, args)]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        codes = run_ranks(cmd, int(nproc), {"OMP_NUM_THREADS": "1", "PYTHONPATH": PYTHONPATH, **(env or {})}, timeout,
                          stdout=out, stderr=err, cwd=ROOT)
        out.seek(0), err.seek(0)
        proc = subprocess.CompletedProcess(cmd, next((c for c in codes if c), 0), out.read(), err.read())
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def nudge_first_master(path: Path) -> None:
    """Add 1 to the first fp32 master element of a ZeRO-1/2 optimizer file, rewritten with a valid CRC: a copy that
    drifted from its twin (test code may unpickle its own fixtures)."""
    import torch

    state = torch.load(path, weights_only=False)
    with torch.no_grad():
        state["optimizer_state_dict"]["single_partition_of_fp32_groups"][0][0] += 1
    torch.save(state, path)


@pytest.fixture
def fixture_copy(tmp_path):
    """A writable copy of a committed fixture."""
    def make(name: str) -> Path:
        dst = tmp_path / name
        shutil.copytree(FIXTURES / name, dst)
        return dst
    return make


def made_once(tmp_path_factory, name: str, make: Callable[[Path], object]) -> Path:
    """The folder ``name``, filled by ``make(folder)`` once per test session: under xdist the workers share it (the
    first one there makes it under a lock, the others wait for it), so a session fixture used by test files on
    several workers trains once."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # (one folder holds every worker's base temp)
    root, made = base / name, base / f"{name}.made"
    with FileLock(f"{root}.lock"):
        if not made.exists():
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir()
            make(root)
            made.touch()
    return root


@pytest.fixture(scope="session")
def trained_z3(tmp_path_factory):
    """One real 2-rank ZeRO-3 run of the demo model, consolidated: shared by the resume tests."""
    def train(root: Path) -> None:
        (root / "ckpt").mkdir()
        (root / "ckpt" / "README.md").write_text("kept\n")  # a file dsckpt did not write: the save goes beside it
        proc = run_cli("train", "--stage", "3", "--nproc", fit_ranks(2), "--steps", "6", "--save-dir", root / "ckpt")
        assert proc.returncode == 0, proc.stderr[-4000:]
        (root / "train.out").write_text(proc.stdout)
        (root / "train.err").write_text(proc.stderr)
        proc = run_cli("consolidate", root / "ckpt", root / "model.safetensors", "-q")
        assert proc.returncode == 0, proc.stderr[-4000:]
    return made_once(tmp_path_factory, "z3run", train)


# reshard_oracle.py's runs of the odd model (tests/models/odd_model.py): shared by test_reshard and test_convert
ODD_STAGES = (1, 2, 3)
ODD_OFFLOAD = ("2o", "3o")  # the offload presets (optimizer on the CPU; at stage 3 the parameters too), fp32
ODD_SUBGROUPS = ("3s",)  # ZeRO-3 with a small sub_group_size: several flat fp32 tensors per rank, fp32
ODD_PRECISIONS = ("32", "bf16", "16")
ODD_STEPS = 3


def odd_run_combos() -> list[str]:
    return [f"{s}:{p}" for p in ODD_PRECISIONS if p in _capabilities() for s in ODD_STAGES] + \
        [f"{s}:32" for s in ODD_OFFLOAD + ODD_SUBGROUPS]


@pytest.fixture(scope="session")
def odd_runs(tmp_path_factory):
    """``odd_runs(n)``: ROOT with ROOT/z<stage>_<precision>/{ckpt, before.pt} for every combo, trained at n
    ranks by one reshard_oracle.py job, once per session and n (test_reshard and test_convert both read the 2-rank
    runs; each writes its own names beside them)."""
    def train(n: int) -> Path:
        return made_once(tmp_path_factory, f"odd_runs_ws{n}", lambda root: run_job(
            "reshard_oracle.py", n, "train", root, ",".join(odd_run_combos()), ODD_STEPS, timeout=400))
    return train


@pytest.fixture(scope="session")
def ds_universal(tmp_path_factory):
    """fixture name -> its universal form, written by DeepSpeed's own ds_to_universal (once per session)."""
    def convert(name: str, out: Path) -> None:
        tag = (FIXTURES / name / "latest").read_text().strip()
        proc = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                               str(FIXTURES / name / tag), "--output_folder", str(out / f"{tag}_universal"),
                               "--inject_missing_state", "--num_extract_workers", "1", "--num_merge_workers", "1"],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]

    def make(name: str) -> Path:
        return made_once(tmp_path_factory, f"universal_{name}", lambda out: convert(name, out))
    return make


def tree_differences(a, b, where: str, plan=None) -> list[str]:
    """Where two parsed rank files differ: keys and their order, types, values, tensor dtypes, shapes, bytes.

    ``plan``: the same file's tree in a reshard plan; where it holds a ``NewTensor``, the byte ranges
    it fills with zeros (partition padding) are not compared - DeepSpeed's ZeRO-3 saves whatever
    memory its padding held (seen: -3.09e+36 in a fixture), dsckpt writes zeros there.
    """
    if isinstance(a, TensorRef) and isinstance(b, TensorRef):
        if (a.dtype, a.shape) != (b.dtype, b.shape):
            return [f"{where}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"]
        x, y = read_tensor_bytes(a), read_tensor_bytes(b)
        if isinstance(plan, NewTensor):
            pos = 0
            for seg in plan.source.pieces:
                if isinstance(seg, Zeros):
                    x = x[:pos] + bytes(seg.nbytes) + x[pos + seg.nbytes:]
                    y = y[:pos] + bytes(seg.nbytes) + y[pos + seg.nbytes:]
                pos += seg.nbytes
        return [] if x == y else [f"{where}: bytes differ"]
    if type(a) is not type(b):
        return [f"{where}: {type(a).__name__} vs {type(b).__name__}"]
    if isinstance(a, Opaque):
        return ([] if (a.args, a.via) == (b.args, b.via) else [f"{where}: constructed differently"]) + \
            tree_differences(a.state, b.state, f"{where}.state")
    if isinstance(a, dict):
        if list(a) != list(b):
            return [f"{where}: keys {list(a)[:8]} vs {list(b)[:8]}"]
        sub = plan if isinstance(plan, dict) else {}
        return [d for k in a for d in tree_differences(a[k], b[k], f"{where}.{k}", sub.get(k))]
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: {len(a)} vs {len(b)} items"]
        sub = plan if isinstance(plan, (list, tuple)) else [None] * len(a)
        return [d for i, (x, y, p) in enumerate(zip(a, b, sub)) for d in tree_differences(x, y, f"{where}[{i}]", p)]
    return [] if a == b else [f"{where}: {a!r:.60} vs {b!r:.60}"]




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
                 "odd_weights", "hf_reference", "odd_runs", "converted"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.module.__name__.rpartition(".")[2]
        if module in RANK_MODULES or RANK_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.runtime)
