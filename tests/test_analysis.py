"""Numbers inside checkpoints (issue 15): statistics against torch, NaN/Inf gates, diffs and their exit codes."""
import json
import math
import shutil
import struct

import pytest
import torch

import dsckpt
from conftest import FIXTURE_NAMES, FIXTURES, run_cli
from dsckpt.analysis.sources import sources
from dsckpt.analysis.stats import compute_stats
from dsckpt.plan.consolidate import build_plan
from dsckpt.zero.reader import open_checkpoint

CPU_FIXTURES = [n for n in FIXTURE_NAMES if "cuda" not in n]


def _check_against_torch(stats, tensors):
    assert {s.name for s in stats} == set(tensors)
    for s in stats:
        t = tensors[s.name].double().reshape(-1)
        assert (s.count, s.nan, s.inf, s.zeros) == (t.numel(), 0, 0, int((t == 0).sum())), s.name
        assert s.min == t.min().item() and s.max == t.max().item(), s.name
        # float32 block sums (relative error ~1e-6, docs/cli.md), compared with torch in float64
        assert math.isclose(s.mean, t.mean().item(), rel_tol=1e-5, abs_tol=1e-7 * t.abs().max().item()), s.name
        assert math.isclose(s.std, t.std(unbiased=False).item(), rel_tol=1e-4, abs_tol=1e-7), s.name
        assert math.isclose(s.norm, t.norm().item(), rel_tol=1e-5), s.name


@pytest.mark.parametrize("name", CPU_FIXTURES)
def test_stats_equal_torch_on_checkpoints_and_files(name, tmp_path):
    _check_against_torch(compute_stats(sources(FIXTURES / name)), dsckpt.load_state_dict(FIXTURES / name))
    out = tmp_path / "m.pt"
    dsckpt.consolidate(FIXTURES / name, out, client_state=False)
    from_file = torch.load(out, weights_only=True)
    _check_against_torch(compute_stats(sources(out)), from_file)


@pytest.mark.parametrize("name", ["z2_ws3_bf16", "z3_ws3_bf16", "z1_ws2_fp32"])
def test_moment_stats_equal_torch(name):
    stats = [s for s in compute_stats(sources(FIXTURES / name, optimizer=True)) if s.kind == "exp_avg_sq"]
    moments = dsckpt.load_state_dict(FIXTURES / name, state="exp_avg_sq")
    _check_against_torch(stats, {f"exp_avg_sq/{k}": v for k, v in moments.items()})
    assert all(s.min >= 0 for s in stats)  # a second moment


def _plant(path, offset, value_bytes):
    """Values written into a file; a rank file's zip records updated to match (a genuinely non-finite checkpoint,
    not a damaged one, which every reading command would refuse by its CRC-32)."""
    data = bytearray(path.read_bytes())
    data[offset:offset + len(value_bytes)] = value_bytes
    if data[:4] == b"PK\x03\x04":
        _recompute_crcs(data)
    path.write_bytes(bytes(data))


def _recompute_crcs(data: bytearray) -> None:
    import io
    import zipfile
    import zlib

    with zipfile.ZipFile(io.BytesIO(bytes(data))) as zf:
        infos, central = zf.infolist(), zf.start_dir
    for info in infos:
        name_len, extra_len = struct.unpack("<HH", data[info.header_offset + 26:info.header_offset + 30])
        start = info.header_offset + 30 + name_len + extra_len
        crc = struct.pack("<I", zlib.crc32(data[start:start + info.compress_size]))
        data[info.header_offset + 14:info.header_offset + 18] = crc  # the local header's
        assert data[central:central + 4] == b"PK\x01\x02"
        data[central + 16:central + 20] = crc  # the central directory's
        n, m, k = struct.unpack("<HHH", data[central + 28:central + 34])
        central += 46 + n + m + k


def test_planted_nan_in_a_partition_and_inf_in_a_file(tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "z3_ws2_fp32", root)
    plan = build_plan(open_checkpoint(root))
    target = next(t for t in plan.tensors if t.kind == "param" and len(t.pieces) == 2)
    piece = target.pieces[1]  # rank 1's part of this parameter
    _plant(piece.path, piece.offset, struct.pack("<ff", float("nan"), float("inf")))
    proc = run_cli("check-finite", root, "--json")
    assert proc.returncode == 3
    report = json.loads(proc.stdout)
    assert report["offending"] == [{"name": target.name, "kind": "param", "nan": 1, "inf": 1,
                                    "count": math.prod(target.shape)}]
    stats = {s["name"]: s for s in json.loads(run_cli("inspect", root, "--stats", "--json").stdout)["stats"]}
    assert stats[target.name]["nan"] == 1 and stats[target.name]["inf"] == 1
    human = run_cli("check-finite", root)
    assert human.returncode == 3 and f"{target.name}: 1 NaN, 1 Inf" in human.stdout
    out = tmp_path / "clean.safetensors"
    dsckpt.consolidate(FIXTURES / "z3_ws2_fp32", out, client_state=False)
    assert run_cli("check-finite", out).returncode == 0
    from dsckpt.formats.safetensors_file import read_header

    header, start = read_header(out)
    _plant(out, start + header["norm.weight"]["data_offsets"][0] + 4, struct.pack("<f", -float("inf")))
    proc = run_cli("check-finite", out, "--json")
    assert proc.returncode == 3 and json.loads(proc.stdout)["offending"][0]["name"] == "norm.weight"
    assert run_cli("check-finite", tmp_path / "nowhere").returncode == 2


