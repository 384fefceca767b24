import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import FIXTURE_NAMES, FIXTURES, run_cli
from dsckpt.api.options import WriteOptions
from dsckpt.progress import Phase, Tally
from dsckpt import consolidate, iter_state_dict, load_state_dict
from dsckpt.errors import OutputError

TIED = {"head.weight": "embed.weight"}


def reference(name):
    return torch.load(FIXTURES / name / "reference.pt", weights_only=True)


def assert_matches_reference(name, sd):
    """Consolidated fp32 masters, cast to the module dtype, equal the live module bit for bit."""
    for key, live in reference(name).items():
        got = sd[key] if key in sd else sd[TIED[key]]
        assert got.shape == live.shape, key
        assert torch.equal(got.to(live.dtype), live), key
        if key in ("tokens_seen",):
            assert got.dtype == torch.int64


@pytest.mark.parametrize("name", FIXTURE_NAMES)
@pytest.mark.parametrize("form", ["model.safetensors", "model.pt", "sharded"])
def test_every_fixture_and_form_matches_live_weights(name, form, tmp_path):
    out = tmp_path / form
    result = consolidate(FIXTURES / name, out, max_shard_size="10KB", verify=True)
    assert result.verified
    if form == "model.pt":
        sd = torch.load(out, weights_only=True)
        assert sd["head.weight"].data_ptr() == sd["embed.weight"].data_ptr()  # torch keeps real aliases
    elif form == "sharded":
        index = json.loads((out / "model.safetensors.index.json").read_text())
        files = sorted(p.name for p in out.glob("model-*.safetensors"))
        assert len(files) > 1 and sorted(set(index["weight_map"].values())) == files
        sd = {}
        for f in files:
            part = load_file(out / f)
            assert not set(part) & set(sd)  # every tensor exactly once
            sd.update(part)
        assert set(sd) == set(index["weight_map"])
        assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in sd.values())
    else:
        sd = load_file(out)
        meta = json.loads(json.dumps(__import__("safetensors").safe_open(str(out), "pt").metadata()))
        assert json.loads(meta["dsckpt.aliases"]) == TIED and "head.weight" not in sd
    assert_matches_reference(name, sd)
    for t in sd.values():
        if t.is_floating_point() and t.dim() > 1:
            assert t.dtype == torch.float32  # fp32 masters by default, frozen ones upcast


@pytest.mark.parametrize("name", ["z1_ws2_fp32", "z2_ws3_bf16", "z3_ws3_bf16"])
def test_trainable_params_equal_zero_to_fp32(name):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    theirs = get_fp32_state_dict_from_zero_checkpoint(str(FIXTURES / name))
    ours = load_state_dict(FIXTURES / name)
    trainable = [k for k in theirs if not k.startswith("blocks.0.") and k not in ("logit_scale", "tokens_seen")]
    assert len(trainable) == 17
    for k in trainable:
        assert torch.equal(ours[k], theirs[k].contiguous()), k
    # where it is wrong: ZeRO-1 frozen params are missing from its output; bf16 frozen stay bf16
    if name.startswith("z1"):
        assert "blocks.0.qkv.weight" not in theirs and "blocks.0.qkv.weight" in ours
    else:
        assert theirs["blocks.0.qkv.weight"].dtype == torch.bfloat16 and ours["blocks.0.qkv.weight"].dtype == torch.float32


def test_bf16_output_equals_fp32_output_cast(tmp_path):
    consolidate(FIXTURES / "z3_ws2_fp32", tmp_path / "a.safetensors")
    consolidate(FIXTURES / "z3_ws2_fp32", tmp_path / "b.safetensors", dtype="bf16")
    a, b = load_file(tmp_path / "a.safetensors"), load_file(tmp_path / "b.safetensors")
    for k in a:
        want = a[k].to(torch.bfloat16) if a[k].is_floating_point() else a[k]
        assert b[k].dtype == want.dtype and torch.equal(b[k], want), k
    assert b["tokens_seen"].dtype == torch.int64


