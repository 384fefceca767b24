"""`dsckpt verify`: every check on real DeepSpeed checkpoints, each broken in the one way it must catch."""
import json
import math

import pytest

from conftest import FIXTURES, run_cli
from malformed import copy, flip, remove, torch_save


def verified(path, *args):
    proc = run_cli("verify", path, "--json", *args)
    return proc.returncode, json.loads(proc.stdout)


@pytest.mark.parametrize("fixture", ["z1_ws2_fp32", "z2_ws3_bf16", "z3_ws3_bf16", "z0_ws2_bf16", "moe_z2_ws2_ep2_fp32"])
def test_a_sound_checkpoint_passes(fixture):
    code, doc = verified(FIXTURES / fixture)
    assert code == 0 and doc["ok"], doc
    tag = doc["tags"][0]
    assert tag["problems"] == [] and tag["storages_checked"] > 0 and tag["tensors_checked"] > 0


def test_damaged_moments_are_named(tmp_path):
    code, doc = verified(flip("z2_ws2_fp32", "zero_pp_rank_1_*optim*", "Adam moment")(tmp_path))
    assert code == 1 and not doc["ok"]
    [problem] = doc["tags"][0]["problems"]
    assert problem["check"] == "crc" and "zero_pp_rank_1_mp_rank_00_optim_states.pt" in problem["message"]


def test_a_missing_rank_file_is_a_structure_problem(tmp_path):
    code, doc = verified(remove("z3_ws3_bf16", "bf16_zero_pp_rank_2_*optim*")(tmp_path))
    assert code == 1 and [p["check"] for p in doc["tags"][0]["problems"]][:1] == ["structure"]
    assert "rank 2" in doc["tags"][0]["problems"][0]["message"]


def test_non_finite_masters_and_moments_are_listed(tmp_path):
    def poison(obj):
        import torch

        osd = obj["optimizer_state_dict"]
        with torch.no_grad():
            osd["single_partition_of_fp32_groups"][0][3] = math.nan
            osd["base_optimizer_state"]["state"][0]["exp_avg"][5] = math.inf

    code, doc = verified(torch_save("z2_ws2_fp32", "zero_pp_rank_0_*optim*", poison, need_unsafe=True)(tmp_path))
    found = [p for p in doc["tags"][0]["problems"] if p["check"] == "finite"]
    assert code == 1 and len(found) == 2
    assert any("NaN" in p["message"] and not p["message"].startswith("exp_avg") for p in found)
    assert any(p["message"].startswith("exp_avg/") and "1 Inf" in p["message"] for p in found)


def test_an_hf_trainer_folder_needs_its_trainer_state_and_rng_files(tmp_path):
    root = copy(tmp_path, "z2_ws2_fp32").rename(tmp_path / "checkpoint-3")
    (root / "rng_state_0.pth").write_bytes(b"")
    code, doc = verified(root)
    messages = [p["message"] for p in doc["tags"][0]["problems"] if p["check"] == "companions"]
    assert code == 1 and len(messages) == 2
    assert "trainer_state.json" in messages[0] and "rng_state_1.pth" in messages[1]


def test_every_tag_and_unreadable_input(tmp_path):
    code, doc = verified(FIXTURES / "z2_ws2_fp32", "--all-tags")
    assert code == 0 and [t["tag"] for t in doc["tags"]] == ["step3"]
    proc = run_cli("verify", tmp_path / "nowhere")
    assert proc.returncode == 2 and "nowhere" in proc.stderr and "Traceback" not in proc.stderr


def test_all_tags_with_a_rank_file_being_written(tmp_path):
    """--all-tags where one tag's rank file is truncated (what a save in progress looks like): that tag's structure
    problem, exit 1, and a verdict for every other tag - not exit 2 for the whole checkpoint."""
    import shutil

    root = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "z2_ws2_fp32", root)
    latest = (root / "latest").read_text().strip()
    shutil.copytree(root / latest, root / "older")
    victim = sorted((root / "older").glob("*optim_states.pt"))[0]
    with open(victim, "r+b") as fh:
        fh.truncate(20000)
    code, doc = verified(root, "--all-tags")
    by_tag = {t["tag"]: t for t in doc["tags"]}
    assert code == 1 and set(by_tag) == {"older", latest}
    assert [p["check"] for p in by_tag["older"]["problems"]] == ["structure"]
    assert victim.name in by_tag["older"]["problems"][0]["message"] and by_tag[latest]["problems"] == []


