"""`dsckpt reshard` (issue 13): the oracle is stock DeepSpeed loading the result at the new world size.

Real runs (tests/jobs/reshard_oracle.py, shared by every test here): the odd model - sizes 2 and 3
do not divide, groups end in padding, two param groups with their own hyper-parameters, a frozen
layer, a tied weight, buffers, an LR scheduler - trained at N for each stage x precision, resharded
to M (2 -> 3, 2 -> 1, 3 -> 2), loaded by ``engine.load_checkpoint`` at M.  Compared:
* bit for bit: ``safe_get_full_fp32_param``, ``safe_get_full_optimizer_state`` (exp_avg, exp_avg_sq),
  the full state dict (frozen weights, buffers, 16-bit weights), Adam's step counts, the scheduler,
  the loss scale, global/skipped steps and samples, per-group hyper-parameters, the client state;
* DeepSpeed's own save of the loaded state at M against dsckpt's files: same files, same trees,
  same tensor bytes (nothing differs, padding included);
* the next steps on the same global batches against the uninterrupted run at N, within the
  tolerance documented in ``CONTINUATION_TOLERANCE``.
"""
from __future__ import annotations

import json
import math
import os
import shutil

import pytest

from conftest import (FIXTURES, ODD_OFFLOAD as OFFLOAD, ODD_PRECISIONS as PRECISIONS, ODD_STAGES as STAGES,
                      ODD_STEPS as STEPS, ODD_SUBGROUPS as SUBGROUPS, _capabilities, odd_run_combos, run_cli, run_job,
                      skip_beyond_devices, tree_differences)
from dsckpt.api.options import WriteOptions
from dsckpt.progress import Tally
from dsckpt.errors import ConfigError, MissingRankError, OutputError, UnsupportedCheckpointError
from dsckpt.formats.torchzip import TorchFile
from dsckpt.plan.reshard import build_reshard_plan
from dsckpt.api.resharding import reshard
from dsckpt.zero.reader import open_checkpoint

torch = pytest.importorskip("torch")

MOVES = ((2, 3), (2, 1), (3, 2))  # larger, down to one rank, smaller
SUBGROUP_MOVES = MOVES  # 2 -> 1 keeps the odd model's sub-groups, 2 -> 3 and 3 -> 2 cut them anew
                        # (test_sub_groups_that_fall_differently_are_cut_anew)
# Continuing at M is continuing at another world size: the same samples, but gradients reduced over
# other partitions in another order.  fp32: that is rounding noise (measured: loss 1e-7 relative,
# masters 6e-8 to 1.2e-7 after 3 steps).  16-bit: the forward runs on the 16-bit weights with another
# micro-batch per rank, so gradients differ at 16-bit resolution (measured bf16: loss 5.6e-5
# relative, masters 3.5e-4); Adam moves a master by at most ~lr per step whatever the gradient, so
# the masters stay within 2 * lr * steps of each other - the bound asserted.
LR = 3e-3
CONTINUATION_TOLERANCE = {"32": {"loss": 1e-5, "master": 1e-5},
                          "bf16": {"loss": 1e-3, "master": 2 * LR * 3},
                          "16": {"loss": 1e-3, "master": 2 * LR * 3}}


@pytest.fixture(scope="module")
def oracle(odd_runs):
    """Train at 2 and 3 ranks (``odd_runs``), reshard with the CLI, load at the new world sizes (5 jobs in all)."""
    for n, m in MOVES:
        skip_beyond_devices(max(n, m))
    combos = odd_run_combos()
    roots = {n: odd_runs(n) for n in sorted({n for n, _ in MOVES})}
    for n, m in MOVES:
        resharded = []
        for combo in combos:
            stage, precision = combo.split(":")
            folder = roots[n] / f"z{stage}_{precision}"
            proc = run_cli("reshard", folder / "ckpt", folder / f"ws{m}", "--world-size", m, "-q", "--no-fsync")
            if stage in SUBGROUPS and proc.returncode == 2 and "fall differently" in proc.stderr:
                (folder / f"ws{m}.refused").write_text(proc.stderr)  # asserted by test_sub_groups_*
                continue
            assert proc.returncode == 0, proc.stderr[-3000:]
            resharded.append(combo)
        run_job("reshard_oracle.py", m, "load", roots[n], ",".join(resharded), STEPS, timeout=400)
    return roots


