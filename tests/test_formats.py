"""Output formats as plug-ins (``export.registry``): built-ins survive a user's registration, a new format is
one class, and the CLI offers what is registered."""
from __future__ import annotations

import json
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from conftest import FIXTURES, ROOT, run_cli
from dsckpt.errors import OutputError
from dsckpt.export import registry


def test_registering_first_keeps_every_built_in():
    """The old registry loaded its built-ins only while empty: a format registered first hid them all."""
    code = ("import json; from dsckpt.export.registry import Format, register, output_formats, for_output\n"
            "class Mine(Format):\n    name, suffixes = 'mine', ('.mine',)\n"
            "register(Mine())\n"
            "print(json.dumps([sorted(output_formats()), for_output('m.safetensors').name, for_output('m.MINE').name]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    names, chosen, mine = json.loads(proc.stdout)
    assert names == ["hf", "lightning", "merged", "mine", "peft", "safetensors", "sharded", "torch"]
    assert (chosen, mine) == ("safetensors", "mine")


def test_a_taken_name_is_refused_unless_replaced():
    class Impostor(registry.Format):
        name = "safetensors"

    with pytest.raises(ValueError, match="'safetensors' is already registered"):
        registry.register(Impostor())
    assert type(registry.by_name("safetensors")).__name__ == "SafetensorsFormat"


class RawFormat(registry.Format):
    """A new output format in a few lines: a JSON index (8-byte length first), then every tensor's bytes."""
    name, suffixes, summary = "raw-test", (".rawtest",), "test-only raw dump"
    selectable = False  # (not offered by --format in this process)

    def write(self, prepared, path, context):
        from dsckpt.io.read import Reader

        tensors, index, pos = prepared.plan.tensors, {}, 0
        for t in tensors:
            index[t.name] = [t.dtype, list(t.shape), pos]
            pos += t.nbytes
        head = json.dumps(index).encode()
        with open(path, "wb") as out, Reader(context) as reader:
            out.write(len(head).to_bytes(8, "little") + head)
            for t in tensors:
                for chunk in reader.chunks(t):
                    out.write(chunk)
        return [path.name]

    def read(self, path):
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            index = json.loads(f.read(size))
        return registry.Listing([registry.Stored(n, d, tuple(s), path, 8 + size + o) for n, (d, s, o) in index.items()])


def test_a_new_format_is_one_class_and_the_whole_pipeline_serves_it(tmp_path):
    import dsckpt

    if "raw-test" not in registry.output_formats():
        registry.register(RawFormat())
    out = tmp_path / "m.rawtest"
    result = dsckpt.consolidate(FIXTURES / "z3_ws3_bf16", out, verify=True, dtype="bf16")  # chosen by suffix
    assert result.format == "raw-test" and result.verified
    reference = dsckpt.load_state_dict(FIXTURES / "z3_ws3_bf16", dtype="bf16")
    listing = RawFormat().read(out)
    data = out.read_bytes()
    for stored in listing.tensors:
        assert data[stored.offset:stored.offset + stored.span_bytes] == \
            reference[stored.name].contiguous().view(-1).view(dtype=__import__("torch").uint8).numpy().tobytes()
    assert {s.name for s in listing.tensors} | set(dsckpt.open_checkpoint(FIXTURES / "z3_ws3_bf16").shared) \
        == set(reference)


def test_hf_peft_and_lightning_are_formats_of_their_own():
    hf, peft, lightning = (registry.by_name(n) for n in ("hf", "peft", "lightning"))
    assert hf.directory and not hf.selectable and hf.resolve(FIXTURES / "z2_ws2_fp32",
                                                             registry.Request(1 << 30)) is hf
    assert peft.exclude_frozen and registry.for_output("model.ckpt") is lightning
    assert lightning.stores_client_state and "lightning" in registry.selectable()
    assert {type(f).__module__ for f in registry.output_formats().values()} >= {
        "dsckpt.export.hf", "dsckpt.export.peft", "dsckpt.export.lightning", "dsckpt.export.sharded"}


def test_the_cli_offers_what_is_registered():
    proc = run_cli("consolidate", "--help")
    offered = proc.stdout.split("--format [", 1)[1].split("]", 1)[0].split("|")
    assert sorted(offered) == sorted(registry.selectable())


def test_a_name_that_contradicts_the_format_is_refused():
    with pytest.raises(OutputError, match=r"ends in \.safetensors, the suffix of safetensors files, but --format "
                                          r"lightning writes \.ckpt/\.pt/\.pth"):
        registry.for_output("lt.safetensors", "lightning")


def test_joined_crc32s_equal_zlibs():
    """The readers join pieces' CRCs into a chunk's, and a zip entry's from its chunks' (``formats.crc``): exactly
    zlib's value of the bytes joined."""
    import os
    import random
    import zlib

    from dsckpt.formats.crc import crc32_combine

    rng = random.Random(7)
    for _ in range(100):
        a, b, start = os.urandom(rng.randint(0, 5000)), os.urandom(rng.randint(0, 5000)), rng.getrandbits(32)
        assert crc32_combine(zlib.crc32(a, start), zlib.crc32(b), len(b)) == zlib.crc32(a + b, start)
    for length in (0, 1, 4099, 1 << 20):  # joined again and again: past TABLE_AFTER, through the byte tables
        b = os.urandom(length)
        for _ in range(40):
            a, start = os.urandom(rng.randint(0, 99)), rng.getrandbits(32)
            assert crc32_combine(zlib.crc32(a, start), zlib.crc32(b), length) == zlib.crc32(a + b, start)


def test_the_fast_crc32_is_zlibs_crc32_and_installed_where_its_wheels_are():
    """``formats.crc.crc32`` (ISA-L's where the ``isal`` dependency installs) gives zlib's values on buffers of
    every shape, and the dependency marker really installed it on this platform."""
    import os
    import platform
    import zlib

    from dsckpt.formats import crc

    if platform.machine() in ("x86_64", "aarch64", "AMD64", "arm64"):
        from isal.isal_zlib import crc32 as isal_crc32

        assert crc.crc32 is isal_crc32
    for n in (0, 1, 63, 64, 4095, 1 << 20, (1 << 20) + 7):
        data = os.urandom(n)
        assert crc.crc32(data) == zlib.crc32(data)
        assert crc.crc32(memoryview(bytearray(data))[1:], 12345) == zlib.crc32(data[1:], 12345)


def test_large_writes_reach_the_kernel_in_small_calls(tmp_path):
    """``write_all`` / ``pwrite_all`` (formats.positional): every byte lands, in calls of at most WRITE_SLICE
    (larger write() calls were 20-30x slower on this project's VMs), and a raw file's short writes are resumed."""
    import os

    from dsckpt.formats.positional import WRITE_SLICE, pwrite_all, write_all

    data = os.urandom(3 * WRITE_SLICE + 12345)

    class ShortWrites:  # a raw stream that takes at most 100,000 bytes per call, as raw files may
        def __init__(self):
            self.calls, self.buf = [], bytearray()

        def write(self, piece):
            self.calls.append(len(piece))
            taken = bytes(piece[:100_000])
            self.buf += taken
            return len(taken)

    out = ShortWrites()
    assert write_all(out, data) == len(data)
    assert bytes(out.buf) == data and max(out.calls) <= WRITE_SLICE
    path = tmp_path / "f.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        os.ftruncate(fd, 10 + len(data))
        assert pwrite_all(fd, memoryview(data), 10) == len(data)
    finally:
        os.close(fd)
    assert path.read_bytes() == bytes(10) + data


def test_the_reader_advises_each_files_ranges_joined_and_reads_the_same_bytes(tmp_path, monkeypatch):
    """``io.read.Reader`` tells the kernel what a source will read (cold ZeRO-3 reshard 4 -> 3: 0.60 -> 0.42 s),
    one call per run of nearby pieces of a file, and the bytes it yields are the segments' bytes either way."""
    import os

    from dsckpt.io import read
    from dsckpt.plan.segments import Segment, TensorSource, Zeros

    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    a.write_bytes(os.urandom(8 << 20))
    b.write_bytes(os.urandom(8 << 20))
    pieces = (Segment(a, 0, 1000), Segment(b, 64, 500), Segment(a, 5000, 3000),  # a: one run (gap < 1 MiB)
              Zeros(77), Segment(a, 6 << 20, 100), Segment(b, 600, 10))  # a: a second run; b: one run
    source = TensorSource("U8", "U8", pieces)
    expected = b"".join(bytes(p.nbytes) if isinstance(p, Zeros) else p.path.read_bytes()[p.offset:p.offset + p.nbytes]
                        for p in pieces)
    from dsckpt.formats import storage

    advised = []
    real = os.posix_fadvise
    monkeypatch.setattr(storage.os, "posix_fadvise", lambda fd, off, n, how: advised.append((off, n, how)) or real(fd, off, n, how))

    class Unadvised(storage.LocalStorage):  # a storage that takes no hints reads the same bytes
        def advise(self, name, ranges):
            pass
    from dsckpt.io.context import WriteContext

    for files in (storage.LocalStorage(), Unadvised()):
        with WriteContext(files) as context, read.Reader(context) as reader:
            assert reader.read(source) == expected
    assert sorted(advised) == sorted([(0, 8000, os.POSIX_FADV_WILLNEED), (6 << 20, 100, os.POSIX_FADV_WILLNEED),
                                      (64, 546, os.POSIX_FADV_WILLNEED)])


def test_the_reader_reads_the_next_storage_ahead_and_never_mixes_buffers(tmp_path):
    """``storage_chunks(storage, then)`` starts ``then``'s first read early; the bytes stay each storage's own
    when the read-ahead is used, when an empty storage comes between, when a different storage is asked for
    instead, and after a stream left half-read (small chunks: every storage spans several)."""
    import os
    from types import SimpleNamespace

    from dsckpt.io import read
    from dsckpt.plan.segments import Segment, TensorSource, Zeros

    f = tmp_path / "a.bin"
    data = os.urandom(1 << 20)
    f.write_bytes(data)

    def storage(offset, nbytes):
        pieces = (Segment(f, offset, nbytes),) if nbytes else ()
        return SimpleNamespace(source=SimpleNamespace(source=TensorSource("U8", "U8", pieces)), nbytes=nbytes)

    s1, empty, s2 = storage(0, 70_000), storage(0, 0), storage(100_000, 50_001)
    s3, s4 = storage(7, 90_000), storage(300_000, 4096)
    def got(s, then=None) -> bytes:  # every chunk comes with its own CRC-32
        chunks = [(bytes(c), crc) for c, crc in reader.storage_chunks(s, then)]
        assert [crc for _, crc in chunks] == [zlib.crc32(c) for c, _ in chunks]
        return b"".join(c for c, _ in chunks)

    with read.Reader(chunk=16_384) as reader:
        assert got(s1, then=s2) == data[:70_000]
        assert reader._ahead[0] is s2
        assert got(empty, then=s2) == b"" and reader._ahead[0] is s2  # an empty storage leaves it in place
        assert got(s2, then=s3) == data[100_000:150_001]
        assert got(s4) == data[300_000:304_096]  # not s3, which was read ahead: dropped
        stream = reader.storage_chunks(s3, then=s1)
        assert bytes(next(stream)[0]) == data[7:7 + 16_384]  # abandoned after one chunk
        assert got(s1, then=s3) == data[:70_000]
        assert got(s3) == data[7:90_007]
        # a ZeRO-3 partition's pieces from several places and padding: each chunk's CRC joined from its pieces'
        pieces = (Segment(f, 5, 1000), Zeros(3000), Segment(f, 200_000, 20_000), Segment(f, 1, 7))
        mixed = SimpleNamespace(source=SimpleNamespace(source=TensorSource("U8", "U8", pieces)), nbytes=24_007)
        assert got(mixed) == data[5:1005] + bytes(3000) + data[200_000:220_000] + data[1:8]


def test_every_read_and_publish_goes_through_the_storage_seam(tmp_path):
    """A storage that counts its calls sees the one reader's reads, the CRC checks' reads and the commit protocol's
    steps: the seam an object-storage backend implements (docs/architecture.md, "A storage backend")."""
    from dsckpt.formats import storage
    from dsckpt.io.context import WriteContext
    from dsckpt.io.output import Staging
    from dsckpt.io.read import Reader
    from dsckpt.plan.consolidate import build_plan
    from dsckpt.zero.reader import open_checkpoint

    calls = []

    class Counting(storage.LocalStorage):
        def pread(self, name, nbytes, offset, into=None):
            calls.append(("pread", Path(name).name))
            return super().pread(name, nbytes, offset, into)

        def replace(self, temp, final):
            calls.append(("replace", Path(final).name))
            super().replace(temp, final)

        def flush(self, name, files=True):
            calls.append(("flush", Path(name).name))
            super().flush(name, files)

    plan = build_plan(open_checkpoint(FIXTURES / "z2_ws2_fp32"))
    with WriteContext(Counting()) as context, Reader(context) as reader:
        first = reader.read(plan.tensors[0])
    assert ("pread", "zero_pp_rank_0_mp_rank_00_optim_states.pt") in calls and len(first) == plan.tensors[0].nbytes
    stage = Staging(fsync=True, storage=Counting())
    tmp = stage.temp_for(tmp_path / "out.bin")
    tmp.write_bytes(first)
    stage.flush()
    stage.publish()
    assert ("replace", "out.bin") in calls and ("flush", tmp.name) in calls
    assert (tmp_path / "out.bin").read_bytes() == first


def test_the_ledger_joins_what_a_write_read_and_reads_only_the_rest(tmp_path):
    """A write recorded through the one Reader leaves the CRC check nothing to read but what the write skipped;
    the verdict is the zip record's either way, and a damaged byte the write read is still caught."""
    import shutil

    from dsckpt.errors import CorruptFileError
    from dsckpt.formats import storage
    from dsckpt.io import integrity
    from dsckpt.io.context import WriteContext
    from dsckpt.io.read import Reader
    from dsckpt.plan.consolidate import build_plan
    from dsckpt.zero.reader import open_checkpoint

    root = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "z3_ws2_fp32", root)
    plan = build_plan(open_checkpoint(root))
    pieces = [p for t in plan.tensors for p in t.pieces]
    ledger = integrity.Ledger()
    with WriteContext(ledger=ledger) as context, Reader(context) as reader:
        for t in plan.tensors:
            reader.read(t)
    read_back = []
    real = storage.LocalStorage.pread
    storage.LocalStorage.pread = lambda self, name, n, off, into=None: read_back.append(n) or real(self, name, n, off, into)
    try:
        ledger.check(pieces)  # sound: the noted CRCs join into each storage's record
    finally:
        storage.LocalStorage.pread = real
    assert sum(read_back) < sum(p.nbytes for p in pieces) / 10  # padding only, not the data again
    victim = pieces[3]
    data = bytearray(victim.path.read_bytes())
    data[victim.offset] ^= 0x01
    victim.path.write_bytes(bytes(data))
    damaged = integrity.Ledger()
    with WriteContext(ledger=damaged) as context, Reader(context) as reader:
        for t in plan.tensors:
            reader.read(t)
    with pytest.raises(CorruptFileError, match="fails its CRC-32 check"):
        damaged.check(pieces)


