"""`dsckpt convert SRC OUT --to deepspeed` (issue 55): another system's training state as a ZeRO checkpoint.

The oracles are the programs themselves (tests/jobs/into_deepspeed.py): an FSDP2 job (the odd model: two
AdamW param groups with their own settings, a frozen layer, a tied weight, float and int buffers, sizes no
world size divides) trains and saves DCP in FSDP2's layout and torchtitan's; stock DeepSpeed loads the
converted folders at 1, 2 and 3 ranks, ZeRO-1/2/3 (and universal checkpoints made of them, at another stage), and its masters, moments, steps and group settings must
equal FSDP2's bit for bit, its next loss and next step FSDP2's.  The round trip `--to dcp` then `--to
deepspeed` is checked against `--to universal` of both, file for file.
"""
from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest

from conftest import FIXTURES, _capabilities, run_cli, run_job

torch = pytest.importorskip("torch")

WORLD_SIZES = (1, 2, 3)
STAGES = (1, 2, 3)
NEXT_LOSS_TOLERANCE = 1e-6  # the same fp32 weights; the forward's reductions run in another order at M ranks
STEP_TOLERANCE = 1e-6  # one AdamW step on gradients reduced in another order


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("into_deepspeed")
    run_job("into_deepspeed.py", 2, "fsdp2", root, timeout=400)
    for m in WORLD_SIZES:
        for s in STAGES:
            proc = run_cli("convert", root / "dcp", root / f"fsdp2_s{s}_w{m}", "--to", "deepspeed", "-w", m,
                           "--stage", s, "--model", "odd_model:build", "-q", "--no-fsync")
            assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run_cli("convert", root / "titan", root / "titan_s3_w3", "--to", "deepspeed", "-w", 3, "--stage", 3,
                   "--model", "odd_model:build", "--group-order", "up.weight,gate", "-q", "--no-fsync")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for source, stage in ((2, 3), (3, 1)):  # a universal folder of a ZeRO-2 and of a ZeRO-3 run, to the other stage
        for args in (("fsdp2_s%d_w2" % source, "universal_s%d" % source, "--to", "universal"),
                     ("universal_s%d" % source, "universal_s%d_s%d_w3" % (source, stage), "--to", "deepspeed", "-w", 3,
                      "--stage", stage)):
            proc = run_cli("convert", root / args[0], root / args[1], *args[2:], "-q", "--no-fsync")
            assert proc.returncode == 0, proc.stderr[-3000:]
    bf16 = "bf16" in _capabilities()  # (a CPU whose DeepSpeed refuses bf16 skips that case)
    if bf16:
        proc = run_cli("convert", root / "dcp", root / "bf16_s3_w2", "--to", "deepspeed", "-w", 2, "--stage", 3,
                       "--dtype", "bf16", "--model", "odd_model:build", "-q", "--no-fsync")
        assert proc.returncode == 0, proc.stderr[-3000:]
    fp16 = "16" in _capabilities()
    for stage in (2, 3) if fp16 else ():
        proc = run_cli("convert", root / "dcp", root / f"fp16_s{stage}_w2", "--to", "deepspeed", "-w", 2, "--stage",
                       stage, "--dtype", "fp16", "--model", "odd_model:build", "-q", "--no-fsync")
        assert proc.returncode == 0, proc.stderr[-3000:]
    for m in WORLD_SIZES:
        folders = [f"fsdp2_s{s}_w{m}:{s}" for s in STAGES] + (["bf16_s3_w2:3:bf16"] if bf16 and m == 2 else [])
        folders += [f"fp16_s{s}_w2:{s}:16" for s in (2, 3)] if fp16 and m == 2 else []
        folders += ["titan_s3_w3:3", "universal_s2_s3_w3:3", "universal_s3_s1_w3:1"] if m == 3 else []
        run_job("into_deepspeed.py", m, "deepspeed", root, ",".join(folders), timeout=400)
    return root


def _records(root: Path, name: str, m: int):
    load = lambda p: torch.load(p, weights_only=False)  # noqa: E731  (written by this test's own jobs)
    return load(root / "fsdp2.pt"), load(root / name / f"loaded_ws{m}.pt")