def test_exclude_frozen_duplicate_tied_and_strip_prefix(tmp_path):
    out = tmp_path / "m.safetensors"
    consolidate(FIXTURES / "z2_ws2_fp32", out, exclude_frozen=True, duplicate_tied=True, strip_prefixes=("blocks.",))
    sd = load_file(out)
    assert not any(k.startswith("0.") for k in sd) and "1.qkv.weight" in sd
    assert torch.equal(sd["head.weight"], sd["embed.weight"])


def test_iterator_and_in_memory_api_agree():
    full = load_state_dict(FIXTURES / "z3_ws3_bf16")
    streamed = dict(iter_state_dict(FIXTURES / "z3_ws3_bf16"))
    assert set(full) == set(streamed)
    assert all(torch.equal(full[k], streamed[k]) for k in full)


def test_client_state_sidecar_round_trips(tmp_path):
    from dsckpt.export.sidecar import read_sidecar

    consolidate(FIXTURES / "z3_ws2_fp32", tmp_path / "m.safetensors")
    client = read_sidecar(tmp_path / "m.safetensors.client_state.json")
    saved = torch.load(FIXTURES / "z3_ws2_fp32/step3/zero_pp_rank_0_mp_rank_00_model_states.pt", weights_only=True)
    assert client["global_step"] == saved["global_step"] == 3
    assert client["rng"]["python"] == saved["rng"]["python"]  # tuples restored as tuples
    assert torch.equal(client["rng"]["torch"], saved["rng"]["torch"])
    assert client["user"]["nested"] == {"values": [1, 2.5, None], "pair": (3, "x")}
    assert torch.equal(client["user"]["tensor"], saved["user"]["tensor"])


class Tags(list):
    """A client's own list subclass: pickled as the object, then APPENDS of its items."""


def test_client_containers_beyond_dict_and_list_are_read_and_round_trip(tmp_path, fixture_copy):
    """A ``defaultdict`` (and any dict or list subclass: pickled as an object, then SETITEMS / APPENDS) stopped every
    command with "cannot parse data.pkl (TypeError: 'defaultdict' object does not support item assignment)"; sets,
    complex numbers and bytearrays came back from the sidecar as lists, an opaque name and bytes."""
    from collections import Counter, defaultdict

    from dsckpt import reshard
    from dsckpt.export.sidecar import read_sidecar

    root = fixture_copy("z2_ws2_fp32")
    path = root / "step3" / "mp_rank_00_model_states.pt"
    state = torch.load(path, weights_only=False)  # (the test's own copy of a committed fixture)
    plain = {"aset": {1, (2, "x")}, "fset": frozenset({"a"}), "cplx": complex(1.5, float("nan")),
             "ba": bytearray(b"\x00\xff"), "looks_tagged": {"__set__": [1]}}
    foreign = {"seen": defaultdict(list, {"k": [1, 2]}), "counts": Counter(a=2), "tags": Tags(["x", "y"])}
    state["user"] = {**state["user"], **plain, **foreign}
    torch.save(state, path)

    assert run_cli("inspect", root).returncode == 0
    consolidate(root, tmp_path / "m.safetensors")
    client = read_sidecar(tmp_path / "m.safetensors.client_state.json")["user"]
    assert client["aset"] == plain["aset"] and type(client["fset"]) is frozenset and type(client["ba"]) is bytearray
    assert client["ba"] == plain["ba"] and client["cplx"].real == 1.5 and client["cplx"].imag != client["cplx"].imag
    assert client["looks_tagged"] == {"__set__": [1]}  # a user's dict is not read back as a tag
    assert client["seen"] == {"__opaque__": "collections.defaultdict"}

    left_out = reshard(root, tmp_path / "ws3", 3, options=WriteOptions(fsync=False))
    assert "collections.defaultdict" in left_out.notes[0] and "test_consolidate.Tags" in left_out.notes[0]
    reshard(root, tmp_path / "trusted", 3, options=WriteOptions(fsync=False, trust=True))
    written = torch.load(tmp_path / "trusted" / "step3" / "mp_rank_00_model_states.pt", weights_only=False)["user"]
    assert all(written[k] == v and type(written[k]) is type(v) for k, v in foreign.items()), written


