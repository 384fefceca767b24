"""Run as one plain process (no launcher): what a background save's process tells the world when it ends.

ARGS: MODE OUT REPORT.  Each mode builds the odd model at ZeRO-3 with dsckpt's runtime (background saves on), saves
tag ``x`` and waits for it, then:
* ``fail-at-exit``: the last save fails (a file-size limit: EFBIG, as a full disk fails) and the script ends with
  ``sys.exit(0)``, no ``wait()``: the process must exit non-zero, `latest` on ``x``, nothing named ``y`` visible;
* ``sigterm`` / ``sigterm-abandon``: a slowed save, then SIGTERM to itself: the save is published within the grace
  (or abandoned past it), and the process ends by SIGTERM either way;
* ``bucket-sigterm``: OUT a bucket's URL; tag ``x`` saved again, its copies into the tag stalled after the first,
  then SIGTERM past the grace: the process says the tag is marked, and ends by SIGTERM;
* ``then-consolidate``: a ``then()`` follow-up consolidates the tag just saved (it must not wait on its own writer);
* ``namespace``: a tag holding a path separator is refused in the call, nothing written; then a client state
  holding an ``argparse.Namespace`` (Megatron's arguments) loads back through the engine's weights-only
  ``load_checkpoint``;
* ``foreign``: a client state holding a class beyond plain data (``fractions.Fraction``): the weights-only load
  refuses it naming ``trust=True``, which then loads it;
* ``hung``: a persist that hangs: ``wait(timeout=1)`` and, with DSCKPT_SAVE_TIMEOUT=1, the next save raise a typed
  error instead of waiting; the process still ends (bounded);
* ``rank-dies`` (2 ranks): rank 1 dies in the middle of writing its files; rank 0's commit learns it within the run's
  timeout (DSCKPT_DIST_TIMEOUT) and raises at ``wait()``, publishing nothing;
* ``load-fence``: a load right after a save whose persist is slow: the save holds the state as of its call, the load
  the loaded tag's.
"""
import argparse
import json
import os
import resource
import signal
import sys
import time
from pathlib import Path

import torch

import dsckpt
from dsckpt.checkpoint_engine import persist
from dsckpt.runtime.commands import quiet_deepspeed
from dsckpt.runtime.config import resolve_config
from dsckpt.runtime.engine import Runtime


def slowed(seconds):
    def write(state, path):
        time.sleep(seconds)
        persist.write_snapshot(state, path)
    return write


