"""DeepSpeed-MoE checkpoints (issue 26): real ones written by ``deepspeed.moe.layer.MoE`` (fixtures/make_moe_fixtures.py:
top-1 and top-2 + residual layers, ep_size 1 and 2, expert-data-parallel groups of 1 and 2, ZeRO 0/1/2, fp32/bf16)."""
from __future__ import annotations

import json
import math
import shutil
import sys

import pytest

from conftest import FIXTURES, MOE_FIXTURE_NAMES, ROOT, run_cli

torch = pytest.importorskip("torch")
pytest.importorskip("deepspeed")
sys.path.insert(0, str(ROOT / "fixtures"))
from make_moe_fixtures import FIXTURES as SPECS, build  # noqa: E402

import dsckpt  # noqa: E402
from dsckpt.errors import UnsupportedCheckpointError  # noqa: E402


def test_every_moe_run_of_the_generator_is_committed():
    assert MOE_FIXTURE_NAMES == sorted(SPECS)


@pytest.mark.parametrize("name", MOE_FIXTURE_NAMES)
@pytest.mark.parametrize("out_name", ["m.safetensors", "m.pt", "sharded", "m.ckpt"])
def test_consolidated_experts_are_the_live_fp32_masters_under_global_ids(name, out_name, tmp_path):
    """Every expert under ``deepspeed_experts.{global id}`` - the names of the same model at ep_size=1 - with the
    fp32 master the live engine held at save time, bit for bit; the dense parameters as before."""
    out = tmp_path / out_name
    result = dsckpt.consolidate(FIXTURES / name, out, verify=True)
    assert result.verified
    reference = torch.load(FIXTURES / name / "reference.pt")
    got = dict(dsckpt.api.consolidation.load_state_dict(FIXTURES / name))
    assert got.keys() == reference.keys()
    assert [k for k in reference if not torch.equal(reference[k], got[k])] == []
    model = build(ep_size=1)  # a single-process model: no process group, every expert local
    listing = dsckpt.export.registry.for_input(out).read(out)
    assert {t.name for t in listing.tensors} == set(model.state_dict())
    if out_name == "m.safetensors":
        from safetensors.torch import load_file

        assert str(model.load_state_dict(load_file(out), strict=True)) == "<All keys matched successfully>"


def test_inspect_names_the_experts(tmp_path):
    proc = run_cli("inspect", FIXTURES / "moe_z2_ws4_ep2_fp32", "--json")
    summary = json.loads(proc.stdout)
    assert summary["grid"] == {"tp": 1, "pp": 1, "dp": 4, "ep": 2} and summary["problems"] == []
    model = build(ep_size=1)
    expert0 = sum(p.numel() for n, p in model.named_parameters() if ".deepspeed_experts.0." in n and n.startswith("moe1."))
    assert summary["experts"] == [
        {"layer": 0, "module": "moe1", "experts": 4, "ep_size": 2, "expert_data_parallel_size": 2,
         "expert_numel": expert0, "optimizer_group": 1},
        {"layer": 1, "module": "moe2", "experts": 4, "ep_size": 2, "expert_data_parallel_size": 2,
         "expert_numel": expert0, "optimizer_group": 1}]
    assert summary["parameters"]["count"] == sum(1 for _ in model.parameters())  # every expert, not rank 0's
    text = run_cli("inspect", FIXTURES / "moe_z2_ws4_ep2_fp32").stdout
    assert "MoE layer 1       moe2: 4 experts of" in text and "ep_size 2 (expert data parallel 2, optimizer group 1)" in text


def test_stats_diff_and_check_finite_cover_the_experts(tmp_path):
    ckpt = FIXTURES / "moe_z2_ws2_ep2_fp32"
    dsckpt.consolidate(ckpt, tmp_path / "m.safetensors")
    diff = json.loads(run_cli("diff", ckpt, tmp_path / "m.safetensors", "--json").stdout)
    assert diff["only_a"] == [] and diff["only_b"] == [] and all(t["equal"] for t in diff["tensor_list"])
    assert sum(".deepspeed_experts.3." in t["name"] for t in diff["tensor_list"]) == 8  # 2 layers x 4 tensors
    stats = json.loads(run_cli("inspect", ckpt, "--stats", "--optimizer", "--json").stdout)
    names = {t["name"] for t in stats["stats"]}
    assert "exp_avg/moe2.deepspeed_moe.experts.deepspeed_experts.3.up.weight" in names
    assert run_cli("check-finite", ckpt, "--optimizer").returncode == 0


def test_what_cannot_be_read_is_refused_by_name(tmp_path):
    broken = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "moe_z2_ws2_ep2_fp32", broken)
    (broken / "step3" / "layer_1_expert_3_mp_rank_00_model_states.pt").unlink()
    proc = run_cli("consolidate", broken, tmp_path / "m.safetensors")
    assert proc.returncode == 2 and "MoE layer 1 (moe2): 4 experts" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "m.safetensors").exists()


# (stage, ep_size, precision, N, M, ep_size at M): the expert-data-parallel group grows 1 -> 2; experts change ranks
# (ep_size 2 -> 1: every rank holds every expert); ep_size 1 at ZeRO-1 in bf16 (`make test-all`: the suite's time)
# Default suite: the expert-parallel size changed (2 -> 1); a world size grown at the same ep size (a 4-rank
# train-and-load) and ZeRO-1 bf16 are `make test-all`'s (the suite's budget is 10 minutes).
RESHARDS = [pytest.param((2, 2, "32", 2, 4, 2), marks=pytest.mark.slow), (2, 2, "32", 2, 2, 1),
            pytest.param((1, 1, "bf16", 2, 3, 1), marks=pytest.mark.slow)]


