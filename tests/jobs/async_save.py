"""Run on 2 ranks: dsckpt's background save against DeepSpeed's own, on one engine.

ARGS: STAGE OUT REPORT.  OUT/ref: DeepSpeed's blocking save (tag t); OUT/async: the same state saved through
checkpoint_engine.background (tag t), its persist slowed so that the next two steps rewrite the optimizer's buffers while it
runs; then a second save at once (t2, back to back); then a save that fails in the background (a file-size limit:
EFBIG on rank 1 only): the next step runs, and the failure is raised on both ranks at the next save; then t4 after it.  Finally the engine loads OUT/async tag t with DeepSpeed's own
load_checkpoint and the optimizer's partitions must equal the ones captured in memory right before the save.
At ZeRO-3 the persistent parameters come out of the background save as the very tensors they were.
"""
import json
import resource
import signal
import sys
import time
from pathlib import Path

import torch

import dsckpt
from dsckpt.errors import BackgroundSaveError
from dsckpt.checkpoint_engine.background import AsyncSave
from dsckpt.checkpoint_engine.persist import write_snapshot
from dsckpt.checkpoint_engine.snapshot import Snapshot
from dsckpt.runtime.commands import quiet_deepspeed
from dsckpt.runtime.engine import rank, shutdown
from dsckpt.runtime.train import TrainOptions, Trainer


def capture(engine):
    """Every fp32 partition of the base optimizer and its state, cloned (what the rank's optim file must hold)."""
    opt = engine.optimizer
    flats = getattr(opt, "fp32_partitioned_groups_flat", None) or opt.single_partition_of_fp32_groups
    out = []
    for p in flats:
        state = opt.optimizer.state.get(p, {})
        out.append([p.detach().clone()] + [v.detach().clone() for _, v in sorted(state.items())
                                           if isinstance(v, torch.Tensor)])
    assert out and all(len(x) == 4 for x in out), "fp32 partition, exp_avg, exp_avg_sq, step"
    return out


def same(a, b):
    return len(a) == len(b) and all(len(x) == len(y) and all(torch.equal(u, v) for u, v in zip(x, y))
                                    for x, y in zip(a, b))


def slow_save(state, path):
    time.sleep(0.5)  # long enough for two training steps to run while the files are written
    write_snapshot(state, path)


def corrupting_save(state, path):
    """A write that lands damaged: one byte of the largest storage flipped after the engine's own write."""
    from dsckpt.formats.torchzip import StorageIndex

    write_snapshot(state, path)
    loc = max(StorageIndex(Path(path)).storages.values(), key=lambda s: s.nbytes)
    with open(path, "r+b") as fh:
        fh.seek(loc.offset)
        byte = fh.read(1)
        fh.seek(loc.offset)
        fh.write(bytes([byte[0] ^ 0xFF]))


def damaged_on_disk(trainer, runtime, saver, root):
    """Files whose bytes are not what their zip's CRC-32s say (checked beside the next file's write): the tag is not
    published, the failure surfaces at wait()."""
    saver.writer.write = corrupting_save
    trainer.step()
    runtime.save_checkpoint(root / "async", trainer.client_state(), tag="t3c")
    try:
        saver.wait()
        failure = None
    except BackgroundSaveError as exc:
        failure = str(exc)
    saver.writer.write = write_snapshot
    torch.distributed.barrier()  # (wait() is this rank's: another may still be removing its temps of the tag)
    return failure, (root / "async" / "latest").read_text(), visible_or_staged(root / "async", "t3c")


def visible_or_staged(save_dir, tag):
    """What of ``tag`` is on disk: its folder, or any hidden folder named after it."""
    return sorted(p.name for p in Path(save_dir).iterdir() if p.name == tag or p.name.startswith(f".{tag}."))