def test_numpy_client_state_is_data_carried_loaded_and_exported(tmp_path, fixture_copy):
    """numpy arrays, scalars and RNG states (Megatron-DeepSpeed and GPT-NeoX save np.random.get_state() beside the
    weights) are numpy's own rebuilders of plain numbers: reshard carries them without --trust-checkpoint, dsckpt's
    weights-only loader for DeepSpeed rebuilds them, the sidecar keeps them as arrays.  They were foreign classes:
    left out by reshard, refused by `resume`, names only in the sidecar."""
    import numpy as np

    from dsckpt import reshard
    from dsckpt.export.sidecar import read_sidecar
    from dsckpt.checkpoint_engine.safe_load import check_checkpoint_classes, safe_torch_load
    from dsckpt.zero.reader import open_checkpoint

    root = fixture_copy("z2_ws2_fp32")
    path = root / "step3" / "mp_rank_00_model_states.pt"
    state = torch.load(path, weights_only=False)  # (the test's own copy of a committed fixture)
    numpy_state = {"np_rng_state": np.random.RandomState(5).get_state(), "f64": np.arange(6.0).reshape(2, 3),
                   "fortran": np.asfortranarray(np.arange(6, dtype=np.int32).reshape(2, 3)), "step": np.int64(9),
                   "scale": np.float32(0.5)}
    state["user"] = {**state["user"], **numpy_state}
    torch.save(state, path)

    def same(a, b):
        if isinstance(a, np.ndarray):
            return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
        if isinstance(a, tuple):
            return isinstance(b, tuple) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        return type(a) is type(b) and a == b

    check_checkpoint_classes(open_checkpoint(root))  # what `resume` asks before DeepSpeed loads: no refusal
    loaded = safe_torch_load(path)["user"]
    assert all(same(v, loaded[k]) for k, v in numpy_state.items())
    result = reshard(root, tmp_path / "ws3", 3, options=WriteOptions(fsync=False))
    assert not result.notes, result.notes
    written = safe_torch_load(tmp_path / "ws3" / "step3" / "mp_rank_00_model_states.pt")["user"]
    assert all(same(v, written[k]) for k, v in numpy_state.items())
    consolidate(root, tmp_path / "m.safetensors")
    exported = read_sidecar(tmp_path / "m.safetensors.client_state.json")["user"]
    assert all(same(v, exported[k]) for k, v in numpy_state.items()), exported


def test_output_refusals(tmp_path, fixture_copy):
    out = tmp_path / "m.safetensors"
    out.write_text("keep me")
    with pytest.raises(OutputError, match="already exists") as refused:
        consolidate(FIXTURES / "z2_ws2_fp32", out)
    assert out.read_text() == "keep me" and "--force" in refused.value.hint
    root = fixture_copy("z2_ws2_fp32")
    victim = root / "step3" / "mp_rank_00_model_states.pt"
    with pytest.raises(OutputError, match="refusing to write over an input"):
        consolidate(root, victim, options=WriteOptions(force=True))
    proc = run_cli("consolidate", root, tmp_path / "missing" / "m.safetensors")
    assert proc.returncode == 2 and "folder" in proc.stderr and "does not exist" in proc.stderr


def test_failed_write_leaves_nothing(tmp_path, monkeypatch):
    import dsckpt.io.safetensors_writer as writer

    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(writer, "copy_range", boom)
    with pytest.raises(OutputError, match="m.safetensors: writing failed \\(No space left on device\\)"):
        consolidate(FIXTURES / "z3_ws2_fp32", tmp_path / "m.safetensors")
    assert [p.name for p in tmp_path.iterdir()] == []


