"""`--nproc N`: start N local ranks through torch.distributed.run (torchrun), not a home-made launcher.

The parent re-runs the same command line as ``python -m dsckpt ...`` under torchrun; a child sees
``LOCAL_RANK`` in its environment and runs the work instead of launching again.
"""
from __future__ import annotations

import os
import sys


def should_launch(nproc: int) -> bool:
    return nproc > 1 and "LOCAL_RANK" not in os.environ


def launch(nproc: int, argv: list[str] | None = None, script: str | None = None) -> int:
    """Run ``python -m dsckpt <argv>`` (or ``python <script> <argv>``) on ``nproc`` local ranks."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    argv = sys.argv[1:] if argv is None else argv
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # ranks share the cores
    # "--" ends torchrun's own options: our flags (e.g. --nproc) must not be prefix-matched by it
    target = ["--", script] if script else ["--module", "--", "dsckpt"]
    args = ["--standalone", f"--nproc_per_node={nproc}", *target, *argv]
    try:
        torchrun.main(args)
    except ChildFailedError as exc:
        failures = exc.failures
        first = min(failures) if failures else None
        code = failures[first].exitcode if first is not None else 1
        return code if isinstance(code, int) and code > 0 else 1
    return 0
