"""Checkpoints and outputs in object storage, against a real S3-protocol server over HTTP (moto's server mode,
started here on a free loopback port; s3fs and botocore talk to it as to S3, pointed at it by AWS_ENDPOINT_URL);
gs:// against gcp-storage-emulator (STORAGE_EMULATOR_HOST) and az:// against Azurite (a connection string).

Every output is compared byte for byte with the same command's output on the local copy of the checkpoint.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import dsckpt

from conftest import FIXTURES, JOB_TIMEOUT, PYTHONPATH, ROOT, run_cli, run_job
from nvme_support import aio_built, aio_environment
from dsckpt.runtime.launch import free_port

BUCKET = "dsckpt-test"
TEMP = ".dsckpt-tmp-"
CKPTS = ("z3_ws2_fp32", "z2_ws3_bf16", "tp2_dp2_z1_fp32")
NVME = "nvme_z3_ws2_fp32"  # ZeRO-Infinity: the optimizer's state in <tag>/offloaded_tensors/rankNN/ (issue 70)




def _serve(cmd: list[str], port: int, env: dict[str, str] | None = None) -> subprocess.Popen:
    """A storage server started on ``port``, once it accepts connections."""
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **(env or {})})
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return server
        except OSError:
            assert time.monotonic() < deadline and server.poll() is None, f"{cmd[0]} did not start"
            time.sleep(0.1)


@pytest.fixture(scope="module")
def s3():
    """The server, the environment pointing at it, a bucket holding the fixtures; an fsspec filesystem on it."""
    port = free_port()
    # parts of a few KiB (S3 takes 5 MiB or more): the small fixtures' streamed files then come in many parts
    server = _serve([sys.executable, "-m", "moto.server", "-p", str(port)], port, {"S3_UPLOAD_PART_MIN_SIZE": "4096"})
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "test",
           "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        import fsspec

        fs = fsspec.filesystem("s3", skip_instance_cache=True)
        fs.mkdir(BUCKET)
        for name in (*CKPTS, NVME):
            fs.put(f"{FIXTURES / name}/", f"{BUCKET}/{name}/", recursive=True)
        try:
            yield fs
        finally:
            server.terminate()
            server.wait(10)


def ok(*args):
    proc = run_cli(*args)
    assert proc.returncode == 0, proc.stderr
    return proc


def same_tree(a: Path, b: Path) -> None:
    files = lambda root: sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    assert files(a) == files(b)
    for rel in files(a):
        if rel == ".metadata":  # a DCP folder's: torch pickles a fresh save id into it each time
            from torch.distributed.checkpoint import FileSystemReader

            assert FileSystemReader(a).read_metadata().state_dict_metadata == \
                FileSystemReader(b).read_metadata().state_dict_metadata
            continue
        assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel


@pytest.mark.parametrize("name", CKPTS)
def test_consolidate_reshard_convert_read_a_bucket_and_write_what_they_write_locally(s3, tmp_path, name):
    url, local = f"s3://{BUCKET}/{name}", FIXTURES / name
    ok("consolidate", url, tmp_path / "remote.safetensors", "--no-client-state")
    ok("consolidate", local, tmp_path / "local.safetensors", "--no-client-state")
    assert (tmp_path / "remote.safetensors").read_bytes() == (tmp_path / "local.safetensors").read_bytes()
    if name.startswith("tp"):
        return  # (resharding a TP checkpoint is tested at its own world sizes: test_tensor_parallel)
    ok("reshard", url, tmp_path / "rs_remote", "-w", "3")
    ok("reshard", local, tmp_path / "rs_local", "-w", "3")
    same_tree(tmp_path / "rs_remote", tmp_path / "rs_local")
    ok("convert", url, tmp_path / "u_remote", "--to", "universal")
    ok("convert", local, tmp_path / "u_local", "--to", "universal")
    same_tree(tmp_path / "u_remote", tmp_path / "u_local")


def test_a_zero_infinity_checkpoint_in_a_bucket_reads_as_the_folder_does(s3, tmp_path):
    """The swap files two folders below the tag come with it: the masters and moments they hold, the NVMe section."""
    url, local = f"s3://{BUCKET}/{NVME}", FIXTURES / NVME
    ok("consolidate", url, tmp_path / "remote.safetensors", "--no-client-state")
    ok("consolidate", local, tmp_path / "local.safetensors", "--no-client-state")
    assert (tmp_path / "remote.safetensors").read_bytes() == (tmp_path / "local.safetensors").read_bytes()
    ok("convert", url, tmp_path / "u_remote", "--to", "universal")
    ok("convert", local, tmp_path / "u_local", "--to", "universal")
    same_tree(tmp_path / "u_remote", tmp_path / "u_local")
    nvme = json.loads(ok("inspect", url, "--json").stdout)["nvme"]
    assert nvme["bytes"] == json.loads(ok("inspect", local, "--json").stdout)["nvme"]["bytes"] > 0
    report = json.loads(ok("verify", url, "--json").stdout)
    assert report["ok"] and len(report["tags"][0]["swap_files"]) == 24
    ok("reshard", url, tmp_path / "n_remote", "-w", "2", "--offload", "nvme")  # swap files for an NVMe engine,
    ok("reshard", local, tmp_path / "n_local", "-w", "2", "--offload", "nvme")
    same_tree(tmp_path / "n_remote", tmp_path / "n_local")
    proc = run_cli("reshard", local, f"s3://{BUCKET}/nvme-copy", "-w", "2", "--offload", "nvme")  # on its local disk
    assert proc.returncode == 2 and "to a local folder" in proc.stderr and "Traceback" not in proc.stderr
    assert run_cli("list", f"s3://{BUCKET}/nvme-copy").returncode != 0


@pytest.mark.runtime
@pytest.mark.skipif(not aio_built(), reason="DeepSpeed's async_io op is not built here (make nvme-tools)")
def test_a_background_save_of_a_zero_infinity_run_uploads_its_swap_files(s3, tmp_path):
    """The swap files DeepSpeed copies into the tag in the call go up with the rank files, hidden until the tag is
    whole; the tag in the bucket holds the live engine's masters, bit for bit."""
    url = f"s3://{BUCKET}/nvme-engine-{tmp_path.name}"
    env = {**aio_environment(), "NVME_FLOW_SAVE": "background", "NVME_FLOW_SAVE_DIR": url,
           **{key: os.environ[key] for key in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                               "AWS_DEFAULT_REGION")}}
    run_job("nvme_flow.py", 2, "train", tmp_path, tmp_path / "train.json", env=env)
    prefix = url[len("s3://"):]
    swapped = sorted(p.split(f"{prefix}/", 1)[1] for p in s3.find(f"{prefix}/step3/offloaded_tensors"))
    assert len(swapped) == 24 and swapped[0] == "step3/offloaded_tensors/rank00/14_17.tensor.swp", swapped
    assert not [p for p in s3.find(prefix) if ".dsckpt-tmp-" in p] and s3.cat_file(f"{prefix}/latest") == b"step3"
    import torch

    reference = torch.load(tmp_path / "reference.pt")
    got = dict(dsckpt.api.consolidation.load_state_dict(url))
    assert [k for k in reference if "::" not in k and not torch.equal(reference[k], got[k])] == []


