"""Tensor-parallel (DeepSpeed AutoTP) checkpoints: the split model, inspect, consolidate against DeepSpeed's own join.

The fixtures are real AutoTP runs of a tiny Llama (fixtures/make_tp_fixtures.py); ``reference.pt`` is what the
live engine's ``_consolidated_16bit_state_dict()`` returned at save time.
"""
from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from conftest import FIXTURES, TP_FIXTURE_NAMES, nudge_first_master, run_cli
from dsckpt.errors import InconsistentCheckpointError, UnsupportedCheckpointError
from dsckpt.zero.tensor_parallel import Block, tp_splits

FP32 = [n for n in TP_FIXTURE_NAMES if n.endswith("fp32")]


def reference(name: str) -> dict[str, torch.Tensor]:
    return torch.load(FIXTURES / name / "reference.pt", weights_only=True)


def test_tp_fixture_set():
    assert TP_FIXTURE_NAMES == ["tp2_dp1_z1_fp32", "tp2_dp1_z3_bf16", "tp2_dp2_z1_fp32", "tp2_dp2_z2_bf16",
                                "tp2_dp2_z3_fp32"]


@pytest.mark.parametrize("name", TP_FIXTURE_NAMES)
def test_consolidate_equals_deepspeeds_own_join(name, tmp_path):
    """fp32 runs: the masters bit for bit; bf16 runs: the masters rounded to bf16 equal the engine's bf16 weights."""
    out = tmp_path / "model.safetensors"
    args = [] if name.endswith("fp32") else ["--dtype", "bf16"]
    proc = run_cli("consolidate", FIXTURES / name, out, *args, "--json")
    assert proc.returncode == 0, proc.stderr
    got, want = load_file(out), reference(name)
    tied = "lm_head.weight" not in got
    assert set(got) | ({"lm_head.weight"} if tied else set()) == set(want)
    for key, tensor in want.items():
        assert torch.equal(got["model.embed_tokens.weight" if tied and key == "lm_head.weight" else key], tensor), key
    doc = json.loads(proc.stdout)
    assert doc["tensors"] == len(got)


@pytest.mark.parametrize("form", ["model.pt", "sharded"])
def test_other_forms_hold_the_same_tensors(form, tmp_path):
    name = "tp2_dp2_z3_fp32"
    out = tmp_path / form
    assert run_cli("consolidate", FIXTURES / name, out, "--max-shard-size", "20KB").returncode == 0
    if form == "model.pt":
        got = torch.load(out, weights_only=True)
    else:
        got = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}
    assert {k: v.shape for k, v in got.items()} == {k: v.shape for k, v in reference(name).items()}
    assert all(torch.equal(got[k], v) for k, v in reference(name).items())


def test_hf_export_loads_in_transformers_and_matches_the_engine(tmp_path):
    """``--hf`` of an AutoTP run: ``from_pretrained`` builds the full model, its logits equal the engine's weights'."""
    from transformers import LlamaForCausalLM

    name = "tp2_dp1_z1_fp32"
    out = tmp_path / "hf"
    proc = run_cli("consolidate", FIXTURES / name, out, "--hf")
    assert proc.returncode == 0, proc.stderr
    model = LlamaForCausalLM.from_pretrained(out).eval()
    oracle = LlamaForCausalLM(model.config).eval()
    oracle.load_state_dict(reference(name))
    ids = torch.arange(12).reshape(2, 6) % 50
    with torch.no_grad():
        assert torch.equal(model(ids).logits, oracle(ids).logits)


@pytest.mark.parametrize("name", ["tp2_dp2_z1_fp32", pytest.param("tp2_dp2_z3_fp32", marks=pytest.mark.slow)])
def test_masters_and_moments_match_ds_to_universal(name, ds_universal):
    """DeepSpeed's own converter joins the TP slices too: its fp32, exp_avg and exp_avg_sq per parameter equal
    ours (values: it writes some ZeRO-3 parameters flat)."""
    import dsckpt

    universal = ds_universal(name) / "step3_universal" / "zero"
    for state in ("fp32", "exp_avg", "exp_avg_sq"):
        got = dsckpt.load_state_dict(FIXTURES / name, state=state)
        folders = sorted(f for f in universal.iterdir() if f.is_dir())
        assert {f.name for f in folders} == set(got)  # (tied: the head is its own folder and its own tensor here)
        for folder in folders:
            if name == "tp2_dp2_z1_fp32" and folder.name == "lm_head.weight":
                # tied to the embedding: ds_to_universal keeps TP rank 0's 25 of its 50 rows (docs/format.md);
                # ours is the embedding, the engine's own join
                assert got[folder.name] is got["model.embed_tokens.weight"]
                continue
            theirs = torch.load(folder / f"{state}.pt", weights_only=True)
            theirs = theirs["param"] if isinstance(theirs, dict) else theirs
            assert torch.equal(theirs.reshape(-1), got[folder.name].reshape(-1)), (state, folder.name)


