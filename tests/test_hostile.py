"""Hostile checkpoints (issue 11): each class of attack, closed for the class, not one example.

1 code execution · 2 wrong output with exit 0 · 3 memory/output blowups · 4 files clobbered ·
5 tracebacks · 6 wrong words.  Inputs are real fixtures with one planted lie each (tests/forge.py).
"""
import json
import os
import shutil
import struct
from collections import OrderedDict

import pytest
import torch

from conftest import FIXTURES, run_cli
from forge import Call, Forge, nested_lists_pickle, replace_data_pkl, save_forged

SMALL = ("--model", "dsckpt.runtime.demo_model:build_small_model")


def clean_error(proc, *fragments):
    """Exit 2, one `dsckpt: error:` line (+ hint), no traceback, each fragment named."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr and proc.stderr.count("dsckpt: error:") == 1, proc.stderr[-2000:]
    assert len(proc.stderr) < 2000  # a bounded message, whatever the input
    for fragment in fragments:
        assert fragment in proc.stderr, proc.stderr


def found_problem(proc, fragment):
    """inspect of a damaged file: exit 1 listing the problem, or exit 2 with it; never a traceback."""
    assert proc.returncode in (1, 2) and fragment in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr


def copy_fixture(tmp_path, name="z2_ws2_fp32"):
    dst = tmp_path / name
    shutil.copytree(FIXTURES / name, dst)
    return dst


def edit_rank_file(root, pattern, edit):
    """Load one rank file (our own trusted fixture), let ``edit`` change it, save it forged."""
    path = next((root / "step3").glob(pattern))
    obj = torch.load(path, weights_only=False)
    save_forged(edit(obj) or obj, path)
    return path


# -- 1. code execution ------------------------------------------------------------------------
def _plant_payload(tmp_path, marker):
    root = copy_fixture(tmp_path, "z3_ws1_fp32")
    edit_rank_file(root, "zero_pp_rank_0_*model_states.pt",
                   lambda sd: sd.update(evil=Call(os.system, f"touch {marker}")))
    return root


@pytest.mark.runtime
def test_sharded_resume_never_runs_checkpoint_code(tmp_path):
    marker = tmp_path / "pwned"
    root = _plant_payload(tmp_path, marker)
    proc = run_cli("resume", root, "--stage", "3", *SMALL, "--steps", "1")
    clean_error(proc, "names posix.system", "--trust-checkpoint")
    assert not marker.exists()
    for cmd in (("inspect", root), ("consolidate", root, tmp_path / "m.safetensors")):
        assert run_cli(*cmd).returncode in (0, 1) and not marker.exists()  # read as an opaque record


def test_deepspeed_loader_is_weights_only_in_ranks(tmp_path):
    """Defence in depth: the engine's own loader, as installed in every rank, refuses the payload."""
    from dsckpt.errors import UnsafeCheckpointError
    from dsckpt.checkpoint_engine.safe_load import safe_torch_load

    marker = tmp_path / "pwned"
    root = _plant_payload(tmp_path, marker)
    with pytest.raises(UnsafeCheckpointError, match="names posix.system"):
        safe_torch_load(str(next((root / "step3").glob("zero_pp_rank_0_*model_states.pt"))))
    assert not marker.exists()
    for path in sorted(FIXTURES.glob("*/step3/*.pt")):  # DeepSpeed's own files load: stage 0-3, fp32/bf16/fp16
        assert isinstance(safe_torch_load(str(path), map_location="cpu"), dict)


# -- 2. wrong output with exit 0 ---------------------------------------------------------------
def _forge_partition(tmp_path, **geometry):
    root = copy_fixture(tmp_path)
    def edit(sd):
        groups = sd["optimizer_state_dict"]["single_partition_of_fp32_groups"]
        groups[0] = Forge(groups[0], **geometry)
    edit_rank_file(root, "zero_pp_rank_1_*optim_states.pt", edit)
    return root


