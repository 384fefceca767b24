"""Checkpoints from DeepSpeed versions that recorded less (real fixtures with the newer keys taken out), and
from save options and training set-ups the fixtures do not use (real runs).

DeepSpeed added ``shared_params``, ``frozen_param_shapes`` / ``frozen_param_fragments`` (model states)
and ``param_slice_mappings`` (ZeRO-1/2 optimizer states) over time; older writers left them out. The
files are rewritten with dsckpt's own pickle writer so everything else - storage keys included, which
tie a ZeRO-3 alias's placeholder to its source - stays as DeepSpeed wrote it.
"""
from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from conftest import FIXTURES, run_cli
from dsckpt import consolidate
from dsckpt.errors import InconsistentCheckpointError, UnsupportedCheckpointError
from dsckpt.zero import layout as L
from dsckpt.zero.reader import open_checkpoint
from forge import rewrite_tree
from test_consolidate import TIED, assert_matches_reference, reference


def drop_keys(ckpt_dir, model_keys=(), optim_keys=()):
    for path in ckpt_dir.glob("*/*model_states.pt"):
        rewrite_tree(path, lambda tree: {k: v for k, v in tree.items() if k not in model_keys})
    for path in ckpt_dir.glob("*/*optim_states.pt"):
        def edit(tree):
            osd = {k: v for k, v in tree[L.OPTIMIZER_STATE_DICT].items() if k not in optim_keys}
            return {**tree, L.OPTIMIZER_STATE_DICT: osd}
        rewrite_tree(path, edit)
    return ckpt_dir


@pytest.mark.parametrize("name", ["z1_ws2_fp32", "z2_ws3_bf16", "z3_ws2_fp32", "z3_ws3_bf16"])
def test_tied_weights_found_without_shared_params(name, fixture_copy, tmp_path):
    """No ``shared_params``: names viewing one storage are tied (at ZeRO-3 the empty placeholders of tied
    names share one storage; every other parameter has its own)."""
    ckpt = drop_keys(fixture_copy(name), model_keys={L.SHARED_PARAMS})
    out = tmp_path / "out.safetensors"
    consolidate(ckpt, out)
    with safe_open(str(out), "pt") as f:
        assert f.metadata()["dsckpt.aliases"] == '{"head.weight": "embed.weight"}'
    sd = load_file(out)
    assert "head.weight" not in sd and sd["embed.weight"].dtype == torch.float32  # the fp32 master, once
    assert_matches_reference(name, sd)


@pytest.mark.parametrize("name", ["z1_ws3_bf16", "z2_ws2_fp32", "z2_ws1_fp16"])
def test_stage12_without_newer_keys_matches_live_weights(name, fixture_copy, tmp_path):
    """ZeRO-1/2 keep frozen parameters whole in ``module``: nothing is lost without the frozen lists."""
    ckpt = drop_keys(fixture_copy(name), model_keys={L.FROZEN_PARAM_SHAPES, L.FROZEN_PARAM_FRAGMENTS, L.DS_VERSION},
                     optim_keys={L.PARAM_SLICE_MAPPINGS, L.DS_VERSION})
    consolidate(ckpt, tmp_path / "out.safetensors")
    sd = load_file(tmp_path / "out.safetensors")
    assert set(sd) | set(TIED) == set(reference(name))
    assert_matches_reference(name, sd)


def test_stage3_frozen_parameters_never_saved_are_named(fixture_copy, tmp_path):
    """ZeRO-3 without ``frozen_param_shapes``: the frozen values are in no file. Refuse by name (the
    peers' converters drop them silently); ``--exclude-frozen`` writes the rest."""
    from dsckpt.runtime.demo_model import TinyCausalLM

    frozen = open_checkpoint(FIXTURES / "z3_ws3_bf16").frozen
    block0 = [f"blocks.0.{n}" for n, _ in TinyCausalLM().blocks[0].named_parameters()]  # the fixtures freeze block 0
    assert sorted(frozen) == sorted(block0) and len(block0) > 5
    ckpt = drop_keys(fixture_copy("z3_ws3_bf16"), model_keys={L.FROZEN_PARAM_SHAPES, L.FROZEN_PARAM_FRAGMENTS})
    with pytest.raises(UnsupportedCheckpointError,
                       match=rf"{len(block0)} parameters have no saved values: blocks\.0\.norm1\.weight, .* "
                             rf"\(\+{len(block0) - 5} more\)"):
        consolidate(ckpt, tmp_path / "out.safetensors")
    assert not (tmp_path / "out.safetensors").exists()
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    theirs = get_fp32_state_dict_from_zero_checkpoint(str(ckpt))  # the reference converter: silently without them
    assert theirs and not any(k.startswith("blocks.0.") for k in theirs)
    proc = run_cli("inspect", str(ckpt), "--json")
    assert "have no saved values" in proc.stdout
    consolidate(ckpt, tmp_path / "out.safetensors", exclude_frozen=True)
    sd = load_file(tmp_path / "out.safetensors")
    assert not any(k.startswith("blocks.0.") for k in sd)
    live = reference("z3_ws3_bf16")
    for key, t in sd.items():
        assert torch.equal(t.to(live[key].dtype), live[key]), key