def test_inspect_shows_the_grid_and_splits():
    proc = run_cli("inspect", FIXTURES / "tp2_dp2_z3_fp32", "--json", "--tensors")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["grid"] == {"tp": 2, "pp": 1, "dp": 2, "ep": 1}
    tp = doc["tensor_parallel"]
    assert tp["degree"] == 2 and tp["described_by"] == "affine_map"
    assert tp["categories"] == {"replicated": 6, "split on dim 0": 11, "split on dim 1": 4}
    assert tp["split"]["model.layers.1.mlp.down_proj.weight"] == "split on dim 1"
    rows = {r["name"]: r for r in doc["tensor_list"]}
    assert rows["model.layers.0.self_attn.o_proj.weight"]["shape"] == [24, 24]  # full, not TP rank 0's [24, 12]
    assert rows["lm_head.weight"]["split"] == "split on dim 0"
    assert doc["parameters"]["numel"] == sum(t.numel() for t in reference("tp2_dp2_z3_fp32").values())
    assert {f["tp_rank"] for f in doc["rank_files"]} == {0, 1}
    text = run_cli("inspect", FIXTURES / "tp2_dp2_z3_fp32").stdout
    assert "tp 2 x dp 2" in text and "split on dim 1" in text




def _copy(name: str, tmp_path):
    import shutil

    dst = tmp_path / name
    shutil.copytree(FIXTURES / name, dst)
    return dst


def test_a_replica_that_drifted_is_refused(tmp_path):
    """TP rank 1's copy of the (replicated) embedding differs, with a valid CRC: refused, naming both."""
    ckpt = _copy("tp2_dp1_z1_fp32", tmp_path)
    path = ckpt / "step3" / "zero_pp_rank_0_mp_rank_01_optim_states.pt"
    nudge_first_master(path)  # its embedding comes first
    for nproc in ("1", "2"):  # (2: one process checks the replicas, every process stops with its verdict)
        proc = run_cli("consolidate", ckpt, tmp_path / "out.safetensors", "--nproc", nproc)
        assert proc.returncode == 2, proc.stderr
        assert "TP rank 1's copy of the replicated parameter 'model.embed_tokens.weight' differs" in proc.stderr
        assert proc.stderr.count("dsckpt: error:") == 1 and not (tmp_path / "out.safetensors").exists()
    import dsckpt

    with pytest.raises(InconsistentCheckpointError, match="replicated parameter"):
        dsckpt.load_state_dict(ckpt)


def test_a_missing_tp_rank_is_named(tmp_path):
    ckpt = _copy("tp2_dp2_z1_fp32", tmp_path)
    (ckpt / "step3" / "mp_rank_01_model_states.pt").unlink()
    proc = run_cli("consolidate", ckpt, tmp_path / "out.safetensors")
    assert proc.returncode == 2 and "tensor-parallel rank 1" in proc.stderr and "Traceback" not in proc.stderr
    ckpt2 = _copy("tp2_dp2_z2_bf16", tmp_path)
    (ckpt2 / "step3" / "bf16_zero_pp_rank_1_mp_rank_01_optim_states.pt").unlink()
    proc = run_cli("consolidate", ckpt2, tmp_path / "out2.safetensors")
    assert proc.returncode == 2 and "rank 1 is missing" in proc.stderr


def test_unsupported_patterns_are_named(tmp_path):
    ckpt = _copy("tp2_dp1_z1_fp32", tmp_path)
    for t in (0, 1):
        path = ckpt / "step3" / f"mp_rank_0{t}_model_states.pt"
        state = torch.load(path, weights_only=False)
        state["universal_checkpoint_info"]["autotp_unsupported_parameter_patterns"] = {r"^fused\.qkv$": "codegen fused"}
        torch.save(state, path)
    proc = run_cli("consolidate", ckpt, tmp_path / "out.safetensors")
    assert proc.returncode == 2 and "autotp_unsupported_parameter_patterns" in proc.stderr and "codegen fused" in proc.stderr
    assert "autotp_unsupported_parameter_patterns" in run_cli("inspect", ckpt).stdout


