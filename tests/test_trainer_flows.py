"""The trainers' own resume at another world size (issue 23), proven with the trainers themselves.

HF Trainer: Transformers' ``Trainer`` with a DeepSpeed config trains on 2 CPU ranks and saves
``checkpoint-2`` (and goes on to step 4: the uninterrupted run); ``dsckpt reshard checkpoint-2 OUT -w 3``;
the Trainer on 3 ranks resumes with ``train(resume_from_checkpoint=OUT)``.  It must start at step 2, repeat
the uninterrupted run's learning rates exactly and its losses to reduction-order noise, and the state it
loaded (saved by the engine itself before the first step) must equal the original's bit for bit, read
by DeepSpeed's own ``ds_to_universal`` on both sides.

The same across a change of ZeRO stage: ``reshard --stage 3`` of a ZeRO-2 run, resumed by a Trainer whose
DeepSpeed config says stage 3.

Accelerate: ``accelerator.save_state`` with a DeepSpeed plugin on 2 ranks, ``dsckpt reshard`` of that folder,
``accelerator.load_state`` on 3 ranks: the same three checks.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_cli, run_job, skip_beyond_devices, skip_unless_supported

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")

SAVE_AT, MAX_STEPS = 2, 4


def universal(tag_dir: Path, out: Path) -> Path:
    """DeepSpeed's own reading of a checkpoint: ``ds_to_universal`` writes zero/<param>/<state>.pt."""
    proc = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                           str(tag_dir), "--output_folder", str(out), "--inject_missing_state"],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out / "zero"


def universal_differences(a: Path, b: Path) -> list[str]:
    """Tensor by tensor, over the parameters both sides list.  One side may list a tied alias the other does
    not (ds_to_universal writes ``lm_head.weight`` for a ZeRO-2 save, not for ZeRO-3): such an entry holds
    the fp32 value only, no optimizer state."""
    side_a, side_b = ({p.name for p in d.iterdir() if p.is_dir()} for d in (a, b))
    for extra, where in ((side_a - side_b, a), (side_b - side_a, b)):
        assert all(not (where / n / "exp_avg.pt").exists() for n in extra), extra
    names = sorted(side_a & side_b)
    assert len(names) >= len(side_a | side_b) - 2
    differences = []
    for name in names:
        # fp32 and the moments; ds_to_universal writes step.pt for some parameters of a ZeRO-3 save and not others
        # (seen both ways) - Adam's step is compared by the oracle in test_reshard.py and by the learning rates here
        states = {p.name for p in (a / name).glob("*.pt")} - {"step.pt"}
        assert states == {p.name for p in (b / name).glob("*.pt")} - {"step.pt"}, name
        for state in sorted(states):
            # a tensor, or {"param": tensor, "cat_dim": 0} (0.19.8 writes this from ZeRO-1/2 saves, not ZeRO-3)
            x, y = (v["param"] if isinstance(v, dict) else v
                    for v in (torch.load(side / name / state, weights_only=True) for side in (a, b)))
            # (ds_to_universal keeps a ZeRO-3 save's values flat at times: compared element for element)
            if not (x.dtype == y.dtype and torch.equal(x.reshape(-1), y.reshape(-1))):
                differences.append(f"{name}/{state}")
    return differences


@pytest.fixture(scope="module")
def hf_reference(tmp_path_factory):
    """The uninterrupted 2-rank Trainer run per (stage, precision), shared by the cases that reshard it."""
    runs = {}

    def get(stage: int, precision: str) -> Path:
        if (stage, precision) not in runs:
            runs[stage, precision] = tmp_path_factory.mktemp(f"hf_z{stage}_{precision}")
            run_job("hf_resume.py", 2, runs[stage, precision], stage, precision, MAX_STEPS, SAVE_AT)
        return runs[stage, precision]
    return get


# The whole matrix is `make test-all`.  The default suite keeps one change of stage: 2 -> 3 fp32 resumes a ZeRO-3
# run as 3 -> 3 does; 1 -> 2 bf16 (ZeRO-1's files; ZeRO-2's optimizer code in DeepSpeed 0.19.8) is test-all's, as
# ZeRO-1 reshards are checked against stock DeepSpeed in test_reshard; each case is ~15-20 s of Trainer runs on 2
# cores, and the suite's budget is 10 minutes.
SLOW_HF = {(1, 1, "32"), (1, 1, "bf16"), (2, 2, "bf16"), (2, 2, "32"), (3, 3, "bf16"), (3, 3, "32"), (1, 2, "bf16")}