@pytest.fixture(scope="module")
def moe_resharded(tmp_path_factory):
    """case -> its folder: trained once per (stage, ep_size, precision, N), resharded and loaded per case."""
    from conftest import run_job, skip_beyond_devices

    roots = {}

    def run(case):
        stage, ep, precision, n, m, new_ep = case
        skip_beyond_devices(max(n, m))
        root = roots.get((stage, ep, precision, n))
        if root is None:
            root = roots[(stage, ep, precision, n)] = tmp_path_factory.mktemp(f"moe_z{stage}_ep{ep}_{precision}")
            run_job("moe_oracle.py", n, "train", root, stage, ep, precision)
        proc = run_cli("reshard", root / "ckpt", root / f"ws{m}_ep{new_ep}", "-w", m, "--ep-size", new_ep, "-q")
        assert proc.returncode == 0, proc.stderr[-3000:]
        run_job("moe_oracle.py", m, "load", root, stage, new_ep, precision)
        return root
    return run


@pytest.mark.runtime
@pytest.mark.parametrize("case", RESHARDS, ids=lambda c: "z{}-ep{}-{}-{}to{}-ep{}".format(*c))
def test_stock_deepspeed_restores_every_expert_after_reshard(moe_resharded, case):
    """Stock engine.load_checkpoint at M (a model built at the new ep_size) restores every expert's (and every
    dense parameter's) fp32 master and both Adam moments bit for bit, and training goes on."""
    stage, ep, precision, n, m, new_ep = case
    root = moe_resharded(case)
    before = torch.load(root / "before.pt")
    after = torch.load(root / f"after_ws{m}_ep{new_ep}.pt", weights_only=False)  # written by this test's own job
    for key in ("masters", "exp_avg", "exp_avg_sq"):
        assert before[key].keys() == after[key].keys()
        assert [n for n in before[key] if not torch.equal(before[key][n], after[key][n])] == [], key
    assert sum(".deepspeed_experts." in n for n in before["masters"]) == 2 * 4 * 4  # 2 layers x 4 experts x 4 tensors
    assert after["global_steps"] == 4 and math.isfinite(after["loss_after"])
    inspected = json.loads(run_cli("inspect", root / f"ws{m}_ep{new_ep}", "--json").stdout)
    assert inspected["problems"] == [] and inspected["world_size"] == m
    assert [(e["ep_size"], e["expert_data_parallel_size"]) for e in inspected["experts"]] == [(new_ep, m // new_ep)] * 2


def test_a_world_size_the_ep_size_does_not_divide_is_refused(tmp_path):
    with pytest.raises(UnsupportedCheckpointError, match=r"4 experts at ep_size 2, which world size 3 is not a multiple of"):
        dsckpt.reshard(FIXTURES / "moe_z2_ws2_ep2_fp32", tmp_path / "ws3", 3)
    with pytest.raises(UnsupportedCheckpointError, match=r"4 experts at ep_size 3, which world size 3"):
        dsckpt.reshard(FIXTURES / "moe_z2_ws2_ep2_fp32", tmp_path / "ws3", 3, ep_size=3)
    with pytest.raises(UnsupportedCheckpointError, match="reshard --stage does not move experts between stages"):
        dsckpt.reshard(FIXTURES / "moe_z2_ws2_ep2_fp32", tmp_path / "z1", 2, stage=1)
    assert not (tmp_path / "ws3").exists() and not (tmp_path / "z1").exists()


@pytest.mark.runtime
@pytest.mark.parametrize("model, nproc, stage, precision", [("build_ep2", 2, 2, "32"), ("build_ep1", 3, 1, "bf16")])
def test_full_weights_resume_into_an_moe_model_at_another_layout(tmp_path, model, nproc, stage, precision):
    """`resume --full-weights` of a consolidated MoE file into the model at another world size, ep_size, stage and
    precision: each rank's local experts get the file's global experts (weights and fp32 masters exact,
    `--check` on every rank), then training goes on and saves an MoE checkpoint dsckpt reads."""
    from conftest import skip_beyond_devices, skip_unless_supported

    skip_beyond_devices(nproc)
    skip_unless_supported(precision)
    weights = tmp_path / "m.safetensors"
    dsckpt.consolidate(FIXTURES / "moe_z2_ws4_ep2_fp32", weights)
    common = ("--full-weights", weights, "--model", f"moe_model:{model}", "--nproc", nproc, "--stage", stage,
              "--precision", precision)
    proc = run_cli("resume", *common, "--check", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    local = build(ep_size=int(model[-1]))  # at ep_size 2 a rank builds (and checks) its 2 of the 4 experts per layer
    assert report["tensors_checked"] == report["fp32_masters_checked"] == sum(1 for _ in local.parameters())
    assert report["max_abs_diff"] == 0.0 and report["fp32_master_max_abs_diff"] == 0.0
    if model == "build_ep2":  # (one continuation is enough: each run costs a few seconds of ranks)
        proc = run_cli("resume", *common, "--steps", "2", "--save-dir", tmp_path / "run")
        assert proc.returncode == 0, proc.stderr[-3000:]
        saved = json.loads(run_cli("inspect", tmp_path / "run", "--json").stdout)
        assert saved["problems"] == [] and [e["ep_size"] for e in saved["experts"]] == [2, 2]
