"""Run on 2 ranks: dsckpt's background save into a bucket (the environment points fsspec at a local S3 server).

ARGS: STAGE URL OUT REPORT.  Tag t1 is saved into URL and, at the same moment (no step between), into OUT/local;
then a step and t2 into URL; then t3 into a bucket that does not exist (a failure reported at wait(), `latest` kept);
then a load of URL through the engine is refused with a typed error.  Rank 0 writes REPORT.
"""
import json
import sys
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
    try:
        engine.load_checkpoint(url)
        refused = None
    except ConfigError as exc:
        refused = f"{exc} (hint: {exc.hint})"
    saver.close()
    if rank() == 0:
        Path(report).write_text(json.dumps({"failure": failure, "refused": refused,
                                            "records": [[r.tag, r.ok, r.nbytes] for r in saver.records]}))


if __name__ == "__main__":
    main(*sys.argv[1:5])
    shutdown(exit_process=True)
