"""The malformed-input corpus (tests/malformed.py) through every writing command on the ranks of one job.

    corpus_ranks.py ROOT   (on N ranks: tests/conftest.run_job)

Rank 0 builds each case under ROOT; every rank then runs each command in process (``dsckpt.cli.app.run``, the
CLI's own entry, as torchrun's processes would run it) on the group of all ranks; rank 0 judges the outcome with
the corpus's own rules (``malformed.judge``) and writes every outcome to ROOT/outcomes.json.  One job for the whole
corpus: a process group started per command would cost more than the commands themselves.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from malformed import MARKER_ENV, WRITERS, Outcome, cases, command_line, judge, run_in_process  # noqa: E402

from job_exit import leave  # noqa: E402


def main(root: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    outcomes: list[Outcome] = []
    for i, case in enumerate(c for c in cases() if set(c.expect) & set(WRITERS)):
        tmp = root / f"case{i}"
        marker = tmp / "marker"
        os.environ[MARKER_ENV] = str(marker)
        box = [None]
        if rank == 0:
            tmp.mkdir()
            box = [case.build(tmp)]
        dist.broadcast_object_list(box, 0)
        target = box[0]
        for command in (c for c in WRITERS if c in case.expect):
            box = [command_line(case, command, tmp, target) if rank == 0 else None]  # (an OUT a case makes: once)
            dist.broadcast_object_list(box, 0)
            args, out = box[0]
            before = out.read_bytes() if rank == 0 and out.is_file() else None
            dist.barrier()
            proc = run_in_process(args, case.max_file_size)
            if rank == 0:
                outcomes.append(judge(case, command, case.expect[command], proc, out, before))
            dist.barrier()
        if rank == 0 and case.dangerous and marker.exists():
            outcomes.append(Outcome(case.name, "pickle", "wrong result", "the hostile pickle ran"))
    if rank == 0:
        (root / "outcomes.json").write_text(json.dumps([asdict(o) for o in outcomes], indent=1))
    dist.barrier()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    leave()
