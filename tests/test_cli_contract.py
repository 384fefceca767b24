"""The command-line contract (issue 22): outputs never destroy what dsckpt did not write, nothing it
writes carries pickle code, names mean what they say, --json tells the truth, options are validated,
interrupts and unwritable places end cleanly, and the defaults are quiet.

Real fixtures and real runs throughout; hostile inputs are planted with tests/forge.py.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import FIXTURES, PYTHONPATH, ROOT, run_cli
from forge import Call, save_forged
from test_hostile import clean_error, copy_fixture

SMALL = ("--model", "dsckpt.runtime.demo_model:build_small_model")


def foreign_repo(path: Path) -> dict[str, bytes]:
    """A clone of a model repo: files dsckpt did not write, which must survive any --force."""
    (path / ".git").mkdir(parents=True)
    files = {".git/HEAD": b"ref: refs/heads/main\n", "README.md": b"# my model\n", "LICENSE": b"MIT\n"}
    for name, data in files.items():
        (path / name).write_bytes(data)
    return files


def still_there(path: Path, files: dict[str, bytes]) -> bool:
    return all((path / name).read_bytes() == data for name, data in files.items())


# -- data loss ----------------------------------------------------------------------------------
def test_force_into_a_model_repo_replaces_only_what_dsckpt_writes(tmp_path):
    ckpt = copy_fixture(tmp_path, "z2_ws2_fp32")
    (ckpt / "config.json").write_text('{"model_type": "custom", "tie_word_embeddings": true}')
    repo = tmp_path / "myrepo"
    files = foreign_repo(repo)
    clean_error(run_cli("consolidate", ckpt, repo, "--hf"), "already exists", "--force")
    assert sorted(os.listdir(repo)) == [".git", "LICENSE", "README.md"]

    proc = run_cli("consolidate", ckpt, repo, "--hf", "--force", "--max-shard-size", "8KB", "--json")
    assert proc.returncode == 0, proc.stderr
    first = json.loads(proc.stdout)["files"]
    assert still_there(repo, files) and len([f for f in first if "-of-" in f]) > 1

    # again with one shard: the shards the old index named go (they were the output), nothing else does
    proc = run_cli("consolidate", ckpt, repo, "--hf", "--force", "--json")
    assert proc.returncode == 0, proc.stderr
    second = json.loads(proc.stdout)["files"]
    assert still_there(repo, files) and all(Path(f).exists() for f in second)
    assert not any(Path(f).exists() for f in first if f not in second)
    assert sorted(os.listdir(repo)) == sorted([".git", "LICENSE", "README.md"] + [Path(f).name for f in second
                                                                                   if Path(f).parent == repo])

    # a weights file from_pretrained would read instead of ours is named, never deleted
    (repo / "model.safetensors").write_bytes(b"someone else's")
    clean_error(run_cli("consolidate", ckpt, repo, "--hf", "--force"), "model.safetensors",
                "which from_pretrained would load instead")
    assert (repo / "model.safetensors").read_bytes() == b"someone else's" and still_there(repo, files)


def test_reshard_force_keeps_other_tags_and_files(tmp_path):
    out = tmp_path / "moved"
    files = foreign_repo(out)
    shutil.copytree(FIXTURES / "z1_ws2_fp32" / "step3", out / "older_tag")
    proc = run_cli("reshard", FIXTURES / "z2_ws2_fp32", out, "-w", "3", "--force", "--json")
    assert proc.returncode == 0, proc.stderr
    assert still_there(out, files) and (out / "older_tag").is_dir()
    assert all(Path(f).is_file() for f in json.loads(proc.stdout)["files"])
    report = json.loads(run_cli("inspect", out, "--json").stdout)
    assert report["world_size"] == 3 and report["tag"] == "step3" and report["problems"] == []


# -- nothing written carries pickle code ----------------------------------------------------------
def _plant(root: Path, pattern: str, key: str, value) -> None:
    path = next((root / "step3").glob(pattern))
    obj = torch.load(path, weights_only=False)  # our own trusted fixture
    obj[key] = value
    save_forged(obj, path)


def test_resharded_hostile_checkpoint_runs_no_code_when_deepspeed_loads_it(tmp_path):
    marker = tmp_path / "pwned"
    root = copy_fixture(tmp_path, "z2_ws2_fp32")
    _plant(root, "mp_rank_00_model_states.pt", "evil", Call(os.system, f"touch {marker}"))
    proc = run_cli("reshard", root, tmp_path / "out", "-w", "3", "--json")
    assert proc.returncode == 0, proc.stderr
    assert "client-state entry 'evil' left out: it holds objects of posix.system" in proc.stderr
    assert json.loads(proc.stdout)["notes"]
    for path in sorted((tmp_path / "out" / "step3").glob("*.pt")):
        obj = torch.load(path, weights_only=False)  # what DeepSpeed's TorchCheckpointEngine.load does
        assert "evil" not in obj
    assert not marker.exists()
    kept = torch.load(tmp_path / "out" / "step3" / "mp_rank_00_model_states.pt", weights_only=True)
    assert kept["global_step"] == 3 and "rng" in kept  # the rest of the client state is carried

    # --trust-checkpoint keeps it as recorded, and says so
    proc = run_cli("reshard", root, tmp_path / "trusted", "-w", "3", "--trust-checkpoint")
    assert proc.returncode == 0 and "--trust-checkpoint: objects of posix.system copied as recorded" in proc.stderr
    assert not marker.exists()  # dsckpt itself still ran nothing

    # a foreign class inside an optimizer file cannot be left out: refused by name
    _plant(root, "zero_pp_rank_0_*optim_states.pt", "custom", Call(os.system, f"touch {marker}"))
    clean_error(run_cli("reshard", root, tmp_path / "refused", "-w", "3"), "optim_states.pt", "posix.system",
                "--trust-checkpoint")
    assert not (tmp_path / "refused").exists() and not marker.exists()


def test_the_pickle_writer_itself_refuses_foreign_classes(tmp_path):
    """Under every writer's own filtering, the one pickle writer refuses what would run code when loaded."""
    from dsckpt.formats.pickle_policy import opaque_type
    from dsckpt.formats.pickle_writer import dumps

    scaler = opaque_type("deepspeed.runtime.fp16.loss_scaler", "LossScaler")(1.0)
    assert dumps({"scaler": scaler})[0]  # DeepSpeed's own records are written
    with pytest.raises(ValueError, match="an object of posix.system would be written"):
        dumps({"x": [opaque_type("posix", "system")("id")]})
    assert dumps({"x": opaque_type("posix", "system")("id")}, allow_foreign=True)[0]


