"""`dsckpt list` and `dsckpt prune` over real DeepSpeed saves: a save folder of tags and an HF output_dir."""
import json
import shutil

from conftest import FIXTURES, run_cli


def _run_folder(tmp_path):
    """Tags step1..step4 of one run, `latest` naming step3 (step4: a save still being written), step2 incomplete."""
    root = tmp_path / "run"
    shutil.copytree(FIXTURES / "z2_ws2_fp32", root)
    for tag in ("step1", "step2", "step4"):
        shutil.copytree(root / "step3", root / tag)
    next((root / "step2").glob("zero_pp_rank_1_*")).unlink()
    return root


def test_list_says_what_each_tag_is(tmp_path):
    root = _run_folder(tmp_path)
    doc = json.loads(run_cli("list", root, "--json").stdout)
    rows = {e["tag"]: e for e in doc["checkpoints"]}
    assert [e["tag"] for e in doc["checkpoints"]] == ["step1", "step2", "step3", "step4"]
    assert rows["step2"]["complete"] is False and "rank 1" in rows["step2"]["problems"][0]
    assert rows["step3"]["resumes_from"] and not rows["step1"]["resumes_from"]
    assert all(rows[t]["complete"] and rows[t]["zero_stage"] == 2 and rows[t]["world_size"] == 2 for t in ("step1", "step3"))
    assert rows["step1"]["bytes"] == sum(f.stat().st_size for f in (root / "step1").iterdir())
    human = run_cli("list", root).stdout
    assert "INCOMPLETE" in human and "<- latest" in human


def test_prune_never_removes_latest_incomplete_or_newer(tmp_path):
    root = _run_folder(tmp_path)
    dry = run_cli("prune", root, "--keep", "1", "--dry-run")
    assert dry.returncode == 0 and "would remove" in dry.stdout and (root / "step1").is_dir()
    doc = json.loads(run_cli("prune", root, "--keep", "1", "--json").stdout)
    assert [e["tag"] for e in doc["removed"]] == ["step1"]
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["step2", "step3", "step4"]  # incomplete, latest, newer
    assert run_cli("consolidate", root, tmp_path / "m.safetensors", "-q").returncode == 0  # the run still resumes


def test_prune_an_hf_output_dir_removes_whole_checkpoint_folders(tmp_path):
    out = tmp_path / "out"
    for n in (100, 200, 300):
        folder = out / f"checkpoint-{n}"
        shutil.copytree(FIXTURES / "z2_ws2_fp32", folder)
        (folder / "step3").rename(folder / f"global_step{n}")
        (folder / "latest").write_text(f"global_step{n}")
    doc = json.loads(run_cli("list", out, "--json").stdout)
    assert [(e["tag"], e["step"], e["resumes_from"]) for e in doc["checkpoints"]] == \
        [("global_step100", 100, False), ("global_step200", 200, False), ("global_step300", 300, True)]
    proc = run_cli("prune", out, "--keep", "2")
    assert proc.returncode == 0 and f"removed {out / 'checkpoint-100'}" in proc.stdout
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-200", "checkpoint-300"]


def _dead_pid() -> int:
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_list_and_prune_show_and_remove_what_interrupted_saves_left(tmp_path):
    """#68: a killed job's hidden staging folders (a tag of dsckpt's commit, an HF pending checkpoint, an older
    dsckpt's per-rank staging) are rows of `list` with their size, removed by `prune`; a live process's are kept."""
    import os

    root = _run_folder(tmp_path)
    dead, alive = _dead_pid(), os.getpid()
    killed = root / f".step5.dsckpt-tmp-{dead}-0a1b2c3d"
    shutil.copytree(root / "step3", killed)
    running = root / f".step6.dsckpt-tmp-{alive}-0a1b2c3d"
    running.mkdir()
    (running / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"x" * 100)
    legacy = root / "step1" / ".dsckpt-saving"
    legacy.mkdir()
    (legacy / "mp_rank_00_model_states.pt").write_bytes(b"y" * 10)
    doc = json.loads(run_cli("list", root, "--json").stdout)
    rows = {e["name"]: e for e in doc["checkpoints"]}
    assert rows[killed.name]["leftover"] == "interrupted save" and not rows[killed.name]["complete"]
    assert rows[killed.name]["bytes"] == sum(f.stat().st_size for f in killed.iterdir())
    assert rows[running.name]["leftover"] == "save in progress"
    assert rows["step1/.dsckpt-saving"]["leftover"] == "interrupted save"
    assert rows["step3"]["leftover"] is None and rows["step3"]["resumes_from"]
    human = run_cli("list", root).stdout
    assert f"{killed.name}" in human and "interrupted save" in human and "save in progress" in human
    proc = run_cli("prune", root, "--keep", "3")
    assert proc.returncode == 0, proc.stderr
    assert f"removed {killed} (interrupted save" in proc.stdout
    assert not killed.exists() and not legacy.exists() and running.is_dir()
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == [running.name, "step1", "step2", "step3", "step4"]