def _differ(want: dict, got: dict) -> list[str]:
    return [k for k in want if not (k in got and want[k].dtype == got[k].dtype and torch.equal(want[k], got[k]))]


CASES = [(f"fsdp2_s{s}_w{m}", m) for m in WORLD_SIZES for s in STAGES] + \
    [("titan_s3_w3", 3), ("universal_s2_s3_w3", 3), ("universal_s3_s1_w3", 3)]


@pytest.mark.parametrize("name,m", CASES)
def test_stock_deepspeed_restores_the_fsdp2_state_bit_for_bit(converted, name, m):
    source, loaded = _records(converted, name, m)
    trainable = {n for n in source["params"] if n in loaded["params"]}
    assert trainable == {"embed.weight", "up.weight", "up.bias", "norm.weight", "norm.bias", "gate"}
    assert _differ({n: source["params"][n] for n in trainable}, loaded["params"]) == []  # fp32 masters
    assert _differ(source["moments"], loaded["moments"]) == [] and len(loaded["moments"]) == 2 * len(trainable)
    assert set(loaded["steps"]) == set(source["steps"]) == {3.0} and loaded["global_steps"] == 3
    assert loaded["hyperparams"] == source["hyperparams"]  # two groups, their own settings (the job asked lr=1.0)
    assert [g["weight_decay"] for g in loaded["hyperparams"]] == [0.1, 0.0]


@pytest.mark.parametrize("name,m", CASES)
def test_the_next_step_under_deepspeed_is_the_fsdp2_jobs_next_step(converted, name, m):
    source, loaded = _records(converted, name, m)
    assert abs(loaded["next_loss"] - source["next_loss"]) <= NEXT_LOSS_TOLERANCE * source["next_loss"]
    for n, want in source["params_after"].items():
        assert torch.allclose(loaded["params_after"][n], want, rtol=0, atol=STEP_TOLERANCE), n


@pytest.mark.parametrize("name,precision,label", [("bf16_s3_w2", "bf16", "bf16"), ("fp16_s2_w2", "16", "fp16"),
                                                  ("fp16_s3_w2", "16", "fp16")])
def test_a_16_bit_engine_gets_the_fp32_state_and_a_16_bit_module(converted, name, precision, label):
    if precision not in _capabilities():
        pytest.skip(f"DeepSpeed refuses {precision} on this CPU (supported: {', '.join(_capabilities())})")
    source, loaded = _records(converted, name, 2)
    assert _differ({n: source["params"][n] for n in loaded["params"]}, loaded["params"]) == []  # fp32 masters exact
    assert _differ(source["moments"], loaded["moments"]) == []
    assert abs(loaded["next_loss"] - source["next_loss"]) <= 5e-3 * source["next_loss"]  # a bf16 forward
    from dsckpt.zero.reader import open_checkpoint

    ckpt = open_checkpoint(converted / name)
    assert ckpt.precision == label and all(f.path.name.startswith("bf16_") == (label == "bf16")
                                               for f in ckpt.optim_files)


def test_the_module_file_holds_every_key_a_strict_load_needs(converted):
    from dsckpt.zero.reader import open_checkpoint

    for stage in STAGES:
        ckpt = open_checkpoint(converted / f"fsdp2_s{stage}_w3")
        module = ckpt.model_files[0].obj["module"]
        assert set(module) == {"gate", "scale", "seen", "embed.weight", "up.weight", "up.bias", "frozen.weight",
                               "frozen.bias", "norm.weight", "norm.bias", "head.weight"}
        assert ckpt.model_files[0].obj["shared_params"] == {"head.weight": "embed.weight"}
        assert ckpt.model_files[0].obj["buffer_names"] == ["scale", "seen"] or \
            set(ckpt.model_files[0].obj["buffer_names"]) == {"scale", "seen"}
        assert ckpt.world_size == 3 and ckpt.zero_stage == stage