@pytest.mark.parametrize("stage,new_stage,precision", [
    pytest.param(*case, marks=pytest.mark.slow if case in SLOW_HF else ())
    for case in [(s, s, p) for p in ("32", "bf16") for s in (1, 2, 3)] + [(2, 3, "32"), (1, 2, "bf16")]])
def test_hf_trainer_resumes_a_resharded_checkpoint(hf_reference, stage, new_stage, precision, tmp_path):
    if precision == "bf16":
        skip_unless_supported("bf16")
    skip_beyond_devices(3)
    ref, moved, resumed = hf_reference(stage, precision), tmp_path / "moved", tmp_path / "resumed"
    proc = run_cli("reshard", ref / f"checkpoint-{SAVE_AT}", moved, "-w", "3", "--stage", new_stage, "--json")
    assert proc.returncode == 0, proc.stderr
    notes = json.loads(proc.stdout)["notes"]
    assert any("rng_state_{rank}.pth: ranks 2 <- 0" in n for n in notes)  # the new rank's RNG file, said so
    assert any(n.startswith("training_args.bin left out") for n in notes)  # it pickles accelerate's classes
    for name in ("trainer_state.json", "scheduler.pt", "config.json", "tokenizer.json", "rng_state_0.pth",
                 "rng_state_1.pth", "rng_state_2.pth"):
        assert (moved / name).is_file(), name
    assert json.loads((moved / "trainer_state.json").read_text())["global_step"] == SAVE_AT

    assert json.loads(proc.stdout)["zero_stage"] == new_stage
    run_job("hf_resume.py", 3, resumed, new_stage, precision, MAX_STEPS, SAVE_AT, moved)  # its config: the new stage
    before, after = (json.loads((d / "log.json").read_text()) for d in (ref, resumed))
    assert after["start_step"] == SAVE_AT and after["world_size"] == 3
    steps = lambda log: {e["step"]: e for e in log["history"] if "loss" in e}
    tol = 1e-5 if precision == "32" else 2e-2
    for step in range(SAVE_AT + 1, MAX_STEPS + 1):
        a, b = steps(before)[step], steps(after)[step]
        assert a["learning_rate"] == b["learning_rate"], step
        assert abs(a["loss"] - b["loss"]) <= tol * abs(a["loss"]), (step, a["loss"], b["loss"])

    original = universal(ref / f"checkpoint-{SAVE_AT}" / f"global_step{SAVE_AT}", tmp_path / "u_original")
    loaded = universal(resumed / "as_loaded" / "as_loaded", tmp_path / "u_loaded")
    assert universal_differences(original, loaded) == []  # fp32 masters, exp_avg, exp_avg_sq, step


@pytest.mark.parametrize("stage", [pytest.param(2, marks=pytest.mark.slow), 3])  # (ZeRO-2: make test-all)
def test_accelerate_load_state_resumes_a_resharded_save_state(stage, tmp_path):
    """Accelerate's ``save_state`` folder (tag ``pytorch_model``, ``random_states_*.pkl``, ``scheduler.bin``) is
    inspected, consolidated and resharded as it is; ``accelerator.load_state`` at 3 ranks resumes from it."""
    skip_beyond_devices(3)
    ref, moved, resumed = tmp_path / "ref", tmp_path / "moved", tmp_path / "resumed"
    run_job("accelerate_resume.py", 2, ref, stage, 5, 3)
    state = ref / "state"
    report = json.loads(run_cli("inspect", state, "--json").stdout)
    assert (report["tag"], report["zero_stage"], report["world_size"], report["problems"]) == ("pytorch_model", stage, 2, [])
    assert run_cli("consolidate", state, tmp_path / "m.safetensors", "-q").returncode == 0
    assert run_cli("diff", state, tmp_path / "m.safetensors").returncode == 0
    proc = run_cli("reshard", state, moved, "-w", "3", "--json")
    assert proc.returncode == 0, proc.stderr
    names = {p.name for p in moved.iterdir()}
    assert "scheduler.bin" in names
    # On CPU ranks Accelerate believes every rank is process 0: all of them write random_states_0.pkl at once,
    # and now and then the file comes out a broken zip (seen here).  Carried for every rank, or named as left out:
    assert {f"random_states_{r}.pkl" for r in range(3)} <= names or \
        "random_states_0.pkl (one per rank) left out: not readable as a pickle" in proc.stderr, proc.stderr

    run_job("accelerate_resume.py", 3, resumed, stage, 5, 3, moved)
    before, after = (json.loads((d / "log.json").read_text())["log"] for d in (ref, resumed))
    assert [e["step"] for e in after] == [4, 5]
    for a, b in zip(before[3:], after):
        assert a["lr"] == b["lr"] and abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (a, b)
    assert run_cli("diff", state, resumed / "as_loaded", "--optimizer").returncode == 0  # masters and moments
    original = universal(state / "pytorch_model", tmp_path / "u_original")
    loaded = universal(resumed / "as_loaded" / "as_loaded", tmp_path / "u_loaded")
    assert universal_differences(original, loaded) == []