def _records(oracle, n: int, m: int, stage: int, precision: str):
    if precision not in _capabilities():
        pytest.skip(f"precision {precision!r} is not supported here (supported: {', '.join(_capabilities())})")
    folder = oracle[n] / f"z{stage}_{precision}"
    assert not (folder / f"ws{m}.refused").exists(), (folder / f"ws{m}.refused").read_text()
    load = lambda name: torch.load(folder / name, weights_only=False)  # noqa: E731 - written by this test's own job
    return folder, load("before.pt"), load(f"after_ws{m}.pt")


def _equal(a: dict, b: dict) -> list[str]:
    assert a.keys() == b.keys()
    return [k for k in a if not (a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]))]


# fp16 is the GPU precision (a CPU DeepSpeed may refuse it): its cases run with `pytest -m gpu` too
MATRIX = [pytest.param(n, m, s, p, id=f"z{s}-{p}-{n}to{m}", marks=pytest.mark.gpu if p == "16" else ())
          for n, m in MOVES for s in STAGES for p in PRECISIONS] + \
    [pytest.param(n, m, s, "32", id=f"z{s}ffload-32-{n}to{m}") for n, m in MOVES for s in OFFLOAD] + \
    [pytest.param(n, m, s, "32", id=f"z{s}ubgroups-32-{n}to{m}") for n, m in SUBGROUP_MOVES for s in SUBGROUPS]


@pytest.mark.parametrize("n, m, stage, precision", MATRIX)
def test_stock_deepspeed_restores_every_state_bit_for_bit(oracle, n, m, stage, precision):
    _, before, after = _records(oracle, n, m, stage, precision)
    assert after["world_size"] == m and before["world_size"] == n
    assert _equal(before["masters"], after["masters"]) == []  # safe_get_full_fp32_param
    assert _equal(before["moments"], after["moments"]) == []  # safe_get_full_optimizer_state exp_avg / exp_avg_sq
    assert len(before["moments"]) == 2 * len(before["masters"]) > 0
    assert _equal(before["module"], after["module"]) == []  # 16-bit weights, frozen layer, buffers
    assert "frozen.weight" in after["module"] and "scale" in after["module"]
    assert set(after["steps"]) == set(before["steps"]) and before["steps"]  # (fp16 may skip a step on overflow)
    assert len(after["steps"]) == len(before["steps"]) or stage in SUBGROUPS  # (one per sub-group: cut anew at M)
    for key in ("scheduler", "loss_scale", "global_steps", "skipped_steps", "global_samples", "hyperparams"):
        assert after[key] == before[key], key
    assert {g["weight_decay"] for g in after["hyperparams"]} == {0.1, 0.0}  # two groups, their own settings
    client = after["client"]
    assert client["note"] == "resharded" and client["epoch"] == 2 and client["rank"] == 0
    assert client["nested"]["ids"] == [1, 2, (3, 4)] and torch.equal(client["nested"]["t"], torch.arange(5))


@pytest.mark.parametrize("n, m, stage, precision", MATRIX)
def test_training_continues_like_the_uninterrupted_run(oracle, n, m, stage, precision):
    _, before, after = _records(oracle, n, m, stage, precision)
    tol = CONTINUATION_TOLERANCE[precision]
    if stage in SUBGROUPS and (n, m) != (2, 1):  # sub-groups cut anew: the state loads exact (the tests above), but
        tol = CONTINUATION_TOLERANCE["bf16"]  # DeepSpeed steps other sub-groups at M (figures: docs/reliability.md)
    for want, got in zip(before["after"]["losses"], after["after"]["losses"]):
        assert math.isfinite(got) and abs(got - want) <= tol["loss"] * abs(want), (want, got)
    worst = max(float((before["after"]["masters"][k] - after["after"]["masters"][k]).abs().max())
                for k in before["after"]["masters"])
    assert worst <= tol["master"]


@pytest.mark.parametrize("n, m, stage, precision", MATRIX)
def test_files_equal_deepspeeds_own_save_at_the_new_world_size(oracle, n, m, stage, precision):
    """DeepSpeed, having loaded the resharded state at M, saves it again: the same files, trees and bytes."""
    folder, _, _ = _records(oracle, n, m, stage, precision)
    ours, native = folder / f"ws{m}" / f"step{STEPS}", folder / f"native_ws{m}" / f"step{STEPS}"
    assert sorted(os.listdir(ours)) == sorted(os.listdir(native))
    for name in sorted(os.listdir(ours)):
        assert tree_differences(TorchFile(ours / name).obj, TorchFile(native / name).obj, name) == []