@pytest.mark.parametrize("small_copy", [0, 1 << 20])  # large ranges' paths; a read and a write
@pytest.mark.parametrize("src_off,dst_off", [(0, 0), (4096, 8192), (64, 200), (4095, 1), (130, 130)])
def test_copy_range_any_offsets(tmp_path, monkeypatch, src_off, dst_off, small_copy):
    """Pages in step go through copy_file_range, out of step through mapped windows (small here, so a range
    spans several), small ranges through pread and pwrite: the bytes land the same every way."""
    import os

    import dsckpt.io.filecopy as filecopy

    monkeypatch.setattr(filecopy, "MAP_WINDOW", 3 * 4096 + 5)
    monkeypatch.setattr(filecopy, "SMALL_COPY", small_copy)
    data = os.urandom(50_000)
    src, dst = tmp_path / "src.bin", tmp_path / "dst.bin"
    src.write_bytes(data)
    dst.write_bytes(b"\0" * (dst_off + 60_000))
    n = len(data) - src_off - 7
    with open(src, "rb") as fi, open(dst, "r+b") as fo:
        filecopy.copy_range(fi.fileno(), fo.fileno(), n, src_off, dst_off, src)
    out = dst.read_bytes()
    assert out[dst_off:dst_off + n] == data[src_off:src_off + n]
    assert out[:dst_off] == b"\0" * dst_off and out[dst_off + n:] == b"\0" * (60_000 - n)


@pytest.mark.parametrize("small_copy", [0, 1 << 20])
def test_copy_range_notes_the_crc_of_what_it_copied(tmp_path, monkeypatch, small_copy):
    """The mapped copy (CRC taken slice by slice as written) and the small read note the CRC-32 of the very
    bytes copied, which the integrity check joins per storage."""
    import os
    import zlib

    import dsckpt.io.filecopy as filecopy
    from dsckpt.io.integrity import Ledger

    monkeypatch.setattr(filecopy, "MAP_WINDOW", 3 * 4096 + 5)
    monkeypatch.setattr(filecopy, "MAPPED_SLICE", 1000)
    monkeypatch.setattr(filecopy, "SMALL_COPY", small_copy)
    data = os.urandom(50_000)
    src, dst = tmp_path / "src.bin", tmp_path / "dst.bin"
    src.write_bytes(data)
    ledger = Ledger()
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        filecopy.copy_range(fi.fileno(), fo.fileno(), 40_000, 130, 7, src, ledger=ledger)
    spans = ledger.spans(lambda path: path.name)["src.bin"]
    assert sum(n for _, n, _ in spans) == 40_000 and (len(spans) > 1) == (small_copy == 0)
    assert all(crc == zlib.crc32(data[offset:offset + n]) for offset, n, crc in spans)
    assert dst.read_bytes()[7:] == data[130:40_130]


def test_copy_pieces_writes_segments_and_zero_fills_in_order(tmp_path, monkeypatch):
    """A reshard's storage copied straight into its zip: segments of two files and zero fills, through a buffer
    smaller than a piece; the CRC-32 of the whole, and each buffer's noted for the integrity check."""
    import os
    import zlib

    import dsckpt.io.filecopy as filecopy
    from dsckpt.io.integrity import Ledger
    from dsckpt.plan.segments import Segment, Zeros

    monkeypatch.setattr(filecopy, "BUFFER", 4096 + 5)
    monkeypatch.setattr(filecopy, "_THREAD", __import__("threading").local())
    one, two = tmp_path / "a.bin", tmp_path / "b.bin"
    one.write_bytes(os.urandom(200_000))
    two.write_bytes(os.urandom(30_000))
    pieces = [Segment(one, 77, 150_000), Zeros(5), Segment(two, 3, 20_000), Zeros(0), Segment(one, 0, 1)]
    expected = one.read_bytes()[77:150_077] + bytes(5) + two.read_bytes()[3:20_003] + one.read_bytes()[:1]
    fds = {p: os.open(p, os.O_RDONLY) for p in (one, two)}
    out, ledger, seen = tmp_path / "out.bin", Ledger(), []
    with open(out, "wb") as fo:
        fo.write(b"head")
        copied = filecopy.copy_pieces(pieces, fds.__getitem__, fo.fileno(), 4, progress=seen.append, ledger=ledger)
    assert copied == (len(expected), zlib.crc32(expected)) and sum(seen) == len(expected)
    assert out.read_bytes() == b"head" + expected
    for path, spans in ledger.spans(lambda path: path).items():
        assert all(crc == zlib.crc32(path.read_bytes()[offset:offset + n]) for offset, n, crc in spans)
    for fd in fds.values():
        os.close(fd)