def test_outputs_in_a_bucket_equal_local_ones_and_an_existing_one_needs_force(s3, tmp_path):
    name = "z3_ws2_fp32"
    url, local = f"s3://{BUCKET}/{name}", FIXTURES / name
    out = f"s3://{BUCKET}/out-{tmp_path.name}"
    ok("consolidate", url, f"{out}/model.safetensors")
    ok("consolidate", local, tmp_path / "model.safetensors")
    tp = "tp2_dp2_z1_fp32"  # (holds the config.json a Hugging Face folder needs)
    ok("consolidate", f"s3://{BUCKET}/{tp}", f"{out}/hf", "--hf", "--max-shard-size", "20KB")
    ok("consolidate", FIXTURES / tp, tmp_path / "hf", "--hf", "--max-shard-size", "20KB")
    ok("reshard", url, f"{out}/rs", "-w", "3", "--nproc", "2")
    ok("reshard", local, tmp_path / "rs", "-w", "3")
    got = tmp_path / "got"
    s3.get(f"{out.removeprefix('s3://')}/", f"{got}/", recursive=True)
    assert (got / "model.safetensors").read_bytes() == (tmp_path / "model.safetensors").read_bytes()
    assert sorted(p.name for p in got.glob("model.safetensors.client_state.*")) == \
        sorted(p.name for p in tmp_path.glob("model.safetensors.client_state.*"))
    same_tree(got / "hf", tmp_path / "hf")
    same_tree(got / "rs", tmp_path / "rs")
    s3.pipe_file(f"{out.removeprefix('s3://')}/hf/notes.txt", b"not dsckpt's")
    before = {p.rsplit("/", 1)[1] for p in s3.find(f"{out.removeprefix('s3://')}/hf")}
    ok("consolidate", f"s3://{BUCKET}/{tp}", f"{out}/hf", "--hf", "--max-shard-size", "10MB", "--force")
    s3.invalidate_cache()
    after = {p.rsplit("/", 1)[1] for p in s3.find(f"{out.removeprefix('s3://')}/hf")}
    shards = lambda names: {n for n in names if n.startswith("model-")}  # noqa: E731
    assert len(shards(before)) > 1 and shards(after) == {"model-00001-of-00001.safetensors"}  # the others: gone
    assert "notes.txt" in after  # not dsckpt's: kept
    s3.pipe_file(f"{out.removeprefix('s3://')}/hf/model.safetensors", b"a stale single file")
    shadowed = run_cli("consolidate", f"s3://{BUCKET}/{tp}", f"{out}/hf", "--hf", "--force")
    assert shadowed.returncode == 2 and "from_pretrained would load" in shadowed.stderr, shadowed.stderr
    s3.invalidate_cache()
    assert {p.rsplit("/", 1)[1] for p in s3.find(f"{out.removeprefix('s3://')}/hf")} == after | {"model.safetensors"}
    again = run_cli("consolidate", url, f"{out}/model.safetensors")
    assert again.returncode == 2 and "already exists" in again.stderr and "Traceback" not in again.stderr
    ok("consolidate", url, f"{out}/model.safetensors", "--force", "--dtype", "bf16")
    ok("consolidate", local, tmp_path / "bf16.safetensors", "--dtype", "bf16")
    assert s3.cat_file(f"{out.removeprefix('s3://')}/model.safetensors") == (tmp_path / "bf16.safetensors").read_bytes()


def test_streamed_files_are_the_local_bytes_part_by_part_from_every_process(s3, tmp_path, monkeypatch):
    """Parts of 4 KiB: tensors and cast elements cut at part edges, a row-parallel join, two processes filling one
    file's upload, torch zips (reshard's rank files, a universal checkpoint, a .pt); each object equals the local
    file, and none is left half-uploaded."""
    monkeypatch.setenv("DSCKPT_MULTIPART_CHUNKSIZE", "4096")  # (--nproc's processes inherit it)
    out = f"s3://{BUCKET}/streamed-{tmp_path.name}"
    from dsckpt.io import parts

    streamed, real_put = set(), parts.S3Parts.put  # (the commands without --nproc run in this process)
    monkeypatch.setattr(parts.S3Parts, "put", lambda self, key, *a: streamed.add(key) or real_put(self, key, *a))
    for name, args in (("z3_ws2_fp32", ["--dtype", "bf16", "--nproc", "2"]), ("z2_ws3_bf16", []),
                       ("tp2_dp2_z1_fp32", [])):
        proc = run_cli("consolidate", f"s3://{BUCKET}/{name}", f"{out}/{name}.safetensors", *args)
        assert proc.returncode == 0, proc.stderr
        ok("consolidate", FIXTURES / name, tmp_path / f"{name}.safetensors", *args[:2])  # (one process: the same)
        local = (tmp_path / f"{name}.safetensors").read_bytes()
        assert len(local) > 3 * 4096
        assert s3.cat_file(f"{out.removeprefix('s3://')}/{name}.safetensors") == local, name
    proc = run_cli("consolidate", f"s3://{BUCKET}/tp2_dp2_z1_fp32", f"{out}/hf", "--hf", "--max-shard-size", "100KB")
    assert proc.returncode == 0, proc.stderr
    ok("consolidate", FIXTURES / "tp2_dp2_z1_fp32", tmp_path / "hf", "--hf", "--max-shard-size", "100KB")
    got = tmp_path / "got"
    s3.get(f"{out.removeprefix('s3://')}/hf/", f"{got}/", recursive=True)
    same_tree(got, tmp_path / "hf")
    # torch zips (zipfile writes each entry's header again when it closes: those parts are held until then)
    for verb, args in (("reshard", ["-w", "3", "--nproc", "2"]), ("convert", ["--to", "universal"]),
                       ("convert", ["--to", "dcp"])):  # (DCP: torch's pickles and archives inside one data file)
        name = f"{verb}-{args[1]}"
        proc = run_cli(verb, f"s3://{BUCKET}/z3_ws2_fp32", f"{out}/{name}", *args)
        assert proc.returncode == 0, proc.stderr
        ok(verb, FIXTURES / "z3_ws2_fp32", tmp_path / f"{name}_local", *args[:2])
        s3.get(f"{out.removeprefix('s3://')}/{name}/", f"{tmp_path / name}/", recursive=True)
        same_tree(tmp_path / name, tmp_path / f"{name}_local")
    bucket_out = out.removeprefix("s3://")
    zips = {f"{bucket_out}/convert-universal/{p.relative_to(tmp_path / 'convert-universal').as_posix()}"
            for p in (tmp_path / "convert-universal").rglob("zero/*/*.pt")}  # (model-states files: copies, staged)
    assert f"{bucket_out}/convert-dcp/__0_0.distcp" in streamed and len(zips) > 10 and zips <= streamed
    proc = run_cli("consolidate", f"s3://{BUCKET}/z2_ws3_bf16", f"{out}/model.pt")
    assert proc.returncode == 0, proc.stderr
    ok("consolidate", FIXTURES / "z2_ws3_bf16", tmp_path / "model.pt")
    assert s3.cat_file(f"{out.removeprefix('s3://')}/model.pt") == (tmp_path / "model.pt").read_bytes()
    import shutil

    from dsckpt.plan.consolidate import build_plan
    from dsckpt.zero.reader import open_checkpoint

    damaged = tmp_path / "damaged"  # found by the CRC check after its parts went up: the upload is aborted
    shutil.copytree(FIXTURES / "z2_ws3_bf16", damaged)
    piece = build_plan(open_checkpoint(damaged)).tensors[-1].pieces[0]
    with open(piece.path, "r+b") as fh:
        fh.seek(piece.offset)
        byte = fh.read(1)
        fh.seek(piece.offset)
        fh.write(bytes([byte[0] ^ 0x10]))
    proc = run_cli("consolidate", damaged, f"{out}/damaged.safetensors")
    assert proc.returncode == 2 and "CRC-32" in proc.stderr and "Traceback" not in proc.stderr
    assert not s3.exists(f"{out.removeprefix('s3://')}/damaged.safetensors")
    assert not s3.call_s3("list_multipart_uploads", Bucket=BUCKET).get("Uploads")  # none left started