@pytest.mark.parametrize("stage", [2, 3])
def test_peft_adapter_export_loads_in_peft(stage, tmp_path):
    """HF Trainer + LoRA + DeepSpeed saves the adapter's shards (exclude_frozen_parameters) with
    adapter_config.json beside them: consolidate --hf writes what PeftModel.from_pretrained loads."""
    peft = pytest.importorskip("peft")
    sys.path.insert(0, str(Path(__file__).parent / "jobs"))
    from hf_trainer import model_config
    from transformers import LlamaForCausalLM

    run = tmp_path / "run"
    run_job("hf_peft.py", 2, run, stage)
    ckpt = run / "checkpoint-3"
    (ckpt / "adapter_model.safetensors").unlink()  # the Trainer's own copy: dsckpt's must stand alone
    proc = run_cli("consolidate", ckpt, tmp_path / "adapter", "--hf", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["format"] == "peft"
    (tmp_path / "base").mkdir()  # #69.6: the docs' old merged-model route says what is missing, not a vocabulary
    model_config().to_json_file(tmp_path / "base" / "config.json")
    merged = run_cli("consolidate", ckpt, tmp_path / "merged", "--hf", "--config", tmp_path / "base" / "config.json")
    assert merged.returncode == 2 and "holds only the adapter:" in merged.stderr and "LoRA tensors" in merged.stderr
    assert "merge_and_unload" in merged.stderr and not (tmp_path / "merged").exists(), merged.stderr
    torch.manual_seed(11)
    base = LlamaForCausalLM(model_config())  # the frozen base: the same initialisation the run started from
    base.save_pretrained(tmp_path / "base")
    model = peft.PeftModel.from_pretrained(base, tmp_path / "adapter")
    live = torch.load(run / "live.pt", weights_only=True)
    loaded = peft.get_peft_model_state_dict(model)
    assert loaded.keys() == live["adapter"].keys() and all(torch.equal(loaded[k], live["adapter"][k]) for k in loaded)
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(input_ids=live["probe"]).logits.float(), live["logits"])
    # #69.6: merged into the base by dsckpt is PEFT's own merge_and_unload, bit for bit, and from_pretrained loads it
    proc = run_cli("consolidate", ckpt, tmp_path / "merged", "--hf", "--base", tmp_path / "base", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["format"] == "merged" and any("merged 4 LoRA pairs" in n for n in doc["notes"]), doc
    ours = LlamaForCausalLM.from_pretrained(tmp_path / "merged").eval()
    theirs = model.merge_and_unload().eval()
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    assert all(torch.equal(v, theirs.state_dict()[k]) for k, v in ours.state_dict().items())
    with torch.no_grad():
        assert torch.allclose(ours(input_ids=live["probe"]).logits.float(), live["logits"], atol=1e-5)
    other = model_config()
    other.hidden_size *= 2
    LlamaForCausalLM(other).save_pretrained(tmp_path / "other")  # another base: every projection of another shape
    proc = run_cli("consolidate", ckpt, tmp_path / "wrong", "--hf", "--base", tmp_path / "other")
    assert proc.returncode == 2 and "another base model" in proc.stderr and not (tmp_path / "wrong").exists()


# --- Lightning ------------------------------------------------------------------------------------------
def _lightning_ds_run(tmp_path_factory, env=None, layout="wrapped"):
    pytest.importorskip("lightning")
    from conftest import _capabilities

    sys.path.insert(0, str(Path(__file__).parent / "models"))
    import lightning as L
    from lit_model import LitOdd, batches

    root = tmp_path_factory.mktemp("lightning_flow")
    trainer = L.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=root)
    trainer.fit(LitOdd(lr=2e-3, note="flow"), batches())
    trainer.save_checkpoint(root / "cpu.ckpt")  # Lightning's own dict: its DeepSpeedStrategy's client state
    run_job("lightning_deepspeed.py", 2, root / "cpu.ckpt", root / "ds", 2, "32", layout, env=env)
    return root


