"""dsckpt's background checkpoint engine (runtime/async_save.py) against DeepSpeed's own save and load."""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from conftest import JOB_TIMEOUT, PYTHONPATH, ROOT, run_cli, run_job, skip_beyond_devices
from dsckpt.api.consolidation import load_state_dict
from dsckpt.checkpoint_engine.snapshot import HostPool, Snapshot
from dsckpt.zero.reader import open_checkpoint

STATES = ("fp32", "exp_avg", "exp_avg_sq")


def test_snapshot_keeps_what_torch_save_sees(tmp_path):
    """Views of one storage stay views of one copied storage; parameters, requires_grad, containers and plain
    objects come through; the copy does not follow later in-place changes."""
    flat = torch.arange(10, dtype=torch.float32)
    param = torch.nn.Parameter(torch.ones(3))
    state = {"a": flat[2:5], "b": flat[5:].view(5), "p": param, "empty": [torch.empty(0), torch.empty(0)],
             "nested": ({"step": 3}, [flat[:2]]), "text": ["x"]}
    snap = Snapshot(HostPool())
    copied = snap.take(state)
    flat.add_(100)
    state["text"].append("y")
    assert copied["a"].untyped_storage().data_ptr() == copied["b"].untyped_storage().data_ptr()
    assert copied["a"].tolist() == [2, 3, 4] and copied["b"].tolist() == [5, 6, 7, 8, 9]
    assert isinstance(copied["p"], torch.nn.Parameter) and copied["p"].requires_grad
    assert copied["text"] == ["x"] and copied["nested"][0] == {"step": 3} and snap.nbytes == 40 + 12
    torch.save(copied, tmp_path / "x.pt")
    back = torch.load(tmp_path / "x.pt", weights_only=True)
    assert back["b"].untyped_storage().nbytes() == 40  # one storage, as torch.save wrote the original's
    assert [t.numel() for t in back["empty"]] == [0, 0]


class Note:  # a client's own class: pickled by reference, as torch.save pickles it
    def __init__(self, text):
        self.text = text


def test_engine_writer_writes_what_torch_save_writes(tmp_path, monkeypatch):
    """``persist.write_snapshot``: torch's headers and pickle, the storages' bytes written in chunks on threads and
    their CRC-32s put where torch puts them - the same file as ``torch.save``'s but for its random serialization id,
    for views, shared and empty storages, odd sizes, bf16, int64, parameters and a client's own object."""
    import zipfile

    from dsckpt.io.integrity import check_files
    from dsckpt.checkpoint_engine import persist

    monkeypatch.setattr(persist, "CHUNK", 4096)  # many chunks, the last one short
    monkeypatch.setattr(persist, "WRITE_PIECE", 1000)  # a chunk in several writes and read-backs, none dividing it
    monkeypatch.setattr(persist, "_READ_BACK", 1500)
    monkeypatch.setattr(persist, "_NICE", 1)
    flat = torch.randn(10_007)
    state = {"a": flat[3:], "b": flat[:7].view(7, 1), "empty": torch.empty(0), "ids": torch.arange(13),
             "bf": torch.randn(4099).bfloat16(), "p": torch.nn.Parameter(torch.randn(5, 3).t()),
             "nested": [{"step": 3, "shared": flat}], "note": Note("as of the call")}
    (tmp_path / "stock").mkdir(), (tmp_path / "dsckpt").mkdir()
    stock, ours = tmp_path / "stock" / "rank.pt", tmp_path / "dsckpt" / "rank.pt"
    torch.save(state, stock)
    persist.write_snapshot(state, ours)
    a, b = stock.read_bytes(), ours.read_bytes()
    with zipfile.ZipFile(stock) as za, zipfile.ZipFile(ours) as zb:
        assert zb.testzip() is None  # every entry's CRC-32 right
        ident = za.getinfo("rank/.data/serialization_id")
        assert [(i.filename, i.header_offset, i.file_size) for i in za.infolist()] == \
               [(i.filename, i.header_offset, i.file_size) for i in zb.infolist()]
        assert [i.CRC for i in za.infolist() if i is not ident] == [i.CRC for i in zb.infolist()
                                                                   if i.filename != ident.filename]
        directory = za.start_dir
    assert len(a) == len(b) and a[:ident.header_offset] == b[:ident.header_offset]  # every storage, descriptor
    assert sum(x != y for x, y in zip(a[directory:], b[directory:])) <= 4  # the id's CRC-32 in the directory
    check_files([ours])
    with torch.serialization.safe_globals([Note]):
        back = torch.load(ours, weights_only=True)
    assert back["note"].text == "as of the call" and back["nested"][0]["shared"].data_ptr() == back["a"].data_ptr() - 12
    assert all(torch.equal(back[k], state[k]) for k in ("a", "b", "empty", "ids", "bf", "p"))
    niced: list[int] = []
    thread = threading.Thread(target=lambda: (persist._lower_priority(),
                                              niced.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))))
    thread.start(), thread.join()
    assert niced == [min(19, os.getpriority(os.PRIO_PROCESS, 0) + 1)]  # the persist thread's own, not the process's