@pytest.mark.parametrize("geometry,fragment", [
    ({"offset": -4}, "malformed geometry"),
    ({"offset": -10**12}, "malformed geometry"),
    ({"stride": (-1,)}, "malformed geometry"),
    ({"shape": ("4",)}, "malformed geometry"),
    ({"offset": 10**6}, "does not fit its storage"),
    ({"state": {"offset": -8}}, "BUILD on a TensorRef"),
    ({"state": (None, {"file": "elsewhere"})}, "BUILD on a TensorRef"),
])
def test_forged_tensor_geometry_is_refused(tmp_path, geometry, fragment):
    root = _forge_partition(tmp_path, **geometry)
    clean_error(run_cli("consolidate", root, tmp_path / "m.safetensors", "--verify"), "zero_pp_rank_1", fragment)
    assert not (tmp_path / "m.safetensors").exists()
    assert run_cli("inspect", root).returncode == 1


def test_overlapping_zip_entries_are_refused(tmp_path):
    """One storage's zip entry pointed at another storage's bytes (central directory edited)."""
    import zipfile

    root = copy_fixture(tmp_path)
    path = next((root / "step3").glob("zero_pp_rank_0_*optim_states.pt"))
    with zipfile.ZipFile(path) as zf:
        storages = [i for i in zf.infolist() if "/data/" in i.filename]
        pos = zf.start_dir
    data = bytearray(path.read_bytes())
    while data[pos:pos + 4] == b"PK\x01\x02":  # walk the central directory to the second storage's record
        name_len, extra_len, comment_len = struct.unpack_from("<HHH", data, pos + 28)
        if data[pos + 46:pos + 46 + name_len].decode() == storages[1].filename:
            struct.pack_into("<I", data, pos + 42, storages[0].header_offset)
            break
        pos += 46 + name_len + extra_len + comment_len
    path.write_bytes(bytes(data))
    proc = run_cli("consolidate", root, tmp_path / "m.safetensors")
    clean_error(proc, str(path.name), "overlap")


@pytest.mark.parametrize("extra,stale", [("zero_pp_rank_00_mp_rank_00_optim_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"),
                                         ("bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"),
                                         ("zero_pp_rank_01_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt")])
def test_two_files_claiming_one_rank_are_a_problem(tmp_path, extra, stale):
    root = copy_fixture(tmp_path, "z3_ws2_fp32")
    shutil.copy(root / "step3" / stale, root / "step3" / extra)
    proc = run_cli("inspect", root, "--json")
    assert proc.returncode == 1
    assert any("both claim" in p and extra in p for p in json.loads(proc.stdout)["problems"])
    clean_error(run_cli("consolidate", root, tmp_path / "m.safetensors"), "both claim", extra)


# -- 3. memory and output blowups ----------------------------------------------------------------
@pytest.mark.parametrize("plant,fragment", [
    (lambda sd: sd.update(blob=Call(bytearray, 3 * 10**9)), "a bytearray of 3,000,000,000 items"),
    (lambda sd: sd.update(s=Call(frozenset, range(2 * 10**7))), "a frozenset of 20,000,000 items"),
    (lambda sd: sd.update(dp_world_size=10**7), "'dp_world_size' is 10,000,000, above the limit of 65,536"),
    (lambda sd: sd.update(big=2 ** 20000), None),  # an int beyond str()'s 4300 digits: works
])
def test_declared_sizes_are_bounded(tmp_path, plant, fragment):
    root = copy_fixture(tmp_path, "z3_ws1_fp32")
    edit_rank_file(root, "zero_pp_rank_0_*model_states.pt", plant)
    out = tmp_path / "m.safetensors"
    proc = run_cli("consolidate", root, out)
    inspect = run_cli("inspect", root, "--json")
    if fragment is None:
        assert proc.returncode == 0 and inspect.returncode == 0, proc.stderr + inspect.stderr
        sidecar = json.loads((tmp_path / "m.safetensors.client_state.json").read_text())["client_state"]
        assert int(sidecar["big"]["__int_hex__"], 16) == 2 ** 20000
        assert json.loads(inspect.stdout)["client_state"]["big"] == {"type": "int", "bits": 20001}
    else:
        clean_error(proc, fragment)
        assert inspect.returncode in (1, 2) and len(inspect.stdout) < 20000 and "Traceback" not in inspect.stderr