def test_lightning_client_state_survives_reshard(tmp_path_factory, tmp_path):
    """Lightning's checkpoint dict (loops, callbacks, hyper-parameters, lr_schedulers, counters) is the client
    state of its DeepSpeedStrategy folders; reshard carries every entry of it, unchanged, to every rank."""
    from dsckpt.zero.reader import open_checkpoint
    from test_reshard import tree_differences

    root = _lightning_ds_run(tmp_path_factory)
    proc = run_cli("reshard", root / "ds", tmp_path / "ws3", "-w", "3", "--stage", "3", "--json")
    assert proc.returncode == 0, proc.stderr
    assert not [n for n in json.loads(proc.stdout)["notes"] if "left out" in n]
    before, after = open_checkpoint(root / "ds").client_state, open_checkpoint(tmp_path / "ws3").client_state
    assert {"loops", "callbacks", "hyper_parameters", "lr_schedulers", "global_step", "epoch"} <= set(after)
    assert tree_differences(before, after, "client") == []


@pytest.mark.gpu
def test_lightning_strategy_resumes_across_a_stage_change(tmp_path):
    """The real thing on a GPU: DeepSpeedStrategy(stage=2) fits 3 steps and saves; `dsckpt reshard --stage 3`;
    DeepSpeedStrategy(stage=3) resumes it with fit(ckpt_path=) at step 3 and its next steps repeat those of
    Lightning's own stage-2 resume of the original - and so does a stage-3 fit(ckpt_path=) of the stage-2 folder
    itself with LightningAsyncSave (no copy: DeepSpeed's load answered from the reshard plan)."""
    pytest.importorskip("lightning")
    if not torch.cuda.is_available():
        pytest.skip("Lightning's DeepSpeedStrategy needs CUDA (run `pytest -m gpu` on a GPU host)")
    job = str(Path(__file__).parent / "jobs" / "lightning_strategy.py")

    def fit(out, stage, steps, ckpt=None, background=False):
        env = {**os.environ, **({"DSCKPT_ASYNC": "1"} if background else {})}
        proc = subprocess.run([sys.executable, job, str(out), str(stage), str(steps), *([str(ckpt)] if ckpt else [])],
                              capture_output=True, text=True, timeout=400, env=env)
        assert proc.returncode == 0, proc.stderr[-4000:]
        return json.loads((out / "log.json").read_text())

    first = fit(tmp_path / "first", 2, 3)
    assert first["end"] == 3
    proc = run_cli("reshard", tmp_path / "first" / "ckpt", tmp_path / "z3", "-w", "1", "--stage", "3", "--json")
    assert proc.returncode == 0, proc.stderr
    native = fit(tmp_path / "native", 2, 6, tmp_path / "first" / "ckpt")  # Lightning's own resume at stage 2
    moved = fit(tmp_path / "moved", 3, 6, tmp_path / "z3")
    assert native["start"] == moved["start"] == 3 and moved["end"] == 6
    assert len(moved["losses"]) == len(native["losses"]) == 3
    for a, b in zip(native["losses"], moved["losses"]):
        assert abs(a - b) <= 1e-5 * abs(a), (native["losses"], moved["losses"])
    # LightningAsyncSave: the stage-2 files themselves, loaded at stage 3 by fit(ckpt_path=) through the planned load
    planned = fit(tmp_path / "planned", 3, 6, tmp_path / "first" / "ckpt", background=True)
    assert planned["start"] == 3 and planned["end"] == 6 and len(planned["losses"]) == 3
    for a, b in zip(native["losses"], planned["losses"]):
        assert abs(a - b) <= 1e-5 * abs(a), (native["losses"], planned["losses"])