def test_copy_pieces_names_a_short_source(tmp_path):
    import os

    from dsckpt.errors import CorruptFileError
    import dsckpt.io.filecopy as filecopy
    from dsckpt.plan.segments import Segment

    src = tmp_path / "rank.pt"
    src.write_bytes(b"x" * 10_000)
    fd = os.open(src, os.O_RDONLY)
    try:
        with open(tmp_path / "dst.bin", "wb") as fo:
            with pytest.raises(CorruptFileError, match="rank.pt: ends before byte 20064 while being copied"):
                filecopy.copy_pieces([Segment(src, 64, 20_000)], lambda path: fd, fo.fileno(), 0)
    finally:
        os.close(fd)


@pytest.mark.parametrize("src_off,small_copy", [(0, 0), (64, 0), (64, 1 << 20)])  # copy_file_range, mapped, read
def test_copy_range_short_source_names_it(tmp_path, monkeypatch, src_off, small_copy):
    from dsckpt.errors import CorruptFileError
    import dsckpt.io.filecopy as filecopy

    monkeypatch.setattr(filecopy, "SMALL_COPY", small_copy)

    src, dst = tmp_path / "rank.pt", tmp_path / "dst.bin"
    src.write_bytes(b"x" * 10_000)
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        with pytest.raises(CorruptFileError, match="rank.pt: ends before byte 20064 while being copied"):
            filecopy.copy_range(fi.fileno(), fo.fileno(), 20_000, 64, src_off, src)


def test_source_truncated_during_mapped_copy(tmp_path, monkeypatch):
    """A rank file cut short while mapped: the kernel fails the write (EFAULT), no SIGBUS; a typed error."""
    import os

    from dsckpt.errors import CorruptFileError
    import dsckpt.io.filecopy as filecopy

    src, dst = tmp_path / "rank.pt", tmp_path / "dst.bin"
    src.write_bytes(os.urandom(100_000))
    real = filecopy._write_view

    def truncate_first(*args):
        os.truncate(src, 4096)
        return real(*args)

    monkeypatch.setattr(filecopy, "_write_view", truncate_first)
    monkeypatch.setattr(filecopy, "SMALL_COPY", 0)
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        with pytest.raises(CorruptFileError, match="rank.pt: shrank while being copied"):
            filecopy.copy_range(fi.fileno(), fo.fileno(), 90_000, 64, 0, src)