def test_processes_of_one_host_share_the_crc_checks_out_disjointly_and_a_damaged_storage_is_still_found(tmp_path):
    """--nproc N on one host: together the processes read each storage once, about evenly split."""
    import shutil

    from dsckpt.errors import CorruptFileError
    from dsckpt.formats import storage
    from dsckpt.io import integrity
    from dsckpt.plan.consolidate import build_plan
    from dsckpt.zero.reader import open_checkpoint

    root = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "z2_ws3_bf16", root)
    pieces = [p for t in build_plan(open_checkpoint(root)).tensors for p in t.pieces]

    def bytes_read(share) -> int:
        read = []
        real = storage.LocalStorage.pread
        storage.LocalStorage.pread = lambda self, name, n, off, into=None: read.append(n) or real(self, name, n, off, into)
        try:
            integrity.Ledger().check(pieces, share=share)
        finally:
            storage.LocalStorage.pread = real
        return sum(read)

    alone = bytes_read((0, 1))
    shares = [bytes_read((k, 3)) for k in range(3)]
    assert sum(shares) == alone and all(shares) and max(shares) < alone * 0.6
    victim = pieces[-1]
    data = bytearray(victim.path.read_bytes())
    data[victim.offset] ^= 0x01
    victim.path.write_bytes(bytes(data))
    failed = []
    for k in range(3):
        try:
            integrity.Ledger().check(pieces, share=(k, 3))
        except CorruptFileError:
            failed.append(k)
    assert len(failed) == 1  # the one process that owns the damaged storage


