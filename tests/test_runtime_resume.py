"""Multi-process tests: each starts real DeepSpeed ranks over gloo (a few seconds each)."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import FIXTURES, demo_counts, fit_ranks, run_cli, run_job, skip_beyond_devices, skip_unless_supported
from dsckpt.zero.layout import list_tags
from dsckpt.zero.reader import open_checkpoint

pytestmark = pytest.mark.gpu  # runs on CUDA too: `pytest -m gpu` on the lent GPU machine
SMALL = ("--model", "dsckpt.runtime.demo_model:build_small_model")


@pytest.mark.parametrize("stage", ["0", "1", "2", "3", "deepspeed_stage_3_offload"])
def test_save_load_round_trip_at_world_size_2(stage, tmp_path):
    skip_beyond_devices(2)
    report = tmp_path / "report.json"
    run_job("roundtrip.py", 2, stage, tmp_path / "ckpt", report)
    r = json.loads(report.read_text())
    assert r["weights_equal"] and r["client_equal"]
    assert r["loss_resumed"] == r["loss_uninterrupted"]
    live = torch.load(report.with_suffix(".moments.pt"))  # safe_get_full_optimizer_state of the live job
    if stage != "0":
        import dsckpt

        for key in ("exp_avg", "exp_avg_sq"):
            gathered = dsckpt.load_state_dict(tmp_path / "ckpt", state=key)
            wanted = {k.split("/", 1)[1]: v for k, v in live.items() if k.startswith(key + "/")}
            assert wanted and gathered.keys() >= wanted.keys()
            for name, value in wanted.items():
                assert torch.equal(gathered[name].reshape(value.shape), value), (key, name)


def test_world_size_mismatch_names_both_sizes():
    proc = run_cli("resume", FIXTURES / "z3_ws2_fp32", "--stage", "3", *SMALL, "--steps", "1")
    assert proc.returncode == 2
    assert "saved at data-parallel world size 2, but this run has world size 1" in proc.stderr
    assert "dsckpt consolidate" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("nproc", [1, 2, 3])
def test_full_weights_into_zero3_at_any_world_size(trained_z3, nproc):
    skip_beyond_devices(nproc)
    proc = run_cli("resume", "--full-weights", trained_z3 / "model.safetensors", "--stage", "3", "--nproc", nproc,
                   "--check", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)  # stdout holds exactly one JSON document, whatever DeepSpeed logs
    counts = demo_counts()
    assert report["tensors_checked"] == counts["state_dict"] and report["max_abs_diff"] == 0
    assert report["fp32_masters_checked"] == counts["trainable_names"] and report["fp32_master_max_abs_diff"] == 0
    assert report["client_state_keys_restored"] == ["global_step", "epoch", "data_position", "rng", "args.seed", "user"]
    assert report["client_state_keys_left_alone"] == []
    assert "Guessing device ID" not in proc.stderr  # (NCCL's warning of a possible hang: each rank binds its GPU)


@pytest.mark.parametrize("stage,precision", [(3, "bf16"), (1, "16"), (0, "bf16")])
def test_full_weights_into_16_bit_runs_keeps_fp32_masters(trained_z3, stage, precision):
    """16-bit models get the file's fp32 values in their masters, not the 16-bit rounding."""
    skip_unless_supported(precision)
    skip_beyond_devices(2)
    proc = run_cli("resume", "--full-weights", trained_z3 / "model.safetensors", "--stage", stage, "--precision",
                   precision, "--nproc", "2", "--check", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["max_abs_diff"] == 0 and report["fp32_master_max_abs_diff"] == 0
    assert report["fp32_masters_checked"] == demo_counts()["trainable_names"]


def test_full_weights_resume_continues_step_count(trained_z3, tmp_path):
    save = tmp_path / "again"
    proc = run_cli("resume", "--full-weights", trained_z3 / "model.safetensors", "--stage", "3", "--nproc", fit_ranks(2),
                   "--steps", "2", "--save-dir", save)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "steps 6 -> 8" in proc.stdout and (save / "latest").read_text().strip() == "step8"
    assert proc.stdout.count("\n") == 1  # one result line; notes and DeepSpeed's logs are on stderr
    assert run_cli("consolidate", save, tmp_path / "m2.safetensors", "-q").returncode == 0
    before, after = load_file(trained_z3 / "model.safetensors"), load_file(tmp_path / "m2.safetensors")
    assert not torch.equal(before["embed.weight"], after["embed.weight"])  # it trained from the loaded weights
    sidecar = json.loads((tmp_path / "m2.safetensors.client_state.json").read_text())
    assert sidecar["client_state"]["global_step"] == 8


def test_strict_loading_names_missing_extra_and_mis_shaped(trained_z3, tmp_path):
    sd = load_file(trained_z3 / "model.safetensors")
    del sd["norm.bias"]
    sd["extra.weight"] = torch.zeros(2)
    sd["pos_embed"] = torch.zeros(3, 3)
    bad = tmp_path / "bad.safetensors"
    from safetensors import safe_open

    with safe_open(str(trained_z3 / "model.safetensors"), "pt") as f:
        save_file(sd, bad, metadata=f.metadata())  # keeps the tied-alias record
    proc = run_cli("resume", "--full-weights", bad, "--stage", "3", "--check")
    assert proc.returncode == 2
    msg = proc.stderr
    assert "does not match the model: 1 missing key (norm.bias); 1 unexpected key (extra.weight)" in msg
    assert "1 of another shape (pos_embed: [3, 3] in the file, [32, 64] in the model)" in msg


def test_interrupted_save_keeps_previous_tag_and_latest(tmp_path):
    report = tmp_path / "report.json"
    run_job("save_atomic.py", 1, tmp_path / "ckpt", report)
    r = json.loads(report.read_text())
    crash = r["after_crash"]
    assert crash["latest"] == "step1" and crash["tags"] == ["step1"] and crash["step1_steps"] == 1
    assert crash["hidden"] == []  # the failed save's staging folder removed (a kill's: tests/test_catalog.py)
    assert r["latest"] == "step2" and r["tags"] == ["step1", "step2"] and r["hidden"] == [] and r["listed"] == []


def test_demo_model_learns(trained_z3):
    first, last = (float(x) for x in (trained_z3 / "train.out").read_text().split("loss ")[1].split(",")[0].split(" -> "))
    assert last < first


def test_reshard_loads_another_world_size(trained_z3, tmp_path):
    """`resume --reshard` at 3 ranks of a 2-rank ZeRO-3 run: one temp copy written by `dsckpt reshard`,
    loaded by DeepSpeed itself, so the Adam moments carry over (saved again at once: 0 steps)."""
    from dsckpt.api.consolidation import load_state_dict

    skip_beyond_devices(3)
    proc = run_cli("resume", trained_z3 / "ckpt", "--nproc", "3", "--reshard", "--steps", "0",
                   "--save-dir", tmp_path / "ws3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resharded ZeRO-3 from 2 to 3 ranks: weights, optimizer state and client state carried over" in proc.stderr
    ckpt = open_checkpoint(tmp_path / "ws3")
    assert ckpt.world_size == 3 and ckpt.zero_stage == 3 and ckpt.layout.tag == "step6" and not ckpt.problems
    assert list_tags(tmp_path / "ws3") == ["step6"]
    assert [p.name for p in (tmp_path / "ws3").iterdir() if p.name.startswith(".")] == []  # no stray partial tags
    assert ckpt.client_state["global_step"] == 6
    for state in ("fp32", "exp_avg", "exp_avg_sq"):
        before, after = load_state_dict(trained_z3 / "ckpt", state=state), load_state_dict(tmp_path / "ws3", state=state)
        assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before), state
    assert not list(trained_z3.glob(".dsckpt-reshard-*"))  # the temp copy (beside the checkpoint) is gone


def test_version_and_module_entry_point():
    from dsckpt import __version__

    assert run_cli("--version").stdout.strip() == f"dsckpt, version {__version__}"
    assert "consolidate" in run_cli("--help").stdout


def test_training_on_from_full_weights_saves_the_live_weights(trained_z3, tmp_path):
    skip_beyond_devices(3)
    report = tmp_path / "report.json"
    run_job("continue_from_full_weights.py", 3, trained_z3 / "model.safetensors", tmp_path / "ckpt", report)
    r = json.loads(report.read_text())
    assert (r["start"], r["end"]) == (6, 8)
    assert r["equal"] and r["user"]
