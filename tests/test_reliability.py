"""The malformed-input corpus (tests/malformed.py), crash consistency and concurrent writers."""
import signal
import subprocess
import sys
import time

import pytest
from safetensors.torch import load_file

from conftest import FIXTURES, ROOT, run_cli
from malformed import cases, run_case
from dsckpt.output import TEMP_MARK

CASES = cases()


def test_corpus_is_large_enough():
    assert len(CASES) >= 40


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_malformed_input(case, tmp_path):
    outcomes = run_case(case, tmp_path)
    assert [o for o in outcomes if o.verdict not in ("expected", "correct result")] == []


def _kill_trials(tmp_path, trials: int):
    out = tmp_path / "m.safetensors"
    for i in range(trials):
        if out.exists():
            out.unlink()
        proc = subprocess.Popen([sys.executable, "-m", "dsckpt", "consolidate", str(FIXTURES / "z3_ws3_bf16"), str(out),
                                 "-q", "--no-client-state"], cwd=ROOT, stderr=subprocess.DEVNULL)
        time.sleep(0.02 + 0.6 * i / trials)  # from interpreter start-up to the last bytes
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if out.exists():
            assert len(load_file(out)) == 30  # complete and valid, or absent
    assert run_cli("consolidate", FIXTURES / "z3_ws3_bf16", out, "--force", "-q").returncode == 0
    assert not [p for p in tmp_path.iterdir() if TEMP_MARK in p.name]  # the next run cleaned up


def test_kill_9_at_random_moments(tmp_path):
    _kill_trials(tmp_path, 5)


@pytest.mark.slow
def test_kill_9_at_random_moments_many(tmp_path):
    _kill_trials(tmp_path, 25)


def test_two_writers_same_out(tmp_path):
    out = tmp_path / "m.safetensors"
    cmd = [sys.executable, "-m", "dsckpt", "consolidate", str(FIXTURES / "z3_ws2_fp32"), str(out), "-q", "--force",
           "--no-client-state"]
    procs = [subprocess.Popen(cmd, cwd=ROOT) for _ in range(2)]
    assert [p.wait() for p in procs] == [0, 0]
    assert len(load_file(out)) == 30
    assert not [p for p in tmp_path.iterdir() if TEMP_MARK in p.name]


def test_fuzzer_findings_stay_fixed(tmp_path):
    """Inputs the atheris harness (fuzz/fuzz_reader.py) once crashed the reader with."""
    import shutil

    from dsckpt.errors import DsckptError
    from dsckpt.reader import open_checkpoint

    for finding in sorted((ROOT / "tests" / "data").glob("fuzz-*.bin")):
        root = tmp_path / finding.stem
        shutil.copytree(FIXTURES / "z2_ws2_fp32", root)
        targets = sorted((root / "step3").glob("*.pt"))
        data = finding.read_bytes()
        targets[data[0] % len(targets)].write_bytes(data[1:])
        with pytest.raises(DsckptError):
            open_checkpoint(root).require_complete()