def test_processes_pool_what_they_noted_so_the_check_reads_only_what_nobody_read(tmp_path):
    """Two processes of one host, each its own view of the checkpoint (other paths, the same files), each reads half
    the tensors: with the other's notes adopted (by relative name), each one's share of the check reads next to
    nothing; without them it reads what the other copied."""
    import shutil

    from dsckpt.formats import storage
    from dsckpt.io import integrity
    from dsckpt.io.context import WriteContext
    from dsckpt.io.read import Reader
    from dsckpt.plan.consolidate import build_plan
    from dsckpt.zero.reader import open_checkpoint

    roots = [tmp_path / "view0" / "ckpt", tmp_path / "view1" / "ckpt"]
    plans = []
    for root in roots:
        shutil.copytree(FIXTURES / "z3_ws2_fp32", root)
        plans.append(build_plan(open_checkpoint(root)))
    ledgers = [integrity.Ledger(), integrity.Ledger()]
    for k in range(2):
        with WriteContext(ledger=ledgers[k]) as context, Reader(context) as reader:
            for t in plans[k].tensors[k::2]:
                reader.read(t)

    def read_by_check(ledger, k) -> int:
        read = []
        real = storage.LocalStorage.pread
        storage.LocalStorage.pread = lambda self, name, n, off, into=None: read.append(n) or real(self, name, n, off, into)
        try:
            ledger.check([p for t in plans[k].tensors for p in t.pieces], share=(k, 2))
        finally:
            storage.LocalStorage.pread = real
        return sum(read)

    total = sum(t.nbytes for t in plans[0].tensors)
    alone = [read_by_check(ledgers[k], k) for k in range(2)]
    names = [lambda path, root=root: path.relative_to(root).as_posix() for root in roots]
    for k in range(2):
        ledgers[k].adopt(ledgers[1 - k].spans(names[1 - k]), lambda rel, root=roots[k]: root / rel)
    pooled = [read_by_check(ledgers[k], k) for k in range(2)]
    assert sum(alone) > total / 3 and sum(pooled) < total / 10, (alone, pooled, total)


