"""Hugging Face and Lightning (issue 14): checkpoints their trainers write in, files they load directly out.

* HF: Transformers' own ``Trainer`` with a DeepSpeed ZeRO-3 config on 2 CPU ranks (tests/jobs/hf_trainer.py:
  a small Llama from a config, tied embeddings, a tokenizer built in code) writes ``checkpoint-3``;
  ``consolidate --hf`` must give a folder ``from_pretrained`` loads with no key problems and the live
  model's logits.
* Lightning: its ``DeepSpeedStrategy`` needs CUDA, so its save is reproduced on CPU ranks
  (tests/jobs/lightning_deepspeed.py) with the real dict Lightning's Trainer wrote;
  ``consolidate --format lightning`` must load in ``load_from_checkpoint`` and ``Trainer.fit(ckpt_path=)``.
* ``dsckpt.load_into``: a model built on the meta device, filled tensor by tensor.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
import os

import pytest

from conftest import FIXTURES, _capabilities, run_cli, run_job

torch = pytest.importorskip("torch")


# --- Hugging Face -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_run(tmp_path_factory):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    out = tmp_path_factory.mktemp("hf_trainer")
    run_job("hf_trainer.py", 2, out, 3)
    return out


def test_hf_trainer_checkpoint_loads_with_from_pretrained(hf_run, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    proc = run_cli("consolidate", hf_run / "checkpoint-3", tmp_path / "hf", "--hf", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert all(line.startswith("note: ") for line in proc.stderr.splitlines()), proc.stderr  # no library chatter
    files = json.loads(proc.stdout)["files"]  # final paths, each of which exists
    assert all(Path(f).is_file() for f in files)
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "model.safetensors.index.json"} <= {Path(f).name for f in files}
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "float32"
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set() and info["mismatched_keys"] == set()
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied the way transformers ties them
    live = torch.load(hf_run / "live.pt", weights_only=True)
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in live["state_dict"].items())
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(input_ids=live["probe"]).logits, live["logits"])
    assert AutoTokenizer.from_pretrained(tmp_path / "hf")("w1 w2").input_ids == [5, 6]


def test_hf_bf16_export_says_bf16_in_its_config(hf_run, tmp_path):
    from transformers import AutoModelForCausalLM

    assert run_cli("consolidate", hf_run / "checkpoint-3", tmp_path / "hf16", "--hf", "--dtype", "bf16", "-q").returncode == 0
    assert json.loads((tmp_path / "hf16" / "config.json").read_text())["dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf16")
    live = torch.load(hf_run / "live.pt", weights_only=True)["state_dict"]
    assert model.dtype == torch.bfloat16
    assert all(torch.equal(model.state_dict()[k], v.to(torch.bfloat16)) for k, v in live.items())


def test_hf_export_needs_a_config(tmp_path):
    proc = run_cli("consolidate", FIXTURES / "z3_ws2_fp32", tmp_path / "hf", "--hf")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "holds no config.json; a Hugging Face folder needs the model's config" in proc.stderr
    assert "--config" in proc.stderr and not (tmp_path / "hf").exists()
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "demo", "tie_word_embeddings": False}))
    proc = run_cli("consolidate", FIXTURES / "z3_ws2_fp32", tmp_path / "hf", "--hf", "--config", config, "-q")
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "float32"
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert "head.weight" in index["weight_map"]  # the config unties the head: both names stored


def test_hf_export_refuses_a_config_of_another_model(hf_run, tmp_path):
    """A config.json that does not describe the weights would give a folder from_pretrained loads with missing
    keys: refused by name, nothing written (the Llama run of tests/jobs/hf_trainer.py)."""
    ckpt = hf_run / "checkpoint-3"
    gpt2 = tmp_path / "gpt2.json"
    gpt2.write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": 2,
                                "n_embd": 36, "n_head": 3, "vocab_size": 97, "n_positions": 32}))
    proc = run_cli("consolidate", ckpt, tmp_path / "wrong", "--hf", "--config", gpt2)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "(GPT2LMHeadModel): does not describe these weights" in proc.stderr and "missing, e.g. 'lm_head.weight'" not in proc.stderr
    assert "missing" in proc.stderr and "unexpected" in proc.stderr and not (tmp_path / "wrong").exists()
    deeper = json.loads((ckpt / "config.json").read_text())
    deeper["num_hidden_layers"] = 3  # the right architecture, one layer too many
    (tmp_path / "deeper.json").write_text(json.dumps(deeper))
    proc = run_cli("consolidate", ckpt, tmp_path / "wrong", "--hf", "--config", tmp_path / "deeper.json")
    assert proc.returncode == 2 and "missing, e.g. 'model.layers.2." in proc.stderr, proc.stderr


def test_inspect_shows_trainer_state_and_hf_folders(hf_run, tmp_path):
    report = json.loads(run_cli("inspect", hf_run / "checkpoint-3", "--json").stdout)
    state = report["trainer_state"]
    assert state["global_step"] == 3 and state["epoch"] > 0 and isinstance(state["last_loss"], float)
    human = run_cli("inspect", hf_run / "checkpoint-3").stdout
    assert "trainer state     global step 3" in human
    assert f"last logged loss {state['last_loss']:.4g}    (trainer_state.json)" in human  # as people read it
    assert ("client state" in human) == bool(report["client_state"])  # an empty section is left out
    early = tmp_path / "early"  # saved before `logging_steps` was reached: the log holds no loss
    shutil.copytree(hf_run / "checkpoint-3", early)
    trainer_state = json.loads((early / "trainer_state.json").read_text())
    trainer_state["log_history"] = [h for h in trainer_state["log_history"] if "loss" not in h]
    (early / "trainer_state.json").write_text(json.dumps(trainer_state))
    assert "last logged loss none logged yet    (trainer_state.json)" in run_cli("inspect", early).stdout
    assert run_cli("consolidate", hf_run / "checkpoint-3", tmp_path / "hf", "--hf", "-q").returncode == 0
    folder = json.loads(run_cli("inspect", tmp_path / "hf", "--json").stdout)
    assert folder["hf_config"]["model_type"] == "llama" and "tokenizer.json" in folder["hf_files"]


def test_hf_trainer_checkpoint_reshards(hf_run, tmp_path):
    """The HF Trainer's two param groups (with and without weight decay) at another world size."""
    from dsckpt.api.consolidation import load_state_dict
    from dsckpt.api.options import WriteOptions
    from dsckpt.api.resharding import reshard

    reshard(hf_run / "checkpoint-3", tmp_path / "ws3", 3, options=WriteOptions(fsync=False))
    for state in ("fp32", "exp_avg", "exp_avg_sq"):
        a, b = load_state_dict(hf_run / "checkpoint-3", state=state), load_state_dict(tmp_path / "ws3", state=state)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --- Lightning --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lightning_run(tmp_path_factory):
    L = pytest.importorskip("lightning")
    from lit_model import LitOdd, batches

    root = tmp_path_factory.mktemp("lightning")
    trainer = L.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=root)
    trainer.fit(LitOdd(lr=2e-3, note="from-lightning"), batches())
    trainer.save_checkpoint(root / "cpu.ckpt")  # Lightning's own dict: what its DeepSpeedStrategy saves as client state
    # bf16, where Lightning's own converter keeps frozen parameters 16-bit inside its "fp32" output
    precision = "bf16" if "bf16" in _capabilities() else "32"
    run_job("lightning_deepspeed.py", 2, root / "cpu.ckpt", root / "ds", 3, precision)
    return root