def test_failed_mapped_write_leaves_nothing(tmp_path, monkeypatch):
    """A write from a mapped window that fails (disk full) closes the mapping cleanly and is the output's error."""
    import mmap
    import os

    import dsckpt.io.filecopy as filecopy

    real, used = os.pwrite, []

    def full_disk(fd, data, offset):
        if isinstance(data, memoryview) and isinstance(data.obj, mmap.mmap):
            used.append(offset)
            raise OSError(28, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(filecopy.os, "pwrite", full_disk)
    monkeypatch.setattr(filecopy, "SMALL_COPY", 0)  # (this fixture's pieces are all small enough to be read)
    with pytest.raises(OutputError, match="m.safetensors: writing failed \\(No space left on device\\)"):
        consolidate(FIXTURES / "z3_ws2_fp32", tmp_path / "m.safetensors")
    assert used and [p.name for p in tmp_path.iterdir()] == []


def test_torch_output_streams_aligned_zip64_entries(tmp_path, monkeypatch):
    """Storages are 64-byte aligned even when zipfile adds zip64 fields (forced here with a tiny limit)."""
    import zipfile

    from dsckpt.formats.torchzip import TorchFile

    monkeypatch.setattr(zipfile, "ZIP64_LIMIT", 100)
    out = tmp_path / "m.pt"
    consolidate(FIXTURES / "z3_ws2_fp32", out, verify=True)
    for loc in TorchFile(out).storages.values():
        assert loc.offset % 64 == 0
    assert_matches_reference("z3_ws2_fp32", torch.load(out, weights_only=True, mmap=True))


def test_verify_catches_damaged_source_bytes(fixture_copy, tmp_path):
    from dsckpt.errors import CorruptFileError
    from dsckpt.formats.torchzip import TorchFile

    root = fixture_copy("z3_ws2_fp32")
    victim = root / "step3" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    tf = TorchFile(victim)
    loc = tf.storages[tf.obj["optimizer_state_dict"]["fp32_flat_groups"][0].storage.key]  # bytes the plan reads
    data = bytearray(victim.read_bytes())
    data[loc.offset + 5] ^= 0x01
    victim.write_bytes(bytes(data))
    with pytest.raises(CorruptFileError, match="zero_pp_rank_0_mp_rank_00_optim_states.pt: storage .* fails its CRC-32"):
        consolidate(root, tmp_path / "m.safetensors", verify=True)
    assert not (tmp_path / "m.safetensors").exists()


def test_stale_sidecar_is_removed_when_out_is_replaced_without_one(tmp_path):
    out = tmp_path / "m.safetensors"
    consolidate(FIXTURES / "z3_ws2_fp32", out)
    assert (tmp_path / "m.safetensors.client_state.json").exists()
    consolidate(FIXTURES / "z3_ws2_fp32", out, client_state=False, options=WriteOptions(force=True))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]


def test_new_user_trial_notes_and_refusals(tmp_path, fixture_copy):
    """Notes where a user would otherwise be left guessing; OUT = the checkpoint folder named as such."""
    tally = Tally()
    result = consolidate(FIXTURES / "z3_ws2_fp32", tmp_path / "m.safetensors", strip_prefixes=("nothing.",),
                         options=WriteOptions(progress=tally))
    (step,) = tally.steps  # the bar has a total and reaches it
    assert step.phase is Phase.WRITE and step.total == step.done == result.bytes
    assert any("--strip-prefix 'nothing.' matched no tensor name" in n for n in result.notes)
    assert any("tied weights are stored once (head.weight = embed.weight)" in n and "--duplicate-tied" in n
               for n in result.notes)
    plain = consolidate(FIXTURES / "z3_ws2_fp32", tmp_path / "d.safetensors", duplicate_tied=True)
    assert plain.notes == ()
    root = fixture_copy("z3_ws2_fp32")
    with pytest.raises(OutputError, match="is the checkpoint folder itself"):
        consolidate(root, root, options=WriteOptions(force=True))
    proc = run_cli("consolidate", FIXTURES / "z3_ws2_fp32", tmp_path / "c.safetensors", "--strip-prefix", "x.")
    assert proc.returncode == 0 and "note: --strip-prefix 'x.' matched no tensor name" in proc.stderr


@pytest.mark.parametrize("dtype", ["int8", "bfloat", torch.int8, torch.float64, 16.0])
def test_api_refuses_dtypes_no_output_takes(dtype, tmp_path):
    """What --dtype refuses, the API refuses too, in Python's words, before anything is written."""
    from dsckpt.errors import ConfigError

    for call in (lambda: load_state_dict(FIXTURES / "z2_ws2_fp32", dtype=dtype),
                 lambda: next(iter_state_dict(FIXTURES / "z2_ws2_fp32", dtype=dtype)),
                 lambda: consolidate(FIXTURES / "z2_ws2_fp32", tmp_path / "m.safetensors", dtype=dtype)):
        with pytest.raises(ConfigError, match=r"dtype=.*one of 'fp32', 'bf16', 'fp16'"):
            call()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, "bfloat16", "BF16", "bf16"])