# --- the split model, without files --------------------------------------------------------------------------

def _join(split, slices: list[torch.Tensor]) -> torch.Tensor:
    """What a Split describes, applied to tensors (the byte plan does the same on files)."""
    flat = [s.reshape(-1) for s in slices]
    out = []
    for i in range(split.count):
        for b in split.blocks:
            start = i * split.periods[b.rank] + b.start
            out.append(flat[b.rank][start:start + b.numel])
    return torch.cat(out).reshape(split.shape)


def test_categories_without_an_affine_map():
    """Megatron-DeepSpeed / older DeepSpeed: patterns only, in ds_to_universal's order."""
    full = {"row.weight": torch.arange(6 * 8.).reshape(6, 8), "col.weight": torch.arange(10 * 4.).reshape(10, 4),
            "vocab.weight": torch.arange(8 * 3.).reshape(8, 3), "norm.weight": torch.arange(5.),
            "glu.weight": torch.arange(8 * 2.).reshape(8, 2)}
    slices = [{"row.weight": full["row.weight"][:, :5], "col.weight": full["col.weight"][:6],
               "vocab.weight": full["vocab.weight"][:4], "norm.weight": full["norm.weight"],
               "glu.weight": torch.cat([full["glu.weight"][0:2], full["glu.weight"][4:6]])},
              {"row.weight": full["row.weight"][:, 5:], "col.weight": full["col.weight"][6:],
               "vocab.weight": torch.cat([full["vocab.weight"][4:7], torch.zeros(1, 3)]), "norm.weight": full["norm.weight"],
               "glu.weight": torch.cat([full["glu.weight"][2:4], full["glu.weight"][6:8]])}]
    info = {"parameter_with_row_parallelism_patterns": [r"^row\.weight$"], "tp_replicated_parameter_patterns": [r"norm"],
            "vocabulary_parameter_patterns": [r"^vocab"], "original_vocab_size": 7,
            "parameter_with_2_sub_params_cat_dim_0": [r"^glu"]}
    splits = tp_splits(info, [{k: tuple(v.shape) for k, v in s.items()} for s in slices], "here")
    assert splits["norm.weight"].replicas == (1,)
    assert splits["row.weight"].category == "row parallel (dim 1)"
    for name, split in splits.items():
        want = full[name][:7] if name == "vocab.weight" else full[name]
        assert torch.equal(_join(split, [s[name] for s in slices]), want), name


def test_sub_parameters_without_a_map_as_ds_to_universal_reads_them():
    """`parameter_with_sub_params`: sizes at partition_dim split evenly (GQA's q/k/v 8/4/4 over 2 ranks), or before
    version 0.4 a count of equal parts (3, as in `(3, -1)`)."""
    full = torch.arange(16 * 2.).reshape(16, 2)
    q, k, v = full[:8], full[8:12], full[12:]
    slices = [torch.cat([q[:4], k[:2], v[:2]]), torch.cat([q[4:], k[2:], v[2:]])]
    info = {"parameter_with_sub_params": [{"patterns": [r"^qkv$"], "shape": [[8, 4, 4], 2], "partition_dim": 0}]}
    split = tp_splits(info, [{"qkv": (8, 2)}, {"qkv": (8, 2)}], "here")["qkv"]
    assert torch.equal(_join(split, slices), full) and split.category == "sub-parameters"
    equal = torch.arange(12 * 2.).reshape(12, 2)
    parts = [equal[:4], equal[4:8], equal[8:]]
    legacy = {"parameter_with_sub_params": [{"patterns": [r"^qkv$"], "shape": [3, -1], "partition_dim": 0}]}
    split = tp_splits(legacy, [{"qkv": (6, 2)}, {"qkv": (6, 2)}], "here")["qkv"]
    assert torch.equal(_join(split, [torch.cat([p[:2] for p in parts]), torch.cat([p[2:] for p in parts])]), equal)


