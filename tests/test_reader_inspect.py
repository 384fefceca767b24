import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from conftest import FIXTURE_NAMES, FIXTURES, TP_FIXTURE_NAMES, run_cli, demo_counts
from dsckpt.errors import CheckpointNotFoundError, CorruptFileError, MissingRankError, TagError
from dsckpt.analysis.inspect import summarize
from dsckpt.zero.layout import discover
from dsckpt.zero.reader import open_checkpoint

EXPECTED = {  # name -> (stage, world size, dtype)
    "z0_ws1_fp32": (0, 1, "fp32"), "z0_ws2_bf16": (0, 2, "bf16"), "z1_ws2_fp32": (1, 2, "fp32"),
    "z1_ws3_bf16": (1, 3, "bf16"), "z2_ws1_fp16": (2, 1, "fp16"), "z2_ws2_fp32": (2, 2, "fp32"),
    "z2_ws3_bf16": (2, 3, "bf16"), "z3_ws1_fp32": (3, 1, "fp32"), "z3_ws2_fp32": (3, 2, "fp32"),
    "z3_ws3_bf16": (3, 3, "bf16"), "z3_ws1_bf16_cuda": (3, 1, "bf16"),  # written on an H200 with nccl
}


def test_fixture_set_is_complete():
    assert FIXTURE_NAMES == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_inspect_json_fields(name):
    proc = run_cli("inspect", FIXTURES / name, "--json")
    assert proc.returncode == 0, proc.stderr
    s = json.loads(proc.stdout)
    stage, ws, dtype = EXPECTED[name]
    assert (s["zero_stage"], s["world_size"], s["dtype"], s["tag"], s["tags"], s["latest"]) == \
        (stage, ws, dtype, "step3", ["step3"], "step3")
    ref = torch.load(FIXTURES / name / "reference.pt", weights_only=True)
    ref_params = {k: v for k, v in ref.items() if k not in ("logit_scale", "tokens_seen", "head.weight")}
    assert s["parameters"]["numel"] + s["frozen"]["numel"] == sum(v.numel() for v in ref_params.values())
    if stage > 0 or dtype != "fp32":  # fp32 stage 0 cannot tell frozen from trainable
        assert s["frozen"]["count"] == 12
    assert s["tied"] == {"head.weight": "embed.weight"}
    assert set(s["buffers"]) == {"logit_scale", "tokens_seen"} and s["buffers"]["tokens_seen"]["dtype"] == "int64"
    assert s["client_state"]["global_step"] == {"type": "int", "value": 3}
    assert s["client_state"]["rng"]["type"] == "dict"
    assert len([f for f in s["rank_files"] if f["kind"] == "optim"]) == (ws if stage else 0)
    assert s["problems"] == []
    assert s["estimates"]["fp32_bytes"] > 0 and s["ds_version"] == "0.19.8"
    assert (s["global_steps"], s["mp_world_size"], s["schema"], s["kind"]) == (3, 1, 2, "deepspeed")
    assert s["parameters"]["groups"] == ([] if stage == 0 else [len(ref_params) - s["frozen"]["count"]])
    sizes = [t["numel"] for t in s["largest"]]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] == max(v.numel() for v in ref_params.values())
    assert all(f["size"] > 0 and Path(f["path"]).is_file() for f in s["rank_files"])
    assert s["estimates"]["elements"] == sum(v.numel() for k, v in ref.items() if k != "head.weight")