def test_api_takes_torch_dtypes_and_the_cli_words(dtype):
    sd = load_state_dict(FIXTURES / "z2_ws2_fp32", dtype=dtype)
    assert {t.dtype for t in sd.values() if t.is_floating_point()} == {torch.bfloat16}


def test_one_string_is_one_prefix(tmp_path):
    consolidate(FIXTURES / "z3_ws2_fp32", tmp_path / "a.safetensors", strip_prefixes="blocks.")
    consolidate(FIXTURES / "z3_ws2_fp32", tmp_path / "b.safetensors", strip_prefixes=("blocks.",))
    a, b = load_file(tmp_path / "a.safetensors"), load_file(tmp_path / "b.safetensors")
    assert sorted(a) == sorted(b) and any(k.startswith("0.") for k in a) and "embed.weight" in a


def test_max_shard_size_takes_bytes_as_hugging_face_does(tmp_path):
    """``max_shard_size=20000`` (an int, as HF's save_pretrained takes it) shards as ``"20KB"`` does."""
    from dsckpt import consolidate

    as_int = consolidate(FIXTURES / "z2_ws2_fp32", tmp_path / "a", max_shard_size=20000).files
    as_text = consolidate(FIXTURES / "z2_ws2_fp32", tmp_path / "b", max_shard_size="20KB").files
    assert [Path(f).name for f in as_int] == [Path(f).name for f in as_text] and len(as_int) > 2
    assert all((tmp_path / "a" / Path(f).name).read_bytes() == (tmp_path / "b" / Path(f).name).read_bytes()
               for f in as_int if f.endswith(".safetensors"))


def test_base_is_for_a_peft_runs_hugging_face_export(tmp_path):
    """--base merges a PEFT run's adapter: without --hf, beside --config, or on a run with no adapter it is refused by
    name and nothing is written (the merge itself: test_trainer_flows.py)."""
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text("{}")
    proc = run_cli("consolidate", FIXTURES / "z2_ws2_fp32", tmp_path / "a", "--base", base)
    assert proc.returncode == 2 and "needs --hf" in proc.stderr
    proc = run_cli("consolidate", FIXTURES / "z2_ws2_fp32", tmp_path / "b", "--hf", "--base", base, "--config",
                   base / "config.json")
    assert proc.returncode == 2 and "not both" in proc.stderr
    proc = run_cli("consolidate", FIXTURES / "z2_ws2_fp32", tmp_path / "c", "--hf", "--base", base)
    assert proc.returncode == 2 and "holds no adapter_config.json" in proc.stderr, proc.stderr
    assert not any((tmp_path / n).exists() for n in "abc")


def _poison_first_master(ckpt: Path) -> None:
    """Rank 0's first fp32 master element set to NaN, the file rewritten with valid CRCs (a run gone to NaN; test
    code may unpickle its own fixtures)."""
    tag = (ckpt / "latest").read_text().strip()
    path = next((ckpt / tag).glob("*zero_pp_rank_0_mp_rank_00_optim_states.pt"))
    state = torch.load(path, weights_only=False)
    optim = state["optimizer_state_dict"]
    flats = optim.get("single_partition_of_fp32_groups") or optim["fp32_flat_groups"]
    with torch.no_grad():
        flats[0][0] = float("nan")
    torch.save(state, path)