def test_lightning_export_loads_in_lightning(lightning_run, tmp_path):
    import lightning as L
    from lit_model import LitOdd, batches

    out = tmp_path / "model.ckpt"
    proc = run_cli("consolidate", lightning_run / "ds", out, "--format", "lightning", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["format"] == "lightning"
    raw = torch.load(out, weights_only=True)  # no class beyond torch's safe ones
    shown = json.loads(run_cli("inspect", out, "--json").stdout)["lightning"]
    assert (shown["epoch"], shown["global_step"], shown["hyper_parameters"]) == (raw["epoch"], 2, ["lr", "note"])
    assert "hparams       lr, note" in run_cli("inspect", out).stdout
    assert raw["hyper_parameters"] == {"lr": 2e-3, "note": "from-lightning"} and raw["global_step"] == 2
    assert all(not k.startswith("_forward_module.") for k in raw["state_dict"])
    model = LitOdd.load_from_checkpoint(out)
    live = torch.load(lightning_run / "ds" / "live.pt", weights_only=True)  # as trained: bf16 weights
    state = model.state_dict()
    assert state.keys() == live.keys() and all(torch.equal(state[k].to(live[k].dtype), live[k]) for k in live)
    assert model.hparams.note == "from-lightning"
    assert raw["state_dict"]["model.frozen.weight"].dtype == torch.float32  # frozen parameters in fp32 too
    assert raw["state_dict"]["model.up.weight"].dtype == torch.float32  # the fp32 masters
    trainer = L.Trainer(accelerator="cpu", max_steps=4, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(LitOdd(), batches(), ckpt_path=out)  # accepted as a weights checkpoint: steps 2 -> 4
    assert trainer.global_step == 4


def test_lightning_export_leaves_out_foreign_client_objects(lightning_run, tmp_path):
    from forge import add_client_entry

    ckpt = tmp_path / "ds"
    import shutil

    shutil.copytree(lightning_run / "ds", ckpt)
    add_client_entry(ckpt, "sampler", "custom.Sampler", {"position": 3})
    proc = run_cli("consolidate", ckpt, tmp_path / "m.ckpt", "--format", "lightning")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "client-state entry 'sampler' left out: it holds objects of custom.Sampler" in proc.stderr
    raw = torch.load(tmp_path / "m.ckpt", weights_only=True)
    assert "sampler" not in raw and raw["global_step"] == 2 and "loops" in raw


# --- load_into --------------------------------------------------------------------------------------
def test_load_into_a_meta_model_keeps_ties_and_reports_keys(lightning_run, tmp_path):
    import dsckpt
    from dsckpt.errors import StateDictMismatchError
    from odd_model import OddLM

    live = torch.load(lightning_run / "ds" / "live.pt", weights_only=True)
    live = {k.removeprefix("model."): v for k, v in live.items()}
    with torch.device("meta"):
        model = OddLM()
    report = dsckpt.load_into(model, lightning_run / "ds", strip_prefixes=("_forward_module.model.",))
    assert report.missing_keys == [] and report.unexpected_keys == [] and report.still_meta == ["scratch"]
    assert model.head.weight is model.embed.weight  # still tied after materializing
    assert model.up.weight.dtype == torch.float32  # the model's dtype, filled from the fp32 masters
    assert all(torch.equal(model.state_dict()[k].to(v.dtype), v) for k, v in live.items())
    dsckpt.consolidate(lightning_run / "ds", tmp_path / "m.safetensors", strip_prefixes=("_forward_module.model.",))
    fresh = OddLM()
    assert dsckpt.load_into(fresh, tmp_path / "m.safetensors").missing_keys == []
    assert all(torch.equal(fresh.state_dict()[k].to(v.dtype), v) for k, v in live.items())
    with pytest.raises(StateDictMismatchError, match=r"does not match the model: 2 missing keys \(weight, bias\)"):
        dsckpt.load_into(torch.nn.Linear(3, 3), tmp_path / "m.safetensors")
    lenient = dsckpt.load_into(torch.nn.Linear(3, 3), tmp_path / "m.safetensors", strict=False)
    assert lenient.missing_keys == ["weight", "bias"] and "gate" in lenient.unexpected_keys


def test_load_into_warns_of_tensors_left_on_meta(tmp_path):
    """A model with a non-persistent buffer (what HF's RoPE has: inv_freq) built on meta: load_into fills the
    parameters, and warns naming the buffer the checkpoint cannot hold (its first forward would fail)."""
    import warnings

    import torch
    from safetensors.torch import save_file

    import dsckpt
    from dsckpt.api.loading import StillMetaWarning

    class Rope(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)
            self.register_buffer("inv_freq", torch.arange(2.0), persistent=False)

    save_file({k: v.contiguous() for k, v in Rope().state_dict().items()}, tmp_path / "w.safetensors")
    with torch.device("meta"):
        model = Rope()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = dsckpt.load_into(model, tmp_path / "w.safetensors")
    assert report.still_meta == ["inv_freq"] and not model.proj.weight.is_meta
    assert [str(w.message) for w in caught if issubclass(w.category, StillMetaWarning) and "inv_freq" in str(w.message)]