def test_affine_map_with_uneven_slices_and_sub_parameters():
    """A map as DeepSpeed writes it (sub_param_map): fused q/k/v of widths 4/2/2 split 2/2, 1/1, 1/1 on dim 0."""
    rows, cols = 8, 3
    full = torch.arange(rows * cols * 1.).reshape(rows, cols)
    ranks = {0: [0, 1, 4, 6], 1: [2, 3, 5, 7]}  # which full rows each rank holds, in order

    def pieces(rank):
        out, dest = [], 0
        for start in (0, 2) if rank == 0 else (2,):
            pass
        runs = [[0, 2], [4, 1], [6, 1]] if rank == 0 else [[2, 2], [5, 1], [7, 1]]
        for first, n in runs:
            out.append({"shape": [n, cols], "source": [first * cols, [cols, 1]], "dest": [dest * cols, [cols, 1]],
                        "locations": [rank]})
            dest += n
        return out
    amap = {"version": 1, "params": {r"^qkv$": {"logical_shape": [rows, cols], "ranks": {
        r: {"shard_shape": [4, cols], "pieces": pieces(r)} for r in (0, 1)}}}}
    split = tp_splits({"affine_map": amap}, [{"qkv": (4, cols)}, {"qkv": (4, cols)}], "here")["qkv"]
    slices = [full[ranks[r]] for r in (0, 1)]
    assert torch.equal(_join(split, slices), full)
    assert split.blocks[0] == Block(0, 0, 6)


def test_affine_maps_dsckpt_cannot_stream_are_refused():
    amap = lambda piece: {"version": 1, "params": {r"^w$": {"logical_shape": [4, 4], "ranks": {
        0: {"shard_shape": [4, 4], "pieces": [piece]}}}}}
    scaled = {"shape": [4, 4], "source": [0, [4, 1]], "dest": [0, [4, 1]], "locations": [0], "scale": 0.5}
    with pytest.raises(UnsupportedCheckpointError, match="scaled"):
        tp_splits({"affine_map": amap(scaled)}, [{"w": (4, 4)}], "here")
    transposed = {"shape": [4, 4], "source": [0, [1, 4]], "dest": [0, [4, 1]], "locations": [0]}
    with pytest.raises(UnsupportedCheckpointError, match="not a block of whole rows"):
        tp_splits({"affine_map": amap(transposed)}, [{"w": (4, 4)}], "here")
    gap = {"shape": [2, 4], "source": [8, [4, 1]], "dest": [0, [4, 1]], "locations": [0]}
    with pytest.raises(InconsistentCheckpointError, match="gap at element 0"):
        tp_splits({"affine_map": {"version": 1, "params": {r"^w$": {"logical_shape": [4, 4], "ranks": {
            0: {"shard_shape": [2, 4], "pieces": [gap]}}}}}}, [{"w": (2, 4)}], "here")
    with pytest.raises(UnsupportedCheckpointError, match="version 2"):
        tp_splits({"affine_map": {"version": 2, "params": {}}}, [{"w": (4, 4)}], "here")


def test_interleaved_pieces_cut_partitions_at_any_byte():
    """A row-parallel join over ZeRO partitions that end mid-row: the runs cross partition boundaries."""
    from pathlib import Path

    from dsckpt.plan.segments import Interleaved, Segment, Zeros

    a = (Segment(Path("a0"), 0, 10), Segment(Path("a1"), 100, 14))  # 24 bytes: 4 rows of 6
    b = (Segment(Path("b0"), 0, 7), Zeros(1))  # 8 bytes: 4 rows of 2
    joined = list(Interleaved([a, b], [(0, 0, 6), (1, 0, 2)], [6, 2], 4))
    assert sum(p.nbytes for p in joined) == 32
    assert joined[:4] == [Segment(Path("a0"), 0, 6), Segment(Path("b0"), 0, 2), Segment(Path("a0"), 6, 4),
                          Segment(Path("a1"), 100, 2)]
    assert joined[-1] == Zeros(1)
    assert math.prod((4, 8)) == 32


