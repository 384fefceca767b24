"""The malformed-input corpus (tests/malformed.py), crash consistency and concurrent writers."""
import json
import signal
import subprocess
import sys
import time

import pytest
from safetensors.torch import load_file

from conftest import FIXTURES, ROOT, demo_counts, run_cli, run_job
from malformed import cases, run_case
from dsckpt.api.options import WriteOptions
from dsckpt.io.output import TEMP_MARK

CASES = cases()


def test_corpus_is_large_enough():
    assert len(CASES) >= 40


@pytest.mark.parametrize("case", [pytest.param(c, id=c.name, marks=pytest.mark.runtime if "resume" in c.expect else ())
                                  for c in CASES])
def test_malformed_input(case, tmp_path):
    outcomes = run_case(case, tmp_path)
    assert [o for o in outcomes if o.verdict not in ("expected", "correct result")] == []


@pytest.mark.runtime  # one job of 2 ranks over gloo (no DeepSpeed) for the whole corpus
def test_malformed_input_at_two_processes(tmp_path):
    """Every writing command (consolidate, reshard, convert) meets the corpus on 2 processes with the verdict it
    gives in one: the same typed error naming the same file, or the same correct output."""
    run_job("corpus_ranks.py", 2, tmp_path)
    outcomes = json.loads((tmp_path / "outcomes.json").read_text())
    assert {o["command"] for o in outcomes} == {"consolidate", "reshard", "convert"}
    assert len(outcomes) >= 100
    assert [o for o in outcomes if o["verdict"] not in ("expected", "correct result")] == []