def test_reshard_of_an_unwritable_integer_is_a_typed_error(tmp_path):
    root = copy_fixture(tmp_path, "z3_ws2_fp32")
    _plant(root, "zero_pp_rank_0_*model_states.pt", "huge", 1 << 16609)  # torch.save writes it (LONG4); torch's
    # weights_only loader reads only LONG1 (255 bytes), so writing it back would make an unloadable file
    clean_error(run_cli("reshard", root, tmp_path / "out", "-w", "3"), "16610 bits", "model_states.pt")
    assert not (tmp_path / "out").exists()


def test_links_out_of_the_checkpoint_are_not_copied_into_outputs(tmp_path):
    root = copy_fixture(tmp_path, "z3_ws2_fp32")
    shutil.move(root / "step3", tmp_path / "elsewhere")
    (root / "step3").symlink_to(tmp_path / "elsewhere")
    for args in (("consolidate", root, tmp_path / "m.safetensors"), ("reshard", root, tmp_path / "r", "-w", "3")):
        clean_error(run_cli(*args), "a symlink leading outside the checkpoint", "--trust-checkpoint")
        assert run_cli(*args, "--trust-checkpoint", "-q").returncode == 0
    assert "followed" in run_cli("inspect", root).stdout  # a look is fine: nothing is copied

    hf = copy_fixture(tmp_path, "z2_ws2_fp32")
    (hf / "config.json").write_text('{"model_type": "custom"}')
    secret = tmp_path / "secret.txt"
    secret.write_text("not for publishing")
    (hf / "tokenizer.json").symlink_to(secret)
    clean_error(run_cli("consolidate", hf, tmp_path / "export", "--hf"), "tokenizer.json", "outside the checkpoint")
    assert not (tmp_path / "export").exists()


# -- names --------------------------------------------------------------------------------------
@pytest.mark.parametrize("out,args,fragment", [
    ("lt.safetensors", ("--format", "lightning"), "the suffix of safetensors files"),
    ("m.ckpt", ("--format", "torch"), "the suffix of lightning files"),
    ("m.pt", ("--format", "safetensors"), "the suffix of torch files"),
    ("m.safetensors", ("--format", "sharded"), "a file suffix, but sharded writes a folder"),
    ("m.bin", ("--hf",), "a file suffix, but hf writes a folder"),
])
def test_a_suffix_that_contradicts_the_format_is_refused(tmp_path, out, args, fragment):
    clean_error(run_cli("consolidate", FIXTURES / "z2_ws2_fp32", tmp_path / out, *args), fragment)
    assert os.listdir(tmp_path) == []


