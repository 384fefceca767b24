"""Multi-process tests: each starts real DeepSpeed ranks over gloo (a few seconds each)."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import FIXTURES, run_cli, run_job
from dsckpt.reader import open_checkpoint

SMALL = ("--model", "dsckpt.runtime.demo_model:build_small_model")


@pytest.mark.parametrize("stage", ["0", "1", "2", "3", "deepspeed_stage_3_offload"])
def test_save_load_round_trip_at_world_size_2(stage, tmp_path):
    report = tmp_path / "report.json"
    run_job("roundtrip.py", 2, stage, tmp_path / "ckpt", report)
    r = json.loads(report.read_text())
    assert r["weights_equal"] and r["client_equal"]
    assert r["loss_resumed"] == r["loss_uninterrupted"]


def test_world_size_mismatch_names_both_sizes():
    proc = run_cli("resume", FIXTURES / "z3_ws2_fp32", "--stage", "3", *SMALL, "--steps", "1")
    assert proc.returncode == 2
    assert "saved at data-parallel world size 2, but this run has world size 1" in proc.stderr
    assert "dsckpt consolidate" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("nproc", [1, 2, 3])
def test_full_weights_into_zero3_at_any_world_size(trained_z3, nproc):
    proc = run_cli("resume", "--full-weights", trained_z3 / "model.safetensors", "--stage", "3", "--nproc", nproc,
                   "--check", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["tensors_checked"] == 31 and report["max_abs_diff"] == 0
    assert report["fp32_masters_checked"] == 29 and report["fp32_master_max_abs_diff"] == 0  # tied: 2 names
    assert report["client_state_keys_restored"] == ["global_step", "epoch", "data_position", "rng", "user"]


@pytest.mark.parametrize("stage,precision", [(3, "bf16"), (1, "16"), (0, "bf16")])
def test_full_weights_into_16_bit_runs_keeps_fp32_masters(trained_z3, stage, precision):
    """16-bit models get the file's fp32 values in their masters, not the 16-bit rounding."""
    proc = run_cli("resume", "--full-weights", trained_z3 / "model.safetensors", "--stage", stage, "--precision",
                   precision, "--nproc", "2", "--check", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["max_abs_diff"] == 0 and report["fp32_master_max_abs_diff"] == 0
    assert report["fp32_masters_checked"] == 29


def test_full_weights_resume_continues_step_count(trained_z3, tmp_path):
    save = tmp_path / "again"
    proc = run_cli("resume", "--full-weights", trained_z3 / "model.safetensors", "--stage", "3", "--nproc", "2",
                   "--steps", "2", "--save-dir", save)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "steps 6 -> 8" in proc.stdout and (save / "latest").read_text().strip() == "step8"
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
    assert "1 missing keys: norm.bias" in msg and "1 unexpected keys: extra.weight" in msg
    assert "pos_embed: file [3, 3] vs model [32, 64]" in msg


def test_interrupted_save_keeps_previous_tag_and_latest(tmp_path):
    report = tmp_path / "report.json"
    run_job("save_atomic.py", 1, tmp_path / "ckpt", report)
    r = json.loads(report.read_text())
    crash = r["after_crash"]
    assert crash["latest"] == "step1" and crash["tags"] == ["step1"] and crash["step1_steps"] == 1
    assert crash["hidden"] == [".step1.dsckpt-partial"]  # named so a user can tell what it is
    assert r["latest"] == "step2" and r["tags"] == ["step1", "step2"]


def test_demo_model_learns(trained_z3):
    first, last = (float(x) for x in (trained_z3 / "train.out").read_text().split("loss ")[1].split(",")[0].split(" -> "))
    assert last < first


def test_reshard_loads_another_world_size(trained_z3, tmp_path):
    proc = run_cli("resume", trained_z3 / "ckpt", "--stage", "3", "--nproc", "3", "--reshard", "--steps", "1",
                   "--save-dir", tmp_path / "ws3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resharding: weights loaded from a consolidated copy" in proc.stdout
    assert "steps 6 -> 7" in proc.stdout
    assert open_checkpoint(tmp_path / "ws3").world_size == 3


def test_version_and_module_entry_point():
    from dsckpt import __version__

    assert run_cli("--version").stdout.strip() == f"dsckpt, version {__version__}"
    assert "consolidate" in run_cli("--help").stdout


def test_training_on_from_full_weights_saves_the_live_weights(trained_z3, tmp_path):
    report = tmp_path / "report.json"
    run_job("continue_from_full_weights.py", 3, trained_z3 / "model.safetensors", tmp_path / "ckpt", report)
    r = json.loads(report.read_text())
    assert (r["start"], r["end"]) == (6, 8)
    assert r["equal"] and r["user"]