def test_sub_groups_that_fall_differently_are_cut_anew(oracle):
    """DeepSpeed cuts ZeRO-3 sub-groups by *partition* size (``_create_fp16_sub_groups``), so where it cuts
    depends on the world size: the odd model at sub_group_size 1500 has 3 sub-groups at 1 or 2 ranks and 2 at 3.
    Every move passes every check above (stock DeepSpeed restores each state bit for bit, saves the same files);
    here the cuts themselves: the files hold as many sub-groups as DeepSpeed cuts at their world size, and the
    optimizer's param groups list theirs."""
    from dsckpt.plan.moves import stage3_sub_groups

    if "32" not in _capabilities():
        pytest.skip("fp32 is not supported here")
    kept, ws3 = oracle[2] / "z3s_32", oracle[3] / "z3s_32"
    assert not list(kept.glob("*.refused")) and not list(ws3.glob("*.refused"))
    src = open_checkpoint(kept / "ckpt")  # param_shapes: one entry per sub-group; two optimizer groups hold them
    groups = [src.param_groups[0] | src.param_groups[1], src.param_groups[2]]
    assert [len(g) for g in src.param_groups] == [1, 1, 4]
    assert [len(g) for g in stage3_sub_groups(groups, 2, 1500)] == [1, 1, 4] == \
        [len(g) for g in stage3_sub_groups(groups, 1, 1500)] != [len(g) for g in stage3_sub_groups(groups, 3, 1500)]
    for folder, ws in ((kept / "ws3", 3), (kept / "ws1", 1), (ws3 / "ws2", 2)):
        osd = TorchFile(next(folder.glob("*/*rank_0*optim_states.pt"))).obj["optimizer_state_dict"]
        assert len(osd["fp32_flat_groups"]) == len(stage3_sub_groups(groups, ws, 1500)), folder
        owned = [g["params"] for g in osd["optimizer_state_dict"]["param_groups"]]
        assert sorted(i for ids in owned for i in ids) == list(range(len(osd["fp32_flat_groups"]))), owned


def test_consolidated_result_of_the_resharded_equals_the_original(oracle):
    from dsckpt.api.consolidation import load_state_dict

    n, m = MOVES[0]
    folder = oracle[n] / "z2_32"
    for state in ("fp32", "exp_avg", "exp_avg_sq"):
        a, b = load_state_dict(folder / "ckpt", state=state), load_state_dict(folder / f"ws{m}", state=state)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --- change of ZeRO stage (reshard --stage S): the same oracle, loaded into a ZeRO-S engine ----------------
RESTAGE = [(1, 2), (2, 1), (1, 3), (2, 3), (3, 1), (3, 2)]  # 2 -> 3 ranks


@pytest.fixture(scope="module")
def restaged(oracle):
    """The ws-2 runs of ``oracle`` resharded to 3 ranks at another stage, loaded by stock DeepSpeed there."""
    combos = []
    for old, new in RESTAGE:
        for precision in ("32", "bf16"):
            if precision not in _capabilities():
                continue
            folder = oracle[2] / f"z{old}_{precision}"
            proc = run_cli("reshard", folder / "ckpt", folder / f"ws3_s{new}", "-w", 3, "--stage", new, "-q", "--no-fsync")
            assert proc.returncode == 0, proc.stderr[-3000:]
            combos.append(f"{old}>{new}:{precision}")
    run_job("reshard_oracle.py", 3, "load", oracle[2], ",".join(combos), STEPS, timeout=400)
    return oracle[2]