@pytest.fixture(scope="module", params=[2, 3], ids=["zero2", "zero3"])
def saved(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"async{request.param}")
    run_job("async_save.py", 2, request.param, root, root / "report.json")
    return root, json.loads((root / "report.json").read_text())


@pytest.mark.runtime
def test_background_save_equals_stock_save(saved):
    """The tag written in the background holds the state as of the call: equal to DeepSpeed's own blocking save of
    the same moment, although two optimizer steps and a change to the client state ran while it was written."""
    check_equal_to_stock(*saved)


@pytest.mark.gpu
def test_background_save_from_gpu_equals_stock_save(tmp_path):
    """The same on a GPU (pinned buffers; the optimizer-states file's copies on a stream of their own, the next
    step waiting for them): ``pytest -m gpu`` on a GPU host."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    run_job("async_save.py", 1, 3, tmp_path, tmp_path / "report.json")
    report = json.loads((tmp_path / "report.json").read_text())
    check_equal_to_stock(tmp_path, report)
    deferred = report["deferred"]  # the optimizer's copies on their own stream, still running when the call returned
    assert deferred["deferred"] and deferred["call_s"] < 0.5 and deferred["pending_after_call"], deferred
    assert deferred["next_step_s"] > 0.2, deferred
    assert deferred["restored"], deferred
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    ours = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "async"), tag="t")
    assert ours.keys() == load_state_dict(tmp_path / "ref", tag="t").keys()


def test_a_pinned_buffers_pages_are_backed_and_kept_out_of_forked_children():
    """What the pool does to a buffer before the driver pins it (it needs no GPU): every page backed (registering
    unbacked ones stalls the GPU's launches), and the mapping left out of a fork's child - a DataLoader worker
    forked from the training process would otherwise get a copy of every pinned private page."""
    import ctypes
    import mmap

    from dsckpt.checkpoint_engine.snapshot import populate

    region = mmap.mmap(-1, 4 << 20, flags=mmap.MAP_PRIVATE)
    buffer = torch.frombuffer(region, dtype=torch.uint8).untyped_storage()
    address = buffer.data_ptr()

    def resident_kib() -> int:  # (mincore: per page of this range; smaps' Rss counts a whole VMA, merged or not)
        pages = (4 << 20) // mmap.PAGESIZE
        vector = (ctypes.c_ubyte * pages)()
        assert ctypes.CDLL(None, use_errno=True).mincore(ctypes.c_void_p(address), ctypes.c_size_t(4 << 20),
                                                           vector) == 0
        return sum(v & 1 for v in vector) * mmap.PAGESIZE // 1024
    assert resident_kib() == 0
    assert populate(buffer)
    assert resident_kib() == 4 << 10
    child = os.fork()
    if child == 0:  # (the child: is the range mapped here?)
        with open("/proc/self/maps") as maps:
            mapped = any(int(line.split("-")[0], 16) <= address < int(line.split()[0].split("-")[1], 16)
                         for line in maps)
        os._exit(3 if mapped else 0)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert torch.frombuffer(region, dtype=torch.uint8).sum() == 0  # (backed with zeros, still the parent's)


@pytest.mark.gpu
def test_pinned_buffers_are_pinned_at_their_size():
    """A large pinned buffer is pinned in place at its own size (torch's pinned allocator rounds each allocation up
    to a power of two); a GPU copy into it lands whole; a refused registration leaves no CUDA error behind for the
    next kernel; ``close`` unpins, and so does a pool dropped without it."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from dsckpt.checkpoint_engine.snapshot import pin_in_place

    pool = HostPool()
    nbytes = (5 << 20) + 7
    buffer = pool.take(nbytes, pinned=True)
    host = torch.empty(0, dtype=torch.uint8).set_(buffer)
    assert buffer.nbytes() == nbytes and host.is_pinned() and pool.pinned == [buffer]
    source = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    host.copy_(source, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(host, source.cpu())
    assert not pin_in_place(buffer)  # registered twice: the driver refuses
    assert int((torch.ones(4, device="cuda") + 1).sum()) == 8  # (the refusal's error did not linger)
    pool.close()
    assert not torch.empty(0, dtype=torch.uint8).set_(buffer).is_pinned() and pool.pinned == []
    dropped = HostPool()  # a pool no one closes unpins when it goes
    buffer = dropped.take(nbytes, pinned=True)
    del dropped
    gc.collect()
    assert not torch.empty(0, dtype=torch.uint8).set_(buffer).is_pinned()


@pytest.mark.gpu
def test_the_first_save_takes_buffers_reserved_off_the_call():
    """#68.8: pinned buffers reserved on a thread of their own (as the engine does after the optimizer's first step)
    are what the first save takes: a take of a size still being reserved waits for that buffer, not a second one."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pool = HostPool()
    sizes = [(64 << 20) + 3, (64 << 20) + 3, 5 << 20]
    thread = pool.reserve(sizes)
    first = pool.take(sizes[0], pinned=True)  # (at once: it waits for the reservation, if it is not done)
    thread.join()
    second, third = pool.take(sizes[1], pinned=True), pool.take(sizes[2], pinned=True)
    [arena] = pool.pinned  # one registration for the three (log 47)
    start, end = arena.data_ptr(), arena.data_ptr() + arena.nbytes()
    assert all(start <= b.data_ptr() and b.data_ptr() + b.nbytes() <= end for b in (first, second, third))
    assert [b.nbytes() for b in (first, second, third)] == sizes and pool.reserving == {}
    assert all(torch.empty(0, dtype=torch.uint8).set_(b).is_pinned() for b in (first, second, third))
    host = torch.empty(0, dtype=torch.uint8).set_(second)
    source = torch.randint(0, 256, (sizes[1],), dtype=torch.uint8, device="cuda")
    host.copy_(source, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(host, source.cpu())
    pool.close()
    assert not host.is_pinned()


def test_one_region_is_carved_into_a_buffer_per_size():
    """#68.8: the reservation's buffers come from one mapping (backed and pinned once on a GPU), each on pages of
    its own, none overlapping another, each kept alive by its own reference."""
    from dsckpt.checkpoint_engine.snapshot import carved_region

    sizes = [(3 << 20) + 5, 1 << 20, (1 << 20) + 1, 7]
    whole, pieces = carved_region(sizes)
    assert [p.nbytes() for p in pieces] == sizes
    offsets = [p.data_ptr() - whole.data_ptr() for p in pieces]
    assert all(o % 4096 == 0 for o in offsets) and offsets == sorted(offsets)
    assert all(o + n <= nxt for o, n, nxt in zip(offsets, sizes, offsets[1:] + [whole.nbytes()]))
    views = [torch.empty(0, dtype=torch.uint8).set_(p) for p in pieces]
    for i, view in enumerate(views):
        view.fill_(i + 1)
    del whole
    gc.collect()
    assert [int(v.sum()) for v in views] == [n * (i + 1) for i, n in enumerate(sizes)]


def check_equal_to_stock(root: Path, report: dict) -> None:
    assert report["moved"], "the steps after the save must have rewritten the optimizer's buffers"
    for state in STATES:
        ref, out = load_state_dict(root / "ref", tag="t", state=state), load_state_dict(root / "async", tag="t",
                                                                                        state=state)
        assert ref.keys() == out.keys() and all(torch.equal(ref[k], out[k]) for k in ref), state
    ref, out = open_checkpoint(root / "ref", "t"), open_checkpoint(root / "async", "t")
    assert out.client_state["user"]["note"] == ["as", "of", "the", "call"] == ref.client_state["user"]["note"]
    assert ref.global_steps == out.global_steps and ref.world_size == out.world_size and not out.problems
    assert report["restored"], "DeepSpeed's load_checkpoint of the tag gives back the partitions captured at the call"


@pytest.mark.runtime
def test_zero3_save_puts_the_persistent_parameters_back_without_a_gather(saved):
    """DeepSpeed's ZeRO-3 save partitions every parameter and all-gathers the persistent ones again after; the
    background save puts back the copies each rank held (the tag's bytes are checked against stock's above)."""
    kept = saved[1]["persistent_kept"]
    if saved[1]["stage"] == 3:
        assert kept and all(kept), kept
    else:
        assert kept == []


@pytest.mark.runtime
def test_background_save_read_by_stock_zero_to_fp32(saved):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    root, _ = saved
    ours = get_fp32_state_dict_from_zero_checkpoint(str(root / "async"), tag="t")
    stock = get_fp32_state_dict_from_zero_checkpoint(str(root / "ref"), tag="t")
    assert ours.keys() == stock.keys() and all(torch.equal(ours[k], stock[k]) for k in ours)


@pytest.mark.runtime
def test_copies_left_past_the_call_finish_before_the_next_step(saved):
    """On CPU the optimizer-states file's copies run on a thread after save_checkpoint returns; the optimizer's step
    waits for them (slowed to 0.5 s here): the call returned before they were done, the step waited, and the tag
    loads back as the optimizer's state at the call."""
    deferred = saved[1]["deferred"]
    assert deferred["deferred"] and deferred["call_s"] < 0.5 and deferred["pending_after_call"], deferred
    assert deferred["step_waited_s"] > 0.2, deferred
    assert deferred["restored"], deferred


@pytest.mark.runtime
def test_a_setter_after_the_call_waits_for_the_copies(saved):
    """#68.7: ``safe_set_local_fp32_param`` (ZeRO-3) / ``safe_set_full_fp32_param`` (ZeRO-2) right after the save
    returns, its copies still running: the setter waits for them; the tag loads back as the state at the call."""
    setter = saved[1]["setter"]
    assert setter["pending_after_call"] and setter["changed"] and setter["restored"], setter


@pytest.mark.runtime
def test_a_read_right_after_a_save_waits_for_it(saved):
    """dsckpt's readers in the process that saves (``open_checkpoint``, ``load_state_dict``) wait for its saves in
    flight: they see the tag just saved, never `latest`'s previous one or a tag folder half written."""
    _, report = saved
    read = report["read_during_save"]
    assert read["pending_after_call"] and read["seen"] == "t7", read
    assert read["loaded"] > 0 and read["latest"] == "t8", read


@pytest.mark.runtime
def test_back_to_back_and_failed_saves(saved):
    """A second save waits for the first and both load; a write that fails on one rank (EFBIG, as a full disk fails)
    lets the next step run on every rank and is raised on every rank at the next save, with the OS's words for it and
    what is on disk; nothing named after the failed tag is left, `latest` stays where it was; the next save works."""
    root, report = saved
    assert report["waited_s"] > 0.1 and report["latest_after_t2"] == "t2"
    failure = report["failure"]
    assert failure and "File too large" in failure and "[process 1 of 2]" in failure, failure
    assert "nothing of it was published, `latest` still names 't2'" in failure and "inline_container" not in failure
    assert report["latest_after_failure"] == "t2" and report["t3_files"] == []
    assert report["read_after_failure"] == "t2"  # a read waited for t3, and left its failure to the next save
    assert report["latest_after_t4"] == "t4" and report["latest_after_close"] == "t5"
    damaged, latest_after_damage, t3c_files = report["damaged"]  # a flipped byte after the write: the CRC check
    assert damaged and "/t3c: the background save failed" in damaged and "fails its CRC-32 check" in damaged, damaged
    assert latest_after_damage == report["latest_after_failure"] and t3c_files == []
    assert [r[:2] for r in report["records"]] == [["t", True], ["t2", True], ["t3", False], ["t3c", False],
                                                  ["t4", True], ["t6", True], ["t9", True], ["t7", True], ["t8", True]]
    for tag in ("t", "t2", "t4"):
        assert not open_checkpoint(root / "async", tag).problems
    proc = run_cli("verify", root / "async", "--tag", "t2")
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.runtime
def test_verify_reports_rank_files_of_two_saves_in_one_tag(saved, tmp_path):
    """#68.3: a tag whose rank 1 files come from an earlier save of the same run (a death between two ranks'
    renames, with an older dsckpt) is a cross-rank problem for `verify`: the steps the files record differ."""
    import shutil

    root, _ = saved
    mixed = tmp_path / "mixed"
    shutil.copytree(root / "async" / "t2", mixed / "t2")
    for f in (root / "async" / "t").glob("*rank_1_*"):
        shutil.copy(f, mixed / "t2" / f.name)
    (mixed / "latest").write_text("t2")
    proc = run_cli("verify", mixed, "--json")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    problems = json.loads(proc.stdout)["tags"][0]["problems"]
    assert any(p["check"] == "cross-rank" and "optimizer step" in p["message"] and "rank_1" in p["message"]
               for p in problems), problems
    assert run_cli("verify", root / "async", "--tag", "t2").returncode == 0


@pytest.mark.runtime
def test_load_at_another_world_size_without_a_copy(saved, tmp_path, request):
    if saved[0].name.startswith("async3") and "slow or" not in request.config.getoption("markexpr"):
        pytest.skip("ZeRO-3 -> 3 at 2 -> 3 ranks is make test-all's; the default suite keeps ZeRO-2 -> 3")
    """A 2-rank save loaded at 3 ranks and ZeRO-3 through DeepSpeed's own load_checkpoint, each file it asks for
    answered from the reshard plan: the same partitions, moments and client state as `dsckpt reshard` + stock load."""
    skip_beyond_devices(3)
    root, _ = saved
    copy = tmp_path / "copy"
    assert run_cli("reshard", root / "async", copy, "--tag", "t", "-w", "3", "--stage", "3").returncode == 0
    run_job("planned_load.py", 3, 3, root / "async", "t", copy, tmp_path / "report.json")
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["loaded"] and report["equal"] and report["client_equal"], report


@pytest.mark.runtime
def test_script_ending_right_after_a_save_persists_it(tmp_path):
    """A plain script whose last line is ``engine.save_checkpoint``: the interpreter's exit waits for the files and
    `latest` (the readers' thread pools stop during shutdown; the persist runs before that)."""
    import os

    out = tmp_path / "ckpt"
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "jobs" / "async_exit.py"), str(out)],
                          capture_output=True, text=True, timeout=JOB_TIMEOUT,
                          env={**os.environ, "PYTHONPATH": PYTHONPATH, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0 and "Error" not in proc.stderr, proc.stderr[-3000:]
    assert (out / "latest").read_text() == "x" and not open_checkpoint(out).problems
    assert f"saved {out / 'x'}: training blocked" in proc.stderr
