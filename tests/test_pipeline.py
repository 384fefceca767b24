"""Pipeline-parallel (DeepSpeed PipelineModule) checkpoints: inspect and consolidate against the live engine.

The fixture is a real pp 2 x dp 2 ZeRO-1 run (fixtures/make_pp_fixtures.py): an embedding tied to the head
(TiedLayerSpec, held by both stages), three blocks, one with a persistent buffer that only its layer file holds.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from conftest import FIXTURES, nudge_first_master, run_cli

NAME = "pp2_dp2_z1_fp32"


def test_consolidate_equals_the_engines_masters_buffers_included(tmp_path):
    out = tmp_path / "model.safetensors"
    proc = run_cli("consolidate", FIXTURES / NAME, out)
    assert proc.returncode == 0, proc.stderr
    got, want = load_file(out), torch.load(FIXTURES / NAME / "reference.pt", weights_only=True)
    assert set(got) == set(want)  # PipelineModule's names; the buffer 2.scale from layer_02's file
    assert all(torch.equal(got[k], v) for k, v in want.items())


def test_inspect_maps_layers_to_stages():
    doc = json.loads(run_cli("inspect", FIXTURES / NAME, "--json").stdout)
    assert doc["grid"] == {"tp": 1, "pp": 2, "dp": 2, "ep": 1}
    assert doc["pipeline"] == [{"stage": 0, "layers": [1], "tied": ["embed"]},
                               {"stage": 1, "layers": [2, 3], "tied": ["embed"]}]
    assert doc["parameters"]["count"] == 16 and doc["tensors"] == 17 and doc["buffers"] == {}
    text = run_cli("inspect", FIXTURES / NAME).stdout
    assert "pp 2 x dp 2" in text and "stage 1           layers 2, 3; tied: embed" in text


def test_a_tied_copy_that_drifted_is_refused(tmp_path):
    ckpt = tmp_path / NAME
    shutil.copytree(FIXTURES / NAME, ckpt)
    path = ckpt / "step3" / "zero_pp_rank_0_mp_rank_01_optim_states.pt"
    nudge_first_master(path)  # its tied embedding first
    proc = run_cli("consolidate", ckpt, tmp_path / "out.safetensors")
    assert proc.returncode == 2
    assert "pipeline stage 1's copy of the replicated parameter 'tied_modules.embed.weight' differs" in proc.stderr
    assert not (tmp_path / "out.safetensors").exists()


def test_a_missing_layer_file_is_named(tmp_path):
    ckpt = tmp_path / NAME
    shutil.copytree(FIXTURES / NAME, ckpt)
    (ckpt / "step3" / "layer_02-model_states.pt").unlink()
    proc = run_cli("consolidate", ckpt, tmp_path / "out.safetensors")
    assert proc.returncode == 2 and "2.scale" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.runtime
def test_reshard_at_the_same_pipeline_degree_loads_in_stock_deepspeed(tmp_path):
    """reshard -w 1 moves each stage's files on its own and copies the layer files; DeepSpeed's load_checkpoint
    in a PipelineModule engine at pp 2 x dp 1 restores every master and buffer, and its re-save holds the original
    masters and Adam moments."""
    import dsckpt
    from conftest import run_job

    out, resave = tmp_path / "ws1", tmp_path / "resaved"
    proc = run_cli("reshard", FIXTURES / NAME, out, "--world-size", "1")
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in (out / "step3").glob("layer_*")) == [f"layer_0{i}-model_states.pt" for i in range(4)]
    run_job("pp_load.py", 2, NAME, out, resave)
    for state in ("fp32", "exp_avg", "exp_avg_sq"):
        before, after = dsckpt.load_state_dict(FIXTURES / NAME, state=state), dsckpt.load_state_dict(resave, state=state)
        assert set(before) == set(after) and all(torch.equal(before[k], after[k]) for k in before), state
    refused = run_cli("reshard", FIXTURES / NAME, tmp_path / "z2", "-w", "1", "--stage", "2")
    assert refused.returncode == 2 and "ZeRO 0 and 1 only" in refused.stderr


PPTP = "pp2_tp2_z1_fp32"  # fixtures/make_pptp_fixtures.py: Megatron-style layers, patterns in client state


def test_pipeline_by_tensor_parallel_joins_both(tmp_path):
    """Each stage's TP ranks joined by the patterns Megatron-DeepSpeed keeps in client state (column dim 0, row
    dim 1, replicated compared), then the stages put together: equal to the live engine's masters; the pickled
    argparse Namespace (`args`) stays an inert record."""
    out = tmp_path / "model.safetensors"
    proc = run_cli("consolidate", FIXTURES / PPTP, out)
    assert proc.returncode == 0, proc.stderr
    got, want = load_file(out), torch.load(FIXTURES / PPTP / "reference.pt", weights_only=True)
    assert set(got) == set(want) and all(torch.equal(got[k], v) for k, v in want.items())
    assert got["1.down"].shape == (12, 20) and got["1.up"].shape == (20, 12)
    sidecar = json.loads((tmp_path / "model.safetensors.client_state.json").read_text())
    assert sidecar["client_state"]["args"] == {"__opaque__": "argparse.Namespace"}
    doc = json.loads(run_cli("inspect", FIXTURES / PPTP, "--json").stdout)
    assert doc["grid"] == {"tp": 2, "pp": 2, "dp": 1, "ep": 1}
    assert doc["tensor_parallel"]["described_by"] == "patterns"
    assert doc["tensor_parallel"]["categories"] == {"replicated": 10, "row parallel (dim 1)": 3, "split on dim 0": 6}
    assert doc["pipeline"] == [{"stage": 0, "layers": [1, 2], "tied": ["embed"]}, {"stage": 1, "layers": [3], "tied": ["embed"]}]


def test_pipeline_by_tensor_parallel_reshards_per_coordinate(tmp_path):
    out = tmp_path / "dp2"
    proc = run_cli("reshard", FIXTURES / PPTP, out, "-w", "2")
    assert proc.returncode == 0, proc.stderr
    names = sorted(p.name for p in (out / "global_step3").iterdir())
    assert [n for n in names if "optim" in n] == [f"zero_pp_rank_{d}_mp_rank_0{m}_optim_states.pt"
                                                  for d in (0, 1) for m in range(4)]
    assert len([n for n in names if n.startswith("layer_")]) == 8
    assert "IDENTICAL" in run_cli("diff", out, FIXTURES / PPTP).stdout
    # Megatron's pickled Namespace is plain data (#68.9): carried, and rebuilt from its fields by a weights-only load
    import argparse

    from dsckpt.checkpoint_engine.safe_load import safe_torch_load

    assert "'args' left out" not in proc.stderr
    source, copy = (safe_torch_load(next((root / "global_step3").glob("mp_rank_00_model_states.pt")))
                    for root in (FIXTURES / PPTP, out))
    assert isinstance(copy["args"], argparse.Namespace) and vars(copy["args"]) == vars(source["args"])


def test_rename_maps_pipeline_names_onto_another_architecture(tmp_path):
    """--rename: PipelineModule's `{layer}.{key}` / `tied_modules.*` names onto a plain module's, which then loads the
    file strictly; a pattern that matches nothing is a note, rules that collide or do not parse are refused."""
    import sys

    sys.path.insert(0, str(FIXTURES))
    from make_pp_fixtures import DIM, VOCAB

    class Block(torch.nn.Module):
        def __init__(self, width, buffer=False):
            super().__init__()
            self.up, self.down = torch.nn.Linear(DIM, width), torch.nn.Linear(width, DIM, bias=False)
            self.norm = torch.nn.LayerNorm(DIM)
            if buffer:
                self.register_buffer("scale", torch.zeros(DIM))

    class Plain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(VOCAB, DIM)
            self.layers = torch.nn.ModuleDict({"1": Block(20), "2": Block(14, True), "3": Block(18)})

    rules = tmp_path / "rules.json"
    rules.write_text(json.dumps({r"(\d+)\.(.*)": r"layers.\1.\2"}))
    out = tmp_path / "plain.safetensors"
    proc = run_cli("consolidate", FIXTURES / NAME, out, "--rename", r"tied_modules\.embed\.(.*)=embed.\1",
                   "--rename", f"@{rules}", "--rename", "nowhere=x")
    assert proc.returncode == 0, proc.stderr
    assert "--rename 'nowhere' matched no tensor name" in proc.stderr
    model = Plain()
    model.load_state_dict(load_file(out), strict=True)
    want = torch.load(FIXTURES / NAME / "reference.pt", weights_only=True)
    assert torch.equal(model.layers["2"].up.weight, want["2.up.weight"]) and torch.equal(model.layers["2"].scale, want["2.scale"])
    assert torch.equal(model.embed.weight, want["tied_modules.embed.weight"])
    clash = run_cli("consolidate", FIXTURES / NAME, tmp_path / "x.safetensors", "--rename", ".*=same")
    assert clash.returncode == 2 and "share the name 'same'" in clash.stderr
    bad = run_cli("consolidate", FIXTURES / NAME, tmp_path / "x.safetensors", "--rename", "(=x")
    assert bad.returncode == 2 and "not a regular expression" in bad.stderr and not (tmp_path / "x.safetensors").exists()


@pytest.mark.runtime
def test_universal_export_loads_at_another_pipeline_degree(tmp_path):
    """convert --to universal of a pp 2 x dp 2 run (every stage's parameters under PipelineModule's names, the layer
    files beside them): DeepSpeed's universal loader restores it in the same PipelineModule on one stage - every
    master and buffer exact, and its re-save holds the original masters and moments."""
    import dsckpt
    from conftest import run_job

    out, resave = tmp_path / "universal", tmp_path / "resaved"
    proc = run_cli("convert", FIXTURES / NAME, out, "--to", "universal")
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in (out / "step3").glob("layer_*")) == [f"layer_0{i}-model_states.pt" for i in range(4)]
    run_job("pp_load.py", 1, NAME, out, resave, 1, "universal")
    for state in ("fp32", "exp_avg", "exp_avg_sq"):
        before, after = dsckpt.load_state_dict(FIXTURES / NAME, state=state), dsckpt.load_state_dict(resave, state=state)
        assert set(before) == set(after) and all(torch.equal(before[k], after[k]) for k in before), state


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_export_holds_every_stage(tmp_path):
    """convert --to dcp of a pipeline run: one state dict of every stage's full masters (a tied module once),
    moments and step, under PipelineModule's names - read back with torch.distributed.checkpoint."""
    import dsckpt
    import torch.distributed.checkpoint as dcp

    out = tmp_path / "dcp"
    assert run_cli("convert", FIXTURES / NAME, out, "--to", "dcp").returncode == 0
    want = dsckpt.load_state_dict(FIXTURES / NAME)
    moments = dsckpt.load_state_dict(FIXTURES / NAME, state="exp_avg")
    state = {"model": {k: torch.empty_like(v) for k, v in want.items()},
             "optim": {"state": {k: {"exp_avg": torch.empty_like(v)} for k, v in moments.items()}}}
    dcp.load(state, checkpoint_id=str(out), no_dist=True)
    assert all(torch.equal(state["model"][k], v) for k, v in want.items())
    assert all(torch.equal(state["optim"]["state"][k]["exp_avg"], v) for k, v in moments.items())