def test_work_is_dealt_by_bytes_the_same_on_every_process():
    """Alternating large and small tensors (weights, biases): every n-th would give one writer everything."""
    from dsckpt.plan.deal import dealt

    sizes = [1000, 1] * 8 + [500, 500]
    owners = dealt(sizes, 2)
    loads = [sum(s for s, o in zip(sizes, owners) if o == k) for k in range(2)]
    assert abs(loads[0] - loads[1]) <= max(sizes) and owners == dealt(list(sizes), 2)
    assert dealt(sizes, 1) == [0] * len(sizes) and dealt([], 3) == []


def test_a_row_parallel_join_is_read_a_chunk_of_rows_at_a_time_and_noted(tmp_path):
    """``Reader`` step 5: a join of two slices (one spanning two partitions and a zero fill, rows of different widths)
    read a few rows at a time yields exactly the rows' bytes in order, and every byte it read is in the ledger."""
    import os

    from dsckpt.io import integrity
    from dsckpt.io.context import WriteContext
    from dsckpt.io.read import Reader
    from dsckpt.plan.segments import Interleaved, Segment, TensorSource, Zeros

    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    a.write_bytes(os.urandom(5000))
    b.write_bytes(os.urandom(5000))
    rows = 37
    left = [Segment(a, 11, 20 * 24), Segment(b, 3, 10 * 24), Zeros(7 * 24)]  # 24-byte rows: 37 of them
    right = [Segment(b, 900, rows * 40)]  # 40-byte rows
    joined = Interleaved([left, right], [(0, 0, 24), (1, 0, 40)], [24, 40], rows)
    expected = b"".join(b"".join(a.read_bytes()[p.offset:p.offset + p.nbytes] if p.path == a else
                                 b.read_bytes()[p.offset:p.offset + p.nbytes] for p in [seg])
                        if isinstance(seg, Segment) else bytes(seg.nbytes) for seg in joined)
    assert len(expected) == rows * 64
    ledger = integrity.Ledger()
    with WriteContext(ledger=ledger) as context, Reader(context, chunk=200) as reader:  # 3 rows a chunk
        chunks = [bytes(c) for c in reader.chunks(TensorSource("U8", "U8", joined))]
    assert b"".join(chunks) == expected and len(chunks) == -(-rows // 3)
    noted = ledger.spans(lambda path: path.name)
    assert sum(n for _, n, _ in noted["a.bin"]) == 20 * 24 and sum(n for _, n, _ in noted["b.bin"]) == 10 * 24 + rows * 40
    from dsckpt.io.read import _interleave

    runs = {0: bytearray(os.urandom(3 * 24)), 1: bytearray(os.urandom(3 * 40))}
    by_loop, by_numpy = (bytes(_interleave(runs, joined, 3, 64, numpy)) for numpy in (False, True))
    assert by_loop == by_numpy == b"".join(bytes(runs[0][r * 24:(r + 1) * 24] + runs[1][r * 40:(r + 1) * 40])
                                           for r in range(3))
