"""Run on 2 ranks: dsckpt's background save into a bucket (the environment points fsspec at a local S3 server).

ARGS: STAGE URL OUT REPORT.  Tag t1 is saved into URL and, at the same moment (no step between), into OUT/local;
then a step and t2 into URL; then t3 into a bucket that does not exist (a failure reported at wait(), `latest` kept);
then a load of URL through the engine is refused with a typed error; then t2 saved again (and at the same moment into
OUT/again) with rank 1's second copy into the tag failing: the tag is marked, and the next save (t5) completes it
from the staged objects.  Rank 0 writes REPORT.  Last, a step and t4
into URL, whose upload rank 1 stalls while rank 0's objects go up: every rank kills itself (SIGKILL) mid-persist,
leaving OUT/killed.<rank>: rank 0's objects are up, hidden under t4's staging name, and nothing named t4 is.
"""
import json
import os
import signal
import sys
import time
from pathlib import Path

import dsckpt
from dsckpt.errors import BackgroundSaveError, ConfigError
from dsckpt.runtime.commands import quiet_deepspeed
from dsckpt.runtime.engine import rank, shutdown
from dsckpt.runtime.train import TrainOptions, Trainer


def main(stage: str, url: str, out: str, report: str) -> None:
    quiet_deepspeed()
    trainer = Trainer(TrainOptions(model="odd_model:build", stage=int(stage), batch_size=2, sync_save=True))
    trainer.fit(2, progress=False)
    engine = trainer.engine
    saver = dsckpt.enable_async_save(engine)
    client = {**trainer.client_state(), "user": {"note": "foreign client state", "numbers": [1, 2.5]}}
    engine.save_checkpoint(url, tag="t1", client_state=client)
    engine.save_checkpoint(str(Path(out) / "local"), tag="t1", client_state=client)
    trainer.step()
    engine.save_checkpoint(url, tag="t2", client_state=trainer.client_state())
    saver.wait()
    missing = url.replace("://", "://no-such-bucket-", 1)
    engine.save_checkpoint(missing, tag="t3", client_state=trainer.client_state())
    try:
        saver.wait()
        failure = None
    except BackgroundSaveError as exc:
        failure = str(exc)
    reused = reused_tag_fails(trainer, url)
    try:
        engine.load_checkpoint(url)
        refused = None
    except ConfigError as exc:
        refused = f"{exc} (hint: {exc.hint})"
    cut = publish_cut(trainer, url, out)
    if rank() == 0:
        Path(report).write_text(json.dumps({"failure": failure, "refused": refused, "reused": reused, "cut": cut,
                                            "records": [[r.tag, r.ok, r.nbytes] for r in saver.records]}))
    killed_mid_upload(trainer, url, out)


def reused_tag_fails(trainer: Trainer, url: str) -> dict:
    """t2 saved again after a step, its upload failing on rank 1: t2's objects must be the first save's still."""
    import fsspec
    import torch.distributed as dist

    from dsckpt.formats.bucket import BucketStorage

    fs, prefix = fsspec.filesystem("s3", skip_instance_cache=True), url[len("s3://"):]
    before = {p: fs.cat_file(p) for p in fs.find(f"{prefix}/t2")}
    put = BucketStorage.replace
    if rank() == 1:
        def failing(self, local, name, **options) -> None:
            if str(name).startswith(".t2."):
                raise OSError(28, "No space left on device", str(local))
            put(self, local, name, **options)
        BucketStorage.replace = failing
    trainer.step()
    trainer.engine.save_checkpoint(url, tag="t2", client_state=trainer.client_state())
    try:
        dsckpt.enable_async_save(trainer.engine).wait()
        failure = None
    except BackgroundSaveError as exc:
        failure = str(exc)
    BucketStorage.replace = put
    dist.barrier()
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    after = {p: fs.cat_file(p) for p in fs.find(f"{prefix}/t2")}
    return {"failure": failure, "untouched": before == after and len(before) == 4,
            "hidden_left": [p for p in fs.find(prefix) if "/.t2.dsckpt-tmp-" in p]}


def publish_cut(trainer: Trainer, url: str, out: str) -> dict:
    """#68.3 on a bucket: t2 saved again, rank 1's copies into the tag cut after the first (the store failing);
    what a reader then sees, and t2 after the next save (t5) rolled the publish forward."""
    import subprocess
    import torch.distributed as dist

    from dsckpt.formats.bucket import BucketStorage

    copy, done = BucketStorage.copy, []
    if rank() == 1:
        def failing(self, source, final) -> None:
            if str(final).startswith("t2/") and done:
                raise OSError(5, "Input/output error", str(final))
            copy(self, source, final)
            done.append(final)
        BucketStorage.copy = failing
    trainer.step()
    state = trainer.client_state()
    trainer.engine.save_checkpoint(str(Path(out) / "again"), tag="t2", client_state=state)
    trainer.engine.save_checkpoint(url, tag="t2", client_state=state)
    saver = dsckpt.enable_async_save(trainer.engine)
    try:
        saver.wait()
        failure = None
    except BackgroundSaveError as exc:
        failure = str(exc)
    BucketStorage.copy = copy
    dist.barrier()
    seen = None
    if rank() == 0:
        verify = subprocess.run([sys.executable, "-m", "dsckpt", "verify", url, "--tag", "t2"], capture_output=True,
                                text=True)
        seen = {"code": verify.returncode, "text": verify.stdout + verify.stderr}
    dist.barrier()
    trainer.step()
    trainer.engine.save_checkpoint(url, tag="t5", client_state=trainer.client_state())
    saver.wait()
    return {"failure": failure, "verify": seen}


def killed_mid_upload(trainer: Trainer, url: str, out: str) -> None:
    import torch.distributed as dist

    from dsckpt.formats.bucket import BucketStorage

    if rank() == 1:
        put = BucketStorage.replace

        def stalled(self, local, name, **options) -> None:
            if str(name).startswith(".t4."):
                time.sleep(120)
            put(self, local, name, **options)
        BucketStorage.replace = stalled
    trainer.step()
    trainer.engine.save_checkpoint(url, tag="t4", client_state=trainer.client_state())
    if rank() == 0:  # until this rank's (hidden) objects of t4 are in the bucket (rank 1's never come)
        import fsspec

        fs, prefix, deadline = fsspec.filesystem("s3", skip_instance_cache=True), url[len("s3://"):], time.time() + 60
        while time.time() < deadline and len([n for n in fs.find(prefix) if "/.t4.dsckpt-tmp-" in n]) < 2:
            time.sleep(0.2)
    dist.barrier()
    Path(out, f"killed.{rank()}").write_text("")
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main(*sys.argv[1:5])
    shutdown(exit_process=True)