def test_names_people_use(tmp_path):
    ckpt = copy_fixture(tmp_path, "z2_ws2_fp32")
    (ckpt / "config.json").write_text('{"model_type": "custom"}')
    for name, args, form in (("Qwen2.5-0.5B-sft", ("--hf",), "hf"), ("gpt2-v1.5", ("--format", "sharded"), "sharded"),
                             ("plain-v2.0", (), "sharded"), ("model.SAFETENSORS", (), "safetensors"),
                             ("weights.PT", (), "torch"), ("lt.pt", ("--format", "lightning"), "lightning")):
        proc = run_cli("consolidate", ckpt, tmp_path / name, *args, "--json")
        assert proc.returncode == 0, (name, proc.stderr)
        assert json.loads(proc.stdout)["format"] == form, name
        assert (tmp_path / name).is_dir() == (form in ("hf", "sharded"))
    proc = run_cli("consolidate", ckpt, f"{tmp_path / 'looks.safetensors'}/", "--json")  # a trailing slash: a folder
    assert proc.returncode == 0 and json.loads(proc.stdout)["format"] == "sharded"
    assert json.loads(run_cli("inspect", tmp_path / "model.SAFETENSORS", "--json").stdout)["kind"] == "safetensors"


# -- --json -------------------------------------------------------------------------------------
def test_every_json_document_has_a_schema_and_true_paths(tmp_path):
    src = FIXTURES / "z2_ws2_fp32"
    docs = {}
    for name, args in {"consolidate": ("consolidate", src, tmp_path / "m.safetensors"),
                       "sharded": ("consolidate", src, tmp_path / "sharded", "--max-shard-size", "8KB"),
                       "reshard": ("reshard", src, tmp_path / "ws3", "-w", "3"),
                       "convert": ("convert", src, tmp_path / "universal", "--to", "universal"),
                       "inspect": ("inspect", src), "stats": ("inspect", src, "--stats"),
                       "diff": ("diff", src, tmp_path / "m.safetensors"), "check-finite": ("check-finite", src)}.items():
        proc = run_cli(*args, "--json")
        assert proc.returncode == 0, (name, proc.stderr)
        docs[name] = json.loads(proc.stdout)
        assert docs[name]["schema"] == 2, name
    for name in ("consolidate", "sharded", "reshard", "convert"):
        assert all(Path(f).is_file() and ".dsckpt-tmp-" not in f for f in docs[name]["files"]), name
    assert str(tmp_path / "sharded" / "model.safetensors.index.json") in docs["sharded"]["files"]
    assert str(tmp_path / "m.safetensors.client_state.json") in docs["consolidate"]["files"]
    # one name and one shape per concept (docs/cli.md, schema 2)
    docs["inspect file"] = json.loads(run_cli("inspect", tmp_path / "m.safetensors", "--json").stdout)
    for name, doc in docs.items():
        assert not {"stage", "source_stage", "form", "tensor_count", "nbytes", "path", "sidecar"} & set(doc), name
        assert isinstance(doc.get("tensors", 0), int) and all(isinstance(f, str) for f in doc.get("files", [])), name
        if name not in ("diff",):
            assert doc["input"] in (str(src), str(tmp_path / "m.safetensors")), name
    for name in ("consolidate", "reshard", "convert", "inspect", "stats", "check-finite"):
        assert docs[name]["tag"] == "step3", name
    assert (docs["diff"]["tag_a"], docs["diff"]["tag_b"]) == ("step3", None)
    assert docs["reshard"]["zero_stage"] == docs["convert"]["zero_stage"] == docs["inspect"]["zero_stage"] == 2
    assert set(docs["inspect file"]["dtypes"]) == {"fp32", "int64"} and docs["inspect"]["dtype"] == "fp32"
    assert {s["dtype"] for s in docs["stats"]["stats"]} <= {"fp32", "int64"}

    proc = run_cli("consolidate", tmp_path / "missing", tmp_path / "x.safetensors", "--json")
    assert proc.returncode == 2 and "dsckpt: error:" in proc.stderr
    assert json.loads(proc.stdout) == {"schema": 2, "error": f"{tmp_path / 'missing'}: no such file or directory",
                                       "hint": None, "exit": 2}
    usage = json.loads(run_cli("reshard", src, "--json").stdout)
    assert usage["exit"] == 2 and "OUT_DIR" in usage["error"] and usage["hint"]