@pytest.mark.parametrize("old, new", RESTAGE)
@pytest.mark.parametrize("precision", ["32", "bf16"])
def test_stock_deepspeed_at_another_stage_restores_every_state(restaged, old, new, precision):
    if precision not in _capabilities():
        pytest.skip(f"precision {precision!r} is not supported here")
    folder = restaged / f"z{old}_{precision}"
    before = torch.load(folder / "before.pt", weights_only=False)  # written by this test's own job
    after = torch.load(folder / f"after_ws3_s{new}.pt", weights_only=False)
    assert _equal(before["masters"], after["masters"]) == []  # safe_get_full_fp32_param, now at ZeRO-{new}
    assert _equal(before["moments"], after["moments"]) == []  # exp_avg, exp_avg_sq
    assert _equal(before["module"], after["module"]) == []  # 16-bit weights, frozen layer, buffers
    for key in ("steps", "scheduler", "loss_scale", "global_steps", "skipped_steps", "global_samples", "hyperparams"):
        assert after[key] == before[key], key
    assert after["client"]["note"] == "resharded"
    tol = CONTINUATION_TOLERANCE[precision]
    for want, got in zip(before["after"]["losses"], after["after"]["losses"]):
        assert abs(got - want) <= tol["loss"] * abs(want), (want, got)
    ours, native = folder / f"ws3_s{new}" / f"step{STEPS}", folder / f"native_ws3_s{new}" / f"step{STEPS}"
    assert sorted(os.listdir(ours)) == sorted(os.listdir(native))  # DeepSpeed's own save at ZeRO-{new}: same files
    src = open_checkpoint(folder / "ckpt")

    planned = {f.name: f.tree for f in build_reshard_plan(src, 3, new).files}
    for name in sorted(os.listdir(ours)):
        assert tree_differences(TorchFile(ours / name).obj, TorchFile(native / name).obj, name, planned[name]) == []


def test_stage3_with_several_sub_groups_to_stage12_is_refused(oracle, tmp_path):
    """Stage 1/2 keep one flat group per param group: ZeRO-3 sub-groups that split one are refused by name."""
    proc = run_cli("reshard", oracle[2] / "z3s_32" / "ckpt", tmp_path / "z2", "-w", 2, "--stage", 2)
    assert proc.returncode == 2 and "ZeRO-3 sub-groups for 2 param groups" in proc.stderr, proc.stderr
    assert not (tmp_path / "z2").exists()


# --- without DeepSpeed: the committed fixtures ------------------------------------------------------
RESHARDABLE = [n for n in sorted(os.listdir(FIXTURES)) if n[:2] in ("z1", "z2", "z3") and "cuda" not in n]


@pytest.mark.parametrize("name", RESHARDABLE)
def test_there_and_back_gives_the_original_files(name, tmp_path):
    """N -> N+2 -> N rewrites every file to its original tree and bytes, padding aside (the plan loses nothing)."""
    src = open_checkpoint(FIXTURES / name)
    n = src.world_size
    reshard(FIXTURES / name, tmp_path / "up", n + 2, options=WriteOptions(fsync=False))
    reshard(tmp_path / "up", tmp_path / "back", n, options=WriteOptions(fsync=False))
    tag = src.layout.tag
    names = sorted(os.listdir(src.layout.tag_dir))
    assert sorted(os.listdir(tmp_path / "back" / tag)) == names
    identity = {f.name: f.tree for f in build_reshard_plan(src, n).files}  # where the padding is
    for f in names:
        assert tree_differences(TorchFile(src.layout.tag_dir / f).obj, TorchFile(tmp_path / "back" / tag / f).obj, f,
                                identity[f]) == []
    assert (tmp_path / "back" / "latest").read_text() == tag


@pytest.mark.parametrize("name", RESHARDABLE)
@pytest.mark.parametrize("world_size", [1, 4, 5])
def test_gathered_state_is_unchanged_at_any_world_size(name, world_size, tmp_path):
    from dsckpt.api.consolidation import load_state_dict

    out = tmp_path / "out"
    result = reshard(FIXTURES / name, out, world_size, options=WriteOptions(fsync=False))
    ckpt = open_checkpoint(out)
    assert ckpt.world_size == world_size == result.world_size and not ckpt.problems
    for state in ("fp32", "exp_avg", "exp_avg_sq"):
        a, b = load_state_dict(FIXTURES / name, state=state), load_state_dict(out, state=state)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), state
    assert tree_differences(ckpt.client_state, open_checkpoint(FIXTURES / name).client_state, "client") == []