def test_many_missing_ranks_are_one_summarized_problem(tmp_path):
    root = copy_fixture(tmp_path, "z3_ws2_fp32")
    for pattern in ("zero_pp_rank_0_*model_states.pt", "zero_pp_rank_1_*model_states.pt"):
        edit_rank_file(root, pattern, lambda sd: sd.update(dp_world_size=50_000))
    for pattern in ("zero_pp_rank_*optim_states.pt",):
        for path in (root / "step3").glob(pattern):
            obj = torch.load(path, weights_only=False)
            obj["optimizer_state_dict"]["partition_count"] = 50_000
            save_forged(obj, path)
    problems = json.loads(run_cli("inspect", root, "--json").stdout)["problems"]
    assert len(problems) <= 2 * 21 + 2
    assert "... and 49,978 more like the above" in problems


def test_oversized_pickle_and_latest(tmp_path):
    root = copy_fixture(tmp_path)
    path = next((root / "step3").glob("zero_pp_rank_0_*optim_states.pt"))
    replace_data_pkl(path, b"\x80\x02N." + b"\0" * (300 << 20), compress=True)  # 0.3 MB zip, 300 MiB declared
    assert path.stat().st_size < 2 << 20
    clean_error(run_cli("consolidate", root, tmp_path / "m.safetensors"), "the size data.pkl declares",
                "above the limit of 268,435,456", "DSCKPT_MAX_PICKLE_BYTES")
    root2 = copy_fixture(tmp_path, "z3_ws2_fp32")
    with open(root2 / "latest", "r+b") as fh:
        fh.truncate(400 << 20)  # sparse: costs no disk
    clean_error(run_cli("inspect", root2), "latest: longer than 4096 bytes")


# -- 4. files left or clobbered -----------------------------------------------------------------
def _sidecars(out):
    return [p for p in out.parent.iterdir() if p.name.startswith(out.name + ".client_state")]


def test_out_and_sidecars_succeed_or_fail_together(tmp_path):
    ckpt = FIXTURES / "z3_ws2_fp32"
    folder = tmp_path / "m.safetensors"
    folder.mkdir()
    clean_error(run_cli("consolidate", ckpt, folder, "--force"), "is a directory")
    plain = tmp_path / "model"
    plain.write_text("mine")
    clean_error(run_cli("consolidate", ckpt, plain, "--force"), "is a file, and a sharded output is a folder")
    assert _sidecars(folder) == [] and _sidecars(plain) == [] and plain.read_text() == "mine"
    out = tmp_path / "n.safetensors"
    mine = tmp_path / "n.safetensors.client_state.json"
    mine.write_text("user's own")
    clean_error(run_cli("consolidate", ckpt, out), "n.safetensors.client_state.json: already exists")
    clean_error(run_cli("consolidate", ckpt, out, "--no-client-state"), "already exists")
    assert mine.read_text() == "user's own" and not out.exists()
    assert run_cli("consolidate", ckpt, out, "--force").returncode == 0  # --force: both replaced together
    assert json.loads(mine.read_text())["weights"] == "n.safetensors"


def test_out_inside_the_checkpoint_is_refused(tmp_path):
    root = copy_fixture(tmp_path, "z3_ws2_fp32")
    clean_error(run_cli("consolidate", root, root / "step3" / "m.safetensors"), "inside the checkpoint")
    clean_error(run_cli("consolidate", root / "step3", root / "m.safetensors"), "inside the checkpoint")