# -- validated options ----------------------------------------------------------------------------
@pytest.mark.parametrize("args,fragment", [
    (("train", "--nproc", "0"), "--nproc"),
    (("train", "--steps", "-3"), "--steps"),
    (("train", "--precision", "fp8"), "'fp8' is not a precision; use fp32 (or 32, float32), bf16 (bfloat16) or fp16"),
    (("inspect", FIXTURES / "z2_ws2_fp32", "--plot", "x.png"), "--plot work on the values: add --stats"),
    (("inspect", FIXTURES / "z2_ws2_fp32", "--top", "3"), "--top work on the values"),
    (("inspect", FIXTURES / "z2_ws2_fp32", "--optimizer"), "--optimizer work on the values"),
    (("consolidate", FIXTURES / "z2_ws2_fp32", "m.safetensors", "--config", "c.json"), "--config is the model config"),
    (("consolidate", FIXTURES / "z2_ws2_fp32", "m.safetensors", "--dtype", "int8"), "'int8' is not a precision"),
    (("reshard", FIXTURES / "z2_ws2_fp32", "out", "-w", "0"), "--world-size"),
    (("check-finite", FIXTURES / "z0_ws1_fp32", "--optimizer"), "ZeRO-0 checkpoint"),
    (("consolidat", FIXTURES / "z2_ws2_fp32", "m.pt"), "No such command 'consolidat'. Did you mean 'consolidate'?"),
    (("xyzzy",), "No such command 'xyzzy'."),
])
def test_options_are_validated(args, fragment):
    clean_error(run_cli(*args), fragment)


def test_optimizer_against_a_weights_file_is_refused_and_precisions_have_one_vocabulary(tmp_path):
    src = FIXTURES / "z2_ws2_fp32"
    assert run_cli("consolidate", src, tmp_path / "m.safetensors", "-q").returncode == 0
    clean_error(run_cli("diff", src, tmp_path / "m.safetensors", "--optimizer"), "holds weights only")
    for word, dtype in (("bfloat16", "bf16"), ("16", "fp16"), ("float32", "fp32")):
        proc = run_cli("consolidate", src, tmp_path / f"{word}.safetensors", "--dtype", word, "--json")
        assert proc.returncode == 0, proc.stderr
        assert json.loads(run_cli("inspect", tmp_path / f"{word}.safetensors", "--json").stdout)["dtypes"].get(dtype)


@pytest.mark.runtime  # (its resume run imports DeepSpeed)
# -- unwritable and interrupted runs ---------------------------------------------------------------
def test_unwritable_save_dir_is_refused_before_any_rank_starts(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    started = time.monotonic()
    proc = run_cli("train", "--nproc", "2", "--steps", "1", *SMALL, "--save-dir", blocker / "ckpt")
    clean_error(proc, f"{blocker / 'ckpt'}: cannot save checkpoints there")
    assert "trained" not in proc.stdout and time.monotonic() - started < 60


@pytest.mark.runtime
def test_ctrl_c_during_a_two_rank_train(tmp_path):
    save = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "dsckpt", "train", "--stage", "3", "--nproc", "2", *SMALL,
                             "--steps", "1000000", "--save-every", "2", "--save-dir", str(save)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": PYTHONPATH})
    try:
        deadline = time.monotonic() + 180
        while not (save / "latest").exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        time.sleep(1.5)  # mid-run, saves under way
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: every process of the group
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err[-3000:]
    assert err.count("Aborted.") == 1 and "Traceback" not in err and "terminate called" not in err, err[-3000:]
    assert "\r" not in err and "\n\n" not in err and err.endswith("\nAborted.\n") and out == "", repr(err[-3000:])
    assert not [p for p in os.listdir(save) if "dsckpt-partial" in p]
    report = json.loads(run_cli("inspect", save, "--json").stdout)  # the last published checkpoint is whole
    assert report["problems"] == [] and report["tag"] == (save / "latest").read_text()
    assert run_cli("consolidate", save, tmp_path / "m.safetensors", "-q").returncode == 0


RANK_INTERRUPTED_IN_A_DEL = """
import os, signal
import click
from dsckpt.cli import app

class Collected:
    def __del__(self):  # a signal handler that runs in here raises into "Exception ignored"
        os.kill(os.getpid(), signal.SIGINT)
        sum(range(100000))

@app.cli.command("broken-collective")
def broken_collective():
    Collected()
    raise RuntimeError("gloo: Connection reset by peer")  # the peer that saw the SIGINT first has gone

app.main(["broken-collective"])
"""


def test_a_rank_whose_sigint_lands_in_a_finalizer_still_ends_as_interrupted(tmp_path):
    """CI saw it: a rank's handler ran inside a collected ``Popen.__del__``, then gloo's error surfaced as a
    traceback."""
    env = {**os.environ, "PYTHONPATH": PYTHONPATH, "LOCAL_RANK": "1", "DSCKPT_ERROR_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", RANK_INTERRUPTED_IN_A_DEL], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=60)
    assert proc.returncode == 130 and proc.stderr == "" and proc.stdout == "", proc.stderr


