"""What a background save's process tells the world when it ends, or is ended (#68): the exit status of a failed last
save, SIGTERM mid-persist, kill -9 of every rank for a new and a reused tag, a follow-up that reads the tag, a client
state holding an argparse.Namespace.  (Apart from tests/test_async_save.py so that the two files run on two workers.)"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from conftest import JOB_TIMEOUT, PYTHONPATH, ROOT, run_cli, run_job
from dsckpt.api.consolidation import load_state_dict
from dsckpt.zero.reader import open_checkpoint


@pytest.mark.runtime
@pytest.mark.parametrize("tag", ["t2", "t1"], ids=["new-tag", "reused-tag"])
def test_kill_during_persist_leaves_previous_tag(tag, tmp_path):
    """SIGKILL of every rank while a tag is being written, a new one or `latest`'s own saved again: `latest` names t1,
    which loads whole as first saved (step 1); nothing of the killed save is visible, only its hidden staging
    folder, which `list` shows as an interrupted save and `prune` removes."""
    from dsckpt.runtime.launch import run_ranks

    out = tmp_path / "ckpt"
    with tempfile.TemporaryFile("w+") as log:
        codes = run_ranks([sys.executable, str(ROOT / "tests" / "jobs" / "async_kill.py"), str(out), tag], 2,
                          {"OMP_NUM_THREADS": "1", "PYTHONPATH": PYTHONPATH}, JOB_TIMEOUT, stdout=log, stderr=log,
                          cwd=ROOT)
        log.seek(0)
        text = log.read()
    assert sorted(p.name for p in out.glob("killed.*")) == ["killed.0", "killed.1"], text[-3000:]
    assert all(code != 0 for code in codes)
    assert (out / "latest").read_text() == "t1"
    ckpt = open_checkpoint(out)
    assert ckpt.layout.tag == "t1" and not ckpt.problems and ckpt.global_steps == 1
    visible = sorted(p.name for p in out.iterdir() if not p.name.startswith(".") and not p.name.endswith(".py"))
    assert visible == ["killed.0", "killed.1", "latest", "t1"]
    assert sorted(p.name for p in (out / "t1").iterdir()) == sorted(f.path.name for f in ckpt.layout.all_files)
    proc = run_cli("verify", out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert load_state_dict(out).keys()
    listed = json.loads(run_cli("list", out, "--json").stdout)["checkpoints"]
    assert [e["leftover"] for e in listed] == [None, "interrupted save"] and listed[1]["bytes"] > 0, listed
    assert run_cli("prune", out, "--keep", "1").returncode == 0
    assert not [p for p in out.iterdir() if p.name.startswith(f".{tag}.")]


def _trust_job(mode: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, str(ROOT / "tests" / "jobs" / "async_trust.py"), mode, str(tmp_path / "ckpt"),
                           str(tmp_path / "report.json")], capture_output=True, text=True, timeout=JOB_TIMEOUT,
                          env={**os.environ, "PYTHONPATH": PYTHONPATH, "OMP_NUM_THREADS": "1", **env})


def _visible(save_dir: Path) -> list[str]:
    return sorted(p.name for p in save_dir.iterdir() if p.name not in ("zero_to_fp32.py", "zero_to_torch.py"))


@pytest.mark.runtime
def test_a_failed_last_save_never_ends_the_process_with_status_0(tmp_path):
    """#68.1-2: a script whose last save fails (EFBIG) and that ends with sys.exit(0), without wait(): exit status 1,
    the OS's words on stderr, `latest` on the previous tag (which loads), nothing named after the failed tag."""
    proc = _trust_job("fail-at-exit", tmp_path)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "File too large" in proc.stderr and "exits with status 1" in proc.stderr, proc.stderr[-3000:]
    save_dir = tmp_path / "ckpt"
    assert (save_dir / "latest").read_text() == "x" and _visible(save_dir) == ["latest", "x"]
    assert not open_checkpoint(save_dir).problems and load_state_dict(save_dir).keys()


@pytest.mark.runtime
@pytest.mark.parametrize("mode", ["sigterm", "sigterm-abandon"])
def test_sigterm_lets_the_save_in_flight_finish_or_abandons_it_cleanly(mode, tmp_path):
    """#68.5: SIGTERM mid-persist: within DSCKPT_SIGTERM_GRACE the save is published, past it abandoned (only its
    hidden staging folder left); the process ends by SIGTERM either way, saying which."""
    proc = _trust_job(mode, tmp_path, DSCKPT_SIGTERM_GRACE="20" if mode == "sigterm" else "1")
    assert proc.returncode == -signal.SIGTERM, proc.stdout[-2000:] + proc.stderr[-3000:]
    save_dir = tmp_path / "ckpt"
    if mode == "sigterm":
        assert "/s, was published" in proc.stderr and (save_dir / "latest").read_text() == "s"
        assert _visible(save_dir) == ["latest", "s", "x"] and not open_checkpoint(save_dir).problems
    else:
        assert "/s, was abandoned" in proc.stderr and (save_dir / "latest").read_text() == "x", proc.stderr[-2000:]
        shown = [n for n in _visible(save_dir) if not n.startswith(".")]
        assert shown == ["latest", "x"] and all(n.startswith(".s.dsckpt-tmp-") for n in _visible(save_dir)
                                                if n.startswith("."))