@pytest.mark.parametrize("name", ["z2_ws2_fp32", "z3_ws3_bf16"])
def test_writing_non_finite_masters_says_so(name, fixture_copy, tmp_path):
    """#69.3: consolidate and reshard of masters holding NaN exit 0 as before, with a note (in --json's notes too),
    from the bytes the CRC check reads anyway; a clean checkpoint gets none.  At 2 processes as at 1."""
    ckpt = fixture_copy(name)
    clean = json.loads(run_cli("consolidate", ckpt, tmp_path / "clean.safetensors", "--json").stdout)
    assert not any("non-finite" in n for n in clean["notes"]), clean["notes"]
    _poison_first_master(ckpt)
    runs = [("consolidate", ckpt, tmp_path / "nan.safetensors", "--json"),
            ("reshard", ckpt, tmp_path / "ws4", "-w", "4", "--json")]
    if name.startswith("z2"):
        runs.append(("consolidate", ckpt, tmp_path / "nan2.safetensors", "--json", "--nproc", "2"))
    for args in runs:
        proc = run_cli(*args)
        assert proc.returncode == 0, proc.stderr
        notes = json.loads(proc.stdout)["notes"]
        assert any("non-finite values (NaN or Inf)" in n and "check-finite" in n for n in notes), (args, notes)
    proc = run_cli("consolidate", ckpt, tmp_path / "plain.safetensors")
    assert "note: the fp32 masters hold non-finite values" in proc.stderr


def test_the_finiteness_scan_sees_nan_and_inf_in_its_ranges_only():
    """The scan behind that note: NaN, +Inf and -Inf inside a watched range are seen wherever a read's chunk starts;
    finite values whose squares overflow are not taken for them; bytes outside the watched ranges are ignored."""
    from dsckpt.io.integrity import Finiteness
    from dsckpt.plan.segments import Segment

    path = Path("/nowhere/rank.pt")
    for bad in (float("nan"), float("inf"), float("-inf")):
        values = torch.ones(1001)
        values[700] = bad
        data = values.numpy().tobytes()
        finite = Finiteness([Segment(path, 400, 3600), Segment(path, 0, 8)])
        finite.scan(path, 0, data[:2048])
        assert not finite.nonfinite
        finite.scan(path, 2048, data[2048:])
        assert finite.nonfinite, bad
    outside = torch.ones(1001)
    outside[0], outside[1000] = float("nan"), float("inf")
    finite = Finiteness([Segment(path, 4, 3996)])
    finite.scan(path, 0, outside.numpy().tobytes())
    finite.scan(Path("/elsewhere"), 0, outside.numpy().tobytes())
    assert not finite.nonfinite
    for n in (1000, 40_000):  # checked in Python, and through numpy
        huge = Finiteness([Segment(path, 0, 4 * n)])
        huge.scan(path, 0, torch.full((n,), 1e30).numpy().tobytes())
        assert not huge.nonfinite
        many = torch.ones(n)
        many[n - 3] = float("-inf")
        seen = Finiteness([Segment(path, 0, 4 * n)])
        seen.scan(path, 0, many.numpy().tobytes())
        assert seen.nonfinite, n


def test_the_copies_show_the_scan_every_byte_they_move(tmp_path):
    """The ways ``copy_range`` moves bytes through user space (pread and pwrite for a small range, mapped slices out
    of page step) show the scan every byte: a NaN is seen wherever it lies; finite bytes leave no note.  (A range
    copied kernel to kernel is shown to it by the ledger's check, which reads it.)"""
    from dsckpt.io.filecopy import MAPPED_SLICE, copy_range
    from dsckpt.io.integrity import Finiteness, Ledger
    from dsckpt.plan.segments import Segment

    src, dst = tmp_path / "src", tmp_path / "dst"
    for n in (1000, 3 * MAPPED_SLICE // 4 + 101):  # pread; mapped, over its slices and not a whole number of them
        for where in (None, 0, MAPPED_SLICE // 4 - 1, MAPPED_SLICE // 4, n - 1):
            values = torch.ones(n)
            if where is not None:
                values[min(where, n - 1)] = float("nan")
            src.write_bytes(b"\0" * 64 + values.numpy().tobytes())
            ledger = Ledger(Finiteness([Segment(src, 64, 4 * n)]))
            with open(src, "rb") as s, open(dst, "wb") as d:
                copy_range(s.fileno(), d.fileno(), 4 * n, 64, 100, src, ledger=ledger)
            assert dst.read_bytes()[100:] == src.read_bytes()[64:]
            assert ledger.finite.nonfinite == (where is not None), (n, where)
