"""The runtime on a model unlike the demo's, on any CPU, from any client state (issue 10).

The odd model (tests/models/odd_model.py) has only odd or prime parameter sizes, a tied embedding,
a frozen layer and float/int buffers.  One torchrun job per world size loads its full weights at
every stage x precision (tests/jobs/full_weights_matrix.py), so the matrix costs three start-ups.
"""
import json
import os

import pytest
import torch

from conftest import _capabilities, fit_ranks, run_cli, run_job, skip_beyond_devices
from dsckpt.api.options import WriteOptions
from dsckpt.errors import UnsupportedPrecisionError
from dsckpt.analysis.inspect import summarize
from dsckpt.zero.reader import open_checkpoint
from dsckpt.runtime.precision import require_supported, supported_precisions

pytestmark = pytest.mark.gpu  # runs on CUDA too: `pytest -m gpu` on the lent GPU machine
ODD = ("--model", "odd_model:build")
TRAINABLE_NAMES = 7  # embed/head (tied: checked under both names), up.weight, up.bias, norm.*, gate


@pytest.fixture(scope="session")
def odd_weights(tmp_path_factory):
    """The odd model trained 2 steps with ZeRO-3 at world size 2 (fp32), then consolidated."""
    root = tmp_path_factory.mktemp("odd")
    proc = run_cli("train", *ODD, "--stage", "3", "--nproc", fit_ranks(2), "--steps", "2", "--save-dir", root / "ckpt")
    assert proc.returncode == 0, proc.stderr[-4000:]
    proc = run_cli("consolidate", root / "ckpt", root / "model.safetensors", "-q")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return root


def test_trained_dtype_is_the_requested_one(odd_weights, tmp_path):
    """zero.Init must not pick bf16 for an fp32 run on a CPU without fp16 (DeepSpeed 0.19.8 does)."""
    assert summarize(odd_weights / "ckpt")["dtype"] == "fp32"  # what `inspect` reports
    proc = run_cli("train", *ODD, "--stage", "3", "--precision", "bf16", "--steps", "1", "--save-dir", tmp_path / "b")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert summarize(tmp_path / "b")["dtype"] == "bf16"


@pytest.mark.parametrize("nproc", [1, 2, 3])
def test_full_weights_every_stage_precision_world_size(odd_weights, tmp_path, nproc):
    """One job per world size: stages 0-3 x every precision this machine trains in (fp32 always)."""
    skip_beyond_devices(nproc)
    precisions = ["32"] + [p for p in ("bf16", "16") if p in _capabilities()]
    report = tmp_path / "report.json"
    run_job("full_weights_matrix.py", nproc, odd_weights / "model.safetensors", report, ",".join(precisions))
    results = json.loads(report.read_text())
    assert len(results) == 4 * len(precisions)
    wanted = {"32": "torch.float32", "bf16": "torch.bfloat16", "16": "torch.float16"}
    for r in results:
        where = f"stage {r['stage']} precision {r['precision']} world size {nproc}"
        assert r["world_size"] == nproc
        assert r["max_abs_diff"] == 0 and r["fp32_master_max_abs_diff"] == 0, where
        assert r["tensors_checked"] == 11, where  # 7 trainable names, 2 frozen, 2 persistent buffers
        has_masters = r["precision"] != "32" or r["stage"] > 0  # stage-0 fp32 trains the weights themselves
        assert r["fp32_masters_checked"] == (TRAINABLE_NAMES if has_masters else 0), where
        assert r["dtypes"] == [wanted[r["precision"]]], where
        assert r["loss_finite"], where
        assert r["client_state_keys_restored"][:3] == ["global_step", "epoch", "data_position"]


class FakeAccelerator:
    def __init__(self, fp16, bf16):
        self.fp16, self.bf16 = fp16, bf16

    def is_fp16_supported(self):
        return self.fp16

    def is_bf16_supported(self):
        return self.bf16

    def device_name(self):
        return "cpu"


@pytest.mark.parametrize("fp16,bf16", [(None, True), (True, True), (False, False), (True, False)])
def test_precision_check_both_ways(fp16, bf16):
    """The answer of DeepSpeed's accelerator decides, whichever way this machine answers."""
    acc = FakeAccelerator(fp16, bf16)
    require_supported("32", acc)
    for precision, ok in (("16", fp16), ("bf16", bf16)):
        if ok:
            require_supported(precision, acc)
        else:
            label = "fp16" if precision == "16" else "bf16"
            with pytest.raises(UnsupportedPrecisionError, match=f"precision {label} is not supported on this "
                                                                 "machine's cpu device"):
                require_supported(precision, acc)


def test_unsupported_precision_fails_before_ranks_start():
    missing = [p for p in ("16", "bf16") if p not in supported_precisions()]
    if not missing or torch.cuda.is_available():
        pytest.skip("this machine trains in every precision (the fake-accelerator test covers the refusal)")
    proc = run_cli("train", "--precision", missing[0], "--nproc", "3", "--steps", "1")
    assert proc.returncode == 2
    assert proc.stderr.count("dsckpt: error:") == 1 and "is not supported on this machine" in proc.stderr
    assert "built successfully" not in proc.stderr  # DeepSpeed never started


