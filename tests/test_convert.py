"""`dsckpt convert --to dcp|universal` (issue 27): a ZeRO run's training state for FSDP2 and for DeepSpeed's
universal loader.  The oracles are the programs users run:

* DCP: tests/jobs/fsdp2_load.py - an FSDP2 ``fully_shard`` model and its AdamW at 1, 2 and 3 ranks, loaded
  with ``get_state_dict`` -> ``dcp.load`` -> ``set_state_dict`` - against what the ZeRO run recorded
  (reshard_oracle.py's ``before.pt``: ``safe_get_full_fp32_param`` and ``safe_get_full_optimizer_state``);
* universal: DeepSpeed's own ``ds_to_universal`` output for the same checkpoint (file for file, tree for tree,
  byte for byte), and stock ``engine.load_checkpoint`` with ``load_universal`` at 3 ranks.
The runs are the odd model's (two param groups with their own settings, a frozen layer, a tied weight, float
and int buffers, sizes no world size divides), ZeRO-1/2/3 and ZeRO-3 cut into sub-groups, fp32 and bf16.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import (FIXTURES, ODD_STEPS, PYTHONPATH, _capabilities, run_cli, run_job, skip_beyond_devices,
                      tree_differences)
from dsckpt.formats.torchzip import TorchFile
from dsckpt.plan.training_state import build_training_state
from dsckpt.zero.reader import open_checkpoint

torch = pytest.importorskip("torch")

COMBOS = ("1:32", "2:bf16", "3:bf16", "3:32", "3s:32")  # stage:precision of the odd model's 2-rank runs
FSDP2_WORLD_SIZES = (1, 2, 3)
UNIVERSAL_WORLD_SIZES = (3,)  # (1 too, by hand: the same records; one job fewer in the suite)
LR = 3e-3
# The first loss after loading is computed before any update, so it depends on the weights alone: FSDP2's fp32
# forward of the fp32 masters vs the DeepSpeed run's forward (fp32: the same numbers, reduced in another order;
# bf16: DeepSpeed ran the forward on bf16 weights - measured 9e-4 relative).
NEXT_LOSS_TOLERANCE = {"32": 1e-6, "bf16": 5e-3}


def _runnable() -> list[str]:
    return [c for c in COMBOS if c.split(":")[1] in _capabilities()]


@pytest.fixture(scope="module")
def converted(odd_runs):
    """The 2-rank runs converted with the CLI, then loaded: FSDP2 at 1-3 ranks, DeepSpeed universal at 1 and 3."""
    for m in FSDP2_WORLD_SIZES + UNIVERSAL_WORLD_SIZES:
        skip_beyond_devices(m)
    root = odd_runs(2)
    combos = _runnable()
    for combo in combos:
        stage, precision = combo.split(":")
        folder = root / f"z{stage}_{precision}"
        for to in ("dcp", "universal"):
            proc = run_cli("convert", folder / "ckpt", folder / to, "--to", to, "-q", "--no-fsync")
            assert proc.returncode == 0, proc.stderr[-3000:]
    for m in FSDP2_WORLD_SIZES:
        run_job("fsdp2_load.py", m, root, ",".join(combos), timeout=400)
    universal = ",".join(f"{c.split(':')[0]}u:{c.split(':')[1]}" for c in combos)
    for m in UNIVERSAL_WORLD_SIZES:
        run_job("reshard_oracle.py", m, "load", root, universal, ODD_STEPS, timeout=400)
    return root


def _load(folder, name):
    return torch.load(folder / name, weights_only=False)  # written by this test's own jobs


def _records(converted, combo: str, name: str):
    stage, precision = combo.split(":")
    if precision not in _capabilities():
        pytest.skip(f"precision {precision!r} is not supported here (supported: {', '.join(_capabilities())})")
    folder = converted / f"z{stage}_{precision}"
    return _load(folder, "before.pt"), _load(folder, name)


def _differ(want: dict, got: dict, cast: bool = False) -> list[str]:
    return [k for k in want if not (k in got and torch.equal(want[k].to(got[k].dtype) if cast else want[k], got[k])
                                    and (cast or want[k].dtype == got[k].dtype))]


@pytest.mark.parametrize("m", FSDP2_WORLD_SIZES)
@pytest.mark.parametrize("combo", COMBOS)
def test_fsdp2_loads_dcp_with_every_state_bit_for_bit(converted, combo, m):
    before, after = _records(converted, combo, f"fsdp2_ws{m}.pt")
    assert after["world_size"] == m
    assert _differ(before["masters"], after["params"]) == []  # every full parameter = the ZeRO run's fp32 master
    assert _differ(before["moments"], after["moments"]) == [] and len(after["moments"]) == 2 * len(before["masters"])
    frozen_and_buffers = {k: v for k, v in before["module"].items() if k not in before["masters"] and k != "head.weight"}
    assert {"frozen.weight", "frozen.bias", "scale", "seen"} <= set(frozen_and_buffers)
    got = {**after["params"], **after["buffers"]}
    assert _differ(frozen_and_buffers, got, cast=True) == []  # the run's values (bf16 ones exact in fp32)
    assert set(after["steps"]) == set(before["steps"]) == {float(ODD_STEPS)}
    assert after["hyperparams"] == before["hyperparams"]  # two groups, each with its own settings and lr
    assert [g["weight_decay"] for g in after["hyperparams"]] == [0.1, 0.0]


@pytest.mark.parametrize("m", FSDP2_WORLD_SIZES)
@pytest.mark.parametrize("combo", COMBOS)
def test_fsdp2_training_goes_on_from_the_same_point(converted, combo, m):
    before, after = _records(converted, combo, f"fsdp2_ws{m}.pt")
    want = before["after"]["losses"][0]  # the uninterrupted run's loss on the same next global batch
    assert abs(after["next_loss"] - want) <= NEXT_LOSS_TOLERANCE[combo.split(":")[1]] * want, (after["next_loss"], want)
    assert after["moved"] and all(after["moved"].values())  # one more AdamW step moved every trainable parameter


@pytest.mark.parametrize("m", UNIVERSAL_WORLD_SIZES)
@pytest.mark.parametrize("combo", COMBOS)
def test_stock_deepspeed_loads_the_universal_checkpoint(converted, combo, m):
    """What DeepSpeed 0.19.8's universal loader restores, it restores exactly; two things it does not restore
    are pinned down here (they hold for ds_to_universal's output too, whose files ours equal):
    the module's buffers (loaded from no file: an int counter comes back as initialized), and at ZeRO-3
    each group's own settings (every group gets the first group's)."""
    before, after = _records(converted, combo, f"after_universal_ws{m}.pt")
    assert after["world_size"] == m
    assert _differ(before["masters"], after["masters"]) == []
    assert _differ(before["moments"], after["moments"]) == []
    assert _differ(before["module"], after["module"]) == ["seen"] and int(after["module"]["seen"].sum()) == 0
    assert set(after["steps"]) == set(before["steps"]) == {float(ODD_STEPS)}
    for key in ("scheduler", "loss_scale", "global_steps", "skipped_steps", "global_samples"):
        assert after[key] == before[key], key
    assert after["client"]["nested"]["ids"] == [1, 2, (3, 4)] and after["client"]["note"] == "resharded"
    if combo.startswith("3"):
        assert after["hyperparams"] == [before["hyperparams"][0]] * 2  # DeepSpeed's ZeRO-3 loader
    else:
        assert after["hyperparams"] == before["hyperparams"]
        losses = zip(before["after"]["losses"], after["after"]["losses"])
        assert all(abs(got - want) <= 1e-3 * want and math.isfinite(got) for want, got in losses)


@pytest.mark.parametrize("name", ["z1_ws3_bf16", "z2_ws2_fp32", "z3_ws3_bf16",  # (shared with test_universal)
                                  pytest.param("z2_ws3_bf16", marks=pytest.mark.slow),
                                  pytest.param("z3_ws1_fp32", marks=pytest.mark.slow)])
def test_universal_equals_ds_to_universal_file_for_file(name, ds_universal, tmp_path):
    theirs = ds_universal(name)
    proc = run_cli("convert", FIXTURES / name, tmp_path / "u", "--to", "universal", "--json", "--no-fsync")
    assert proc.returncode == 0, proc.stderr
    tag = (FIXTURES / name / "latest").read_text().strip()
    ours_dir, theirs_dir = tmp_path / "u" / tag, theirs / f"{tag}_universal"
    listing = lambda d: sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file())  # noqa: E731
    assert listing(ours_dir) == listing(theirs_dir)
    assert (tmp_path / "u" / "latest_universal").read_text() == tag
    compared = 0
    for rel in listing(ours_dir):
        a, b = TorchFile(ours_dir / rel), TorchFile(theirs_dir / rel)
        assert tree_differences(a.obj, b.obj, rel) == []
        compared += 1
    assert compared > 10
    for model_states in ours_dir.glob("*model_states.pt"):  # copied as they are
        assert model_states.read_bytes() == (theirs_dir / model_states.name).read_bytes()


def test_training_state_plan_maps_sub_groups_to_their_param_groups(odd_runs):
    """ZeRO-3 with a small sub_group_size: 3 sub-groups in the files, 2 torch param groups, and each parameter
    in its own group with its own step (pure: metadata only)."""
    ckpt = open_checkpoint(odd_runs(2) / "z3s_32" / "ckpt")
    assert len(ckpt.optimizer_states[0].groups) == 3
    state = build_training_state(ckpt)
    assert [g.settings["weight_decay"] for g in state.groups] == [0.1, 0.0]
    matrices = {n for n, s in ckpt.trainable.items() if len(s) > 1}
    assert set(state.groups[0].params) == matrices and set(state.groups[1].params) == set(ckpt.trainable) - matrices
    assert [p.name for p in state.params] == list(ckpt.trainable) and all(p.step is not None for p in state.params)
    assert "frozen.weight" in {t.name for t in state.model.tensors} and state.model.aliases == {"head.weight": "embed.weight"}


def test_weights_only_dcp_of_zero0_holds_the_consolidated_weights(tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from dsckpt import load_state_dict

    proc = run_cli("convert", FIXTURES / "z0_ws2_bf16", tmp_path / "d", "--to", "dcp")
    assert proc.returncode == 2 and "ZeRO-0 checkpoint keeps no partitioned optimizer state" in proc.stderr
    assert "--weights-only" in proc.stderr and not (tmp_path / "d").exists()
    proc = run_cli("convert", FIXTURES / "z0_ws2_bf16", tmp_path / "d", "--to", "dcp", "--weights-only", "--json")
    assert proc.returncode == 0, proc.stderr
    dcp_to_torch_save(tmp_path / "d", tmp_path / "d.pt")
    written = torch.load(tmp_path / "d.pt", weights_only=True)
    assert set(written) == {"model"}
    want = load_state_dict(FIXTURES / "z0_ws2_bf16")
    assert _differ(want, written["model"]) == [] and set(written["model"]) == set(want)
    assert (tmp_path / "d" / "client_state.json").exists()  # the client state inside the folder, as consolidate puts it


@pytest.mark.parametrize("args, message", [
    (("moe_z2_ws2_ep2_fp32", "--to", "dcp"), "a mixture-of-experts run; convert does not map expert parallelism"),
    (("z2_ws2_fp32", "--to", "universal", "--weights-only"), "a universal checkpoint is optimizer state by definition"),
    (("z2_ws2_fp32", "--to", "safetensors"), "Invalid value for '--to'"),
])
def test_refusals_name_the_problem_and_write_nothing(tmp_path, args, message):
    proc = run_cli("convert", FIXTURES / args[0], tmp_path / "out", *args[1:])
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and os.listdir(tmp_path) == []


def test_universal_input_and_existing_output_are_refused(ds_universal, tmp_path):
    """--force writes into an existing OUT_DIR; files convert did not write stay."""
    proc = run_cli("convert", ds_universal("z2_ws2_fp32"), tmp_path / "out", "--to", "dcp")
    assert proc.returncode == 2 and "already a universal checkpoint" in proc.stderr
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep").write_text("x")
    proc = run_cli("convert", FIXTURES / "z2_ws2_fp32", tmp_path / "out", "--to", "universal")
    assert proc.returncode == 2 and "already exists" in proc.stderr
    assert os.listdir(tmp_path / "out") == ["keep"]
    proc = run_cli("convert", FIXTURES / "z2_ws2_fp32", tmp_path / "out", "--to", "universal", "--force", "-q")
    assert proc.returncode == 0 and sorted(os.listdir(tmp_path / "out")) == ["keep", "latest_universal", "step3"]


def _convert_and_compare(root: Path, names: tuple[str, ...]) -> None:
    """`convert --to dcp|universal` of each run; each universal state file equals what DeepSpeed held."""
    for name in names:
        for to in ("dcp", "universal"):
            proc = run_cli("convert", root / name / "ckpt", root / name / to, "--to", to)
            assert proc.returncode == 0, proc.stderr
        reference = torch.load(root / name / "reference.pt", weights_only=True)
        for key, tensors in reference.items():
            for param, want in tensors.items():
                got = torch.load(root / name / "universal" / "step3" / "zero" / param / f"{key}.pt", weights_only=True)
                got = got["param"] if isinstance(got, dict) else got
                assert torch.equal(got.reshape(-1), want.reshape(-1)), (name, key, param)


@pytest.mark.runtime
def test_other_optimizers_convert_and_load(tmp_path):
    """Real DeepSpeed ZeRO-2 runs with torch's SGD (Nesterov momentum) and Adagrad: `convert --to dcp` gives what
    FSDP2 with the same optimizer at 3 ranks loads (every master and state tensor equal to DeepSpeed's own, then one
    step moves every parameter); `--to universal` writes each state key to its own file, equal to DeepSpeed's."""
    run_job("optimizers.py", 2, "train", tmp_path)
    _convert_and_compare(tmp_path, ("sgd", "adagrad"))
    run_job("optimizers.py", 3, "fsdp2", tmp_path)
    for name, key in (("sgd", "momentum_buffer"), ("adagrad", "sum")):
        reference, loaded = (torch.load(tmp_path / name / f, weights_only=True) for f in ("reference.pt", "fsdp2.pt"))
        for state in ("fp32", key):
            assert set(loaded[state]) == set(reference[state])
            assert all(torch.equal(loaded[state][n], t) for n, t in reference[state].items()), (name, state)
        assert loaded["moved"]
    assert loaded["groups"][0]["lr_decay"] == 0.01  # Adagrad's own settings carried