def main(mode: str, out: str, report: str) -> None:
    import odd_model

    quiet_deepspeed()
    config = resolve_config(None, precision="32", stage=3)
    config["train_micro_batch_size_per_gpu"] = 1
    config.pop("train_batch_size", None)
    runtime = Runtime(config)
    from dsckpt.runtime.demo_model import build_demo_model

    build = build_demo_model if mode == "fail-at-exit" else odd_model.build  # (rank files larger than DeepSpeed's script)
    engine = runtime.setup(build, lambda params: torch.optim.AdamW(params, lr=1e-4))
    runtime.saver.report = print  # rank 0's line per save, on stdout
    engine.save_checkpoint(out, tag="x")
    runtime.saver.wait()
    facts = {}
    if mode == "fail-at-exit":
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))
        engine.save_checkpoint(out, tag="y")
        sys.exit(0)
    if mode.startswith("sigterm"):
        runtime.saver.writer.write = slowed(2 if mode == "sigterm" else 60)
        engine.save_checkpoint(out, tag="s")
        print("sending SIGTERM", flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(90)  # (the handler ends the process)
    if mode == "bucket-sigterm":  # (OUT a URL: x saved again, its copies into the tag stalled after the first)
        import fsspec

        from dsckpt.formats.bucket import BucketStorage

        copy = BucketStorage.copy

        def stalled(self, source, final) -> None:
            copy(self, source, final)
            time.sleep(60)
        BucketStorage.copy = stalled
        engine.save_checkpoint(out, tag="x")
        fs, marker = fsspec.filesystem("s3", skip_instance_cache=True), f"{out[len('s3://'):]}/x/dsckpt-publishing.json"
        deadline = time.time() + 60
        while time.time() < deadline and not fs.exists(marker):
            time.sleep(0.2)
        time.sleep(0.5)  # (the first copy made, the second stalled)
        print("sending SIGTERM", flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(90)
    if mode == "then-consolidate":
        engine.save_checkpoint(out, tag="a")
        target = Path(out).parent / "a.safetensors"
        runtime.saver.then(lambda: dsckpt.consolidate(out, target, tag="a"))
        runtime.saver.wait(timeout=120)
        from safetensors.torch import load_file

        facts["consolidated"] = target.is_file() and len(load_file(target)) > 0
    if mode == "namespace":
        before = sorted(os.listdir(out))
        try:  # (a tag with a path separator: stock DeepSpeed nests folders; one rename cannot publish that)
            engine.save_checkpoint(out, tag="epoch1/n")
            facts["nested"] = None
        except dsckpt.errors.TagError as exc:
            facts["nested"] = f"{exc} {exc.hint}"
        facts["nested_left"] = sorted(set(os.listdir(out)) - set(before))
        args = argparse.Namespace(lr=1e-4, layers=[3, 5], name="megatron-style")
        engine.save_checkpoint(out, tag="n", client_state={"args": args})
        runtime.saver.wait()
        _, client = engine.load_checkpoint(out, tag="n")
        facts["args"] = vars(client["args"]) if isinstance(client.get("args"), argparse.Namespace) else repr(client)
    if mode == "foreign":
        from fractions import Fraction

        engine.save_checkpoint(out, tag="f", client_state={"ratio": Fraction(3, 7)})
        runtime.saver.wait()
        try:
            engine.load_checkpoint(out, tag="f")
            facts["refused"] = None
        except dsckpt.errors.DsckptError as exc:
            facts["refused"] = f"{exc} {exc.hint or ''}"
        _, client = engine.load_checkpoint(out, tag="f", trust=True)
        facts["ratio"] = str(client["ratio"])
    if mode == "hung":
        runtime.saver.writer.write = slowed(40)
        engine.save_checkpoint(out, tag="h")
        for name, call in (("wait", lambda: runtime.saver.wait(timeout=1)),
                           ("next_save", lambda: engine.save_checkpoint(out, tag="h2"))):
            start = time.monotonic()
            try:
                call()
                facts[name] = None
            except dsckpt.errors.BackgroundSaveError as exc:
                facts[name] = [round(time.monotonic() - start, 1), str(exc)]
        facts["latest"] = (Path(out) / "latest").read_text()
        Path(report).write_text(json.dumps(facts))
        sys.exit(0)  # (the exit waits for the hung save at most DSCKPT_SAVE_TIMEOUT, then ends non-zero)
    if mode == "rank-dies":
        from dsckpt.runtime.engine import rank

        def dies(state, path):
            time.sleep(1)  # (past the save call's own barrier, which DeepSpeed's: this is the persist's part)
            Path(path).write_bytes(b"partial")
            os._exit(9)
        if rank() == 1:
            runtime.saver.writer.write = dies
        engine.save_checkpoint(out, tag="d")
        start = time.monotonic()
        try:
            runtime.saver.wait(timeout=120)
            facts["raised"] = None
        except dsckpt.errors.DsckptError as exc:
            facts["raised"] = [round(time.monotonic() - start, 1), type(exc).__name__, str(exc)]
        facts["latest"] = (Path(out) / "latest").read_text()
        facts["visible"] = sorted(p.name for p in Path(out).iterdir() if not p.name.startswith("."))
        Path(report).write_text(json.dumps(facts))
        os._exit(0)  # (its peer is gone: no collective shutdown)
    if mode == "load-fence":
        from dsckpt.runtime.engine import full_state_dict

        from dsckpt.runtime.demo_model import synthetic_batch

        model = engine.module
        loss = engine(synthetic_batch(1, seed=0, batch_size=1, seq_len=model.seq_len, vocab_size=model.vocab_size))
        engine.backward(loss)
        engine.step()  # (so that the state saved as "l" is not the one "x" holds)
        before = {k: v.clone() for k, v in full_state_dict(engine.module).items()}
        runtime.saver.writer.write = slowed(3)
        engine.save_checkpoint(out, tag="l")
        engine.load_checkpoint(out, tag="x")  # (a state other than the one "l" snapshots: "x" was saved earlier)
        loaded = full_state_dict(engine.module)
        runtime.saver.wait()
        from dsckpt.api.consolidation import load_state_dict

        saved = load_state_dict(out, tag="l")
        facts["saved_as_of_call"] = all(torch.equal(saved[k].to(v.dtype), v) for k, v in before.items()
                                        if k in saved)
        facts["load_took_effect"] = any(not torch.equal(loaded[k], v) for k, v in before.items())
    Path(report).write_text(json.dumps(facts))


if __name__ == "__main__":
    main(*sys.argv[1:4])