@pytest.mark.gpu
def test_lightning_strategy_resumes_at_another_world_size(tmp_path_factory, tmp_path):
    """A Lightning DeepSpeed folder of 2 ranks (written on CPU ranks as Lightning 2.6 lays it out: the lent GPU hosts
    have one GPU) resumed by
    Lightning's own DeepSpeedStrategy(stage=3) on one GPU with fit(ckpt_path=): through LightningAsyncSave from the
    2-rank ZeRO-2 files themselves (DeepSpeed's load answered from the reshard plan, no copy) it runs the same next
    steps as Lightning's stock load of `dsckpt reshard -w 1 --stage 3`'s copy."""
    pytest.importorskip("lightning")
    if not torch.cuda.is_available():
        pytest.skip("Lightning's DeepSpeedStrategy needs CUDA (run `pytest -m gpu` on a GPU host)")
    root = _lightning_ds_run(tmp_path_factory, {"CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu"}, layout="bare")
    job = str(Path(__file__).parent / "jobs" / "lightning_strategy.py")

    def fit(out, ckpt, background=False):
        env = {**os.environ, **({"DSCKPT_ASYNC": "1"} if background else {})}
        proc = subprocess.run([sys.executable, job, str(out), "3", "5", str(ckpt)], capture_output=True, text=True,
                              timeout=400, env=env)
        assert proc.returncode == 0, proc.stderr[-4000:]
        return json.loads((out / "log.json").read_text())

    proc = run_cli("reshard", root / "ds", tmp_path / "ws1", "-w", "1", "--stage", "3", "--json")
    assert proc.returncode == 0, proc.stderr
    planned, copied = fit(tmp_path / "planned", root / "ds", background=True), fit(tmp_path / "copied", tmp_path / "ws1")
    assert planned["start"] == copied["start"] == 2 and planned["end"] == copied["end"] == 5
    assert len(planned["losses"]) == len(copied["losses"]) == 3
    for a, b in zip(copied["losses"], planned["losses"]):
        assert abs(a - b) <= 1e-5 * abs(a), (copied["losses"], planned["losses"])


def test_hf_trainer_background_saves_resume(hf_reference, tmp_path):
    """HFAsyncSave: a save every step with save_total_limit=1 leaves only published checkpoints (never a
    checkpoint-N without `latest` when the Trainer looks), the losses of the reference run, and
    resume_from_checkpoint=True at 3 ranks and ZeRO-3 continues from the newest one (2 ranks, ZeRO-2) with the
    reference's next steps: no copy, DeepSpeed's load answered from the reshard plan."""
    skip_beyond_devices(3)
    ref, out = hf_reference(2, "32"), tmp_path / "out"
    env = {"DSCKPT_ASYNC_LIMIT": "1"}
    run_job("hf_resume.py", 2, out, 2, "32", MAX_STEPS, 1, env={**env, "DSCKPT_STOP_AT": str(SAVE_AT)})
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(("checkpoint-", "."))) == [f"checkpoint-{SAVE_AT}"]
    first = json.loads((out / "log.json").read_text())
    assert first["unpublished_at_save"] == []
    resumed = run_job("hf_resume.py", 3, out, 3, "32", MAX_STEPS, 1, "last", env=env)
    said = "saved at 2 ranks ZeRO-2, for 3 ranks ZeRO-3 through the reshard plan"  # (#69.9: rank 0 says it, once)
    assert resumed.stderr.count(said) == 1, resumed.stderr[-3000:]
    second = json.loads((out / "log.json").read_text())
    assert second["start_step"] == SAVE_AT and second["unpublished_at_save"] == [] and second["world_size"] == 3
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(("checkpoint-", "."))) == [f"checkpoint-{MAX_STEPS}"]
    steps = lambda log: {e["step"]: e for e in log["history"] if "loss" in e}
    reference = steps(json.loads((ref / "log.json").read_text()))
    for step, entry in {**steps(first), **steps(second)}.items():
        assert entry["learning_rate"] == reference[step]["learning_rate"], step
        assert abs(entry["loss"] - reference[step]["loss"]) <= 1e-5 * abs(entry["loss"]), step


