"""Output discipline for the runtime's commands, whatever the number of ranks.

* stdout carries results only: ``claim_stdout()`` moves file descriptor 1 away for the rest of the
  process (to stderr with ``--verbose``, else to /dev/null), so JIT build notes and any library
  ``print`` never mix with results; ``result()`` writes to the saved real stdout (rank 0 only).
* errors are reported once: a rank started by ``launch`` writes its typed error to
  ``$DSCKPT_ERROR_DIR/rank<N>.json`` and exits 2 quietly; the launcher prints each distinct error
  once and exits 2, as a single-process run does.
"""
from __future__ import annotations

from ..formats.storage import Alias
from ..jsondoc import json_document  # noqa: F401  (re-exported: the runtime's results)

import json
import os
import sys
from pathlib import Path

ERROR_DIR_ENV = "DSCKPT_ERROR_DIR"
_result_fd: int | None = None


def claim_stdout(verbose: bool = False) -> None:
    """From now on fd 1 is stderr (``verbose``) or /dev/null; results go to the original stdout through
    ``result``.  What libraries ``print`` - DeepSpeed's "deepspeed_shm_comm_op built successfully" once per
    rank, JIT build output - is chatter unless asked for; DeepSpeed's logger is moved to stderr
    (``quiet_deepspeed``), so its warnings still show."""
    global _result_fd
    if _result_fd is not None:
        return
    sys.stdout.flush()
    _result_fd = os.dup(1)
    if verbose:
        os.dup2(2, 1)
    else:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.close(devnull)


SHOWN_AS_ENV = "DSCKPT_SHOWN_AS"  # JSON [[local, given], ...]: this run's alias, handed to the ranks it starts


def alias() -> Alias:
    """The local copies of what the user named by URL (``resume`` fetches them before its ranks start)."""
    return Alias(tuple((local, given) for local, given in json.loads(os.environ.get(SHOWN_AS_ENV, "[]"))))


def name_as(local: str, given: str) -> None:
    """From here on (in this process and the ranks it starts) ``local`` and what is below it are shown as
    ``given`` wherever a path is shown: ``shown``, and the ``at`` of the errors the CLI reports."""
    os.environ[SHOWN_AS_ENV] = json.dumps([*alias().pairs, (local, given)])


def shown(path: object) -> object:
    """``path`` as the user named it."""
    return alias()(path)


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def result(text: str) -> None:
    """A result line (human summary or the one JSON document): rank 0 only, on the real stdout."""
    if _rank() != 0:
        return
    data = (text + "\n").encode()
    if _result_fd is None:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    else:
        os.write(_result_fd, data)


def info(text: str) -> None:
    """A note for the user (rank 0 only), on stderr."""
    if _rank() == 0:
        print(text, file=sys.stderr, flush=True)


def note(text: str) -> None:
    """``note: <text>`` on stderr (rank 0 only): the one channel for notes, as the file commands print them."""
    info(f"note: {text}")


def report_rank_error(message: str, hint: str | None) -> bool:
    """Inside a launched rank: record the error for the launcher; False when not launched."""
    folder = os.environ.get(ERROR_DIR_ENV)
    if not folder:
        return False
    path = Path(folder) / f"rank{_rank()}.json"
    path.write_text(json.dumps({"message": message, "hint": hint}))
    return True


def collect_rank_errors(folder: Path) -> list[tuple[str, str | None, list[int]]]:
    """Distinct ``(message, hint, ranks)`` recorded by the ranks of a launch, lowest rank first."""
    seen: dict[tuple[str, str | None], list[int]] = {}
    for path in sorted(folder.glob("rank*.json"), key=lambda p: int(p.stem[4:])):
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        seen.setdefault((str(doc.get("message")), doc.get("hint")), []).append(int(path.stem[4:]))
    return [(msg, hint, ranks) for (msg, hint), ranks in seen.items()]