def copies_after_the_call(trainer, runtime, saver, root):
    """The optimizer-states file's copies are left past the call (a thread on CPU, a stream of their own on a GPU);
    slowed here, so that the next step must wait for them: the tag holds the optimizer's state as of the call."""
    finish, beside = Snapshot.finish, Snapshot._copy_beside
    Snapshot.finish = lambda snap: (time.sleep(0.5), finish(snap))[1]

    def slowed_beside(snap, host, t):  # on a GPU: the copy stream held ~0.5 s before its copies
        if not snap.on_copy_stream:
            with torch.cuda.stream(snap.copy_stream):
                torch.cuda._sleep(1_000_000_000)
        beside(snap, host, t)
    Snapshot._copy_beside = slowed_beside
    trainer.step()
    as_of_call = capture(trainer.engine)
    t0 = time.perf_counter()
    runtime.save_checkpoint(root / "async", trainer.client_state(), tag="t6")
    call_s = time.perf_counter() - t0
    pending = any(not f.done() for f in saver.staging)
    t0 = time.perf_counter()
    trainer.step()  # (it waits for the copies: in the optimizer's step, or where DeepSpeed syncs the device first)
    next_step_s = time.perf_counter() - t0
    Snapshot.finish, Snapshot._copy_beside = finish, beside
    deferred, step_waited = saver.defers, saver.records[-1].step_waited_s
    saver.wait()
    runtime.load_checkpoint(root / "async", tag="t6")
    return {"deferred": deferred, "call_s": call_s, "pending_after_call": pending, "next_step_s": next_step_s,
            "step_waited_s": step_waited,
            "restored": same(capture(trainer.engine), as_of_call)}


def setter_after_the_call(trainer, runtime, saver, root):
    """DeepSpeed's public setter of an fp32 master, called while the save's deferred copies still run (slowed):
    it waits for them, so the tag holds the state as of the call and not the value set after it."""
    from deepspeed.utils import safe_get_local_fp32_param, safe_set_full_fp32_param, safe_set_local_fp32_param
    from deepspeed.utils import safe_get_full_fp32_param

    finish = Snapshot.finish
    Snapshot.finish = lambda snap: (time.sleep(0.5), finish(snap))[1]
    trainer.step()
    as_of_call = capture(trainer.engine)
    runtime.save_checkpoint(root / "async", trainer.client_state(), tag="t9")
    pending = any(not f.done() for f in saver.staging)
    param = next(p for p in trainer.engine.module.parameters() if p.requires_grad)
    if trainer.engine.zero_optimization_stage() == 3:
        local = safe_get_local_fp32_param(param)
        safe_set_local_fp32_param(param, torch.full_like(local, 7.0))
    else:
        safe_set_full_fp32_param(param, torch.full_like(safe_get_full_fp32_param(param), 7.0))
    Snapshot.finish = finish
    changed = not same(capture(trainer.engine), as_of_call)
    saver.wait()
    runtime.load_checkpoint(root / "async", tag="t9")
    return {"pending_after_call": pending, "changed": changed, "restored": same(capture(trainer.engine), as_of_call)}


def read_while_persisting(trainer, runtime, saver, root):
    """dsckpt's readers, called right after a save returns while its files are still being written (slowed): they
    wait for it, and see its tag - not the previous one `latest` still names, nor a tag folder half written."""
    saver.writer.write = slow_save
    trainer.step()
    runtime.save_checkpoint(root / "async", trainer.client_state(), tag="t7")
    pending = not saver.idle.is_set()
    seen = dsckpt.open_checkpoint(root / "async").layout.tag
    saver.writer.write = write_snapshot
    runtime.save_checkpoint(root / "async", trainer.client_state(), tag="t8")  # at full speed, read at once
    loaded = len(dsckpt.load_state_dict(root / "async"))
    return {"pending_after_call": pending, "seen": seen, "loaded": loaded,
            "latest": (root / "async" / "latest").read_text()}


