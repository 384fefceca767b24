"""Coverage-guided fuzzing of the checkpoint reader (atheris; not part of CI).

    make fuzz                                  # 120 s
    python fuzz/fuzz_reader.py -max_total_time=600 fuzz/corpus

Each input replaces one rank file of a real ZeRO-2 checkpoint (the first byte picks which); the
reader, the planner and inspect must answer with a result or a ``DsckptError`` - any other
exception is a crash.  The seeds (``fuzz/corpus``, made from fixtures on first run) must load.
"""
import shutil
import sys
import tempfile
from pathlib import Path

import atheris

with atheris.instrument_imports():
    from dsckpt.errors import DsckptError
    from dsckpt.analysis.inspect import summarize_checkpoint
    from dsckpt.plan.consolidate import build_plan
    from dsckpt.zero.reader import open_checkpoint

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "fixtures" / "z2_ws2_fp32"
WORK = Path(tempfile.mkdtemp(prefix="dsckpt-fuzz-"))
shutil.copytree(FIXTURE, WORK / "ckpt")
TARGETS = sorted((WORK / "ckpt" / "step3").glob("*.pt"))
ORIGINALS = {t: t.read_bytes() for t in TARGETS}


def one_input(data: bytes) -> None:
    if not data:
        return
    target = TARGETS[data[0] % len(TARGETS)]
    target.write_bytes(data[1:])
    try:
        ckpt = open_checkpoint(WORK / "ckpt")
        summarize_checkpoint(ckpt, with_tensors=True)
        if not ckpt.problems:
            build_plan(ckpt)
    except DsckptError:
        pass
    finally:
        target.write_bytes(ORIGINALS[target])


def make_seeds(corpus: Path) -> None:
    corpus.mkdir(parents=True, exist_ok=True)
    for i, t in enumerate(TARGETS):
        seed = corpus / f"seed-{t.name}"
        if not seed.exists():
            seed.write_bytes(bytes([i]) + ORIGINALS[t])
    for seed in corpus.glob("seed-*"):  # the valid seeds must load
        one_input(seed.read_bytes())
        summarize_checkpoint(open_checkpoint(WORK / "ckpt"))


if __name__ == "__main__":
    corpus = next((Path(a) for a in sys.argv[1:] if not a.startswith("-")), ROOT / "fuzz" / "corpus")
    make_seeds(corpus)
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()
