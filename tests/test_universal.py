"""Universal checkpoints (DeepSpeed's ds_to_universal output) as input, and rank folders without optimizer files.

A universal checkpoint keeps the rank model-states files and replaces the optimizer files with
zero/<parameter>/{fp32,exp_avg,exp_avg_sq}.pt. Read as a plain checkpoint it looked like ZeRO-0 and, at
stage 3, consolidated to empty placeholder tensors with exit code 0; now it is read as what it is.
"""
from __future__ import annotations

import shutil

import pytest
import torch

from conftest import FIXTURES, run_cli
from dsckpt import load_state_dict
from dsckpt.errors import MissingRankError, UnsupportedCheckpointError
from dsckpt.plan.reshard import build_reshard_plan
from dsckpt.zero.reader import open_checkpoint


@pytest.fixture
def universal(ds_universal):
    return ds_universal


@pytest.mark.parametrize("name", ["z2_ws2_fp32", "z1_ws3_bf16", "z3_ws3_bf16"])
def test_universal_consolidates_to_the_same_tensors(name, universal):
    """Every tensor - masters, frozen (stage 3: only in the model states), buffers, ties - and both Adam
    moments equal what the original rank files give."""
    root = universal(name)
    ckpt = open_checkpoint(root)
    assert ckpt.universal and ckpt.zero_stage == int(name[1])
    for state in ("fp32", "exp_avg", "exp_avg_sq"):
        ours, original = load_state_dict(root, state=state), load_state_dict(FIXTURES / name, state=state)
        assert list(ours) == list(original) and ours, state
        for key in original:
            assert ours[key].dtype == original[key].dtype and torch.equal(ours[key], original[key]), (state, key)
    proc = run_cli("inspect", root)
    assert proc.returncode == 0 and "(universal: ds_to_universal's zero/ folder)" in proc.stdout


def test_universal_missing_parameter_file_is_named(universal, tmp_path):
    root = tmp_path / "u"
    shutil.copytree(universal("z3_ws3_bf16"), root)
    (root / "step3_universal" / "zero" / "norm.bias" / "fp32.pt").unlink()
    proc = run_cli("consolidate", root, tmp_path / "out.safetensors")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "norm.bias/fp32.pt: missing - the universal checkpoint holds no fp32 for 'norm.bias'" in proc.stderr
    assert not (tmp_path / "out.safetensors").exists()


def test_universal_is_not_resharded(universal):
    with pytest.raises(UnsupportedCheckpointError, match="a universal checkpoint .* is not split by world size"):
        build_reshard_plan(open_checkpoint(universal("z2_ws2_fp32")), 3)


def test_zero3_without_optimizer_files_is_refused_not_emptied(fixture_copy, tmp_path):
    """ZeRO-3 model states hold placeholders only: with the optimizer files gone there is nothing to gather."""
    ckpt = fixture_copy("z3_ws2_fp32")
    for f in ckpt.glob("*/*optim_states.pt"):
        f.unlink()
    with pytest.raises(MissingRankError, match="optimizer-states file of rank 0 is missing"):
        load_state_dict(ckpt)
    proc = run_cli("consolidate", ckpt, tmp_path / "out.safetensors")
    assert proc.returncode == 2 and "optimizer-states file of rank 0 is missing" in proc.stderr
    assert not (tmp_path / "out.safetensors").exists()