def test_cli_json_and_inspect_report_the_new_world_size(tmp_path):
    proc = run_cli("reshard", FIXTURES / "z3_ws3_bf16", tmp_path / "ws2", "-w", "2", "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert (result["zero_stage"], result["source_world_size"], result["world_size"]) == (3, 3, 2)
    assert str(tmp_path / "ws2" / "latest") in result["files"] and len(result["files"]) == 2 + 2 + 1 + 1
    assert str(tmp_path / "ws2" / "reference.pt") in result["files"]  # a file beside the tag travels too
    report = json.loads(run_cli("inspect", tmp_path / "ws2", "--json").stdout)
    assert report["world_size"] == 2 and report["zero_stage"] == 3


def test_refusals_name_the_problem(tmp_path, fixture_copy):
    with pytest.raises(UnsupportedCheckpointError, match="ZeRO-0 checkpoint is not partitioned"):
        reshard(FIXTURES / "z0_ws1_fp32", tmp_path / "a", 2)
    with pytest.raises(ConfigError, match="world size 0: expected a whole number of data-parallel ranks, 1 to"):
        reshard(FIXTURES / "z2_ws2_fp32", tmp_path / "a", 0)
    with pytest.raises(ConfigError, match="world size '2': expected a whole number"):  # API words, not the CLI's
        reshard(FIXTURES / "z2_ws2_fp32", tmp_path / "a", "2")
    with pytest.raises(OutputError, match="inside the checkpoint"):
        reshard(FIXTURES / "z2_ws2_fp32", FIXTURES / "z2_ws2_fp32" / "ws3", 3)
    (tmp_path / "exists").mkdir()
    with pytest.raises(OutputError, match="already exists"):
        reshard(FIXTURES / "z2_ws2_fp32", tmp_path / "exists", 3)
    broken = fixture_copy("z3_ws3_bf16")
    next(broken.glob("*/bf16_zero_pp_rank_1_*")).unlink()
    with pytest.raises(MissingRankError):
        reshard(broken, tmp_path / "b", 2)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp folder left behind
    proc = run_cli("reshard", FIXTURES / "z0_ws1_fp32", tmp_path / "c", "-w", "2")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "a ZeRO-0 checkpoint is not partitioned" in proc.stderr


def test_foreign_client_classes_are_left_out_or_carried_on_trust_never_run(tmp_path, fixture_copy):
    """A client object of a class dsckpt does not know is left out (with a note) - or, with trust, written
    back as recorded - never built."""
    from dsckpt.formats.pickle_policy import opaque_type
    from forge import rewrite_tree

    ckpt_dir = fixture_copy("z2_ws2_fp32")
    marker = tmp_path / "pwned"
    payload = opaque_type("os", "system")(f"touch {marker}")  # recorded as `os.system("touch ...")`
    rewrite_tree(next(ckpt_dir.glob("*/mp_rank_00_model_states.pt")), lambda tree: {**tree, "payload": payload})
    result = reshard(ckpt_dir, tmp_path / "ws3", 3, options=WriteOptions(fsync=False))
    assert "payload" not in TorchFile(tmp_path / "ws3" / "step3" / "mp_rank_00_model_states.pt").obj
    assert result.notes and "'payload' left out: it holds objects of os.system" in result.notes[0]
    result = reshard(ckpt_dir, tmp_path / "trusted", 3, options=WriteOptions(fsync=False, trust=True))
    written = TorchFile(tmp_path / "trusted" / "step3" / "mp_rank_00_model_states.pt").obj["payload"]
    assert written.class_path == "os.system" and written.args == (f"touch {marker}",) and written.via == "reduce"
    assert "--trust-checkpoint" in result.notes[0]
    assert not marker.exists()
    with pytest.raises(Exception, match="os.system"):  # stock weights-only loading refuses it, as the input's
        torch.load(tmp_path / "trusted" / "step3" / "mp_rank_00_model_states.pt", weights_only=True)
    assert not marker.exists()


@pytest.mark.runtime
def test_round_robin_checkpoint_is_read_by_param_shapes(tmp_path):
    """ZeRO-2 with round_robin_gradients flattens each group in a reordered sequence; ``param_shapes`` follows
    it, DeepSpeed's recorded param_slice_mappings do not (see zero/slice_mappings.py). consolidate reads by
    param_shapes: in an fp32 run the saved module weights are the masters, so they are the oracle.
    reshard refuses: the reorder depends on the world size."""
    from safetensors.torch import load_file

    from dsckpt.zero import slice_mappings
    from dsckpt.zero.partitioning import stage12_group

    skip_beyond_devices(2)
    config = tmp_path / "rr.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "zero_allow_untested_optimizer": True,
                                  "zero_optimization": {"stage": 2, "round_robin_gradients": True}}))
    proc = run_cli("train", "--config", config, "--model", "odd_model:build", "--nproc", 2, "--steps", 2,
                   "--save-dir", tmp_path / "rr")
    assert proc.returncode == 0, proc.stderr[-3000:]
    src = open_checkpoint(tmp_path / "rr")
    shapes = src.param_groups[0]
    assert list(shapes)[:3] == ["gate", "up.weight", "norm.weight"]  # reordered: module order is gate, embed, up...
    computed = stage12_group([math.prod(s) for s in shapes.values()], 2, [0] * len(shapes))
    assert "is not where its param_slice_mappings entry says" in slice_mappings.mismatch(src, 0, list(shapes), computed)

    proc = run_cli("consolidate", tmp_path / "rr", tmp_path / "rr.safetensors")
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours = load_file(tmp_path / "rr.safetensors")
    module = torch.load(src.model_files[0].path, weights_only=False)["module"]  # noqa: S614 - this test's own run
    assert {n for n in shapes} <= set(ours)
    for name in ours:
        assert torch.equal(ours[name], module[name].float()), name
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    theirs = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "rr"))  # also reads by param_shapes
    assert all(torch.equal(ours[n], theirs[n]) for n in shapes)

    proc = run_cli("reshard", tmp_path / "rr", tmp_path / "ws3", "-w", 3)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "round_robin_gradients order, which depends on the world size" in proc.stderr
    assert not (tmp_path / "ws3").exists()