@pytest.mark.slow  # (DeepSpeed JIT-compiles its FusedAdam in every new venv, so in every CI run)
@pytest.mark.runtime
def test_muon_converts_and_loads(tmp_path):
    """DeepSpeed's Muon at ZeRO-3 (momentum for its matrices, Adam's moments for the rest): `--to dcp` gives what
    DeepSpeed's own MuonWithAuxAdam as an FSDP2 job's optimizer (1 rank) loads, every master and state tensor equal
    to DeepSpeed's own, then one step moves every parameter; `--to universal` as for the others."""
    run_job("optimizers.py", 2, "muon", tmp_path)
    _convert_and_compare(tmp_path, ("muon",))
    run_job("optimizers.py", 1, "muon_fsdp2", tmp_path)
    muon = torch.load(tmp_path / "muon" / "fsdp2.pt", weights_only=True)
    for key, tensors in torch.load(tmp_path / "muon" / "reference.pt", weights_only=True).items():
        assert set(muon[key]) == set(tensors) and all(torch.equal(muon[key][n], t) for n, t in tensors.items()), key
    assert muon["moved"]


def test_foreign_client_classes_are_left_out_of_the_copied_model_states(tmp_path, fixture_copy):
    """ds_to_universal copies the model-states files whole; dsckpt rewrites one whose client state names a
    class beyond DeepSpeed's own without that entry (DeepSpeed's loader would run its pickle code)."""
    from dsckpt.formats.pickle_policy import opaque_type
    from forge import rewrite_tree

    ckpt_dir = fixture_copy("z2_ws2_fp32")
    marker = tmp_path / "pwned"
    payload = opaque_type("os", "system")(f"touch {marker}")
    rewrite_tree(next(ckpt_dir.glob("*/mp_rank_00_model_states.pt")), lambda tree: {**tree, "payload": payload})
    proc = run_cli("convert", ckpt_dir, tmp_path / "u", "--to", "universal")
    assert proc.returncode == 0, proc.stderr
    assert "'payload' left out: it holds objects of os.system" in proc.stderr
    written = TorchFile(tmp_path / "u" / "step3" / "mp_rank_00_model_states.pt").obj
    assert "payload" not in written and "module" in written
    assert not marker.exists()


def test_dcp_write_failure_is_a_typed_error(tmp_path):
    """A write that fails inside torch.distributed.checkpoint (here a file-size limit: EFBIG) is the typed output
    error with its JSON document, exit 2, nothing at OUT - not torch's wrapped traceback with exit 1."""
    import resource
    import signal

    pytest.importorskip("torch")
    out = tmp_path / "dcp"

    def limited():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))

    proc = subprocess.run([sys.executable, "-m", "dsckpt", "convert", str(FIXTURES / "z2_ws2_fp32"), str(out),
                           "--to", "dcp", "--json"], capture_output=True, text=True, preexec_fn=limited,
                          env={**os.environ, "PYTHONPATH": PYTHONPATH})
    assert proc.returncode == 2, proc.stderr[-2000:]
    doc = json.loads(proc.stdout)
    assert doc["error"].startswith(f"{out}: writing failed (File too large)") and doc["exit"] == 2
    assert "Traceback" not in proc.stderr and not out.exists() and list(tmp_path.iterdir()) == []