@pytest.mark.parametrize("form", ["m.safetensors", "m.pt", "sharded"])
def test_diff_proves_a_consolidated_file_equals_its_checkpoint(form, tmp_path):
    for name in CPU_FIXTURES:
        out = tmp_path / name / form
        out.parent.mkdir()
        dsckpt.consolidate(FIXTURES / name, out, client_state=False, max_shard_size="10KB")
        proc = run_cli("diff", FIXTURES / name, out, "--json")
        assert proc.returncode == 0, (name, proc.stdout[-2000:], proc.stderr[-2000:])
        report = json.loads(proc.stdout)
        assert report["identical"] and not report["only_a"] and not report["only_b"]


def test_diff_reports_changes_and_exit_codes(tmp_path):
    a = tmp_path / "a.safetensors"
    dsckpt.consolidate(FIXTURES / "z2_ws2_fp32", a, client_state=False)
    b = tmp_path / "b.safetensors"
    shutil.copy(a, b)
    from dsckpt.formats.safetensors_file import read_header

    header, start = read_header(b)
    where = start + header["norm.bias"]["data_offsets"][0]
    old = struct.unpack("<f", b.read_bytes()[where:where + 4])[0]
    _plant(b, where, struct.pack("<f", old + 0.5))
    report = json.loads(run_cli("diff", a, b, "--json").stdout)
    changed = [t for t in report["tensor_list"] if not t["equal"]]
    assert [t["name"] for t in changed] == ["norm.bias"]
    assert changed[0]["max_abs_diff"] == pytest.approx(0.5, abs=1e-6) and changed[0]["rel_l2"] > 0
    assert run_cli("diff", a, b).returncode == 1
    assert run_cli("diff", a, b, "--atol", "0.6").returncode == 0
    assert run_cli("diff", a, b, "--atol", "0.1").returncode == 1
    assert run_cli("diff", a, tmp_path / "missing.safetensors").returncode == 2
    assert json.loads(run_cli("diff", FIXTURES / "z2_ws2_fp32", a, "--json").stdout)["identical"]
    other = run_cli("diff", FIXTURES / "z3_ws2_fp32", FIXTURES / "z3_ws3_bf16", "--json")  # two runs
    assert other.returncode == 1 and any(not t["equal"] for t in json.loads(other.stdout)["tensor_list"])


@pytest.mark.runtime
def test_resumed_then_saved_run_equals_the_file_it_loaded(tmp_path):
    weights = tmp_path / "m.safetensors"
    dsckpt.consolidate(FIXTURES / "z3_ws2_fp32", weights)
    proc = run_cli("resume", "--full-weights", weights, "--model", "dsckpt.runtime.demo_model:build_small_model",
                   "--stage", "3", "--steps", "0", "--save-dir", tmp_path / "saved")
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run_cli("diff", tmp_path / "saved", weights, "--json")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert json.loads(proc.stdout)["identical"]


def test_plot_needs_the_extra_and_renders_when_present(tmp_path):
    import subprocess
    import sys

    from conftest import ROOT
    from test_packaging import BLOCKED  # the CLI with some packages made unimportable

    blocked = BLOCKED.replace("('torch', 'deepspeed', 'safetensors')", "('matplotlib',)")
    proc = subprocess.run([sys.executable, "-c", blocked, "diff", FIXTURES / "z3_ws2_fp32", FIXTURES / "z3_ws2_fp32",
                           "--plot", tmp_path / "d.png"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2 and "--plot needs matplotlib" in proc.stderr
    assert "pip install 'dsckpt[plot]'" in proc.stderr and "Traceback" not in proc.stderr
    import matplotlib  # noqa: F401  (the test extra installs it: this half never skips)
    for args in (("diff", FIXTURES / "z3_ws2_fp32", FIXTURES / "z3_ws3_bf16"), ("inspect", FIXTURES / "z3_ws2_fp32", "--stats")):
        out = tmp_path / f"{args[0]}.png"
        assert run_cli(*args, "--plot", out).returncode in (0, 1)
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