def test_inspect_tensors_names_rank_files():
    s = summarize(FIXTURES / "z3_ws2_fp32", tensors=True)
    row = next(t for t in s["tensor_list"] if t["name"] == "embed.weight")
    assert row["files"] == ["zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    assert any(t["kind"] == "tied" and t["alias_of"] == "embed.weight" for t in s["tensor_list"])


def test_layout_accepts_root_tag_folder_and_rank_file():
    for path in (FIXTURES / "z2_ws2_fp32", FIXTURES / "z2_ws2_fp32" / "step3",
                 FIXTURES / "z2_ws2_fp32" / "step3" / "mp_rank_00_model_states.pt"):
        assert discover(path).tag == "step3"


def test_tag_choice_errors(fixture_copy):
    root = fixture_copy("z2_ws1_fp16")
    shutil.copytree(root / "step3", root / "step9")
    (root / "latest").unlink()
    with pytest.raises(TagError, match="several tags and no usable 'latest': .*step3, step9"):
        discover(root)
    assert discover(root, tag="step9").tag == "step9"
    with pytest.raises(TagError, match="tag 'nope' not found"):
        discover(root, tag="nope")
    with pytest.raises(CheckpointNotFoundError, match="no such file"):
        discover(root / "missing")


def test_a_folder_of_checkpoints_names_them(tmp_path):
    """HF Trainer's output_dir holds checkpoint-N folders, each a checkpoint root: say so, and which to pass."""
    for step in (10, 9):
        shutil.copytree(FIXTURES / "z2_ws2_fp32", tmp_path / "out" / f"checkpoint-{step}")
    (tmp_path / "out" / "runs").mkdir()
    with pytest.raises(CheckpointNotFoundError, match=r"out: no DeepSpeed checkpoint found .*; it holds checkpoints "
                                                      r"in checkpoint-9, checkpoint-10$") as info:
        discover(tmp_path / "out")
    assert info.value.hint == f"pass one of them, e.g. {tmp_path / 'out' / 'checkpoint-10'} (the last in natural order)"
    proc = run_cli("consolidate", tmp_path / "out", tmp_path / "m.safetensors")
    assert proc.returncode == 2 and "checkpoint-10 (the last in natural order)" in proc.stderr


def test_latest_naming_missing_tag_is_a_note_beside_an_explicit_tag(fixture_copy):
    """#69.2: with --tag, `latest` is not read for the tag: naming a missing tag it is said, not a problem of step3."""
    root = fixture_copy("z2_ws1_fp16")
    shutil.copytree(root / "step3", root / "step4")
    (root / "latest").write_text("step7")
    proc = run_cli("inspect", root, "--tag", "step3")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "latest: names tag 'step7', which is not a tag folder beside it; not used: tag 'step3'" in proc.stdout


def test_missing_rank_is_reported_and_typed(fixture_copy):
    root = fixture_copy("z3_ws3_bf16")
    (root / "step3" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    proc = run_cli("inspect", root, "--json")
    assert proc.returncode == 1
    assert any("optimizer-states file of rank 1 is missing" in p for p in json.loads(proc.stdout)["problems"])
    with pytest.raises(MissingRankError, match="rank 1 is missing .*world size 3"):
        open_checkpoint(root).require_complete()


def test_truncated_rank_file_names_the_file(fixture_copy):
    root = fixture_copy("z2_ws2_fp32")
    victim = root / "step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    victim.write_bytes(victim.read_bytes()[:5000])
    proc = run_cli("inspect", root)
    assert proc.returncode == 1 and "zero_pp_rank_1_mp_rank_00_optim_states.pt: unreadable zip" in proc.stdout
    proc = run_cli("consolidate", root, root / "out.safetensors")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" in proc.stderr and not (root / "out.safetensors").exists()
    debug = run_cli("consolidate", root, root / "out.safetensors", env={"DSCKPT_DEBUG": "1"})
    assert "Traceback" in debug.stderr


class Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_client_state_is_never_executed(fixture_copy, tmp_path):
    root = fixture_copy("z2_ws1_fp16")
    marker = tmp_path / "pwned"
    states = root / "step3" / "mp_rank_00_model_states.pt"
    obj = torch.load(states, weights_only=True)
    obj["evil"] = Evil(marker)
    torch.save(obj, states)
    proc = run_cli("inspect", root, "--json")
    assert proc.returncode == 0, proc.stderr
    evil = json.loads(proc.stdout)["client_state"]["evil"]
    assert evil == {"type": "opaque", "class": f"{os.system.__module__}.system"}
    proc = run_cli("consolidate", root, tmp_path / "out.safetensors")
    assert proc.returncode == 0, proc.stderr
    sidecar = json.loads((tmp_path / "out.safetensors.client_state.json").read_text())
    assert sidecar["client_state"]["evil"] == {"__opaque__": f"{os.system.__module__}.system"}
    assert not marker.exists()


def test_inspect_consolidated_safetensors_validates_header(tmp_path):
    out = tmp_path / "m.safetensors"
    assert run_cli("consolidate", FIXTURES / "z3_ws2_fp32", out, "-q").returncode == 0
    s = summarize(out)
    assert s["kind"] == "safetensors" and s["problems"] == []
    assert s["tensors"] == demo_counts(vocab_size=32, dim=16, n_layers=2, n_heads=2, seq_len=16)["written"]
    data = bytearray(out.read_bytes())
    data += b"junk"
    out.write_bytes(bytes(data))
    proc = run_cli("inspect", out)
    assert proc.returncode == 1 and "4 trailing bytes after the last tensor" in proc.stdout


def test_no_checkpoint_gives_one_line_error(tmp_path):
    proc = run_cli("inspect", tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[0] == f"dsckpt: error: {tmp_path}: no DeepSpeed checkpoint found (no rank files, no tag folders)"


def test_not_a_zip_is_typed(tmp_path):
    bad = tmp_path / "mp_rank_00_model_states.pt"
    bad.write_bytes(b"hello")
    with pytest.raises(CorruptFileError, match="mp_rank_00_model_states.pt: not a torch zip checkpoint"):
        open_checkpoint(bad)


def test_tag_folder_with_another_tag_named(fixture_copy):
    root = fixture_copy("z2_ws1_fp16")
    shutil.copytree(root / "step3", root / "step5")
    assert discover(root / "step3").tag == "step3"
    assert discover(root / "step3", tag="step5").tag == "step5"  # --tag wins; the root is the parent


@pytest.mark.parametrize("name", FIXTURE_NAMES + TP_FIXTURE_NAMES)
def test_rank_file_name_spells_what_deepspeed_wrote(name):
    """zero.grid.rank_file_name is the one place names are built: it reproduces every fixture's rank files."""
    from dsckpt.zero.grid import Coord, rank_file_name

    ckpt = open_checkpoint(FIXTURES / name)
    tp = ckpt.grid.tp
    bf16 = any(f.path.name.startswith("bf16_") for f in ckpt.layout.optim_files)
    model = [rank_file_name("model", Coord(tp=t, dp=r)) for t in range(tp) for r in range(ckpt.world_size)] \
        if ckpt.zero_stage == 3 else [rank_file_name("model", Coord(tp=t), per_dp_rank=False) for t in range(tp)]
    optim = [rank_file_name("optim", Coord(tp=t, dp=r), bf16=bf16) for t in range(tp) for r in range(ckpt.world_size)] \
        if ckpt.zero_stage and not ckpt.universal else []  # (ds_to_universal keeps no optimizer files)
    assert [f.path.name for f in ckpt.layout.model_files] == model
    assert [f.path.name for f in ckpt.layout.optim_files] == optim
    assert (ckpt.grid.tp, ckpt.grid.pp, ckpt.grid.dp, ckpt.grid.ep) == (tp, 1, ckpt.world_size, 1)