# -- quiet by default, and the small things ----------------------------------------------------------
def test_a_training_run_is_quiet_and_writes_beside_foreign_files(trained_z3):
    err = (trained_z3 / "train.err").read_text()
    assert "UserWarning" not in err and "built successfully" not in err and "\r" not in err, err
    assert err.count("note: ") == 1 and "is a ZeRO-3 checkpoint sharded over 2 ranks" in err
    assert (trained_z3 / "ckpt" / "README.md").read_text() == "kept\n"
    assert "trained 6 steps" in (trained_z3 / "train.out").read_text()


def test_help_and_small_things(tmp_path):
    bare = run_cli()
    assert bare.returncode == 0 and "Commands:" in bare.stdout and "error" not in bare.stderr
    top = run_cli("--help").stdout
    assert "Train a model with DeepSpeed and save sharded checkpoints with client state." in " ".join(top.split())
    assert "additional, not a target step" in " ".join(run_cli("resume", "--help").stdout.split())

    spaced = tmp_path / "my runs"
    spaced.mkdir()
    shutil.copytree(FIXTURES / "z2_ws2_fp32", spaced / "checkpoint-3")
    proc = run_cli("inspect", spaced)
    assert f"'{spaced / 'checkpoint-3'}'" in proc.stderr  # a hint to copy and paste

    long_name = "model.layers.0.self_attn.rotary_embedding.inv_freq_with_a_really_long_suffix"
    from safetensors.torch import save_file

    save_file({long_name: torch.zeros(3), "b": torch.zeros(2, 2)}, tmp_path / "long.safetensors")
    row = next(line for line in run_cli("inspect", tmp_path / "long.safetensors", "--tensors").stdout.splitlines()
               if long_name in line)
    assert f"{long_name}  fp32" in row


def test_shell_completion_works():
    proc = subprocess.run([sys.executable, "-m", "dsckpt"], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "_DSCKPT_COMPLETE": "bash_source", "PYTHONPATH": PYTHONPATH})
    assert proc.returncode == 0 and "_dsckpt_completion" in proc.stdout
    assert "_DSCKPT_COMPLETE=bash_source dsckpt" in (ROOT / "README.md").read_text()

    def completions(*words: str) -> list[str]:  # what bash gets for the last word (each command imported lazily)
        proc = subprocess.run([sys.executable, "-m", "dsckpt"], capture_output=True, text=True, cwd=ROOT, env={
            **os.environ, "_DSCKPT_COMPLETE": "bash_complete", "PYTHONPATH": PYTHONPATH,
            "COMP_WORDS": " ".join(("dsckpt",) + words), "COMP_CWORD": str(len(words))})
        assert proc.returncode == 0, proc.stderr
        return [line.split(",", 1)[1] for line in proc.stdout.splitlines() if line]

    assert completions("con") == ["consolidate", "convert"]
    assert completions("consolidate", "--no") == ["--no-client-state", "--no-fsync"]
    assert "safetensors" in completions("consolidate", "a", "b", "--format", "''")
    assert completions("consolidate", "a", "b", "--dtype", "b") == ["bf16"]
    assert completions("convert", "a", "b", "--to", "''") == ["universal", "dcp", "deepspeed"]
    fixture = str(FIXTURES / "z3_ws2_fp32")
    for command in ("consolidate", "reshard", "convert", "inspect", "verify", "check-finite", "resume"):
        before = ("out",) if command in ("consolidate", "reshard", "convert") else ()
        assert completions(command, fixture, *before, "--tag", "st") == ["step3"], command
    assert completions("diff", fixture, fixture, "--tag-b", "''") == ["step3"]
    assert completions("inspect", "s3://bucket/run", "--tag", "''") == []  # completion never reaches a store


# -- names and hints (#43) -------------------------------------------------------------------------
@pytest.mark.parametrize("name, meant", [("model.safetensor", "model.safetensors"), ("model.savetensors", "model.safetensors"),
                                         ("model.safetensors.tmp", "model.safetensors"), ("model.ptt", "model.pt")])
def test_a_suffix_one_or_two_edits_from_a_format_is_a_question_not_a_folder(tmp_path, name, meant):
    proc = run_cli("consolidate", FIXTURES / "z2_ws2_fp32", tmp_path / name)
    clean_error(proc, f"did you mean {meant}?")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["model.gguf", "weights.ONNX", "state.pkl"])
def test_another_tools_file_suffix_is_refused_not_made_a_folder(tmp_path, name):
    """`consolidate ckpt model.gguf` wrote a folder of safetensors shards named model.gguf."""
    proc = run_cli("consolidate", FIXTURES / "z2_ws2_fp32", tmp_path / name)
    clean_error(proc, "a file format dsckpt does not write (it writes .bin, ")
    assert "end it with / for a sharded folder" in proc.stderr and list(tmp_path.iterdir()) == []
    proc = run_cli("consolidate", FIXTURES / "z2_ws2_fp32", f"{tmp_path / name}/", "--json")  # asked for a folder
    assert proc.returncode == 0 and json.loads(proc.stdout)["format"] == "sharded", proc.stderr