@pytest.mark.runtime
@pytest.mark.parametrize("name,stage", [pytest.param("tp2_dp2_z1_fp32", 1, marks=pytest.mark.slow), ("tp2_dp2_z3_fp32", 3)])
def test_reshard_at_the_same_tp_degree_loads_in_stock_deepspeed(name, stage, tmp_path):
    """reshard -w 1 moves each TP rank's files on their own; DeepSpeed's load_checkpoint in an AutoTP engine at
    tp 2 x dp 1 restores every TP-local master bit for bit, and what it then saves holds the original masters and
    Adam moments."""
    import dsckpt
    from conftest import run_job

    out, resave = tmp_path / "ws1", tmp_path / "resaved"
    proc = run_cli("reshard", FIXTURES / name, out, "--world-size", "1", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["world_size"] == 1
    run_job("tp_load.py", 2, name, out, resave, stage, 2)
    for state in ("fp32", "exp_avg", "exp_avg_sq"):
        before, after = dsckpt.load_state_dict(FIXTURES / name, state=state), dsckpt.load_state_dict(resave, state=state)
        assert set(before) == set(after) and all(torch.equal(before[k], after[k]) for k in before), state


@pytest.mark.runtime
@pytest.mark.parametrize("name,args", [
    ("tp2_dp2_z3_fp32", ("consolidate", "model.safetensors")),
    pytest.param("pp2_dp2_z1_fp32", ("consolidate", "model.safetensors"), marks=pytest.mark.slow),
    pytest.param("tp2_dp2_z3_fp32", ("convert", "universal", "--to", "universal"), marks=pytest.mark.slow),
    ("pp2_tp2_z1_fp32", ("reshard", "dp2", "-w", "2"))])
def test_two_processes_write_the_same_bytes(name, args, tmp_path):
    """One code path: --nproc 2 joins TP slices / pipeline stages, converts and reshards them into the same bytes as
    one process."""
    verb, out, *rest = args
    outputs = []
    for nproc, folder in (("1", tmp_path / "one"), ("2", tmp_path / "two")):
        folder.mkdir()
        proc = run_cli(verb, FIXTURES / name, folder / out, *rest, "--nproc", nproc)
        assert proc.returncode == 0, proc.stderr
        outputs.append({str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()})
    assert outputs[0] == outputs[1] and outputs[0]


def _set_info(key, value):
    def change(path):
        state = torch.load(path, weights_only=False)
        state["universal_checkpoint_info"][key] = value
        torch.save(state, path)
    return change


BOTH_TP_RANKS = ("mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt")
HOSTILE = {  # label: (fixture, change, files it applies to, what the error names)
    "affine map entry not a dict": ("tp2_dp1_z1_fp32", _set_info("affine_map", {"version": 1, "params": {
        "^model.norm.weight$": "junk"}}), BOTH_TP_RANKS, "does not describe 'model.norm.weight'"),
    "affine piece of junk": ("tp2_dp1_z1_fp32", _set_info("affine_map", {"version": 1, "params": {"^model.norm.weight$": {
        "logical_shape": [24], "ranks": {0: {"shard_shape": [24], "pieces": [{"shape": "x"}]},
                                         1: {"shard_shape": [24], "pieces": []}}}}}), BOTH_TP_RANKS, "model.norm.weight"),
    "split description of another run": ("tp2_dp1_z1_fp32", _set_info("original_vocab_size", 7),
                                         ("mp_rank_01_model_states.pt",), "differs from TP rank 0's"),
    "truncated TP rank 1 optimizer file": ("tp2_dp2_z3_fp32", lambda p: p.write_bytes(p.read_bytes()[:1000]),
                                           ("zero_pp_rank_1_mp_rank_01_optim_states.pt",), "zero_pp_rank_1_mp_rank_01"),
    "garbage layer file of TP rank 1": ("pp2_tp2_z1_fp32", lambda p: p.write_bytes(b"not a zip" * 10),
                                        ("layer_01-model_01-model_states.pt",), "layer_01-model_01-model_states.pt"),
    "a stage's TP rank missing": ("pp2_tp2_z1_fp32", lambda p: p.unlink(), ("mp_rank_03_model_states.pt",),
                                  "model-parallel rank 3 is missing"),
}


@pytest.mark.parametrize("label", list(HOSTILE))
def test_hostile_tp_and_pipeline_input_is_a_clean_error(label, tmp_path):
    name, change, files, names = HOSTILE[label]
    ckpt = _copy(name, tmp_path)
    for f in files:
        change(next(ckpt.glob(f"*/{f}")))
    for args in (("consolidate", ckpt, tmp_path / "out.safetensors"), ("convert", ckpt, tmp_path / "dcp", "--to", "dcp")):
        proc = run_cli(*args)
        assert proc.returncode == 2 and names in proc.stderr and "Traceback" not in proc.stderr, (args[0], proc.stderr)
    assert not (tmp_path / "out.safetensors").exists() and not (tmp_path / "dcp").exists()
    assert run_cli("inspect", ckpt).returncode in (1, 2)


def test_universal_export_without_affine_maps_matches_ds_to_universal(tmp_path):
    """The pattern path as Megatron-DeepSpeed records it (no affine map; a vocabulary padded past
    `original_vocab_size`, 49 of 50 rows): ds_to_universal run on the same checkpoint writes the same files, keys
    (cat_dim per category, vocab_tensor, a fused parameter's SubparamShape) and values; consolidate trims the head."""
    import subprocess
    import sys

    ckpt = _copy("tp2_dp1_z1_fp32", tmp_path)
    gate = r"^model\.layers\.\d+\.mlp\.gate_proj\.weight$"
    for t in (0, 1):
        path = ckpt / "step3" / f"mp_rank_0{t}_model_states.pt"
        state = torch.load(path, weights_only=False)
        info = state["universal_checkpoint_info"]
        del info["affine_map"]
        info["parameter_with_sub_params"] = [{"patterns": [gate], "shape": [[20, 20], 24], "partition_dim": 0}]
        info["sub_param_shard_widths"] = {gate: [[10, 10], [10, 10]]}
        info["original_vocab_size"] = 49
        torch.save(state, path)
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    proc = run_cli("convert", ckpt, ours, "--to", "universal")
    assert proc.returncode == 0, proc.stderr
    proc = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                           str(ckpt / "step3"), "--output_folder", str(theirs / "step3"), "--inject_missing_state",
                           "--num_extract_workers", "1", "--num_merge_workers", "1"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    listing = lambda d: sorted(str(p.relative_to(d)) for p in (d / "zero").rglob("*.pt"))  # noqa: E731
    assert listing(ours / "step3") == listing(theirs / "step3")
    keys = set()
    for rel in listing(theirs / "step3"):
        a, b = (torch.load(d / "step3" / rel, weights_only=False) for d in (ours, theirs))
        if isinstance(b, dict) and "param" in b:
            assert {k: v for k, v in a.items() if k != "param"} == {k: v for k, v in b.items() if k != "param"}, rel
            assert torch.equal(a["param"], b["param"]), rel
            keys |= set(b)
    assert {"cat_dim", "vocab_tensor", "sub_param_shape"} <= keys
    head = torch.load(ours / "step3" / "zero" / "lm_head.weight" / "fp32.pt", weights_only=True)["param"]
    assert torch.equal(head, reference("tp2_dp1_z1_fp32")["lm_head.weight"][:49])
    assert run_cli("consolidate", ckpt, tmp_path / "m.safetensors").returncode == 0
    assert torch.equal(load_file(tmp_path / "m.safetensors")["lm_head.weight"], head)


@pytest.mark.runtime
def test_universal_export_loads_at_another_tp_degree(tmp_path):
    """convert --to universal of a tp 2 run writes what ds_to_universal writes, file for file; DeepSpeed's universal
    loader restores it in a model without tensor parallelism (tp 1): every fp32 master equals the engine's join,
    and its re-save holds the original masters and moments."""
    import dsckpt
    from conftest import run_job

    name = "tp2_dp1_z1_fp32"
    out, resave = tmp_path / "universal", tmp_path / "resaved"
    proc = run_cli("convert", FIXTURES / name, out, "--to", "universal")
    assert proc.returncode == 0, proc.stderr
    run_job("tp_load.py", 1, name, out, resave, 1, 1, "universal")
    for state in ("fp32", "exp_avg", "exp_avg_sq"):
        before, after = dsckpt.load_state_dict(FIXTURES / name, state=state), dsckpt.load_state_dict(resave, state=state)
        assert set(before) == set(after) and all(torch.equal(before[k], after[k]) for k in before), state


def test_universal_export_is_what_ds_to_universal_writes(ds_universal, tmp_path):
    """Every file, every key (``vocab_tensor`` on the head, no ``cat_dim`` where an affine map describes the split),
    every tensor: the same as DeepSpeed's converter's for an AutoTP run."""
    name = "tp2_dp1_z1_fp32"
    out = tmp_path / "universal"
    assert run_cli("convert", FIXTURES / name, out, "--to", "universal").returncode == 0
    ours, theirs = out / "step3", ds_universal(name) / "step3_universal"
    listing = lambda d: sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file())  # noqa: E731
    assert listing(ours) == listing(theirs)
    for rel in listing(theirs / "zero"):
        a, b = (torch.load(d / "zero" / rel, weights_only=False) for d in (ours, theirs))
        if isinstance(b, dict) and "param" in b:
            assert {k: v for k, v in a.items() if k != "param"} == {k: v for k, v in b.items() if k != "param"}, rel
            assert torch.equal(a["param"], b["param"]), rel
        elif isinstance(b, torch.Tensor):
            assert torch.equal(a, b), rel
    assert json.loads(run_cli("inspect", out, "--json").stdout)["grid"]["tp"] == 2