@pytest.mark.runtime
def test_a_follow_up_that_consolidates_the_tag_does_not_deadlock(tmp_path):
    """#68.6: ``then(lambda: dsckpt.consolidate(...))`` of the tag just saved runs on the writer, whose reads do not
    wait on the writer itself."""
    proc = _trust_job("then-consolidate", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((tmp_path / "report.json").read_text())["consolidated"]


@pytest.mark.runtime
def test_a_namespace_in_the_client_state_loads_weights_only(tmp_path):
    """#68.9: Megatron-style ``args`` (an argparse.Namespace) are data: the engine's weights-only load rebuilds them
    from their fields; `verify` finds no foreign class.  A nested tag (``epoch1/n``) is refused in the call with
    nothing written (before, its staging folder failed at ``wait()`` and left a hidden ``.epoch1`` behind)."""
    proc = _trust_job("namespace", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    facts = json.loads((tmp_path / "report.json").read_text())
    assert facts["args"] == {"lr": 1e-4, "layers": [3, 5], "name": "megatron-style"}
    assert "tag 'epoch1/n' is not one folder name" in facts["nested"] and "epoch1_n" in facts["nested"], facts
    assert facts["nested_left"] == []  # refused in the call: no staging folder, no `.epoch1` left behind
    assert run_cli("verify", tmp_path / "ckpt", "--tag", "n").returncode == 0


@pytest.mark.runtime
def test_a_client_state_beyond_plain_data_loads_with_trust_only(tmp_path):
    """#68.9: the weights-only load refuses a foreign class, naming the Python argument that trusts it; trust=True
    (enable_async_save's load_checkpoint) then loads it."""
    proc = _trust_job("foreign", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    facts = json.loads((tmp_path / "report.json").read_text())
    assert "fractions.Fraction" in facts["refused"] and "load_checkpoint(..., trust=True)" in facts["refused"]
    assert facts["ratio"] == "3/7"


@pytest.mark.runtime
def test_a_hung_persist_is_a_typed_error_at_the_next_wait_and_save_and_the_process_still_ends(tmp_path):
    """#68.5: wait(timeout=1) and, under DSCKPT_SAVE_TIMEOUT=1, the next save_checkpoint raise BackgroundSaveError
    after about a second; `latest` stays on the previous tag; the process ends, with status 1, though its writer
    is still stuck."""
    proc = _trust_job("hung", tmp_path, DSCKPT_SAVE_TIMEOUT="1")
    assert proc.returncode == 1, proc.stderr[-3000:]
    facts = json.loads((tmp_path / "report.json").read_text())
    for name in ("wait", "next_save"):
        seconds, message = facts[name]
        assert seconds < 10 and "still being written after 1 s" in message, facts
    assert facts["latest"] == "x" and "was not saved" in proc.stderr


@pytest.mark.runtime
def test_a_load_right_after_a_save_leaves_that_save_as_of_its_call(tmp_path):
    """#68.7: load_checkpoint while a save persists: the save holds the state of its call, the engine the loaded one."""
    proc = _trust_job("load-fence", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((tmp_path / "report.json").read_text()) == {"saved_as_of_call": True, "load_took_effect": True}


@pytest.mark.runtime
def test_a_rank_that_dies_mid_persist_fails_the_save_on_the_others_at_once(tmp_path):
    """#68.4-5: rank 1 dies writing its files; rank 0's commit learns it from the transport (well inside the run's
    timeout), raises a typed error at wait() saying what is on disk, and publishes nothing."""
    from dsckpt.runtime.launch import run_ranks

    out = tmp_path / "ckpt"
    with tempfile.TemporaryFile("w+") as log:
        codes = run_ranks([sys.executable, str(ROOT / "tests" / "jobs" / "async_trust.py"), "rank-dies", str(out),
                           str(tmp_path / "report.json")], 2,
                          {"OMP_NUM_THREADS": "1", "PYTHONPATH": PYTHONPATH, "DSCKPT_DIST_TIMEOUT": "60"}, JOB_TIMEOUT,
                          stdout=log, stderr=log, cwd=ROOT)
        log.seek(0)
        text = log.read()
    assert codes == [0, 9], text[-3000:]
    facts = json.loads((tmp_path / "report.json").read_text())
    seconds, kind, message = facts["raised"]
    assert seconds < 30 and kind == "BackgroundSaveError" and "a process of the run stopped" in message, facts
    assert message.count("published") == 1 and "`latest` still names 'x'" in message
    assert facts["latest"] == "x" and [n for n in facts["visible"] if not n.endswith(".py")] == ["latest", "x"]
    assert not [p for p in out.iterdir() if p.name.startswith(".d.")]  # rank 0 removed the staged tag


@pytest.mark.slow  # ZenFlow's CPU Adam is a JIT-built op (make test-all)
@pytest.mark.runtime
@pytest.mark.parametrize("overlap", ["0", "1"], ids=["in-step", "overlapped"])
def test_a_zenflow_run_is_saved_as_of_the_call(overlap, tmp_path):
    """ZenFlow writes its masters outside the fenced ``step`` (overlapped: on a process of its own), so its
    files are copied in the call: the tag equals DeepSpeed's own save of the same moment though three steps ran
    while it was written, and the engine's ``load_checkpoint`` gives back the partitions held at the call."""
    run_job("zenflow_save.py", 1, overlap, tmp_path, tmp_path / "report.json")
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["optimizer"].startswith("ZenFlow") and report["moved"] and report["restored"], report
    # overlapped, Adam's moments live in ZenFlow's process and DeepSpeed's own save holds none (docs/reliability.md)
    for state in ("fp32", "exp_avg", "exp_avg_sq") if overlap == "0" else ("fp32",):
        ref = load_state_dict(tmp_path / "ref", tag="t", state=state)
        out = load_state_dict(tmp_path / "async", tag="t", state=state)
        assert ref.keys() == out.keys() and all(torch.equal(ref[k], out[k]) for k in ref), state