@pytest.mark.runtime  # (its resume run imports DeepSpeed)
# -- 5. tracebacks instead of one line ------------------------------------------------------------
def test_deep_nesting_everywhere_is_a_typed_error(tmp_path):
    from safetensors.torch import save_file

    root = copy_fixture(tmp_path)
    path = next((root / "step3").glob("zero_pp_rank_1_*optim_states.pt"))
    replace_data_pkl(path, nested_lists_pickle(100_000))
    clean_error(run_cli("consolidate", root, tmp_path / "m.safetensors"), path.name, "nesting depth")
    depth = 100_000  # the same inside a recorded object's items: defaultdict(None, {"k": [[[...]]]})
    inside = b"\x80\x02ccollections\ndefaultdict\n)R(X\x01\x00\x00\x00k" + b"]" * depth + b"a" * (depth - 1) + b"u."
    replace_data_pkl(path, inside)
    clean_error(run_cli("consolidate", root, tmp_path / "m.safetensors"), path.name, "nesting depth")
    deep = "[" * 100_000 + "]" * 100_000
    st = tmp_path / "deep.safetensors"
    save_file({"x": torch.zeros(2)}, st)
    raw = st.read_bytes()
    header = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])
    header["__metadata__"] = {"k": "v"}
    text = json.dumps(header)[:-1] + f', "z": {deep}}}'
    st.write_bytes(struct.pack("<Q", len(text)) + text.encode() + raw[8 + struct.unpack("<Q", raw[:8])[0]:])
    found_problem(run_cli("inspect", st), "nested too deeply")
    index = tmp_path / "sharded" / "model.safetensors.index.json"
    index.parent.mkdir()
    index.write_text('{"weight_map": ' + deep + "}")
    found_problem(run_cli("inspect", index), "nested too deeply")
    clean_error(run_cli("resume", "--full-weights", index, "--steps", "1"), "nested too deeply")


def test_symlink_loop_rank_file(tmp_path):
    root = copy_fixture(tmp_path)
    victim = next((root / "step3").glob("zero_pp_rank_1_*optim_states.pt"))
    victim.unlink()
    victim.symlink_to(victim.name)
    clean_error(run_cli("inspect", root), "a symlink loop")


@pytest.mark.runtime  # (its resume run imports DeepSpeed)
@pytest.mark.parametrize("header_edit,fragment", [
    (lambda h: h["x"].update(shape=["4"]), "malformed header entry"),
    (lambda h: h["x"].update(shape=[2.5, 1.6]), "malformed header entry"),
    (lambda h: h["x"].update(data_offsets=[0, 16.0]), "malformed header entry"),
    (lambda h: h.update(__metadata__={"dsckpt.aliases": '["a", "b"]'}), "'dsckpt.aliases' must map names to names"),
    (lambda h: h.update(__metadata__={"dsckpt.aliases": '{"a": ["x"]}'}), "'dsckpt.aliases' must map names to names"),
])
def test_malformed_safetensors_headers(tmp_path, header_edit, fragment):
    from safetensors.torch import save_file

    st = tmp_path / "m.safetensors"
    save_file({"x": torch.zeros(4)}, st)
    raw = st.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    header_edit(header)
    text = json.dumps(header).encode()
    st.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])
    found_problem(run_cli("inspect", st), fragment)
    clean_error(run_cli("resume", "--full-weights", st, "--steps", "1"), fragment)


@pytest.mark.runtime  # (its resume run imports DeepSpeed)
@pytest.mark.parametrize("weight_map,fragment", [
    ({"x": 3}, "must map tensor names to file names"),
    ({"x": ["a.safetensors"]}, "must map tensor names to file names"),
    ({"x": "../elsewhere.safetensors"}, "is a path"),
    ({"x": "/etc/passwd"}, "is a path"),
    ({"x": "b.safetensors", "y": "a.safetensors"}, "tensor 'y' is in shard 'b.safetensors', but the index puts it in 'a.safetensors'"),
])
def test_malformed_indexes(tmp_path, weight_map, fragment):
    from safetensors.torch import save_file

    folder = tmp_path / "sharded"
    folder.mkdir()
    save_file({"y": torch.ones(2)}, folder / "a.safetensors")
    save_file({"x": torch.zeros(2), "y": torch.zeros(2)}, folder / "b.safetensors")  # y in two shards
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    found_problem(run_cli("inspect", folder / "model.safetensors.index.json"), fragment)
    clean_error(run_cli("resume", "--full-weights", folder, "--steps", "1"), fragment)