def test_frozen_parameters_come_from_the_layer_files(tmp_path):
    """pp2_dp1_z1_frozen_fp32: block 1 frozen whole (no name in any stage's records: its layer file alone holds it),
    block 3's `down` frozen; both written from the layer files, equal to the live module, and left out on request."""
    name = "pp2_dp1_z1_frozen_fp32"
    out = tmp_path / "model.safetensors"
    assert run_cli("consolidate", FIXTURES / name, out).returncode == 0
    got, want = load_file(out), torch.load(FIXTURES / name / "reference.pt", weights_only=True)
    assert set(got) == set(want) and all(torch.equal(got[k], v) for k, v in want.items())
    doc = json.loads(run_cli("inspect", FIXTURES / name, "--json").stdout)
    assert doc["frozen"]["count"] == 6
    assert run_cli("consolidate", FIXTURES / name, tmp_path / "trained.safetensors", "--exclude-frozen").returncode == 0
    assert set(load_file(tmp_path / "trained.safetensors")) == set(want) - {
        "1.up.weight", "1.up.bias", "1.down.weight", "1.norm.weight", "1.norm.bias", "3.down.weight"}


@pytest.mark.parametrize("name", [pytest.param("pp2_tp2_z1_fp32", marks=pytest.mark.slow), "pp2_dp1_z1_frozen_fp32"])
def test_ds_to_universal_agrees_where_it_has_values_and_loses_the_rest(name, ds_universal):
    """DeepSpeed's converter merges the stages (and Megatron-style TP slices) too: every fp32 it writes equals ours;
    the frozen parameters and buffers that live only in layer files it leaves out, dsckpt writes them."""
    import dsckpt

    tag = (FIXTURES / name / "latest").read_text().strip()
    folder = ds_universal(name) / f"{tag}_universal" / "zero"
    ours = dsckpt.load_state_dict(FIXTURES / name)
    theirs = {p.name: torch.load(p / "fp32.pt", weights_only=True) for p in folder.iterdir() if p.is_dir()}
    theirs = {n: t["param"] if isinstance(t, dict) else t for n, t in theirs.items()}
    assert theirs and all(torch.equal(t.reshape(-1), ours[n].reshape(-1)) for n, t in theirs.items())
    lost = set(ours) - set(theirs)
    assert lost == ({"1.up.weight", "1.up.bias", "1.down.weight", "1.norm.weight", "1.norm.bias", "3.down.weight",
                     "2.scale"} if "frozen" in name else set())


@pytest.mark.slow
def test_pipeline_by_tensor_parallel_reshard_loads_in_stock_deepspeed(tmp_path):
    """reshard -w 2 of the pp 2 x tp 2 run; DeepSpeed's load_checkpoint at tp 2 x pp 2 x dp 2 (8 ranks: `make
    test-all`) restores every TP-local master, and its re-save holds the original masters and moments."""
    import dsckpt
    from conftest import run_job

    out, resave = tmp_path / "dp2", tmp_path / "resaved"
    assert run_cli("reshard", FIXTURES / PPTP, out, "-w", "2").returncode == 0
    run_job("pptp_load.py", 8, out, resave, timeout=600)
    for state in ("fp32", "exp_avg", "exp_avg_sq"):
        before, after = dsckpt.load_state_dict(FIXTURES / PPTP, state=state), dsckpt.load_state_dict(resave, state=state)
        assert set(before) == set(after) and all(torch.equal(before[k], after[k]) for k in before), state