def test_round_trip_through_dcp_keeps_every_master_and_moment(tmp_path):
    """A ZeRO-2 fixture -> `--to dcp` -> `--to deepspeed` at 3 ranks ZeRO-3: `--to universal` of the original
    and of the round trip hold the same fp32 master, exp_avg and exp_avg_sq for every parameter (the step is
    checked by the FSDP2 tests: ds_to_universal writes step.pt for ZeRO-1/2 sources only)."""
    source = FIXTURES / "z2_ws2_fp32"
    assert run_cli("convert", source, tmp_path / "dcp", "--to", "dcp", "-q", "--no-fsync").returncode == 0
    proc = run_cli("convert", tmp_path / "dcp", tmp_path / "back", "--to", "deepspeed", "-w", 3, "--stage", 3,
                   "--model", "dsckpt.runtime.demo_model:build_small_model", "-q", "--no-fsync")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("dcp", "back"):
        ckpt = source if name == "dcp" else tmp_path / "back"
        proc = run_cli("convert", ckpt, tmp_path / f"{name}_universal", "--to", "universal", "-q", "--no-fsync")
        assert proc.returncode == 0, proc.stderr[-3000:]
    def trained(root: Path) -> dict[str, Path]:  # zero/<param>/<state>.pt of every parameter Adam holds
        return {str(p.relative_to(p.parents[2])): p for p in root.glob("*/zero/*/*.pt")
                if (p.parent / "exp_avg.pt").exists() and p.stem in ("fp32", "exp_avg", "exp_avg_sq")}
    want, got = trained(tmp_path / "dcp_universal"), trained(tmp_path / "back_universal")
    assert sorted(want) == sorted(got) and len(want) >= 3 * 16  # fp32, exp_avg, exp_avg_sq of 16 parameters
    for key in want:
        a, b = (torch.load(p[key], weights_only=True) for p in (want, got))
        a, b = (t["param"] if isinstance(t, dict) else t for t in (a, b))  # by stage: wrapped, or flat
        assert a.dtype == b.dtype == torch.float32 and torch.equal(a.reshape(-1), b.reshape(-1)), key


# --- bad input: typed errors naming the file, exit 2, nothing at OUT ---------------------------------------------
def _tiny_dcp(folder: Path, names: tuple[str, ...] = ("w", "b")) -> None:
    """A one-process DCP in FSDP2's layout: two trainable parameters, an int buffer."""
    import torch.distributed.checkpoint as dcp

    gen = torch.Generator().manual_seed(0)
    model = {"w": torch.randn(5, 3, generator=gen), "b": torch.randn(5, generator=gen), "seen": torch.arange(3)}
    state = {n: {"step": torch.tensor(2.0), "exp_avg": torch.randn(model[n].shape, generator=gen),
                 "exp_avg_sq": torch.rand(model[n].shape, generator=gen)} for n in ("w", "b")}
    groups = [{"lr": 0.1, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.0, "params": list(names)}]
    dcp.save({"model": model, "optim": {"state": state, "param_groups": groups}}, checkpoint_id=str(folder),
             no_dist=True)


def _refused(tmp_path, src: Path, *extra) -> str:
    """The refusal, the same words at 1 and 2 processes (every check runs in the shared preparation step), nothing
    left at OUT or beside it."""
    out = tmp_path / "out"
    said = []
    for nproc in (1, 2):
        proc = run_cli("convert", src, out, "--to", "deepspeed", "-w", 2, "--stage", 3, "-q", "--nproc", nproc, *extra)
        assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
        assert "Traceback" not in proc.stderr and not out.exists()
        assert not [p for p in tmp_path.iterdir() if "dsckpt-tmp" in p.name or "dsckpt-probe" in p.name]
        said.append([line for line in proc.stderr.splitlines() if line.startswith(("dsckpt: error", "hint"))])
    assert said[0] == said[1] and said[0], said
    return proc.stderr


def test_a_small_dcp_converts_without_a_model_when_nothing_is_ambiguous(tmp_path):
    _tiny_dcp(tmp_path / "dcp")
    proc = run_cli("convert", tmp_path / "dcp", tmp_path / "out", "--to", "deepspeed", "-w", 2, "--stage", 2, "-q")
    assert proc.returncode == 0, proc.stderr
    from dsckpt.zero.reader import open_checkpoint

    ckpt = open_checkpoint(tmp_path / "out")
    assert ckpt.model_files[0].obj["buffer_names"] == ["seen"] and ckpt.world_size == 2