def test_names_far_from_every_suffix_stay_folders(tmp_path):
    for name in ("Qwen2.5-0.5B-sft", "run.v2"):
        proc = run_cli("consolidate", FIXTURES / "z2_ws2_fp32", tmp_path / name, "--json")
        assert proc.returncode == 0 and json.loads(proc.stdout)["format"] == "sharded", proc.stderr


def test_weights_given_where_a_checkpoint_is_needed_say_what_takes_them(tmp_path):
    assert run_cli("consolidate", FIXTURES / "z2_ws2_fp32", tmp_path / "m.safetensors", "-q").returncode == 0
    pretrained = tmp_path / "pretrained"
    pretrained.mkdir()
    shutil.copy(tmp_path / "m.safetensors", pretrained / "model.safetensors")  # what save_pretrained writes
    for args in (("reshard", tmp_path / "m.safetensors", tmp_path / "r", "-w", "2"),
                 ("convert", tmp_path / "m.safetensors", tmp_path / "u", "--to", "universal"),
                 ("consolidate", pretrained, tmp_path / "x.pt")):
        clean_error(run_cli(*args), "weights file (full tensors), not a DeepSpeed checkpoint", "--full-weights",
                    "load_into", "dsckpt diff")


def test_a_folder_output_keeps_its_client_state_inside_and_no_file_loading_note(tmp_path):
    proc = run_cli("consolidate", FIXTURES / "z2_ws2_fp32", tmp_path / "folder", "--json")
    doc = json.loads(proc.stdout)
    assert doc["client_state"] == str(tmp_path / "folder" / "client_state.json")
    assert (tmp_path / "folder" / "client_state.json").is_file() and sorted(p.name for p in tmp_path.iterdir()) == ["folder"]
    assert "tied weights are stored once" not in proc.stderr and "load_model" not in proc.stderr
    file_out = run_cli("consolidate", FIXTURES / "z2_ws2_fp32", tmp_path / "m.safetensors")
    assert "tied weights are stored once" in file_out.stderr  # where it applies


def test_the_wrong_folder_gets_the_right_hint(tmp_path):
    """An HF output_dir (checkpoint-N beside the final model.safetensors) is pointed at its checkpoint-N by
    consolidate, reshard and convert too, not at `resume --full-weights`; dsckpt's own DCP folder is named as one,
    its client-state sidecar never proposed as weights."""
    import shutil

    out = tmp_path / "output_dir"
    out.mkdir()
    shutil.copytree(FIXTURES / "z2_ws2_fp32", out / "checkpoint-3")
    assert run_cli("consolidate", FIXTURES / "z2_ws2_fp32", out / "model.safetensors", "-q").returncode == 0
    for args in (["consolidate", out, tmp_path / "o.safetensors"], ["reshard", out, tmp_path / "o2", "-w", "3"],
                 ["convert", out, tmp_path / "o3", "--to", "universal"], ["inspect", out]):
        proc = run_cli(*args)
        assert proc.returncode == 2 and "it holds checkpoints in checkpoint-3" in proc.stderr, (args, proc.stderr)
        assert "--full-weights" not in proc.stderr
    dcp = tmp_path / "dcp"
    assert run_cli("convert", FIXTURES / "z2_ws2_fp32", dcp, "--to", "dcp", "-q").returncode == 0
    proc = run_cli("consolidate", dcp, tmp_path / "d.safetensors")
    assert proc.returncode == 2 and "a torch.distributed.checkpoint (DCP) folder" in proc.stderr, proc.stderr
    assert "client_state.safetensors" not in proc.stderr
    summary = run_cli("inspect", dcp)  # (#69.7: inspect summarizes it, as what convert --to deepspeed reads)
    assert summary.returncode == 0 and "torch.distributed.checkpoint, fsdp2 layout" in summary.stdout


