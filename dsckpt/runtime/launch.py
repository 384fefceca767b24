"""`--nproc N`: start N local ranks through torch.distributed.run (torchrun), not a home-made launcher.

The parent re-runs the same command line as ``python -m dsckpt ...`` under torchrun; a child sees
``LOCAL_RANK`` in its environment and runs the work instead of launching again.  Children report
typed errors through files (``console.report_rank_error``); the parent prints each distinct one
once and exits 2, as ``--nproc 1`` does, instead of torchrun's per-rank failure tables.
"""
from __future__ import annotations

import logging
import os
import sys
import tempfile
from pathlib import Path

from ..errors import DsckptError
from . import console


class RankError(DsckptError):
    """A typed error raised inside the launched ranks (the message is theirs)."""


def should_launch(nproc: int) -> bool:
    return nproc > 1 and "LOCAL_RANK" not in os.environ


def quiet_accelerator_choice() -> None:
    """Name DeepSpeed's accelerator up front: each rank otherwise warns "Setting accelerator to CPU"."""
    if "DS_ACCELERATOR" not in os.environ:
        import torch

        os.environ["DS_ACCELERATOR"] = "cuda" if torch.cuda.is_available() else "cpu"


def launch(nproc: int, argv: list[str] | None = None, script: str | None = None) -> int:
    """Run ``python -m dsckpt <argv>`` (or ``python <script> <argv>``) on ``nproc`` local ranks."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    argv = sys.argv[1:] if argv is None else argv
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # ranks share the cores
    quiet_accelerator_choice()
    for name in list(logging.root.manager.loggerDict):  # failures (and Ctrl-C) are reported below, once;
        if name.startswith(("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher")):
            logging.getLogger(name).setLevel(logging.CRITICAL)  # (elastic sets levels per module logger)
    # "--" ends torchrun's own options: our flags (e.g. --nproc) must not be prefix-matched by it
    target = ["--", script] if script else ["--module", "--", "dsckpt"]
    args = ["--standalone", f"--nproc_per_node={nproc}", *target, *argv]
    with tempfile.TemporaryDirectory(prefix="dsckpt-ranks-") as errors:
        os.environ[console.ERROR_DIR_ENV] = errors
        try:
            torchrun.main(args)
        except ChildFailedError as exc:
            reported = console.collect_rank_errors(Path(errors))
            if reported:
                raise _one_error(reported, nproc) from None
            failures = exc.failures
            first = min(failures) if failures else None
            code = failures[first].exitcode if first is not None else 1
            return code if isinstance(code, int) and code > 0 else 1
        finally:
            os.environ.pop(console.ERROR_DIR_ENV, None)
    return 0


def _one_error(reported: list[tuple[str, str | None, list[int]]], nproc: int) -> RankError:
    lines = []
    for message, _, ranks in reported:
        where = "" if len(reported) == 1 and len(ranks) in (1, nproc) else f" [rank {','.join(map(str, ranks))}]"
        lines.append(message + where)
    return RankError("\n".join(lines), hint=reported[0][1])