def test_a_truncated_data_file_is_named(tmp_path):
    _tiny_dcp(tmp_path / "dcp")
    data = max((tmp_path / "dcp").glob("*.distcp"), key=lambda p: p.stat().st_size)
    os.truncate(data, data.stat().st_size // 2)
    assert data.name in _refused(tmp_path, tmp_path / "dcp")


def test_metadata_describing_a_missing_file_is_named(tmp_path):
    _tiny_dcp(tmp_path / "dcp")
    for data in (tmp_path / "dcp").glob("*.distcp"):
        data.unlink()
    assert "missing" in _refused(tmp_path, tmp_path / "dcp")


def test_groups_naming_a_parameter_the_weights_lack_are_refused(tmp_path):
    _tiny_dcp(tmp_path / "dcp", names=("w", "b", "ghost"))
    err = _refused(tmp_path, tmp_path / "dcp")
    assert "ghost" in err and ".metadata" in err


def test_a_metadata_pickle_runs_no_code(tmp_path):
    _tiny_dcp(tmp_path / "dcp")
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))
    (tmp_path / "dcp" / ".metadata").write_bytes(pickle.dumps(Payload(), protocol=2))
    assert ".metadata" in _refused(tmp_path, tmp_path / "dcp")
    assert not marker.exists()


