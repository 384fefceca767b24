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

from conftest import JOB_TIMEOUT, PYTHONPATH, ROOT, run_cli
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
    from their fields; `verify` finds no foreign class."""
    proc = _trust_job("namespace", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((tmp_path / "report.json").read_text())["args"] == {"lr": 1e-4, "layers": [3, 5],
                                                                         "name": "megatron-style"}
    assert run_cli("verify", tmp_path / "ckpt", "--tag", "n").returncode == 0