def test_factory_may_import_inside_itself(tmp_path):
    """`import torch._dynamo` under zero.Init's patched Tensor.__new__ used to fail (transformers does it)."""
    proc = run_cli("train", "--model", "odd_model:build_with_lazy_import", "--stage", "3", "--steps", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Signature mismatch" not in proc.stderr


def test_transformers_factory_at_stage_3():
    """A transformers model built inside the factory (runs where transformers is installed: the GPU image)."""
    pytest.importorskip("transformers")
    proc = run_cli("train", "--model", "odd_model:build_tiny_gpt2", "--stage", "3", "--precision", "bf16",
                   "--steps", "2", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["steps"] == 2


def _write_sidecar(path, state):
    path.write_text(json.dumps({"format": "dsckpt.client_state/1", "weights": "x", "client_state": state}))
    return path


LIGHTNING = {"epoch": 3, "global_step": 40, "pytorch-lightning_version": "2.6.6",
             "loops": {"fit_loop": {"epoch_progress": {"current": {"completed": 3}}}},
             "callbacks": {"ModelCheckpoint{}": {"best_model_score": None}}, "lr_schedulers": [],
             "hyper_parameters": {"lr": 0.001, "hidden": 53}}
HF = {"global_step": 12, "epoch": 1.5, "max_steps": 100, "best_metric": None,
      "log_history": [{"loss": 4.2, "step": 10}], "trial_params": None}


@pytest.mark.parametrize("name,state,restored,left_alone", [
    ("lightning", LIGHTNING, ["epoch", "global_step"], ["pytorch-lightning_version", "loops", "callbacks",
                                                        "lr_schedulers", "hyper_parameters"]),
    ("hf", HF, ["global_step", "epoch"], ["max_steps", "best_metric", "log_history", "trial_params"]),
    ("foreign types", {"global_step": "forty", "epoch": {"n": 1}, "rng": [1, 2], "data_position": -3},
     [], ["global_step (unusable str value)", "epoch (unusable dict value)", "rng (unusable list value)",
          "data_position (unusable int value)"]),
])
def test_resume_from_foreign_client_state(odd_weights, tmp_path, name, state, restored, left_alone):
    sidecar = _write_sidecar(tmp_path / "state.json", state)
    proc = run_cli("resume", "--full-weights", odd_weights / "model.safetensors", "--client-state", sidecar,
                   *ODD, "--stage", "2", "--steps", "1", "--save-dir", tmp_path / "run", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert summary["client_state_keys_restored"] == restored
    assert summary["client_state_keys_left_alone"] == left_alone
    step = state["global_step"] if isinstance(state["global_step"], int) else 0
    assert (summary["start_step"], summary["end_step"]) == (step, step + 1)
    saved = open_checkpoint(tmp_path / "run").client_state
    assert saved["global_step"] == step + 1
    if isinstance(state["epoch"], (int, float)):
        assert saved["epoch"] == int(state["epoch"])


def test_client_state_none_and_embedded_pt_state(odd_weights, tmp_path):
    """A Lightning-style .pt holds its client state beside state_dict; `--client-state none` skips any."""
    from safetensors.torch import load_file

    weights = load_file(odd_weights / "model.safetensors")
    weights["head.weight"] = weights["embed.weight"]
    pt = tmp_path / "lightning.pt"
    torch.save({"state_dict": weights, "epoch": 2, "global_step": 30, "hyper_parameters": {"lr": 0.1}}, pt)
    proc = run_cli("resume", "--full-weights", pt, *ODD, "--stage", "3", "--check", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["client_state_keys_restored"] == ["epoch", "global_step"] and report["max_abs_diff"] == 0
    assert report["client_state_keys_left_alone"] == ["hyper_parameters"]
    proc = run_cli("resume", "--full-weights", pt, *ODD, "--stage", "3", "--check", "--json", "--client-state", "none")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["client_state_keys_restored"] == []


@pytest.mark.parametrize("nproc", [1, 2])
def test_rank_errors_print_once_with_the_same_exit_code(odd_weights, nproc):
    """An error every rank hits (the model does not fit the file) is one line, exit 2, at any --nproc."""
    skip_beyond_devices(nproc)
    proc = run_cli("resume", "--full-weights", odd_weights / "model.safetensors", "--nproc", nproc, "--check")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.count("dsckpt: error:") == 1 and "does not match the model" in proc.stderr
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr
    assert proc.stdout == ""


@pytest.mark.parametrize("args,message", [
    (("--check",), "give either CKPT_DIR or --full-weights FILE"),
    (("x", "--full-weights", "y"), "give either CKPT_DIR or --full-weights FILE"),
    (("fixtures/z3_ws2_fp32", "--check"), "--check compares the loaded model with a --full-weights file"),
    (("--full-weights", "nowhere.safetensors"), "nowhere.safetensors: no such weights file or folder"),
    (("fixtures/z3_ws2_fp32", "--nproc", "3"), "saved at data-parallel world size 2, but this run has world size 3"),
    (("--full-weights", "fixtures/z3_ws2_fp32/reference.pt", "--client-state", "missing.json"),
     "--client-state missing.json: no such file"),
])
def test_checks_that_need_no_rank_run_before_ranks_start(args, message):
    proc = run_cli("resume", *args, "--nproc", "2", "--steps", "1") if "--nproc" not in args else \
        run_cli("resume", *args, "--steps", "1")
    assert proc.returncode == 2
    assert proc.stderr.count("dsckpt: error:") == 1 and message in proc.stderr
    assert "built successfully" not in proc.stderr and "Traceback" not in proc.stderr  # no rank was started
    assert "no --save-dir" not in proc.stderr  # the error is the only line


def test_train_without_save_dir_says_so():
    proc = run_cli("train", *ODD, "--stage", "0", "--steps", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "no --save-dir given: this run trains and saves nothing" in proc.stderr


def test_a_config_optimizer_is_the_one_deepspeed_builds(tmp_path):
    """A config's "optimizer" section wins over the trainer's AdamW (as in Lightning): DeepSpeed builds it, and
    the checkpoint holds that optimizer's state (Adagrad's ``sum``, its own ``lr_decay``), not Adam's moments."""
    from dsckpt.formats.torchzip import TorchFile

    config = tmp_path / "adagrad.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2},
                                  "optimizer": {"type": "Adagrad", "params": {"lr": 0.05, "lr_decay": 0.01}}}))
    proc = run_cli("train", *ODD, "--config", config, "--steps", "1", "--save-dir", tmp_path / "ckpt")
    assert proc.returncode == 0, proc.stderr[-3000:]
    optim = TorchFile(next((tmp_path / "ckpt").glob("*/*optim_states.pt"))).obj["optimizer_state_dict"]
    base = optim["base_optimizer_state"]
    assert [set(s) for s in base["state"].values()] == [{"step", "sum"}]
    assert base["param_groups"][0]["lr_decay"] == 0.01 and base["param_groups"][0]["lr"] == 0.05


def test_consolidate_fsyncs_unless_told_not_to(monkeypatch, tmp_path):
    import dsckpt

    calls = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: calls.append(os.readlink(f"/proc/self/fd/{fd}")) or real(fd))
    out = tmp_path / "m.safetensors"
    dsckpt.consolidate("fixtures/z2_ws2_fp32", out)
    assert any(c.endswith("m.safetensors") or ".m.safetensors.dsckpt-tmp-" in c for c in calls)
    assert str(tmp_path) in calls  # the folder, after the rename
    calls.clear()
    dsckpt.consolidate("fixtures/z2_ws2_fp32", tmp_path / "n.safetensors", options=WriteOptions(fsync=False))
    assert calls == []


MUON_PROBE = """
import os, sys, torch
from dsckpt.runtime.engine import MUON_MODULE, import_muon_uncompiled
os.environ.pop("TORCHDYNAMO_DISABLE", None)
muon_like = type("MuonWithAuxAdam", (torch.optim.SGD,), {"__module__": "my_muon_fork"})
sys.modules["deepspeed.runtime.zero.muon"] = None  # a DeepSpeed without Muon: the import fails, quietly
import_muon_uncompiled(torch.optim.AdamW([torch.nn.Parameter(torch.ones(1))]))
assert "TORCHDYNAMO_DISABLE" not in os.environ
del sys.modules["deepspeed.runtime.zero.muon"]
import_muon_uncompiled(None)  # DeepSpeed builds the config's optimizer: may be Muon
import_muon_uncompiled(muon_like([torch.nn.Parameter(torch.ones(1))], lr=0.1))
left_alone = MUON_MODULE not in sys.modules
import_muon_uncompiled(torch.optim.AdamW([torch.nn.Parameter(torch.ones(1))]))
from deepspeed.runtime.zero.muon import original_muon
print(left_alone, MUON_MODULE in sys.modules, hasattr(original_muon.muon_update, "_torchdynamo_orig_callable"),
      "torch._inductor.compile_fx" in sys.modules, "TORCHDYNAMO_DISABLE" in os.environ)
"""


def test_deepspeeds_muon_module_is_imported_uncompiled_for_other_optimizers():
    """DeepSpeed imports its Muon module in every initialize; for a non-Muon optimizer dsckpt imports it first with
    torch.compile off (no torch._inductor: ~0.85 s of CPU per rank), and leaves TORCHDYNAMO_DISABLE as it was."""
    import subprocess
    import sys

    from conftest import PYTHONPATH

    proc = subprocess.run([sys.executable, "-c", MUON_PROBE], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": PYTHONPATH})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1].split() == ["True", "True", "False", "False", "False"], proc.stdout