def fail_on_rank_1(trainer, runtime, saver, root):
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing
    if rank() == 1:  # one rank's disk "full": every rank must refuse to publish t3
        resource.setrlimit(resource.RLIMIT_FSIZE, (20 * 1024, old[1]))
    trainer.step()
    runtime.save_checkpoint(root / "async", trainer.client_state(), tag="t3")
    read_after = dsckpt.open_checkpoint(root / "async").layout.tag  # waits for t3; its failure stays for the save
    resource.setrlimit(resource.RLIMIT_FSIZE, old)
    trainer.step()  # (the ranks stay in step: no rank raises here)
    try:
        runtime.save_checkpoint(root / "async", trainer.client_state(), tag="t3b")
        failure = None
    except BackgroundSaveError as exc:  # on every rank, at this same call
        failure = str(exc)
    latest_after_failure = (root / "async" / "latest").read_text()
    return failure, latest_after_failure, visible_or_staged(root / "async", "t3"), read_after


def main(stage: str, out: str, report: str) -> None:
    quiet_deepspeed()
    root = Path(out)
    trainer = Trainer(TrainOptions(model="odd_model:build", stage=int(stage), batch_size=2, sync_save=True))
    runtime = trainer.runtime
    trainer.fit(2, progress=False)
    client = trainer.client_state()
    client["user"] = {"note": ["as", "of", "the", "call"], "tensor": torch.arange(5)}
    runtime.save_checkpoint(root / "ref", client, tag="t")  # DeepSpeed's own blocking save
    before = capture(trainer.engine)

    runtime.saver = saver = AsyncSave(trainer.engine)
    saver.writer.write = slow_save
    persistent = getattr(trainer.engine.optimizer, "persistent_parameters", [])
    held = [(p.data_ptr(), p.detach().clone()) for p in persistent]
    runtime.save_checkpoint(root / "async", client, tag="t")
    kept = [p.ds_status.name == "AVAILABLE" and p.data_ptr() == ptr and torch.equal(p.detach(), value)
            for p, (ptr, value) in zip(persistent, held)]  # put back as held, not gathered again
    blocked = saver.records[-1].blocked_s
    client["user"]["note"].append("changed after the save returned")  # must not reach the file
    client["user"]["tensor"].add_(100)
    trainer.step()
    trainer.step()
    moved = not same(capture(trainer.engine), before)
    runtime.save_checkpoint(root / "async", trainer.client_state(), tag="t2")  # back to back: waits for t
    waited = saver.records[-1].waited_s
    saver.wait()
    latest_after_t2 = (root / "async" / "latest").read_text()

    saver.writer.write = write_snapshot
    failure, latest_after_failure, t3_files, read_after_failure = None, None, None, None
    if torch.distributed.get_world_size() > 1:  # (rank 0 copies DeepSpeed's scripts: a failing rank must be another)
        failure, latest_after_failure, t3_files, read_after_failure = fail_on_rank_1(trainer, runtime, saver, root)
    damaged = damaged_on_disk(trainer, runtime, saver, root)
    runtime.save_checkpoint(root / "async", trainer.client_state(), tag="t4")
    saver.wait()
    latest_after_t4 = (root / "async" / "latest").read_text()

    deferred = copies_after_the_call(trainer, runtime, saver, root)
    setter = setter_after_the_call(trainer, runtime, saver, root)
    read_during_save = read_while_persisting(trainer, runtime, saver, root)
    runtime.load_checkpoint(root / "async", tag="t")  # DeepSpeed's own load (weights-only unpickler)
    restored = same(capture(trainer.engine), before)
    saver.close()
    runtime.save_checkpoint(root / "async", trainer.client_state(), tag="t5")  # after close: a blocking save
    latest_after_close = (root / "async" / "latest").read_text()
    if rank() == 0:
        Path(report).write_text(json.dumps({
            "blocked_s": blocked, "moved": moved, "waited_s": waited, "latest_after_t2": latest_after_t2,
            "failure": failure, "latest_after_failure": latest_after_failure, "t3_files": t3_files,
            "read_after_failure": read_after_failure,
            "damaged": damaged, "latest_after_t4": latest_after_t4, "restored": restored, "latest_after_close": latest_after_close,
            "deferred": deferred, "setter": setter, "read_during_save": read_during_save, "stage": int(stage), "persistent_kept": kept,
            "records": [[r.tag, r.ok, r.nbytes] for r in saver.records]}))


if __name__ == "__main__":
    main(*sys.argv[1:4])
    shutdown(exit_process=True)