def test_a_fill_in_progress_feeds_the_streamed_parts_and_its_crc_failure_stops_them(s3, tmp_path, monkeypatch):
    """The fixtures are small enough to arrive whole with their skeletons; with 1 KiB skeletons their storages
    come through the fill, on its thread, while the parts that need them wait: the same bytes as locally, and a
    damaged storage is an exit 2 naming its object, with no object and no upload left behind."""
    from dsckpt.io import remote, skeleton

    for name, value in (("EDGE", 1024), ("TAIL", 1024), ("MERGE_GAP", 0), ("SMALL", 1024)):
        monkeypatch.setattr(skeleton, name, value)
    monkeypatch.setenv("DSCKPT_MULTIPART_CHUNKSIZE", "4096")
    landed = []
    real = remote.Arrivals.landed
    monkeypatch.setattr(remote.Arrivals, "landed", lambda self, path, offset, n: landed.append(n) or real(self, path, offset, n))
    read = remote.RemoteStore.read  # a slow store: a part that read before its bytes arrived would hold zeros
    monkeypatch.setattr(remote.RemoteStore, "read", lambda self, rel, start, end, exact=True:
                        (end - start < 4096 or time.sleep(0.2)) and read(self, rel, start, end, exact) or
                        read(self, rel, start, end, exact))
    fetched = []
    monkeypatch.setattr(remote.RemoteStore, "fill", lambda self, *a, real=remote.RemoteStore.fill, **k:
                        fetched.append(real(self, *a, **k)) or fetched[-1])
    import json

    stats = json.loads(ok("inspect", f"s3://{BUCKET}/z3_ws2_fp32", "--stats", "--json").stdout)["stats"]
    assert stats == json.loads(ok("inspect", FIXTURES / "z3_ws2_fp32", "--stats", "--json").stdout)["stats"]
    whole = sum(p.stat().st_size for p in (FIXTURES / "z3_ws2_fp32").rglob("*.pt"))
    assert 0 < sum(fetched) < whole / 2  # the fp32 masters, not the moments or the 16-bit weights
    out = f"{BUCKET}/filled-{tmp_path.name}"
    ok("consolidate", f"s3://{BUCKET}/z3_ws2_fp32", f"s3://{out}/model.safetensors", "--dtype", "bf16")
    ok("consolidate", FIXTURES / "z3_ws2_fp32", tmp_path / "model.safetensors", "--dtype", "bf16")
    assert sum(landed) > 10_000
    assert s3.cat_file(f"{out}/model.safetensors") == (tmp_path / "model.safetensors").read_bytes()
    from dsckpt.plan.consolidate import build_plan
    from dsckpt.zero.reader import open_checkpoint

    piece = build_plan(open_checkpoint(FIXTURES / "z3_ws2_fp32")).tensors[-1].pieces[-1]
    rel = piece.path.relative_to(FIXTURES / "z3_ws2_fp32").as_posix()
    prefix = f"{BUCKET}/fill-damaged-{tmp_path.name}"
    s3.put(f"{FIXTURES / 'z3_ws2_fp32'}/", f"{prefix}/", recursive=True)
    data = bytearray((FIXTURES / "z3_ws2_fp32" / rel).read_bytes())
    data[piece.offset] ^= 0x10
    s3.pipe_file(f"{prefix}/{rel}", bytes(data))
    proc = run_cli("consolidate", f"s3://{prefix}", f"s3://{out}/damaged.safetensors")
    assert proc.returncode == 2 and f"s3://{prefix}/{rel}" in proc.stderr and "CRC-32" in proc.stderr, proc.stderr
    assert not s3.exists(f"{out}/damaged.safetensors")
    assert not s3.call_s3("list_multipart_uploads", Bucket=BUCKET).get("Uploads")