def test_verify_notes_a_tag_folder_linked_from_elsewhere(tmp_path):
    """The note inspect gives for a tag folder that is a link out of the checkpoint, verify gives too (stderr and
    the JSON's per-tag notes)."""
    import shutil

    root, elsewhere = tmp_path / "ckpt", tmp_path / "elsewhere"
    tag = (FIXTURES / "z2_ws2_fp32" / "latest").read_text().strip()
    shutil.copytree(FIXTURES / "z2_ws2_fp32" / tag, elsewhere)
    root.mkdir()
    shutil.copy(FIXTURES / "z2_ws2_fp32" / "latest", root / "latest")
    (root / tag).symlink_to(elsewhere)
    proc = run_cli("verify", root)
    assert proc.returncode == 0 and f"note: {root / tag}: a symlink to {elsewhere}" in proc.stderr
    code, doc = verified(root)
    assert code == 0 and any(str(elsewhere) in n for n in doc["tags"][0]["notes"])


def test_verify_reports_its_progress_in_bytes():
    """The bar `dsckpt verify` shows: every storage's bytes, once, as its CRC is checked."""
    from dsckpt.analysis.verify import verify
    from dsckpt.formats.torchzip import StorageIndex
    from dsckpt.progress import Phase, Tally

    ckpt = FIXTURES / "z2_ws2_fp32"
    tally = Tally()
    (report,) = verify(ckpt, progress=tally)
    assert not report.problems
    expected = [loc.nbytes for p in sorted((ckpt / "step3").iterdir()) for loc in StorageIndex(p).storages.values()]
    (step,) = tally.steps
    assert step.phase is Phase.VERIFY and sorted(step.pieces) == sorted(expected) and step.done > 0


@pytest.mark.parametrize("latest", [b"\x00\xff garbage \x01" * 3, b"step9"], ids=["garbage", "missing-tag"])
def test_a_bad_latest_never_blocks_a_tag_named_explicitly(tmp_path, latest):
    """#69.2: garbage in `latest`, or `latest` naming a tag that is not there: every command given --tag works,
    `verify --all-tags` checks every tag and reports `latest` alone, `list` marks every healthy tag complete and
    says what is wrong with `latest` once; without --tag the commands refuse, with a hint that leads to one."""
    root = tmp_path / "run"
    import shutil

    shutil.copytree(FIXTURES / "z2_ws2_fp32", root)
    shutil.copytree(root / "step3", root / "step6")
    (root / "latest").write_bytes(latest)
    for args in (["verify", root, "--tag", "step6"], ["inspect", root, "--tag", "step6"],
                 ["check-finite", root, "--tag", "step6"],
                 ["consolidate", root, tmp_path / "m.safetensors", "--tag", "step6", "-q"],
                 ["reshard", root, tmp_path / "ws3", "-w", "3", "--tag", "step6", "-q"]):
        proc = run_cli(*args)
        assert proc.returncode == 0, (args, proc.stdout, proc.stderr)
    proc = run_cli("verify", root, "--all-tags", "--json")
    assert proc.returncode == 1, proc.stderr
    reports = json.loads(proc.stdout)["tags"]
    assert [r["tag"] for r in reports] == ["latest", "step3", "step6"]
    assert reports[0]["problems"] and all(not r["problems"] for r in reports[1:]), reports
    listed = json.loads(run_cli("list", root, "--json").stdout)
    assert [(e["tag"], e["complete"]) for e in listed["checkpoints"]] == [("step3", True), ("step6", True)]
    assert len(listed["notes"]) == 1 and "latest" in listed["notes"][0]
    refused = run_cli("verify", root)
    assert refused.returncode in (1, 2) and "Traceback" not in refused.stderr
    if refused.returncode == 2:
        assert "--tag" in refused.stderr, refused.stderr