@pytest.mark.runtime
def test_resume_reshard_moves_stage_and_world_size_with_the_optimizer(tmp_path):
    """`resume --reshard --stage S`: the same restage plan inside the runtime, optimizer state carried."""
    shutil.copytree(FIXTURES / "z3_ws2_fp32", tmp_path / "ckpt")
    proc = run_cli("resume", tmp_path / "ckpt", "--nproc", 3, "--reshard", "--stage", 2, "--steps", 1,
                   "--model", "dsckpt.runtime.demo_model:build_small_model", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "note: resharded ZeRO-3 -> ZeRO-2 from 2 to 3 ranks: weights, optimizer state" in proc.stderr
    result = json.loads(proc.stdout)
    assert (result["schema"], result["start_step"], result["end_step"]) == (2, 3, 4)


@pytest.mark.parametrize("fixture", ["z3_ws3_bf16", "z2_ws2_fp32"])
def test_rank_files_written_on_several_threads_are_the_same_bytes(tmp_path, monkeypatch, fixture):
    """Hosts with 4+ cores write up to WRITE_THREADS rank files at once (2-core CI writes one at a time): the
    files are byte for byte the one-thread ones, and progress counts every byte once."""
    import dsckpt.api.resharding as resharding

    outs, counted = {}, {}
    for threads in (1, 3):
        monkeypatch.setattr(resharding, "WRITE_THREADS", threads)
        tally = Tally()
        result = reshard(FIXTURES / fixture, tmp_path / f"t{threads}", 2, options=WriteOptions(progress=tally))
        seen = tally.steps[-1].pieces
        outs[threads] = {p.relative_to(tmp_path / f"t{threads}"): p.read_bytes()
                         for p in sorted((tmp_path / f"t{threads}").rglob("*")) if p.is_file()}
        counted[threads] = (sum(seen), result.bytes)
    assert outs[1] == outs[3] and len(outs[3]) >= 5
    assert counted[1] == counted[3] == (counted[1][1], counted[1][1])


@pytest.mark.parametrize("fixture", ["z3_ws3_bf16", "z2_ws2_fp32", "z1_ws3_bf16"])
def test_storages_copied_straight_in_are_the_streamed_bytes(tmp_path, monkeypatch, fixture):
    """Local rank files copy each storage straight into the zip (``Reader.copy_storage``); streamed through the
    reader's buffers instead (what a cast or a bucket takes), the files are the same bytes, zip CRCs included."""
    import zipfile

    from dsckpt.io.read import Reader

    copied = []
    real = Reader.copy_storage
    monkeypatch.setattr(Reader, "copy_storage", lambda *a, **k: copied.append(real(*a, **k)) or copied[-1])
    reshard(FIXTURES / fixture, tmp_path / "copied", 5, options=WriteOptions(fsync=False))
    monkeypatch.setattr(Reader, "copy_storage", lambda *a, **k: None)
    reshard(FIXTURES / fixture, tmp_path / "streamed", 5, options=WriteOptions(fsync=False))
    files = sorted(p.relative_to(tmp_path / "copied") for p in (tmp_path / "copied").rglob("*") if p.is_file())
    assert copied and all(c is not None for c in copied) and len(files) >= 6
    for name in files:
        assert (tmp_path / "copied" / name).read_bytes() == (tmp_path / "streamed" / name).read_bytes(), name
        if name.suffix == ".pt":
            assert zipfile.ZipFile(tmp_path / "copied" / name).testzip() is None  # every entry's CRC-32 holds