def test_a_part_is_the_files_bytes_at_any_edge(tmp_path):
    """``io.stream.part_bytes`` at 1000-byte edges (inside elements of a cast, inside a row-parallel join's rows)
    joins into exactly what the local writer writes."""
    from dsckpt.io.context import WriteContext
    from dsckpt.io.stream import part_bytes, part_size
    from dsckpt.io.safetensors_writer import safetensors_header, write_safetensors
    from dsckpt.plan.consolidate import build_plan
    from dsckpt.zero.reader import open_checkpoint

    for name, dtype in (("z3_ws2_fp32", "bf16"), ("z2_ws3_bf16", "fp32"), ("tp2_dp2_z1_fp32", None)):
        plan = build_plan(open_checkpoint(FIXTURES / name), dtype)
        tensors = list(plan.tensors)
        with WriteContext() as context:
            write_safetensors(tensors, tmp_path / f"{name}.safetensors", plan.metadata, context)
        expected = (tmp_path / f"{name}.safetensors").read_bytes()
        header, offsets = safetensors_header(tensors, plan.metadata)
        with WriteContext() as context:
            parts = [part_bytes(header, tensors, offsets, lo, min(lo + 1000, len(expected)), context)
                     for lo in range(0, len(expected), 1000)]
        assert b"".join(parts) == expected, name
    for total in (10, 8 << 20, 80 << 30, 1 << 40):  # S3: at most 10,000 parts, whole MiB when larger than 8 MiB
        size = part_size(total)
        assert size >= 8 << 20 and -(-total // size) <= 10_000 and (size == 8 << 20 or size % (1 << 20) == 0)


def test_a_zip_header_rewritten_at_close_stays_while_it_spans_parts(tmp_path, monkeypatch):
    """``ZipSink`` keeps every part an open entry's header touches (with parts smaller than the header: all of
    them), so the rewrite at the entry's close lands before they go up; the parts join into the local zip."""
    import zipfile

    from dsckpt.io.stream import ZipSink

    class Parts:  # the store's side of Streams: what ZipSink calls
        def __init__(self):
            self.got: dict[int, bytes] = {}

        def start(self, key):
            return key

        def put(self, upload, number, data):
            self.got[number] = bytes(data)

    monkeypatch.setenv("DSCKPT_MULTIPART_CHUNKSIZE", "64")
    got, name = Parts(), "archive/data/" + "x" * 150  # its header: 30 + 163 bytes, over three 64-byte parts
    with ZipSink(got, "key", tmp_path / "placeholder") as sink, zipfile.ZipFile(sink, "w") as zf:
        for entry in (name, "archive/version"):
            sink.hold(zf.fp.tell())
            with zf.open(zipfile.ZipInfo(entry), "w") as out:
                out.write(os.urandom(1000))
            sink.release(sink._holds[0])
    data = b"".join(got.got[n] for n in sorted(got.got))
    assert len(got.got) > 20 and zipfile.ZipFile(__import__("io").BytesIO(data)).testzip() is None


def test_what_a_reader_looks_for_goes_up_last():
    from dsckpt.io.upload import upload_order

    assert upload_order(["d/.metadata", "d/__0_0.distcp", "d/client_state.json"])[-1] == "d/.metadata"  # DCP's
    assert upload_order(["u/latest_universal", "u/step3/zero/w/fp32.pt", "u/step3/mp_rank_00_model_states.pt"]) \
        [-1] == "u/latest_universal"
    assert upload_order(["hf/model.safetensors.index.json", "hf/model-00001-of-00002.safetensors",
                         "hf/config.json"])[-1] == "hf/model.safetensors.index.json"
    assert upload_order(["m.safetensors", "m.safetensors.client_state.json"], last="m.safetensors")[-1] == \
        "m.safetensors"


def test_inspect_reads_a_bucket_as_it_reads_a_folder(s3):
    import json

    remote = json.loads(ok("inspect", f"s3://{BUCKET}/z2_ws3_bf16", "--json").stdout)
    local = json.loads(ok("inspect", FIXTURES / "z2_ws3_bf16", "--json").stdout)
    text = json.dumps(remote).replace(f"s3://{BUCKET}/z2_ws3_bf16", str(FIXTURES / "z2_ws3_bf16"))
    assert json.loads(text) == local
    stats = ok("inspect", f"s3://{BUCKET}/z2_ws3_bf16", "--stats", "--json").stdout
    assert json.loads(stats)["stats"] == json.loads(ok("inspect", FIXTURES / "z2_ws3_bf16", "--stats", "--json").stdout)["stats"]


def test_a_truncated_or_damaged_object_is_exit_2_naming_it_and_nothing_is_written(s3, tmp_path):
    from dsckpt.plan.consolidate import build_plan
    from dsckpt.zero.reader import open_checkpoint

    piece = build_plan(open_checkpoint(FIXTURES / "z2_ws3_bf16")).tensors[0].pieces[0]
    rel = piece.path.relative_to(FIXTURES / "z2_ws3_bf16").as_posix()
    for how in ("truncated", "damaged"):
        prefix = f"{BUCKET}/{how}-{tmp_path.name}"
        s3.put(f"{FIXTURES / 'z2_ws3_bf16'}/", f"{prefix}/", recursive=True)
        data = bytearray((FIXTURES / "z2_ws3_bf16" / rel).read_bytes())
        if how == "truncated":
            data = data[: len(data) // 2]
        else:
            data[piece.offset + 1] ^= 0x10
        s3.pipe_file(f"{prefix}/{rel}", bytes(data))
        for out in (tmp_path / f"{how}.safetensors", f"s3://{BUCKET}/out-{how}-{tmp_path.name}.safetensors"):
            proc = run_cli("consolidate", f"s3://{prefix}", out)
            assert proc.returncode == 2 and "Traceback" not in proc.stderr
            assert f"s3://{prefix}/{rel}" in proc.stderr, proc.stderr
            assert ("CRC-32" if how == "damaged" else "truncated") in proc.stderr
        assert not list(tmp_path.glob(f"{how}*")) and not s3.exists(f"{BUCKET}/out-{how}-{tmp_path.name}.safetensors")
    missing = run_cli("inspect", f"s3://{BUCKET}/no-such-checkpoint")
    assert missing.returncode == 2 and f"s3://{BUCKET}/no-such-checkpoint: no such object or prefix" in missing.stderr


@pytest.mark.parametrize("when", ["streaming", "publishing"])
def test_an_interrupted_upload_leaves_nothing_that_looks_complete(s3, tmp_path, when):
    """Ctrl-C while convert streams its 60-odd files up (once 10 uploads have started), or while it completes them
    (once an object has appeared): what it had completed is deleted, the uploads it had started are aborted,
    `latest_universal` never appeared."""
    for attempt in range(3):  # (a run can still finish before the first look: then it is tried again)
        out = f"{BUCKET}/interrupted-{when}-{attempt}-{tmp_path.name}"
        returncode, stderr = _interrupt_convert(s3, out, when)
        if returncode != 0:
            break
    else:
        pytest.skip("three runs finished before Ctrl-C reached them")
    s3.invalidate_cache()
    assert returncode == 130 and b"Traceback" not in stderr
    assert s3.find(out) == [] and _started(s3, out) == []


def _started(s3, out: str) -> list[str]:
    uploads = s3.call_s3("list_multipart_uploads", Bucket=BUCKET).get("Uploads", [])
    return [u["Key"] for u in uploads if u["Key"].startswith(out.split("/", 1)[1])]


def _interrupt_convert(s3, out: str, when: str) -> tuple[int, bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DSCKPT_MULTIPART_CHUNKSIZE": "4096"}
    proc = subprocess.Popen([sys.executable, "-m", "dsckpt", "convert", f"s3://{BUCKET}/z3_ws2_fp32", f"s3://{out}",
                             "--to", "universal"], env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline:
        proc.send_signal(signal.SIGSTOP)  # it cannot finish while the bucket is looked at (a loaded host is slow to)
        s3.invalidate_cache()
        if len(_started(s3, out)) >= 10 if when == "streaming" else s3.find(out):
            break
        proc.send_signal(signal.SIGCONT)
        time.sleep(0.01)  # (at 50 ms a run could complete every upload between two looks)
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGCONT)
    _, stderr = proc.communicate(timeout=60)
    return proc.returncode, stderr


def test_the_reading_api_and_commands_take_urls(s3, tmp_path):
    """load_state_dict, iter_state_dict and load_into (a checkpoint and a weights file in the bucket); diff,
    check-finite and verify (every tag) read the bucket as they read the folder."""
    import torch

    import dsckpt
    from dsckpt.runtime.demo_model import TinyCausalLM

    url, local = f"s3://{BUCKET}/z3_ws2_fp32", FIXTURES / "z3_ws2_fp32"
    expected = dsckpt.load_state_dict(local)
    got = dsckpt.load_state_dict(url)
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)
    assert all(torch.equal(t, expected[n]) for n, t in dsckpt.iter_state_dict(url))
    weights = f"{BUCKET}/weights-{tmp_path.name}/model.safetensors"
    ok("consolidate", local, tmp_path / "model.safetensors")
    s3.put_file(str(tmp_path / "model.safetensors"), weights)
    vocab, dim = expected["embed.weight"].shape
    layers = len({k.split(".")[1] for k in expected if k.startswith("blocks.")})
    for source in (url, f"s3://{weights}"):
        model = TinyCausalLM(vocab_size=vocab, dim=dim, n_layers=layers, n_heads=2,
                             seq_len=expected["pos_embed"].shape[0])
        assert dsckpt.load_into(model, source).missing_keys == []
        assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())
    assert "IDENTICAL" in ok("diff", url, f"s3://{weights}").stdout
    assert "tensors finite" in ok("check-finite", url, "--optimizer").stdout
    assert ok("verify", url, "--all-tags").stdout == ok("verify", local, "--all-tags").stdout


@pytest.mark.runtime  # (dsckpt resume: DeepSpeed's runtime in subprocesses)
def test_resume_from_a_bucket_sharded_and_from_full_weights(s3, tmp_path):
    """resume fetches what DeepSpeed's loader reads to a scratch folder, removed when it ends (one process too: it
    ends without interpreter teardown); its messages name the URL."""
    from dsckpt.io.remote import SCRATCH_ENV

    model = "dsckpt.runtime.demo_model:build_small_model"
    env = {"CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu"}
    weights = f"{BUCKET}/full-{tmp_path.name}/model.safetensors"
    ok("consolidate", FIXTURES / "z3_ws2_fp32", tmp_path / "model.safetensors")
    s3.put(f"{tmp_path}/", f"{BUCKET}/full-{tmp_path.name}/", recursive=True)  # with its client-state sidecars
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    check = run_cli("resume", "--full-weights", f"s3://{weights}", "--model", model, "--stage", "3", "--check",
                    env={**env, SCRATCH_ENV: str(scratch)})
    assert check.returncode == 0, check.stderr
    assert f"identical to s3://{weights}" in check.stdout + check.stderr and "step 3" in check.stderr
    assert list(scratch.iterdir()) == []  # the local copy of the weights is gone with the command
    url = f"s3://{BUCKET}/z3_ws2_fp32"
    sharded = run_cli("resume", url, "--model", model, "--nproc", "2", "--steps", "1", "--save-dir", tmp_path / "run",
                      env=env)
    assert sharded.returncode == 0, sharded.stderr
    assert f"resumed {url} at step 3" in sharded.stderr and (tmp_path / "run" / "step4").is_dir()


AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="  # its documented dev key


def _azurite() -> str | None:
    import shutil

    local = ROOT / ".tools" / "node_modules" / ".bin" / "azurite-blob"  # where `make setup` puts it, given npm
    return str(local) if local.exists() else shutil.which("azurite-blob")


@pytest.mark.parametrize("scheme", ["gs", "az"])
def test_gcs_and_azure_read_and_write_as_s3_does(scheme, tmp_path, monkeypatch):
    """The same commands through gcsfs and adlfs against their clouds' emulators: the local bytes, streamed (Azure's
    staged blocks, GCS's composed part objects), a truncated object named, nothing left at OUT."""
    port = free_port()
    if scheme == "gs":
        pytest.importorskip("gcsfs")
        cmd = [sys.executable, "-m", "gcp_storage_emulator", "start", "--port", str(port), "--in-memory"]
        env = {"STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{port}",
               "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}  # (its bucket-type probe speaks gRPC: no emulator does)
    else:
        pytest.importorskip("adlfs")
        azurite = _azurite()
        if azurite is None:
            pytest.skip("Azurite not installed (`make setup` installs it where npm is)")
        cmd = [azurite, "--blobHost", "127.0.0.1", "--blobPort", str(port), "--inMemoryPersistence",
               "--skipApiVersionCheck", "--silent"]
        env = {"AZURE_STORAGE_CONNECTION_STRING": "DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;"
               f"AccountKey={AZURITE_KEY};BlobEndpoint=http://127.0.0.1:{port}/devstoreaccount1;"}
    server = _serve(cmd, port)
    from dsckpt.io import parts

    uploaded = []  # both stream their outputs: Azure as staged blocks, GCS as part objects composed at the end
    backend = parts.GcsCompose if scheme == "gs" else parts.AzureBlocks
    real_put = backend.put
    monkeypatch.setattr(backend, "put", lambda self, *a: uploaded.append(a[0]) or real_put(self, *a))
    monkeypatch.setenv("DSCKPT_MULTIPART_CHUNKSIZE", "512" if scheme == "gs" else "4096")  # (GCS: over 32 parts)
    try:
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        import fsspec

        fs = fsspec.filesystem(scheme, skip_instance_cache=True)
        fs.mkdir("bkt")
        fs.put(f"{FIXTURES / 'z2_ws3_bf16'}/", "bkt/ckpt/", recursive=True)
        url = f"{scheme}://bkt/ckpt"
        ok("consolidate", url, f"{scheme}://bkt/out/model.safetensors", "--dtype", "bf16")
        ok("consolidate", FIXTURES / "z2_ws3_bf16", tmp_path / "model.safetensors", "--dtype", "bf16")
        assert fs.cat_file("bkt/out/model.safetensors") == (tmp_path / "model.safetensors").read_bytes()
        monkeypatch.setenv("DSCKPT_MULTIPART_CHUNKSIZE", "4096")
        ok("reshard", url, f"{scheme}://bkt/out/rs", "-w", "2")
        ok("reshard", FIXTURES / "z2_ws3_bf16", tmp_path / "rs", "-w", "2")
        fs.get("bkt/out/rs/", f"{tmp_path / 'got'}/", recursive=True)
        same_tree(tmp_path / "got", tmp_path / "rs")
        assert '"zero_stage": 2' in ok("inspect", url, "--json").stdout
        streamed = {key.rsplit("/", 1)[-1] for key in uploaded}
        zips = {name for name in streamed if name.endswith("_optim_states.pt")}
        assert "model.safetensors" in streamed and len(zips) == 2, streamed
        assert uploaded.count("bkt/out/model.safetensors") > (32 if scheme == "gs" else 3)  # (GCS: composites of composites)
        assert not [key for key in fs.find("bkt/out") if ".dsckpt-" in key]  # (GCS's part objects deleted)
        if scheme == "gs":  # what a failure or Ctrl-C does to a started upload: its part objects go
            gcs, key = parts.GcsCompose(fs), "bkt/out/aborted.safetensors"
            upload_id = gcs.start(key)
            for number in (1, 2, 3):
                real_put(gcs, key, upload_id, number, bytearray(100))
            assert len([key for key in fs.find("bkt/out", refresh=True) if ".dsckpt-part-" in key]) == 3
            gcs.abort(key, upload_id)
            assert not [key for key in fs.find("bkt/out", refresh=True) if ".dsckpt-" in key]
        rel = next(p for p in fs.find("bkt/ckpt") if p.endswith("optim_states.pt"))
        fs.pipe_file(rel, fs.cat_file(rel)[:-4096])
        proc = run_cli("consolidate", url, f"{scheme}://bkt/out/truncated.safetensors")
        assert proc.returncode == 2 and f"{scheme}://{rel}" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
        assert not fs.exists("bkt/out/truncated.safetensors")
        assert not [key for key in fs.find("bkt/out") if ".dsckpt-" in key]
    finally:
        server.terminate()
        server.wait(10)


def test_every_reading_command_takes_another_tag_than_latest_in_a_bucket(s3, tmp_path):
    """Rolling back to an older tag in a bucket: --tag (and the API's tag=) of a tag `latest` does not name works
    as it does on a local folder - consolidate, reshard, convert, diff, check-finite, verify, inspect, load_state_dict."""
    import shutil

    import torch

    import dsckpt

    local = tmp_path / "two_tags"
    shutil.copytree(FIXTURES / "z3_ws2_fp32", local)
    old = (local / "latest").read_text().strip()
    shutil.copytree(local / old, local / "newer")
    (local / "latest").write_text("newer")
    url = f"s3://{BUCKET}/two-tags-{tmp_path.name}"
    s3.put(f"{local}/", url[len("s3://"):] + "/", recursive=True)
    ok("consolidate", url, tmp_path / "r.safetensors", "--tag", old, "--no-client-state")
    ok("consolidate", local, tmp_path / "l.safetensors", "--tag", old, "--no-client-state")
    assert (tmp_path / "r.safetensors").read_bytes() == (tmp_path / "l.safetensors").read_bytes()
    ok("reshard", url, tmp_path / "rs", "-w", "3", "--tag", old)
    ok("convert", url, tmp_path / "u", "--to", "universal", "--tag", old)
    assert "IDENTICAL" in ok("diff", url, local, "--tag-a", old, "--tag-b", old).stdout
    ok("check-finite", url, "--tag", old)
    assert ok("verify", url, "--tag", old).stdout == ok("verify", local, "--tag", old).stdout
    report = json.loads(ok("inspect", url, "--tag", old, "--json").stdout)
    assert report["tag"] == old and set(report["tags"]) == {old, "newer"}, report
    got, want = dsckpt.load_state_dict(url, tag=old), dsckpt.load_state_dict(local, tag=old)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)


def test_urls_keep_their_spelling_in_the_api_and_the_catalog(s3, tmp_path):
    """classify and verify read a bucket; open_checkpoint, list and prune refuse one in the URL's own spelling (not
    `s3:/...`); an upper-case scheme is the same URL."""
    import dsckpt

    url, local = f"s3://{BUCKET}/z3_ws2_fp32", FIXTURES / "z3_ws2_fp32"
    assert dsckpt.classify(url).kind == "deepspeed"
    assert [(r.tag, r.problems) for r in dsckpt.verify(url, all_tags=True)] == \
        [(r.tag, r.problems) for r in dsckpt.verify(local, all_tags=True)]
    with pytest.raises(dsckpt.errors.CheckpointNotFoundError, match=f"^{url}: open_checkpoint reads a local folder"):
        dsckpt.open_checkpoint(url)
    for verb in (["list"], ["prune", "--keep", "1"]):
        proc = run_cli(*verb, url)
        assert proc.returncode == 2 and proc.stderr.startswith(f"dsckpt: error: {url}: {verb[0]} works on a local"), \
            proc.stderr
    upper = "S3://" + url[len("s3://"):]
    assert json.loads(ok("inspect", upper, "--json").stdout)["zero_stage"] == 3


def test_a_stale_latest_in_a_bucket_is_the_same_error_at_one_and_two_processes(s3, tmp_path):
    import shutil

    local = tmp_path / "stale"
    shutil.copytree(FIXTURES / "z2_ws2_fp32", local)
    (local / "latest").write_text("step99")
    url = f"s3://{BUCKET}/stale-{tmp_path.name}"
    s3.put(f"{local}/", url[len("s3://"):] + "/", recursive=True)
    errors = []
    for n in ("1", "2"):
        proc = run_cli("consolidate", url, tmp_path / f"o{n}.safetensors", "--nproc", n, "--json")
        assert proc.returncode == 2, proc.stderr[-2000:]
        errors.append(json.loads(proc.stdout)["error"])
    assert errors == [f"{url}/latest: names tag 'step99', which is not a tag folder beside it"] * 2


def test_inspect_of_a_tag_folder_url_names_the_bucket(s3):
    url = f"s3://{BUCKET}/z3_ws2_fp32"
    tag = (FIXTURES / "z3_ws2_fp32" / "latest").read_text().strip()
    doc = json.loads(ok("inspect", f"{url}/{tag}", "--json").stdout)
    assert (doc["input"], doc["root"], doc["tag"]) == (f"{url}/{tag}", url, tag)
    assert "dsckpt-read" not in ok("inspect", f"{url}/{tag}").stdout


@pytest.mark.slow  # gcsfs retries with back-off for ~35 s before it gives up: make test-all
def test_an_unreachable_store_is_one_clean_line(tmp_path):
    """gs:// whose endpoint does not answer (a closed local port stands in for missing credentials or network): the
    typed error, without the client's logged retry tracebacks before it."""
    pytest.importorskip("gcsfs")
    env = {"STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{free_port()}", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
    proc = run_cli("inspect", "gs://nobucket/run", env=env, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("dsckpt: error: gs://nobucket/run"), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and len(proc.stderr.splitlines()) <= 3, proc.stderr[-3000:]


def test_convert_to_deepspeed_reads_and_writes_buckets_as_it_does_folders(s3, tmp_path):
    """A DCP folder in a bucket -> a ZeRO checkpoint in the bucket: the bytes of a local conversion."""
    from test_into_deepspeed import _tiny_dcp

    _tiny_dcp(tmp_path / "dcp")
    s3.put(f"{tmp_path / 'dcp'}/", f"{BUCKET}/dcp-{tmp_path.name}/", recursive=True)
    url, out = f"s3://{BUCKET}/dcp-{tmp_path.name}", f"s3://{BUCKET}/ds-{tmp_path.name}"
    ok("convert", url, out, "--to", "deepspeed", "-w", "3", "--stage", "3")
    ok("convert", tmp_path / "dcp", tmp_path / "local", "--to", "deepspeed", "-w", "3", "--stage", "3")
    s3.get(f"{out.removeprefix('s3://')}/", f"{tmp_path / 'got'}/", recursive=True)
    same_tree(tmp_path / "got", tmp_path / "local")
    # two processes on one host: the first fetches the source, the other finds it (never both into one folder)
    ok("convert", url, tmp_path / "two", "--to", "deepspeed", "-w", "3", "--stage", "3", "--nproc", "2")
    same_tree(tmp_path / "two", tmp_path / "local")
    from dsckpt.api.options import WriteOptions
    from dsckpt.progress import Phase, Tally

    tally = Tally()  # the source's fetch is told (#56), then the write
    result = dsckpt.into_deepspeed(url, tmp_path / "api", 3, stage=3, options=WriteOptions(progress=tally))
    fetched, written = tally.steps
    objects = sum(info["size"] for info in s3.find(url.removeprefix("s3://"), detail=True).values())
    assert (fetched.phase, fetched.total, fetched.done) == (Phase.FETCH, objects, objects) and objects > 0
    assert written.phase is Phase.WRITE and written.total == result.bytes
    missing = run_cli("convert", f"s3://{BUCKET}/no-such-{tmp_path.name}", tmp_path / "x", "--to", "deepspeed",
                      "-w", "2", "--stage", "2")
    assert missing.returncode == 2 and "Traceback" not in missing.stderr and not (tmp_path / "x").exists()


def test_verify_of_a_bucket_reports_what_it_fetches_and_checks(s3):
    """`dsckpt verify s3://...` shows progress: a fetch of every object's bytes (its total known before the first
    byte), then the bytes CRC-checked."""
    from dsckpt.analysis.verify import verify
    from dsckpt.progress import Phase, Tally

    tally = Tally()
    (report,) = verify(f"s3://{BUCKET}/z3_ws2_fp32", progress=tally)
    assert not report.problems
    objects = sum(info["size"] for info in s3.find(f"{BUCKET}/z3_ws2_fp32", detail=True).values())
    fetched, checked = tally.steps
    assert (fetched.phase, checked.phase) == (Phase.FETCH, Phase.VERIFY)
    assert 0 < fetched.total == fetched.done <= objects  # (the zips' directories came first, with the listing)
    assert 0 < checked.done < objects


def test_writing_verbs_report_a_buckets_fetch_then_their_write(s3, tmp_path):
    """#56/#53: consolidate, reshard and convert of a bucket's checkpoint tell one ``Progress`` a ``FETCH`` (its
    total known before the first byte) and then the ``WRITE`` of what they write; a local checkpoint only the
    ``WRITE``."""
    from dsckpt.api.options import WriteOptions
    from dsckpt.progress import Phase, Tally

    url = f"s3://{BUCKET}/z3_ws2_fp32"
    verbs = {"consolidate": lambda src, out, o: dsckpt.consolidate(src, out / "m.safetensors", options=o),
             "reshard": lambda src, out, o: dsckpt.reshard(src, out / "r", 3, options=o),
             "convert": lambda src, out, o: dsckpt.convert(src, out / "u", "universal", options=o)}
    for verb, run in verbs.items():
        tallies = {}
        for where, src in (("bucket", url), ("local", FIXTURES / "z3_ws2_fp32")):
            tallies[where] = Tally()
            (tmp_path / verb / where).mkdir(parents=True)
            result = run(src, tmp_path / verb / where, WriteOptions(progress=tallies[where]))
        fetched, written = tallies["bucket"].steps
        assert (fetched.phase, written.phase) == (Phase.FETCH, Phase.WRITE), verb
        assert fetched.total == fetched.done > 0 and written.total == result.bytes, verb
        (local,) = tallies["local"].steps
        assert local.phase is Phase.WRITE and local.total == written.total and local.done == written.done, verb


def test_a_local_merge_publishes_pointers_last_as_an_upload_does():
    """One pointer-last order for every commit: a folder merged into an existing one (--force) puts
    `latest_universal` and DCP's `.metadata` after their data, as the bucket upload does."""
    from dsckpt.io.output import publish_order
    from dsckpt.io.upload import upload_order

    names = [".metadata", "__0_0.distcp", "latest_universal", "step3", "client_state.json"]
    assert publish_order(names)[:3] == ["__0_0.distcp", "client_state.json", "step3"]
    assert publish_order(names)[3:] == ["latest_universal", ".metadata"]
    assert upload_order([f"d/{n}" for n in names]) == [f"d/{n}" for n in publish_order(names)]


@pytest.mark.runtime
def test_the_background_engine_saves_into_a_bucket(s3, tmp_path):
    """#54: ``engine.save_checkpoint("s3://...")`` with dsckpt's engine on 2 ranks (ZeRO-3): every object of the tag
    is byte for byte the file a local save of the same moment wrote, `latest` goes up last and names the newest
    tag, the bucket reads as any checkpoint (verify, consolidate); a save into a bucket that does not exist fails at
    ``wait()`` with the URL named and leaves nothing; DeepSpeed's load of a URL is refused in words.  Then kill -9 of
    every rank while a tag's upload is in flight (rank 0's objects up, rank 1's not): `latest` stays on the previous
    tag, which reads whole; the half-uploaded tag is refused as one, not taken for a checkpoint.  A reused tag whose
    copies into place are cut between two objects is marked (readers refuse it) and completed by the next save; a
    new process's first save removes what the killed one staged."""
    from dsckpt.runtime.launch import run_ranks

    url = f"s3://{BUCKET}/engine-{tmp_path.name}"
    env = {key: os.environ[key] for key in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                            "AWS_DEFAULT_REGION")}
    with tempfile.TemporaryFile("w+") as log:
        codes = run_ranks([sys.executable, str(ROOT / "tests" / "jobs" / "async_bucket.py"), "3", url, str(tmp_path),
                           str(tmp_path / "report.json")], 2,
                          {"OMP_NUM_THREADS": "1", "PYTHONPATH": PYTHONPATH, **env}, JOB_TIMEOUT, stdout=log,
                          stderr=log, cwd=ROOT)
        log.seek(0)
        text = log.read()
    assert sorted(p.name for p in tmp_path.glob("killed.*")) == ["killed.0", "killed.1"], text[-3000:]
    assert all(code != 0 for code in codes)
    doc = json.loads((tmp_path / "report.json").read_text())
    prefix = url[len("s3://"):]
    assert s3.cat_file(f"{prefix}/latest").decode() == "t5"
    hidden = sorted(p.rsplit("/", 1)[-1] for p in s3.find(prefix) if "/.t4.dsckpt-tmp-" in p)
    assert hidden == ["zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    assert not s3.exists(f"{prefix}/t4")  # a killed upload leaves no visible half tag (#68.2)
    partial = run_cli("consolidate", url, tmp_path / "t4.safetensors", "--tag", "t4")
    assert partial.returncode == 2 and not (tmp_path / "t4.safetensors").exists()
    local = sorted(p.name for p in (tmp_path / "local" / "t1").iterdir())
    assert sorted(p.rsplit("/", 1)[-1] for p in s3.ls(f"{prefix}/t1")) == local and len(local) == 4
    for name in local:
        assert s3.cat_file(f"{prefix}/t1/{name}") == (tmp_path / "local" / "t1" / name).read_bytes(), name
    assert s3.exists(f"{prefix}/zero_to_fp32.py") and not s3.exists(f"{prefix}/t3")
    assert "no-such-bucket-" in doc["failure"] and "/t3: the background save failed" in doc["failure"]
    assert "no such bucket" in doc["failure"]
    assert "t3" not in [tag for tag, ok, _ in doc["records"] if ok]
    assert "dsckpt resume" in doc["refused"]
    reused = doc["reused"]  # #68.3: a reused tag whose upload fails on one rank keeps every object of the old one
    assert reused["untouched"] and reused["hidden_left"] == [], reused
    assert "No space left on device" in reused["failure"] and "still names 't2'" in reused["failure"], reused
    cut = doc["cut"]  # #68.3: a publish into a reused tag cut between two objects is marked, then rolled forward
    assert "its publish into the bucket had begun: the tag is marked incomplete" in cut["failure"] and "Input/output error" in cut["failure"], cut
    assert cut["verify"]["code"] == 1 and "publish into the bucket was cut" in cut["verify"]["text"], cut
    again = sorted(p.name for p in (tmp_path / "again" / "t2").iterdir())
    assert sorted(p.rsplit("/", 1)[-1] for p in s3.ls(f"{prefix}/t2")) == again and len(again) == 4
    for name in again:  # every object is the cut save's (the one the local twin holds), none the older save's
        assert s3.cat_file(f"{prefix}/t2/{name}") == (tmp_path / "again" / "t2" / name).read_bytes(), name
    assert not [p for p in s3.find(prefix) if "/.t2.dsckpt-tmp-" in p]
    ok("verify", url, "--all-tags")
    from dsckpt.checkpoint_engine.commit import Targets, new_owner, staging_name

    target, staging = Targets().for_path(url), staging_name("t6", new_owner())
    target.prepare("t6", staging)  # a new process's first save into URL: what a killed one left is removed
    target.persist(staging, [])
    assert not [p for p in s3.find(prefix) if "/.t4.dsckpt-tmp-" in p]
    assert sorted({p[len(prefix) + 1:].split("/")[0] for p in s3.find(prefix)}) == \
        ["latest", "t1", "t2", "t5", "zero_to_fp32.py", "zero_to_torch.py"]
    target.close()
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    ok("consolidate", url, a, "--tag", "t1")
    ok("consolidate", tmp_path / "local", b)
    assert a.read_bytes() == b.read_bytes()


def test_a_publish_cut_by_a_killed_process_is_finished_by_the_next_ones_first_save(s3, tmp_path):
    """#68.3 on a bucket, a kill between two copies into a reused tag: the tag holds two saves' objects and the
    marker, which every reader refuses; a new process's first save into the folder copies the rest from the hidden
    objects (every one whole before the first copy) and removes the marker; the tag then reads whole."""
    from dsckpt.checkpoint_engine.commit import BucketTarget, new_owner, staging_name
    from dsckpt.formats.bucket import BucketStorage

    url = f"s3://{BUCKET}/cut-{tmp_path.name}"
    prefix = url[len("s3://"):]
    ok("reshard", FIXTURES / "z1_ws2_fp32", url, "-w", "2")  # the tag as saved before (step3)
    tag = s3.cat_file(f"{prefix}/latest").decode()
    names = sorted(p.rsplit("/", 1)[-1] for p in s3.ls(f"{prefix}/{tag}"))
    again = tmp_path / "again"
    ok("reshard", FIXTURES / "z2_ws2_fp32", again, "-w", "2")  # the same tag saved again (another run's step3)...
    newer = {name: (again / tag / name).read_bytes() for name in names}
    assert any(s3.cat_file(f"{prefix}/{tag}/{n}") != data for n, data in newer.items())  # (...bytes of its own)
    dead = BucketTarget(BucketStorage(url))  # ...by a process that is gone: its objects up, one copy made, killed
    staging = staging_name(tag, "999999999-0")
    files = []
    for name, data in newer.items():
        path = Path(dead.local) / staging / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        files.append(str(path))
    dead.persist(staging, files)
    dead.open_publish(tag, staging, leader=True)
    dead.bucket.copy(f"{staging}/{names[0]}", f"{tag}/{names[0]}")
    dead.close()
    proc = run_cli("verify", url)
    assert proc.returncode == 1 and "publish into the bucket was cut" in proc.stdout + proc.stderr
    target, staging = BucketTarget(BucketStorage(url)), staging_name("next", new_owner())
    target.prepare("next", staging)  # (rank 0, in the save call)
    target.persist(staging, [])  # (its writer thread, before the save's own objects go up)
    target.close()
    assert {n: s3.cat_file(f"{prefix}/{tag}/{n}") for n in names} == newer
    assert not [p for p in s3.find(prefix) if TEMP in p or p.endswith("dsckpt-publishing.json")]
    ok("verify", url)


@pytest.mark.runtime
def test_sigterm_during_a_bucket_publish_says_the_tag_is_marked_and_the_next_save_finishes_it(s3, tmp_path):
    """#68.3/68.5 on a bucket: SIGTERM while a reused tag's objects are copied into place, past the grace: the process
    ends by SIGTERM saying the tag is marked incomplete (not "nothing of it is visible"); readers refuse it; a new
    process's first save into the folder finishes the copies, and the tag reads whole."""
    from dsckpt.checkpoint_engine.commit import BucketTarget, new_owner, staging_name
    from dsckpt.formats.bucket import BucketStorage

    url = f"s3://{BUCKET}/sigterm-{tmp_path.name}"
    env = {key: os.environ[key] for key in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                            "AWS_DEFAULT_REGION")}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "jobs" / "async_trust.py"), "bucket-sigterm", url,
                           str(tmp_path / "report.json")], capture_output=True, text=True, timeout=JOB_TIMEOUT,
                          env={**os.environ, **env, "PYTHONPATH": PYTHONPATH, "OMP_NUM_THREADS": "1",
                               "DSCKPT_SIGTERM_GRACE": "1"})
    assert proc.returncode == -signal.SIGTERM, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "/x, was abandoned (its publish into the bucket had begun: the tag is marked incomplete" in proc.stderr, \
        proc.stderr[-2000:]
    prefix = url[len("s3://"):]
    assert s3.cat_file(f"{prefix}/latest").decode() == "x"
    refused = run_cli("verify", url)
    assert refused.returncode == 1 and "publish into the bucket was cut" in refused.stdout + refused.stderr
    target, staging = BucketTarget(BucketStorage(url)), staging_name("next", new_owner())
    target.prepare("next", staging)
    target.persist(staging, [])
    target.close()
    ok("verify", url)