def test_hf_trainer_best_model_checkpoint_never_points_into_a_pending_folder(tmp_path):
    """#68.9: with background saves, an evaluation at every save and load_best_model_at_end, the Trainer's
    best_model_checkpoint - in its state and in every trainer_state.json - names a published checkpoint-N (which
    rotation kept), never the pending folder; the Trainer's own load of it at the end succeeds."""
    out = tmp_path / "out"
    run_job("hf_resume.py", 2, out, 2, "32", MAX_STEPS, 1, env={"DSCKPT_ASYNC_LIMIT": "1", "DSCKPT_BEST": "1"})
    best = json.loads((out / "log.json").read_text())["best_model_checkpoint"]
    assert best is not None and Path(best).parent == out and (Path(best) / "latest").is_file(), best
    left = sorted(p for p in out.iterdir() if p.name.startswith(("checkpoint-", ".")))
    assert Path(best) in left and all(not p.name.startswith(".") for p in left), left
    for folder in left:
        named = json.loads((folder / "trainer_state.json").read_text())["best_model_checkpoint"]
        assert named is not None and ".dsckpt-pending" not in named and Path(named).is_dir(), (folder, named)


def test_accelerate_background_save_state_loads(tmp_path):
    """``dsckpt.enable_async_save(model)`` under Accelerate: ``save_state`` returns while the files are written,
    training goes on, and ``load_state`` of that folder in a new job resumes with the same next steps."""
    ref, resumed, env = tmp_path / "ref", tmp_path / "resumed", {"DSCKPT_ASYNC": "1"}
    run_job("accelerate_resume.py", 2, ref, 3, 5, 3, env=env)
    state = ref / "state"
    assert (state / "latest").read_text() == "pytorch_model" and not list(state.rglob(".dsckpt-saving"))
    run_job("accelerate_resume.py", 2, resumed, 3, 5, 3, state)
    before, after = (json.loads((d / "log.json").read_text())["log"] for d in (ref, resumed))
    assert [e["step"] for e in after] == [4, 5]
    for a, b in zip(before[3:], after):
        assert a["lr"] == b["lr"] and abs(a["loss"] - b["loss"]) <= 1e-6 * abs(a["loss"]), (a, b)
    assert run_cli("diff", state, resumed / "as_loaded", "--optimizer").returncode == 0  # masters and moments


@pytest.mark.gpu
def test_lightning_strategy_background_saves(tmp_path):
    """LightningAsyncSave with Lightning's own DeepSpeedStrategy on a GPU: a ModelCheckpoint every step with
    save_top_k=1 keeps one published checkpoint; the run's losses and a fit(ckpt_path=) resume of its save equal
    the same runs with DeepSpeed's blocking save."""
    pytest.importorskip("lightning")
    if not torch.cuda.is_available():
        pytest.skip("Lightning's DeepSpeedStrategy needs CUDA (run `pytest -m gpu` on a GPU host)")

    job = str(Path(__file__).parent / "jobs" / "lightning_strategy.py")

    def fit(out, steps, ckpt=None, background=False):
        env = {**os.environ, **({"DSCKPT_ASYNC": "1"} if background else {})}
        proc = subprocess.run([sys.executable, job, str(out), "3", str(steps), *([str(ckpt)] if ckpt else [])],
                              capture_output=True, text=True, timeout=400, env=env)
        assert proc.returncode == 0, proc.stderr[-4000:]
        return json.loads((out / "log.json").read_text())

    background, stock = fit(tmp_path / "bg", 3, background=True), fit(tmp_path / "stock", 3)
    assert len(background["every"]) == 1 and background["every_latest"] == [True], background
    assert background["losses"] == stock["losses"]
    again_bg = fit(tmp_path / "bg2", 6, tmp_path / "bg" / "ckpt", background=True)
    again_stock = fit(tmp_path / "stock2", 6, tmp_path / "stock" / "ckpt")
    assert again_bg["start"] == again_stock["start"] == 3 and again_bg["losses"] == again_stock["losses"]