@pytest.mark.parametrize("case", ["stale", "several", "huge"])
def test_latest_is_refused_in_the_same_words_at_one_and_two_processes(tmp_path, case):
    """One tag choice for one process and many: a `latest` naming a missing tag, several tags and no usable
    `latest`, and a `latest` past the size bound get the same error at --nproc 1 and 2 (the huge one refused at
    once, not read whole by a process and printed)."""
    import shutil

    root = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "z2_ws2_fp32", root)
    if case == "several":
        shutil.copytree(root / "step3", root / "step4")
    (root / "latest").write_text("step99")
    if case == "huge":
        with open(root / "latest", "r+b") as fh:
            fh.truncate(400 * 1024 * 1024)  # sparse: costs no disk
    errors = []
    for n in ("1", "2"):
        started = time.monotonic()
        proc = run_cli("consolidate", root, tmp_path / f"out{n}.safetensors", "--nproc", n, "--json")
        assert proc.returncode == 2 and time.monotonic() - started < 30, proc.stderr[-2000:]
        doc = json.loads(proc.stdout)
        errors.append((doc["error"], doc["hint"]))
        assert len(proc.stderr) < 2000
    assert errors[0] == errors[1], errors
    expected = {"stale": f"{root}/latest: names tag 'step99', which is not a tag folder beside it",
                "several": f"{root}: several tags and no usable 'latest': step3, step4",
                "huge": f"{root}/latest: longer than 4096 bytes; expected one tag name"}[case]
    assert errors[0][0] == expected


def test_what_one_process_reads_is_checked_alike_at_two_and_named_as_typed(tmp_path):
    """One survey rule (#53): a link out of the checkpoint inside a tag folder the run does not read is no concern
    at 1 or 2 processes; a rank file of the chosen tag linked out is the same refusal at both; a relative CKPT keeps
    its spelling in every message (a distributed run named it by its absolute path)."""
    import shutil

    root = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "z2_ws2_fp32", root)
    shutil.copytree(root / "step3", root / "step1")
    (tmp_path / "outside.txt").write_text("x")
    (root / "step1" / "notes.txt").symlink_to(tmp_path / "outside.txt")
    for n in ("1", "2"):
        proc = run_cli("consolidate", "ckpt", f"other{n}.safetensors", "--nproc", n, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-2000:]
    rank_file = root / "step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    rank_file.rename(tmp_path / rank_file.name)
    rank_file.symlink_to(tmp_path / rank_file.name)
    answers = []
    for n in ("1", "2"):
        proc = run_cli("consolidate", "ckpt", f"chosen{n}.safetensors", "--nproc", n, "--json", cwd=tmp_path)
        assert proc.returncode == 2, proc.stderr[-2000:]
        doc = json.loads(proc.stdout)
        answers.append((doc["error"], doc["hint"]))
        assert not (tmp_path / f"chosen{n}.safetensors").exists()
    assert answers[0] == answers[1], answers
    assert answers[0][0] == (f"ckpt/step3/{rank_file.name} -> {tmp_path / rank_file.name}: a symlink leading "
                             "outside the checkpoint ckpt; its files are not copied into an output"), answers
    rank_file.unlink()
    (tmp_path / rank_file.name).rename(rank_file)
    shutil.rmtree(root / "step1")
    (root / "latest").write_text("step99")
    for n in ("1", "2"):
        proc = run_cli("consolidate", "ckpt", f"stale{n}.safetensors", "--nproc", n, "--json", cwd=tmp_path)
        assert json.loads(proc.stdout)["error"] == "ckpt/latest: names tag 'step99', which is not a tag folder beside it", n


def test_list_names_what_other_commands_take(tmp_path):
    """`list` of an HF output_dir names its checkpoint-N (what the other commands take), of a folder of runs the
    runs; OUT in a missing folder says how to make it."""
    import shutil

    out = tmp_path / "output_dir"
    shutil.copytree(FIXTURES / "z2_ws2_fp32", out / "checkpoint-3")
    proc = run_cli("list", out)
    assert proc.returncode == 0 and proc.stdout.splitlines()[1].startswith("checkpoint-3 "), proc.stdout
    assert json.loads(run_cli("list", out, "--json").stdout)["checkpoints"][0]["name"] == "checkpoint-3"
    runs = tmp_path / "runs"
    for name in ("a", "b"):
        shutil.copytree(FIXTURES / "z2_ws2_fp32", runs / name)
    proc = run_cli("list", runs)
    assert proc.returncode == 2 and "it holds the runs a, b" in proc.stderr and f"dsckpt list {runs / 'a'}" in proc.stderr
    proc = run_cli("consolidate", FIXTURES / "z2_ws2_fp32", tmp_path / "no" / "such" / "m.safetensors")
    assert proc.returncode == 2 and f"mkdir -p {tmp_path / 'no' / 'such'}" in proc.stderr


def test_every_reading_command_has_notes_in_its_json(tmp_path):
    """check-finite, diff, verify and inspect --stats carry `notes` as the writing commands do: what they print as
    `note:` lines (here --skip-crc-check's), an empty list otherwise."""
    ckpt = FIXTURES / "z2_ws2_fp32"
    for args in (["check-finite", ckpt], ["diff", ckpt, ckpt], ["inspect", ckpt, "--stats"], ["verify", ckpt]):
        doc = json.loads(run_cli(*args, "--json").stdout)
        assert doc["notes"] == [], args
        if args[0] != "verify":
            skipped = json.loads(run_cli(*args, "--json", "--skip-crc-check").stdout)
            assert len(skipped["notes"]) == 1 and "CRC" in skipped["notes"][0], args