def test_torchtitan_groups_are_taken_in_model_order_and_a_job_listing_them_otherwise_fails_loudly(converted, tmp_path):
    """#69.5: torchtitan records no group order; without --group-order the groups come in model order (each one's
    first parameter's place), said in a note.  The fixture's job lists its decay group first while the model's
    first parameter (``gate``) is in the other: stock DeepSpeed's load of that copy fails on the partition sizes,
    never loading one group's state into the other.  Groups of equal partition sizes are refused instead."""
    out = tmp_path / "model_order"
    proc = run_cli("convert", converted / "titan", out, "--to", "deepspeed", "-w", 3, "--stage", 3,
                   "--model", "odd_model:build", "--no-fsync", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    notes = json.loads(proc.stdout)["notes"]
    assert any("2 param groups by their settings, taken in model order (gate, embed.weight first)" in n for n in notes)
    with pytest.raises(AssertionError, match="size"):
        run_job("into_deepspeed.py", 3, "deepspeed", tmp_path, "model_order:3", timeout=200)
    err = _refused(tmp_path, converted / "titan", "--model", "odd_model:build", "--group-order", "up.weight,scale")
    assert "scale" in err


def test_torchtitan_groups_of_equal_partition_sizes_need_their_order():
    """A guessed order DeepSpeed's load could not catch (every rank's partitions the same size) is refused."""
    from dsckpt.errors import ConfigError
    from dsckpt.plan.into_deepspeed import DeepSpeedLayout, _require_telling_sizes
    from dsckpt.zero.partitioning import stage3_group, stage12_group

    for stage, layout in ((3, stage3_group), (2, stage12_group)):
        target = DeepSpeedLayout(world_size=3, stage=stage, dtype="F32", tag="global_step1")
        _require_telling_sizes([layout([10, 4], 3), layout([30], 3)], target, Path("titan"))  # told apart
        with pytest.raises(ConfigError, match="the other way round"):
            _require_telling_sizes([layout([6, 6], 3), layout([12], 3)], target, Path("titan"))


def test_floating_entries_no_optimizer_holds_need_the_model(converted, tmp_path):
    err = _refused(tmp_path, converted / "dcp")
    assert "--model" in err and "frozen.weight" in err


# --- a Hugging Face folder: weights, a fresh optimizer, the HF Trainer's resume ----------------------------------
@pytest.mark.runtime  # (two Trainer runs in subprocesses, ~40 s: make test's, not test-fast's)
def test_an_hf_folder_resumes_in_the_hf_trainer_as_a_run_started_from_it(tmp_path):
    """save_pretrained weights -> a 2-rank ZeRO-3 checkpoint-like folder -> Transformers' Trainer (its model built
    with other weights) resumes from it; its losses and learning rates equal a Trainer run that started from the
    same weights with from_pretrained (warmup: the first step's lr is 0, the peak the scheduler's base)."""
    import json
    import subprocess
    import sys

    from conftest import PYTHONPATH, ROOT

    script = ("import torch, sys; sys.path.insert(0, 'tests/jobs'); from hf_trainer import model_config; "
              "from transformers import LlamaForCausalLM; torch.manual_seed(5); "
              f"LlamaForCausalLM(model_config()).save_pretrained({str(tmp_path / 'w5')!r})")
    subprocess.run([sys.executable, "-c", script], check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": PYTHONPATH},
                   capture_output=True)
    proc = run_cli("convert", tmp_path / "w5", tmp_path / "converted", "--to", "deepspeed", "-w", 2, "--stage", 3,
                   "--group-settings", '{"lr": 0.0, "initial_lr": 3e-3}',
                   "--trainer-state", '{"logging_steps": 1, "save_steps": 100, "train_batch_size": 3}', "-q")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Adam's moments zero, step 0" in proc.stderr
    run_job("hf_resume.py", 2, tmp_path / "resumed", 3, "32", 3, 100, tmp_path / "converted")
    run_job("hf_resume.py", 2, tmp_path / "reference", 3, "32", 3, 100, env={"DSCKPT_INIT_FROM": str(tmp_path / "w5")})
    logs = [json.loads((tmp_path / run / "log.json").read_text())["history"] for run in ("resumed", "reference")]
    steps = [[(h["loss"], h["learning_rate"]) for h in log if "loss" in h] for log in logs]
    assert len(steps[0]) == 3 and [lr for _, lr in steps[0]] == [0.0, 3e-3, 1.5e-3]
    for (got, got_lr), (want, want_lr) in zip(*steps):
        assert got_lr == want_lr and abs(got - want) <= 1e-6 * want, steps


def test_a_weights_file_needs_the_groups(tmp_path):
    from safetensors.torch import save_file

    save_file({"w": torch.ones(3, 2)}, tmp_path / "model.safetensors")
    err = _refused(tmp_path, tmp_path / "model.safetensors")
    assert "--group-settings" in err and "model.safetensors" in err


def test_two_processes_write_the_bytes_one_does(converted, tmp_path):
    for nproc in (1, 2):
        proc = run_cli("convert", converted / "dcp", tmp_path / f"n{nproc}", "--to", "deepspeed", "-w", 3, "--stage",
                       2, "--model", "odd_model:build", "--nproc", nproc, "-q", "--no-fsync")
        assert proc.returncode == 0, proc.stderr[-3000:]
    files = lambda root: sorted(p.relative_to(root) for p in root.rglob("*") if p.is_file())  # noqa: E731
    assert files(tmp_path / "n1") == files(tmp_path / "n2") and len(files(tmp_path / "n1")) == 5
    for rel in files(tmp_path / "n1"):
        assert (tmp_path / "n1" / rel).read_bytes() == (tmp_path / "n2" / rel).read_bytes(), rel


def test_a_pt_state_dict_becomes_masters_in_model_order(tmp_path):
    """A plain ``torch.save(model.state_dict())``: the masters are its weights (consolidate gives them back), the
    flat order the model's (never the file's), one group, Adam's state fresh."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent / "models"))
    from odd_model import build

    torch.manual_seed(3)
    model = build()
    torch.save(model.state_dict(), tmp_path / "odd.pt")
    proc = run_cli("convert", tmp_path / "odd.pt", tmp_path / "out", "--to", "deepspeed", "-w", 3, "--stage", 3,
                   "--model", "odd_model:build", "--group-settings", '{"lr": 1e-3, "weight_decay": 0.1}',
                   "--groups", "one", "-q")
    assert proc.returncode == 0, proc.stderr
    from dsckpt.zero.reader import open_checkpoint

    ckpt = open_checkpoint(tmp_path / "out")
    assert [list(g) for g in ckpt.param_groups] == [[n for n, p in model.named_parameters() if p.requires_grad]]
    assert run_cli("consolidate", tmp_path / "out", tmp_path / "out.pt", "--duplicate-tied", "-q").returncode == 0
    got = torch.load(tmp_path / "out.pt", weights_only=True)
    want = model.state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    from dsckpt.plan.training_state import build_training_state

    state = build_training_state(ckpt)
    assert [g.settings["weight_decay"] for g in state.groups] == [0.1] and state.groups[0].settings["lr"] == 1e-3


def test_an_item_holding_other_than_the_metadata_says_is_named(tmp_path):
    """An item archive whose tensor is not the chunk the metadata describes (shape or dtype): a typed error naming
    the data file, before a byte is written."""
    from dataclasses import replace

    from dsckpt.errors import CorruptFileError
    from dsckpt.formats.dcp import read_index, tensor_ranges

    _tiny_dcp(tmp_path / "dcp")
    index = read_index(tmp_path / "dcp")
    good = index.tensors["model.w"]
    assert len(tensor_ranges(good)) == 1
    for forged in (replace(good, dtype="BF16"),
                   replace(good, shape=(4, 3), chunks=(replace(good.chunks[0], sizes=(4, 3)),))):
        with pytest.raises(CorruptFileError, match=good.chunks[0].file.name):
            tensor_ranges(forged)
    with pytest.raises(CorruptFileError, match="rows"):
        tensor_ranges(replace(good, shape=(6, 3)))  # chunks that leave a row uncovered


def test_a_universal_sources_client_state_is_carried(tmp_path):
    """The client state a universal checkpoint keeps beside DeepSpeed's keys (a trainer's counters, RNG states, a
    user's tensors) is in every model file of the ZeRO checkpoint, as DeepSpeed's save_checkpoint puts it."""
    from conftest import tree_differences
    from dsckpt.zero.reader import open_checkpoint

    source = FIXTURES / "z2_ws2_fp32"
    for args in ((source, tmp_path / "u", "--to", "universal"), (tmp_path / "u", tmp_path / "z3", "--to", "deepspeed",
                                                                "-w", 3, "--stage", 3)):
        proc = run_cli("convert", *args, "-q", "--no-fsync")
        assert proc.returncode == 0, proc.stderr
    want = open_checkpoint(source).client_state
    assert {"user", "rng", "global_step"} <= set(want)
    out = open_checkpoint(tmp_path / "z3")
    for f in out.model_files:  # every rank's, at ZeRO-3
        got = {k: v for k, v in f.obj.items() if k in want}
        assert tree_differences(want, got, "client") == [], f.path


def test_the_training_step_is_the_one_the_run_recorded(converted, tmp_path):
    """#69.9: a DCP folder with dsckpt's client state beside it (what `convert --to dcp` writes) is at the training
    step that records, not the optimizer's (which restarts at a full-weights resume): tag and global_steps say 77."""
    import shutil

    from dsckpt.zero.reader import open_checkpoint

    source = tmp_path / "dcp"
    shutil.copytree(converted / "dcp", source)
    (source / "client_state.json").write_text(json.dumps({"format": "dsckpt.client_state/1", "weights": ".",
                                                           "client_state": {"global_step": 77, "epoch": 3}}))
    proc = run_cli("convert", source, tmp_path / "out", "--to", "deepspeed", "-w", 1, "--stage", 2,
                   "--model", "odd_model:build", "--no-fsync")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "training step 77, as client_state.json records it" in proc.stderr
    assert "(DeepSpeed ZeRO-2 at 1 rank, tag global_step77, from FSDP2's DCP at step 77" in proc.stdout, proc.stdout
    ckpt = open_checkpoint(tmp_path / "out")
    assert ckpt.layout.tag == "global_step77" and ckpt.global_steps == 77


def test_inspect_summarizes_a_dcp_folder_before_converting(converted):
    """#69.7: `dsckpt inspect` of the DCP folders `convert --to deepspeed` reads: layout, the processes that saved
    it, step, the param groups and their settings, the entries no optimizer holds and what they will need."""
    proc = run_cli("inspect", converted / "dcp", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["format"] == "dcp (fsdp2)" and doc["world_size"] == 2 and doc["step"] > 0
    assert [g["settings"]["weight_decay"] for g in doc["param_groups"]] == [0.1, 0.0]
    assert "frozen.weight" in doc["untrained"] and any("--model" in n for n in doc["notes"])
    assert doc["bytes"] == sum(f.stat().st_size for f in (converted / "dcp").iterdir() if f.is_file())
    titan = run_cli("inspect", converted / "titan")
    assert titan.returncode == 0 and "torchtitan layout" in titan.stdout and "--group-order" in titan.stdout
    assert run_cli("inspect", converted / "dcp", "--stats").returncode == 2