def test_a_publish_that_fails_before_its_first_copy_leaves_the_tag_as_it_was(s3, tmp_path):
    """The marker is up but the ranks never agreed to copy (a peer gone): the failed save's hidden objects and its
    marker go, the tag reads as before, and the failure claims nothing was cut; once copies began, it keeps both."""
    from dsckpt.checkpoint_engine.commit import BucketTarget, new_owner, staging_name
    from dsckpt.formats.bucket import BucketStorage

    url = f"s3://{BUCKET}/unopened-{tmp_path.name}"
    prefix = url[len("s3://"):]
    ok("reshard", FIXTURES / "z1_ws2_fp32", url, "-w", "2")
    before = {p: s3.cat_file(p) for p in s3.find(prefix)}
    target = BucketTarget(BucketStorage(url))
    for began in (False, True):
        staging = staging_name("step3", new_owner())
        target.prepare("step3", staging)
        path = Path(target.local) / staging / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"newer")
        target.persist(staging, [str(path)])
        target.open_publish("step3", staging, leader=True)
        if began:
            target.publish("step3", staging, [], leader=True)  # (this rank's copies done; another's cut)
        said = target.discard("step3", staging, [], leader=True)
        s3.invalidate_cache()
        if not began:
            assert said is None and {p: s3.cat_file(p) for p in s3.find(prefix)} == before
            ok("verify", url)
    assert "its publish into the bucket had begun: the tag is marked incomplete" in said
    assert s3.exists(f"{prefix}/step3/dsckpt-publishing.json")
    target.close()