def test_files_is_a_list_of_paths_in_every_document():
    """`files` means the same everywhere (docs/cli.md, JSON vocabulary): verify and inspect --du list the files they
    read, relative to the checkpoint folder, as the writing commands list what they wrote."""
    ckpt = FIXTURES / "z2_ws2_fp32"
    rank_files = sorted(f"step3/{p.name}" for p in (ckpt / "step3").iterdir())
    verified = json.loads(run_cli("verify", ckpt, "--json").stdout)["tags"][0]["files"]
    assert sorted(verified) == rank_files
    usage = json.loads(run_cli("inspect", ckpt, "--du", "--json").stdout)["files"]
    assert set(rank_files) <= set(usage) and "latest" in usage and all((ckpt / f).is_file() for f in usage)


@pytest.mark.parametrize("nproc", ["1", "2"])
def test_temps_of_dead_processes_are_cleaned_at_any_process_count(tmp_path, nproc):
    """A temp left beside OUT by a process that died (kill -9) is removed by the next run, at 1 and 2 processes."""
    from dsckpt.io.output import TEMP_MARK

    gone = subprocess.Popen(["true"])
    gone.wait()
    out = tmp_path / "model.safetensors"
    stale = tmp_path / f".{out.name}{TEMP_MARK}{gone.pid}-deadbeef"
    stale.write_bytes(b"half written")
    proc = run_cli("consolidate", FIXTURES / "z2_ws2_fp32", out, "--nproc", nproc)
    assert proc.returncode == 0, proc.stderr
    assert not stale.exists() and out.is_file()


def test_the_writing_commands_take_one_set_of_writing_options():
    """#53: consolidate, reshard and convert declare --trust-checkpoint, --skip-crc-check, --no-fsync, --nproc,
    --quiet and --json once (``cli.options.writing_options``): the same names, defaults and words in each."""
    from dsckpt.cli import cli

    shared = ("trust_checkpoint", "skip_crc_check", "no_fsync", "nproc", "quiet", "as_json")
    commands = cli.all_commands()
    seen = []
    for name in ("consolidate", "reshard", "convert"):
        params = {p.name: p for p in commands[name].params}
        assert set(shared) <= set(params), name
        seen.append([(p, params[p].opts, params[p].default, (params[p].help or "").replace("OUT_DIR", "OUT"))
                     for p in shared])
    assert seen[0] == seen[1] == seen[2]


def test_the_exit_code_table(tmp_path):
    """#69.2: docs/cli.md's exit-code table, row by row, as the commands behave."""
    import math

    import torch

    from malformed import torch_save

    good = FIXTURES / "z2_ws2_fp32"
    missing = tmp_path / "missing"
    shutil.copytree(good, missing)
    next((missing / "step3").glob("zero_pp_rank_1_*")).unlink()
    stale_one, stale_many = tmp_path / "stale_one", tmp_path / "stale_many"
    for folder in (stale_one, stale_many):
        shutil.copytree(good, folder)
        (folder / "latest").write_text("step9")
    shutil.copytree(good / "step3", stale_many / "step4")

    def poison(obj):
        with torch.no_grad():
            obj["optimizer_state_dict"]["single_partition_of_fp32_groups"][0][3] = math.nan
    nan = torch_save("z2_ws2_fp32", "zero_pp_rank_0_*optim*", poison, need_unsafe=True)(tmp_path / "nan")
    rows = [(0, ["inspect", good]), (1, ["inspect", missing]), (1, ["inspect", stale_one]),
            (2, ["inspect", stale_many]), (0, ["inspect", stale_many, "--tag", "step4"]),
            (0, ["verify", good]), (1, ["verify", missing]), (2, ["verify", tmp_path / "nowhere"]),
            (0, ["diff", good, good]), (1, ["diff", good, nan]),
            (0, ["check-finite", good]), (3, ["check-finite", nan]), (2, ["check-finite", tmp_path / "nowhere"]),
            (0, ["list", good]), (2, ["list", tmp_path / "nowhere"]),
            (2, ["consolidate", missing, tmp_path / "m.safetensors"]), (2, ["consolidate", good, "--bogus"])]
    found = [(expected, run_cli(*args).returncode, args) for expected, args in rows]
    assert [(e, c) for e, c, _ in found] == [(e, e) for e, _, _ in found], [f for f in found if f[0] != f[1]]
