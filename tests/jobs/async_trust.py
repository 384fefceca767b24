"""Run as one plain process (no launcher): what a background save's process tells the world when it ends.

ARGS: MODE OUT REPORT.  Each mode builds the odd model at ZeRO-3 with dsckpt's runtime (background saves on), saves
tag ``x`` and waits for it, then:
* ``fail-at-exit``: the last save fails (a file-size limit: EFBIG, as a full disk fails) and the script ends with
  ``sys.exit(0)``, no ``wait()``: the process must exit non-zero, `latest` on ``x``, nothing named ``y`` visible;
* ``sigterm`` / ``sigterm-abandon``: a slowed save, then SIGTERM to itself: the save is published within the grace
  (or abandoned past it), and the process ends by SIGTERM either way;
* ``then-consolidate``: a ``then()`` follow-up consolidates the tag just saved (it must not wait on its own writer);
* ``namespace``: a client state holding an ``argparse.Namespace`` (Megatron's arguments) loads back through the
  engine's weights-only ``load_checkpoint``.
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
    if mode == "then-consolidate":
        engine.save_checkpoint(out, tag="a")
        target = Path(out).parent / "a.safetensors"
        runtime.saver.then(lambda: dsckpt.consolidate(out, target, tag="a"))
        runtime.saver.wait(timeout=120)
        from safetensors.torch import load_file

        facts["consolidated"] = target.is_file() and len(load_file(target)) > 0
    if mode == "namespace":
        args = argparse.Namespace(lr=1e-4, layers=[3, 5], name="megatron-style")
        engine.save_checkpoint(out, tag="n", client_state={"args": args})
        runtime.saver.wait()
        _, client = engine.load_checkpoint(out, tag="n")
        facts["args"] = vars(client["args"]) if isinstance(client.get("args"), argparse.Namespace) else repr(client)
    Path(report).write_text(json.dumps(facts))


if __name__ == "__main__":
    main(*sys.argv[1:4])