def test_a_bucket_answers_the_storage_protocol_as_a_folder_does(s3, tmp_path):
    """#53 point 1: ``storage_for`` chooses the backend from the path; both answer the same protocol - list, size,
    ranged reads, a zip's index through ``open``, publish (a staged file and a staged folder, in order), remove - and
    a bucket's errors name its URL."""
    from dsckpt.errors import CheckpointNotFoundError, CorruptFileError
    from dsckpt.formats.backends import storage_for
    from dsckpt.formats.bucket import BucketStorage
    from dsckpt.formats.storage import LocalStorage
    from dsckpt.formats.torchzip import StorageIndex

    folder, url = FIXTURES / "z2_ws3_bf16", f"s3://{BUCKET}/z2_ws3_bf16"
    local, bucket = storage_for(folder), storage_for(url)
    assert isinstance(local, LocalStorage) and isinstance(bucket, BucketStorage)
    assert [(e.name.relative_to(folder), e.size) for e in local.list(folder)] == \
        [(e.name, e.size) for e in bucket.list()]
    rank = "step3/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    size = local.size(folder / rank)
    assert bucket.size(rank) == bucket.size(f"{url}/{rank}") == size
    assert bucket.pread(rank, 1000, size - 1000) == local.pread(folder / rank, 1000, size - 1000)
    into = bytearray(64)
    assert bytes(bucket.pread(rank, 64, 30, into)) == bytes(local.pread(folder / rank, 64, 30))
    with bucket.open(rank) as remote_file, local.open(folder / rank) as local_file:
        assert remote_file.read() == local_file.read()
    assert StorageIndex(rank, storage=bucket).storages == StorageIndex(folder / rank).storages
    with pytest.raises(CorruptFileError, match=f"^{url}/{rank}: .* bytes at offset"):
        bucket.pread(rank, 100, size - 10)
    with pytest.raises(CheckpointNotFoundError, match=f"^{url}/step3/nothing: no such object"):
        bucket.size("step3/nothing")

    staged = tmp_path / "out"
    (staged / "sub").mkdir(parents=True)
    (staged / "latest").write_text("sub")
    (staged / "sub" / "data.bin").write_bytes(b"x" * 10)
    out = BucketStorage(f"s3://{BUCKET}/published")
    order: list[str] = []
    out.merge_into(staged, "", order=lambda names: order.extend(sorted(names, key=lambda n: n == "latest")) or order)
    assert order[-1] == "latest" and out.read("latest", 0, 3) == b"sub" and out.size("sub/data.bin") == 10
    out.replace(staged / "latest", "copy")
    out.write("small", b"abc")
    assert sorted((str(e.name), e.size) for e in out.list()) == \
        [("copy", 3), ("latest", 3), ("small", 3), ("sub/data.bin", 10)]
    out.write("small/beside", b"not ours")  # an object whose name continues another's stays when that one goes
    out.remove("small")
    assert out.object_size("small") is None and out.read("small/beside", 0, 8) == b"not ours"
    out.remove("")
    out.remove("never-there")
    assert not s3.exists(f"{BUCKET}/published/latest")
