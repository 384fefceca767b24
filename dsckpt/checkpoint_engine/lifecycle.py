"""A background save's life in its process: the commit's group, bounded waits, and how the process ends.

* ``commit_group()``: a gloo group of the commit's own over every rank, with the run's timeout (``DSCKPT_DIST_TIMEOUT``
  seconds, else torch's default for a process group): a peer that died becomes a typed error, never a hang.
* ``save_timeout_s()``: the longest any wait for a save in flight lasts (``DSCKPT_SAVE_TIMEOUT``, else the same).
* ``opened(saver)``, once per handle, makes sure that however the process ends, a save that failed is not a success:
  - interpreter exit (the script's end, ``sys.exit``, an exception): every handle is closed first (its saves waited
    for); a failure is printed, the other exit handlers run, and the process ends with status 1;
  - ``torch.distributed.destroy_process_group()``: the handles close first and a failure is raised there;
  - SIGTERM, where the process has no handler of its own: the save in flight gets ``DSCKPT_SIGTERM_GRACE`` seconds
    (default 30) to be published, then the process ends by SIGTERM as it would have (a non-zero status), saying
    whether the save finished; an unfinished one leaves only its hidden staging folder (``commit``);
  - a read of a checkpoint in this process waits for its saves (``saves_in_flight``), except on a save's own writer.
"""
from __future__ import annotations

import atexit
import datetime
import os
import signal
import sys
import threading
import weakref
from typing import Any

from .. import saves_in_flight
from ..errors import DsckptError
from ..parallel.group import ONE_PROCESS, Group
from ..parallel.transport import TIMEOUT_ENV

SAVE_TIMEOUT_ENV = "DSCKPT_SAVE_TIMEOUT"
GRACE_ENV = "DSCKPT_SIGTERM_GRACE"
_OPEN: "weakref.WeakSet[Any]" = weakref.WeakSet()  # the open handles (background.AsyncSave)
_installed = threading.Event()


def dist_timeout_s() -> float:
    from torch.distributed.constants import default_pg_timeout

    return float(os.environ.get(TIMEOUT_ENV) or default_pg_timeout.total_seconds())


def save_timeout_s() -> float:
    return float(os.environ.get(SAVE_TIMEOUT_ENV) or dist_timeout_s())


def commit_group() -> Group:
    import torch.distributed as dist

    from ..parallel.transport import GlooTransport

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return ONE_PROCESS
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=dist_timeout_s()))
    return Group(dist.get_rank(), dist.get_world_size(), transport=GlooTransport(group))


def opened(saver: Any) -> None:
    _OPEN.add(saver)
    if _installed.is_set():
        return
    _installed.set()
    import concurrent.futures.thread  # noqa: F401  (its exit hook registered first, so it runs after ours)

    threading._register_atexit(_close_at_exit)  # type: ignore[attr-defined]
    saves_in_flight.register(settle_all)
    _close_before_destroy()
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)


def close_all() -> None:
    """Every handle closed: its saves waited for (a failure raised).  ``runtime.engine.shutdown`` calls it (a
    finished command ends with ``os._exit``, which runs no exit handler)."""
    for saver in list(_OPEN):
        saver.close()


def settle_all() -> None:
    """Every save of this process finished, published or failed (at most ``save_timeout_s``): a read waits for it.
    A failure is not raised here: it stays for the next save or ``wait()``."""
    for saver in list(_OPEN):
        if not saver.closed and threading.current_thread() is not saver.writer.thread:
            saver.writer.idle.wait(save_timeout_s())


def _close_at_exit() -> None:
    """Run before the interpreter's exit handlers (the readers' thread pools stop during shutdown)."""
    failures: list[BaseException] = []
    for saver in list(_OPEN):
        try:
            saver.close()
        except DsckptError as exc:
            failures.append(exc)
    if failures:
        for failure in failures:
            print(f"dsckpt: error: {failure}", file=sys.stderr)
        print("dsckpt: the process exits with status 1: its last checkpoint was not saved", file=sys.stderr)
        atexit._run_exitfuncs()
        _flush()
        os._exit(1)


def _close_before_destroy() -> None:
    import torch.distributed as dist

    destroy = dist.destroy_process_group

    def destroy_after_saves(group: Any = None) -> None:
        failure = None
        if group is None:  # (the commit groups go with the default one)
            try:
                close_all()
            except DsckptError as exc:
                failure = exc
        destroy(group)
        if failure is not None:
            raise failure
    dist.destroy_process_group = destroy_after_saves
    dist.distributed_c10d.destroy_process_group = destroy_after_saves


def _on_sigterm(signum: int, frame: Any) -> None:
    grace = float(os.environ.get(GRACE_ENV, "30"))
    finished = True
    for saver in list(_OPEN):
        if saver.closed:
            continue
        if saver.in_save:  # stopped inside save_checkpoint: the snapshot is not whole
            finished = False
        elif not saver.writer.idle.wait(grace):
            finished = False
        elif saver.writer.failure is not None:
            finished = False
            print(f"dsckpt: error: {saver.writer.failure}", file=sys.stderr)
    last = next((s.last.name for s in _OPEN if s.last is not None), None)
    marked = [note for s in _OPEN if s.target is not None for note in [s.target.left_if_stopped()] if note]
    if last is not None:
        said = "was published" if finished else \
            f"was abandoned ({marked[0] if marked else 'nothing of it is visible'}; `latest` is unchanged)"
        print(f"dsckpt: SIGTERM: the last save, {last}, {said}", file=sys.stderr)
    _flush()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