def test_sidecar_naming_a_missing_tensor(tmp_path):
    from dsckpt.errors import CorruptFileError
    from dsckpt.export.sidecar import read_sidecar

    sidecar = tmp_path / "m.safetensors.client_state.json"
    sidecar.write_text(json.dumps({"client_state": {"t": {"__tensor__": "t9"}}}))
    with pytest.raises(CorruptFileError, match="names tensor 't9', absent from its companion file"):
        read_sidecar(sidecar)
    sidecar.write_text('{"client_state": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(CorruptFileError, match="nested too deeply"):
        read_sidecar(sidecar)


# -- 6. clean but wrong words ---------------------------------------------------------------------
def test_latest_symlink_outside_is_not_read(tmp_path):
    root = copy_fixture(tmp_path, "z3_ws2_fp32")
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET-CONTENT")
    (root / "latest").unlink()
    (root / "latest").symlink_to(secret)
    proc = run_cli("inspect", root)
    clean_error(proc, "symlink to", "outside the checkpoint; not read")
    assert "TOP-SECRET" not in proc.stderr + proc.stdout


@pytest.mark.parametrize("special,fragment", [("/dev/zero", "is a device"), ("fifo", "is a FIFO")])
def test_devices_and_fifos_are_named(tmp_path, special, fragment):
    path = special
    if special == "fifo":
        path = tmp_path / "pipe"
        os.mkfifo(path)
    clean_error(run_cli("inspect", path), fragment)
    root = copy_fixture(tmp_path, "z3_ws2_fp32")
    victim = root / "step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    victim.unlink()
    if special == "fifo":
        os.mkfifo(victim)
    else:
        victim.symlink_to(special)
    clean_error(run_cli("inspect", root), "expected a rank file, found " + fragment.split()[-2] + " " + fragment.split()[-1])


def test_tag_symlinked_from_elsewhere_is_reported(tmp_path):
    root = copy_fixture(tmp_path, "z3_ws2_fp32")
    elsewhere = tmp_path / "scratch"
    shutil.move(root / "step3", elsewhere)
    (root / "step3").symlink_to(elsewhere)
    summary = json.loads(run_cli("inspect", root, "--json").stdout)
    assert summary["problems"] == [] and any("outside" in n and "followed" in n for n in summary["notes"])


def test_reading_errors_are_not_called_writing_errors(tmp_path):
    import errno

    from dsckpt.io.output import write_errors
    from dsckpt.errors import CorruptFileError, OutputError

    with pytest.raises(CorruptFileError, match="rank.pt: reading failed"):
        with write_errors(tmp_path / "m.safetensors"):
            raise OSError(errno.EIO, "Input/output error", str(tmp_path / "rank.pt"))
    with pytest.raises(OutputError, match="writing failed"):
        with write_errors(tmp_path / "m.safetensors"):
            raise OSError(errno.ENOSPC, "No space left on device")


def test_pickle_memo_index_cannot_allocate(tmp_path):
    """`LONG_BINPUT 2**31-1` made CPython's C unpickler grow its memo array to 2**32 slots (the fuzzer's
    OOM); dsckpt's unpickler keeps a dict.  Run under a 1.5 GiB address-space limit."""
    import resource
    import subprocess
    import sys

    from conftest import ROOT

    root = copy_fixture(tmp_path)
    path = next((root / "step3").glob("zero_pp_rank_1_*optim_states.pt"))
    replace_data_pkl(path, b"\x80\x02}r\xff\xff\xff\x7f.")
    limit = lambda: resource.setrlimit(resource.RLIMIT_AS, (1536 << 20, 1536 << 20))  # noqa: E731
    proc = subprocess.run([sys.executable, "-m", "dsckpt", "inspect", str(root)], capture_output=True, text=True,
                          cwd=ROOT, preexec_fn=limit, timeout=60)
    assert proc.returncode == 1 and "MemoryError" not in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr


# -- 6. damage the zip cannot see: bytes overwritten, CRC-32 record left as it was -------------------
@pytest.fixture
def damaged_masters(tmp_path):
    from malformed import flip

    return flip("z2_ws2_fp32", "zero_pp_rank_0_*optim*", "tensor data")(tmp_path)


def test_every_command_that_reads_values_checks_crcs(damaged_masters, tmp_path):
    """The fp32 masters' bytes changed, their CRC-32 not: every reading command refuses, naming file and storage."""
    named = ("zero_pp_rank_0_mp_rank_00_optim_states.pt", "fails its CRC-32 check")
    for args in (("check-finite", damaged_masters), ("diff", damaged_masters, damaged_masters),
                 ("inspect", damaged_masters, "--stats"), ("consolidate", damaged_masters, tmp_path / "m.pt"),
                 ("convert", damaged_masters, tmp_path / "u", "--to", "universal")):
        clean_error(run_cli(*args), *named)
    assert not (tmp_path / "m.pt").exists() and not (tmp_path / "u").exists()
    from dsckpt import load_state_dict
    from dsckpt.errors import CorruptFileError

    with pytest.raises(CorruptFileError, match="fails its CRC-32 check"):
        load_state_dict(damaged_masters)


def test_processes_that_pool_their_crc_checks_still_refuse_damage(damaged_masters, tmp_path):
    """--nproc 2 on one host: each process notes the CRCs of what it copies and checks its share of the storages
    from everyone's notes after the write; the damaged masters are still refused, and nothing is published."""
    named = ("zero_pp_rank_0_mp_rank_00_optim_states.pt", "fails its CRC-32 check")
    for verb, out, extra in (("consolidate", tmp_path / "m.safetensors", ()), ("reshard", tmp_path / "rs", ("-w", "3")),
                             ("convert", tmp_path / "u", ("--to", "universal"))):
        clean_error(run_cli(verb, damaged_masters, out, *extra, "--nproc", "2"), *named)
    assert [p.name for p in tmp_path.iterdir() if p != damaged_masters] == []  # no output, temp or view


def test_skip_crc_check_reads_anyway_and_says_so(damaged_masters):
    proc = run_cli("check-finite", damaged_masters, "--skip-crc-check")
    assert proc.returncode in (0, 3), proc.stderr
    assert "note: CRC-32 checks skipped" in proc.stderr


@pytest.mark.runtime
def test_the_engines_load_at_another_world_size_refuses_damaged_bytes(damaged_masters, tmp_path):
    """enable_async_save's load_checkpoint answers DeepSpeed from the reshard plan: the partitions it reads are
    CRC-checked too (they were not: only the plan's unchanged tensors were), on every rank, before DeepSpeed sees
    a byte of them."""
    from conftest import run_job

    run_job("load_damaged.py", 3, damaged_masters, 2, tmp_path / "said.json")
    said = json.loads((tmp_path / "said.json").read_text())
    assert all(s and "fails its CRC-32 check" in s and "zero_pp_rank_0_mp_rank_00_optim_states.pt" in s
               for s in said), said


@pytest.mark.runtime  # (resume's preflight imports DeepSpeed)
def test_sharded_resume_refuses_damaged_bytes_before_any_rank_starts(damaged_masters):
    clean_error(run_cli("resume", damaged_masters, "--steps", "1"), "fails its CRC-32 check")