@pytest.mark.runtime
def test_dcp_export_loads_in_fsdp2(tmp_path):
    """convert --to dcp of a tp 2 x dp 2 run: an FSDP2 job at 2 ranks (no TP) loads the full masters, both moments
    and the step through get_state_dict / dcp.load / set_state_dict, equal to the checkpoint's."""
    import dsckpt
    from conftest import run_job

    name = "tp2_dp2_z3_fp32"
    out, got = tmp_path / "dcp", tmp_path / "fsdp2.pt"
    proc = run_cli("convert", FIXTURES / name, out, "--to", "dcp")
    assert proc.returncode == 0, proc.stderr
    run_job("fsdp2_tp_load.py", 2, name, out, got)
    loaded = torch.load(got, weights_only=True)
    assert loaded["steps"] == [3.0]
    for state in ("fp32", "exp_avg", "exp_avg_sq"):
        want = dsckpt.load_state_dict(FIXTURES / name, state=state)
        assert set(loaded[state]) == set(want)
        assert all(torch.equal(loaded[state][k], v) for k, v in want.items()), state


@pytest.mark.runtime
def test_full_weights_resume_into_an_autotp_model(tmp_path):
    """resume --full-weights of a consolidated AutoTP run into the same Llama under AutoTP (tp 2, ZeRO-3, a tied
    head): --check finds every rank's slice and fp32 master equal to the file; training on saves an AutoTP
    checkpoint that consolidate joins and a sharded resume at the same grid continues."""
    weights = tmp_path / "model.safetensors"
    assert run_cli("consolidate", FIXTURES / "tp2_dp1_z3_bf16", weights).returncode == 0
    config = tmp_path / "tp.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                                  "tensor_parallel": {"autotp_size": 2}, "zero_optimization": {"stage": 3}}))
    common = ("--model", "tiny_llama:build_tied", "--config", config, "--nproc", "2")
    proc = run_cli("resume", "--full-weights", weights, *common, "--check", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)  # rank 0's; a difference on any rank fails the command
    assert report["fp32_masters_checked"] == 21 and report["max_abs_diff"] == report["fp32_master_max_abs_diff"] == 0
    run = tmp_path / "run"
    proc = run_cli("resume", "--full-weights", weights, *common, "--steps", "2", "--save-dir", run)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(run_cli("inspect", run, "--json").stdout)
    assert doc["grid"]["tp"] == 2 and doc["problems"] == []
    assert run_cli("consolidate", run, tmp_path / "after.safetensors").returncode == 0
    proc = run_cli("resume", run, *common, "--steps", "1")
    assert proc.returncode == 0, proc.stderr
    assert "resumed" in proc.stderr + proc.stdout and "at step 2" in proc.stderr + proc.stdout


def test_reshard_of_a_tp_run_says_how_many_processes_resume_it(tmp_path):
    """`reshard -w M` of a tp 2 run means M data-parallel ranks: its output says the job runs on tp x M processes."""
    proc = run_cli("reshard", FIXTURES / "tp2_dp2_z1_fp32", tmp_path / "out", "-w", "3")
    assert proc.returncode == 0 and "data-parallel world size 2 -> 3; the job runs on 6 processes" in proc.stdout
    doc = json.loads(run_cli("reshard", FIXTURES / "tp2_dp2_z1_fp32", tmp_path / "j", "-w", "3", "--json").stdout)
    assert (doc["world_size"], doc["processes"]) == (3, 6)