def test_stage3_frozen_shapes_without_fragments_refused(fixture_copy, tmp_path):
    """Frozen shapes recorded but their fragments gone: ``module`` holds only placeholders - an error, not
    zeros (this wrote wrong values before)."""
    ckpt = drop_keys(fixture_copy("z3_ws2_fp32"), model_keys={L.FROZEN_PARAM_FRAGMENTS})
    with pytest.raises(InconsistentCheckpointError,
                       match=r"frozen 'blocks\.0\.norm1\.weight' \(shape \[16\]\): no 'frozen_param_fragments' "
                             r"entry; 'module' holds 0 elements for it"):
        consolidate(ckpt, tmp_path / "out.safetensors")
    proc = run_cli("consolidate", str(ckpt), str(tmp_path / "out.safetensors"))
    assert proc.returncode != 0 and "Traceback" not in proc.stderr and "frozen_param_fragments" in proc.stderr
    assert not (tmp_path / "out.safetensors").exists()


@pytest.fixture(scope="module", params=[2, 3], ids=["zero2", "zero3"])
def other_setups(request, tmp_path_factory):
    """One real 2-rank run per stage (tests/jobs/orphan_params.py): a plain save and an exclude_frozen one."""
    import json

    from conftest import run_job, skip_beyond_devices

    skip_beyond_devices(2)
    root = tmp_path_factory.mktemp(f"setups_z{request.param}")
    run_job("orphan_params.py", 2, request.param, root / "ckpt", root / "report.json")
    return request.param, root, json.loads((root / "report.json").read_text())


def test_parameters_left_out_of_the_optimizer(other_setups):
    """``requires_grad`` parameters in no optimizer param group are in neither shape list. ZeRO-2 keeps them
    whole in ``module``: written, equal to the live ones (they were dropped when frozen ones existed too).
    ZeRO-3 saves only a placeholder: refused by name."""
    stage, root, r = other_setups
    plain = r["plain"]
    if stage == 2:
        assert plain["error"] is None and set(plain["saved"]) | set(TIED) == set(r["live"]) and plain["unequal"] == []
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        theirs = get_fp32_state_dict_from_zero_checkpoint(str(root / "ckpt" / "plain"))
        assert "norm.weight" not in theirs and "norm.bias" not in theirs  # the reference converter drops them
    else:
        assert plain["error"].startswith("UnsupportedCheckpointError")
        assert "2 parameters have no saved values: norm.weight, norm.bias" in plain["error"]


def test_deepspeed_save_without_frozen_parameters(other_setups):
    """``save_checkpoint(exclude_frozen_parameters=True)``: frozen names leave ``module`` and no frozen shapes
    are recorded. Nothing frozen is reported missing; the output is every other tensor, equal to the live one
    (at ZeRO-3 the parameters outside the optimizer are still refused by name, as in the plain save)."""
    stage, _, r = other_setups
    saved = r["no_frozen"]
    assert r["frozen"] and not set(r["frozen"]) & set(saved["saved"])
    if stage == 2:
        assert saved["error"] is None and saved["unequal"] == []
        assert set(saved["saved"]) | set(r["frozen"]) | set(TIED) == set(r["live"])
    else:
        assert "2 parameters have no saved values: norm.weight, norm.bias" in saved["error"]
        excluded = r["no_frozen_excluded"]  # --exclude-frozen: the rest, exactly
        assert excluded["error"] is None and excluded["unequal"] == []
        assert set(excluded["saved"]) | set(r["frozen"]) | {"norm.weight", "norm.bias"} | set(TIED) == set(r["live"])