def test_not_a_run_folder(tmp_path):
    proc = run_cli("list", tmp_path)
    assert proc.returncode == 2 and "no DeepSpeed tag folders" in proc.stderr and "Traceback" not in proc.stderr


def test_inspect_du_accounts_for_every_byte(tmp_path):
    for fixture, masters in (("z2_ws2_fp32", True), ("z3_ws3_bf16", True), ("z0_ws1_fp32", False)):
        root = FIXTURES / fixture
        doc = json.loads(run_cli("inspect", root, "--du", "--json").stdout)
        tag_files = list((root / doc["tag"]).iterdir())
        beside = [p for p in root.iterdir() if p.is_file()]
        assert doc["bytes"] == sum(p.stat().st_size for p in tag_files + beside) == sum(doc["components"].values())
        parts = doc["components"]
        if masters:
            assert parts["fp32 masters"] == parts["exp_avg"] == parts["exp_avg_sq"] > 0, fixture
        assert parts["companions (beside the tags)"] == sum(p.stat().st_size for p in beside)
    clean = run_cli("inspect", FIXTURES / "z2_ws2_fp32", "--du", "--stats")
    assert clean.returncode == 2 and "--du" in clean.stderr


def test_list_tags_and_prune_in_python(tmp_path):
    """#69.8: ``dsckpt.list_tags(root)`` gives the rows `dsckpt list --json` gives; ``dsckpt.prune(root, keep=)``
    removes what `dsckpt prune` removes."""
    import dsckpt

    root = _run_folder(tmp_path)
    rows = dsckpt.list_tags(root)
    assert [vars(e) for e in rows] == json.loads(run_cli("list", root, "--json").stdout)["checkpoints"]
    assert [e.tag for e in rows if e.complete][-1] == "step4" and next(e for e in rows if e.resumes_from).tag == "step3"
    removed, kept = dsckpt.prune(root, keep=1)
    assert [e.tag for e in removed] == ["step1"] and not (root / "step1").exists()
    assert [e.tag for e in kept] == ["step2", "step3", "step4"]


def test_prune_keeps_the_newest_finite_checkpoints_when_the_newest_hold_nan(tmp_path):
    """#69.3: `prune --keep 1` of a run whose newest tag (the one `latest` names) has NaN masters keeps that tag and
    the newest finite one, removing only older ones; `--no-check` keeps the newest --keep whatever they hold."""
    import math

    import torch

    from malformed import torch_save

    def poison(obj):
        with torch.no_grad():
            obj["optimizer_state_dict"]["single_partition_of_fp32_groups"][0][3] = math.nan

    root = torch_save("z2_ws2_fp32", "zero_pp_rank_0_*optim*", poison, need_unsafe=True)(tmp_path)  # step3: NaN
    for tag, step in (("step1", 1), ("step2", 2)):
        shutil.copytree(FIXTURES / "z2_ws2_fp32" / "step3", root / tag)
    dry = json.loads(run_cli("prune", root, "--keep", "1", "--dry-run", "--no-check", "--json").stdout)
    assert [e["tag"] for e in dry["removed"]] == ["step1", "step2"] and dry["notes"] == []
    proc = run_cli("prune", root, "--keep", "1", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert [e["tag"] for e in doc["removed"]] == ["step1"], doc
    assert [(e["tag"], e["finite"]) for e in doc["kept"]] == [("step2", True), ("step3", False)]
    assert len(doc["notes"]) == 1 and "step3: its fp32 masters hold NaN or Inf" in doc["notes"][0]
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["step2", "step3"]


def test_every_json_document_carries_notes(tmp_path):
    """#69.9: docs/cli.md's vocabulary - every --json document has a `notes` list, empty when there is none:
    `inspect --du`, `inspect FILE`, `list` and `prune --dry-run` had none."""
    root = _run_folder(tmp_path)
    assert run_cli("consolidate", root, tmp_path / "m.safetensors", "-q").returncode == 0
    for args in (["inspect", root, "--du", "--json"], ["inspect", tmp_path / "m.safetensors", "--json"],
                 ["list", root, "--json"], ["prune", root, "--keep", "1", "--dry-run", "--json"]):
        doc = json.loads(run_cli(*args).stdout)
        assert isinstance(doc.get("notes"), list), (args, doc)