@pytest.fixture(scope="module")
def large_checkpoint(tmp_path_factory):
    """A real ZeRO-2 checkpoint of ~21M parameters: its 84 MB output takes long enough to write to be hit."""
    root = tmp_path_factory.mktemp("large") / "ckpt"
    proc = run_cli("train", "--model", "odd_model:build_large", "--stage", "2", "--steps", "1",
                   "--save-dir", root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root


LARGE_TENSORS = demo_counts(vocab_size=8192, dim=512, n_layers=4, n_heads=8, seq_len=16, tie_embeddings=False)["written"]
LARGE_BYTES = 80 << 20  # about its fp32 output (84 MB): where the kill points are spread


def _kill_trials(ckpt, tmp_path, trials: int) -> dict[str, int]:
    """Kill consolidate at spread-out points of its write: trial i stops the process (SIGSTOP) once its temp output
    holds i/trials of the final bytes on disk, records where it stands - a stopped process cannot finish in between
    - then kills it (SIGKILL); count where each landed."""
    out = tmp_path / "m.safetensors"
    total = LARGE_BYTES
    landed = {"mid-write": 0, "after the rename": 0, "before writing": 0}
    for i in range(trials):
        if out.exists():
            out.unlink()
        proc = subprocess.Popen([sys.executable, "-m", "dsckpt", "consolidate", str(ckpt), str(out), "-q",
                                 "--no-client-state"], cwd=ROOT, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while proc.poll() is None and _written(tmp_path) < max(1, total * i // trials):
            assert time.monotonic() < deadline
            time.sleep(0.0005)
        proc.send_signal(signal.SIGSTOP)
        temps = [p for p in tmp_path.iterdir() if TEMP_MARK in p.name]
        landed["after the rename" if out.exists() else "mid-write" if temps else "before writing"] += 1
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert out.exists() == (not temps)  # stopped mid-write: nothing at OUT; or done, and nothing half-done
        if out.exists():
            assert len(load_file(out)) == LARGE_TENSORS  # complete and valid, or absent
    assert run_cli("consolidate", ckpt, out, "--force", "-q").returncode == 0
    assert not [p for p in tmp_path.iterdir() if TEMP_MARK in p.name]  # the next run cleaned up
    return landed


def _written(folder) -> int:
    """Bytes on disk in the temp outputs in ``folder`` (allocated blocks: a file made at its final size is sparse)."""
    return sum(p.stat().st_blocks * 512 for p in folder.iterdir() if TEMP_MARK in p.name)


def test_kill_9_mid_write(large_checkpoint, tmp_path):
    landed = _kill_trials(large_checkpoint, tmp_path, 6)
    print(f"kill -9 landed: {landed}")
    assert landed["mid-write"] >= 3  # the kills really hit a half-written file (0/6 to 5/6 of it), never OUT


@pytest.mark.slow
def test_kill_9_mid_write_many(large_checkpoint, tmp_path):
    landed = _kill_trials(large_checkpoint, tmp_path, 40)
    print(f"kill -9 landed: {landed}")
    assert landed["mid-write"] >= 20


def test_two_writers_same_out(tmp_path):
    out = tmp_path / "m.safetensors"
    cmd = [sys.executable, "-m", "dsckpt", "consolidate", str(FIXTURES / "z3_ws2_fp32"), str(out), "-q", "--force",
           "--no-client-state"]
    procs = [subprocess.Popen(cmd, cwd=ROOT) for _ in range(2)]
    assert [p.wait() for p in procs] == [0, 0]
    assert len(load_file(out)) == demo_counts(vocab_size=32, dim=16, n_layers=2, n_heads=2, seq_len=16)["written"]
    assert not [p for p in tmp_path.iterdir() if TEMP_MARK in p.name]


def test_fuzzer_findings_stay_fixed(tmp_path):
    """Inputs the atheris harness (fuzz/fuzz_reader.py) once crashed the reader with."""
    import shutil

    from dsckpt.errors import DsckptError
    from dsckpt.zero.reader import open_checkpoint

    findings = sorted((ROOT / "tests" / "data").glob("fuzz-*.bin"))
    assert findings  # a test over an empty folder would assert nothing
    for finding in findings:
        root = tmp_path / finding.stem
        shutil.copytree(FIXTURES / "z2_ws2_fp32", root)
        targets = sorted((root / "step3").glob("*.pt"))
        data = finding.read_bytes()
        targets[data[0] % len(targets)].write_bytes(data[1:])
        with pytest.raises(DsckptError):
            open_checkpoint(root).require_complete()


def test_reshard_flushes_every_file_it_publishes(tmp_path, monkeypatch):
    """Durability by default covers the rank files inside the tag folder (the flush once stopped at OUT_DIR's
    own entries: measured, `reshard` cost the same with and without fsync)."""
    import os

    import dsckpt

    flushed = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (flushed.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd))[1])
    result = dsckpt.reshard(FIXTURES / "z2_ws2_fp32", tmp_path / "ws3", 3)
    names = {os.path.basename(p) for p in flushed}
    assert {os.path.basename(f) for f in result.files} <= names  # every rank file and `latest`
    assert str(tmp_path) in flushed  # and the folder the output was renamed into
    staged = {path: i for i, path in enumerate(flushed) if ".dsckpt-tmp-" in path}  # before the rename
    for path, i in staged.items():  # each staged folder after what it holds
        assert all(staged[folder] > i for folder in staged if path.startswith(folder + os.sep))


def test_durable_outputs_start_their_writeback_as_they_go(tmp_path, monkeypatch):
    """A flushed output asks the disk to start on each range as it is written (io.writeback: the copy and the
    disk overlap instead of following each other); a --no-fsync one does not."""
    import os

    import dsckpt
    import dsckpt.io.writeback as writeback

    started = []
    monkeypatch.setattr(writeback, "_bind", lambda: lambda fd, offset, n, flags: started.append(
        (os.path.basename(os.readlink(f"/proc/self/fd/{fd}")), offset, n, flags)))
    src = FIXTURES / "z3_ws2_fp32"
    dsckpt.consolidate(src, tmp_path / "model.safetensors")
    dsckpt.reshard(src, tmp_path / "ws3", 3)
    files = {name for name, _, _, _ in started}
    assert any(name.startswith(".model.safetensors.dsckpt-tmp-") for name in files)  # the temp, before the rename
    assert {f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(3)} <= files
    assert all(flags == 2 and n > 0 for _, _, n, flags in started)  # SYNC_FILE_RANGE_WRITE: start, do not wait
    size = (tmp_path / "model.safetensors").stat().st_size
    assert sum(n for name, _, n, _ in started if name.startswith(".model.")) > size // 2  # the data, not the header
    started.clear()
    dsckpt.consolidate(src, tmp_path / "fast.safetensors", options=WriteOptions(fsync=False))
    dsckpt.reshard(src, tmp_path / "fast_ws3", 3, options=WriteOptions(fsync=False))
    assert started == []
