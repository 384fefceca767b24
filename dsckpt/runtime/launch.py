"""`--nproc N`: start N local ranks of the same command, with the environment torchrun gives its workers.

1. The parent re-runs its own command line as ``python -m dsckpt ...`` (or a script) N times, each child
   with ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` and torchrun's other worker
   variables; a child sees ``LOCAL_RANK`` and runs the work instead of launching again.  Rank 0 hosts the
   rendezvous store (``env://``), on a port the parent found free; a command that needs no torch
   (consolidate, reshard, convert) meets on another, through ``parallel.transport.LocalTransport``.
2. The parent does not import torch (torchrun's agent does, before its workers import it again: seconds per
   job, docs/dev/performance-log.md).
3. It waits for every rank.  When one fails, the others get ``FAILURE_GRACE_S`` to notice (a broken
   collective) and write their own error, then SIGTERM, then SIGKILL: no rank outlives the launch.
4. Ctrl-C reaches every rank of the terminal's process group; each stops on its own (``interruptible``),
   the parent waits for them and reports ``Aborted.`` once.  The parent passes a SIGINT/SIGTERM it gets
   on as SIGINT (a rank ignores all but its first, ``cli.app``), then SIGKILL after ``STOP_GRACE_S``.
5. Children report typed errors through files (``console.report_rank_error``); the parent prints each
   distinct one once and exits 2, as ``--nproc 1`` does.
6. A command that needs no torch (``fork_ranks``) forks its ranks instead of starting N interpreters: each
   rank begins with the parent's imports (a fresh one paid its start and imports again, the larger part of
   a short run's time) and its own environment; the steps above are the same.  Only where that is safe
   (``may_fork``): Linux, no thread but the main one, no torch, and an entry point that ends every rank with
   ``os._exit`` (``cli.app.main``), so no rank returns into its parent's code or runs its exit handlers.
"""
from __future__ import annotations

import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any
from pathlib import Path

from ..errors import DsckptError, Interrupted
from ..parallel.transport import hub_environment
from . import console

FAILURE_GRACE_S = 10.0  # after a rank fails, the time the others get to stop by themselves
STOP_GRACE_S = 10.0  # after SIGTERM (or a Ctrl-C), before SIGKILL


class RankError(DsckptError):
    """A typed error raised inside the launched ranks (the message is theirs)."""


def should_launch(nproc: int) -> bool:
    return nproc > 1 and "LOCAL_RANK" not in os.environ


def free_port() -> int:
    """A port for a rendezvous store, below the kernel's ephemeral range where it can: a port from that range, free
    when asked, may be taken by any process's outgoing connection (gloo opens one per pair of ranks) before the
    store binds it (seen in the test suite: a store's clients reached another job's)."""
    import random

    low = _ephemeral_low()  # (the system's randomness: a run that seeded `random` would pick the ports of every other)
    for port in random.SystemRandom().sample(range(20000, low), min(64, max(0, low - 20000))):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            return int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # (Linux's default; elsewhere a guess)


def rank_environment(rank: int, nproc: int, port: int) -> dict[str, str]:
    """What torchrun (one node, standalone) sets for its worker ``rank``: libraries key on these names."""
    same = {"WORLD_SIZE": nproc, "LOCAL_WORLD_SIZE": nproc, "GROUP_RANK": 0, "GROUP_WORLD_SIZE": 1,
            "ROLE_NAME": "default", "ROLE_WORLD_SIZE": nproc, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
            "TORCHELASTIC_RUN_ID": f"dsckpt-{os.getpid()}", "TORCHELASTIC_RESTART_COUNT": 0,
            "TORCHELASTIC_MAX_RESTARTS": 0}
    return {k: str(v) for k, v in {**same, "RANK": rank, "LOCAL_RANK": rank, "ROLE_RANK": rank}.items()}


def run_ranks(command: list[str], nproc: int, env: dict[str, str] | None = None, timeout: float | None = None,
              **popen) -> list[int]:
    """Run ``command`` as ``nproc`` local ranks; their exit codes, by rank (steps 1, 3, 4).  ``popen``: more
    arguments for every rank's ``subprocess.Popen`` (``stdout``, ``cwd``...).  Past ``timeout`` seconds
    the ranks are stopped and ``subprocess.TimeoutExpired`` is raised."""
    base = {**os.environ, **(env or {}), **_shared_environment()}
    port = free_port()
    procs = [subprocess.Popen(command, env={**base, **rank_environment(r, nproc, port)}, **popen)
             for r in range(nproc)]
    return _supervise(procs, timeout, command)


def _shared_environment() -> dict[str, str]:
    """What every rank of one launch gets beyond the launcher's own environment."""
    shared = hub_environment(free_port())
    if "OMP_NUM_THREADS" not in os.environ:
        shared["OMP_NUM_THREADS"] = "1"  # ranks share the cores
    return shared


def _supervise(procs: list, timeout: float | None, command: list[str]) -> list[int]:
    """Wait for the ranks, passing signals on (steps 3, 4); their exit codes."""
    previous = {sig: signal.signal(sig, _raise_interrupted) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        if not _wait(procs, time.monotonic() + timeout if timeout else None):
            raise subprocess.TimeoutExpired(command, timeout or 0.0)
    except (KeyboardInterrupt, Interrupted):
        _stop(procs, first=signal.SIGINT, wait_first=0)  # (a rank ignores a second SIGINT)
        raise Interrupted from None
    finally:
        _stop(procs, first=signal.SIGTERM, wait_first=0)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return [p.returncode for p in procs]


def _raise_interrupted(signum, frame) -> None:
    raise Interrupted  # not KeyboardInterrupt: click would print a stray newline for it


def _wait(procs: list[Any], deadline: float | None) -> bool:
    """Until every rank has ended (True) or ``deadline`` (False); once one fails, the rest get
    FAILURE_GRACE_S, then are stopped."""
    failed_at = None
    with _ExitWatch(procs) as watch:
        while None in (codes := [p.poll() for p in procs]):  # every rank polled (any() would stop at the first)
            if deadline is not None and time.monotonic() > deadline:
                return False
            if failed_at is None and any(code not in (None, 0) for code in codes):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > FAILURE_GRACE_S:
                _stop(procs, first=signal.SIGTERM, wait_first=0)
                break
            watch.pause(0.05)
    return True


class _ExitWatch:
    """``pause(s)``: sleep at most ``s`` seconds, waking as soon as a rank exits (Linux pidfds; elsewhere a
    plain sleep), so a short run's launcher does not lag its ranks by a polling period."""

    def __init__(self, procs: list[subprocess.Popen]):
        self.fds: list[int] = []
        for proc in procs:
            try:
                self.fds.append(os.pidfd_open(proc.pid))
            except (AttributeError, OSError):  # (no pidfd_open; a rank already reaped): plain sleeps
                self.close()
                return

    def pause(self, seconds: float) -> None:
        if not self.fds:
            time.sleep(seconds)
            return
        ended, _, _ = select.select(self.fds, [], [], seconds)
        for fd in ended:  # an exited rank's pidfd stays readable: watch the others only
            os.close(fd)
            self.fds.remove(fd)

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []

    def __enter__(self) -> "_ExitWatch":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _stop(procs: list[Any], first: signal.Signals, wait_first: float) -> None:
    """Ranks still running: wait ``wait_first`` s (a Ctrl-C reached them too), send ``first``, then SIGKILL."""
    deadline = time.monotonic() + wait_first
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    for sig in (first, signal.SIGKILL):
        alive = [p for p in procs if p.poll() is None]
        for p in alive:
            p.send_signal(sig)
        deadline = time.monotonic() + STOP_GRACE_S
        while any(p.poll() is None for p in alive) and time.monotonic() < deadline:
            time.sleep(0.05)


def launch(nproc: int, argv: list[str] | None = None, script: str | None = None) -> int:
    """Run ``python -m dsckpt <argv>`` (or ``python <script> <argv>``) on ``nproc`` local ranks (step 5)."""
    argv = sys.argv[1:] if argv is None else argv
    command = [sys.executable, script, *argv] if script else [sys.executable, "-m", "dsckpt", *argv]
    with tempfile.TemporaryDirectory(prefix="dsckpt-ranks-") as errors:
        return _outcome(run_ranks(command, nproc, {console.ERROR_DIR_ENV: errors}), Path(errors), nproc)


def may_fork() -> bool:
    """This process may fork its ranks (step 6; its entry point is the caller's to check)."""
    return sys.platform.startswith("linux") and threading.active_count() == 1 and "torch" not in sys.modules


def forked_rank() -> bool:
    """This process is a rank ``fork_ranks`` forked."""
    return _forked_rank


_forked_rank = False


def fork_ranks(nproc: int) -> int | None:
    """Step 6: ``nproc`` forks of this process.  In each rank it returns None, the environment that of a
    launched rank; in the launcher, once every rank has ended, the launch's exit code (or its error)."""
    global _forked_rank
    shared = _shared_environment()
    port = free_port()
    ranks = [rank_environment(r, nproc, port) for r in range(nproc)]  # here: the run's id is this pid
    errors = tempfile.mkdtemp(prefix="dsckpt-ranks-")  # (no TemporaryDirectory: its finalizer would run in ranks)
    shared[console.ERROR_DIR_ENV] = errors
    sys.stdout.flush()
    sys.stderr.flush()
    procs: list[_ForkedRank] = []
    try:
        for environment in ranks:
            pid = os.fork()
            if pid == 0:
                _forked_rank = True
                os.environ.update({**shared, **environment})
                return None
            procs.append(_ForkedRank(pid))
        return _outcome(_supervise(procs, None, sys.argv), Path(errors), nproc)
    except BaseException:
        _stop(procs, first=signal.SIGTERM, wait_first=0)  # (a fork that failed: the ranks started wait for it)
        raise
    finally:
        if not _forked_rank:
            shutil.rmtree(errors, ignore_errors=True)


class _ForkedRank:
    """What ``_wait`` and ``_stop`` use of a ``subprocess.Popen``, for a forked rank."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)  # (negative: the signal that ended it)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)


def _outcome(codes: list[int], errors: Path, nproc: int) -> int:
    """The launch's exit code, or the ranks' error (step 5)."""
    if not any(codes):
        return 0
    reported = console.collect_rank_errors(errors)
    if reported:
        raise _one_error(reported, nproc)
    if any(code == 130 for code in codes) and all(code in (0, 130, -signal.SIGTERM) for code in codes):
        raise Interrupted  # a rank was interrupted on its own (e.g. SIGINT sent to it alone)
    killed = [(r, code) for r, code in enumerate(codes) if code < 0 and code != -signal.SIGTERM]
    if killed:  # the cause, where the others' tracebacks show only the broken connection
        rank, code = killed[0]
        raise RankError(f"rank {rank} of {nproc} was killed by {signal.Signals(-code).name}",
                        hint="out of memory? the system log (dmesg) says what killed it")
    first = next(code for code in codes if code)
    return first if first > 0 else 1


def _one_error(reported: list[tuple[str, str | None, list[int]]], nproc: int) -> RankError:
    lines = []
    for message, _, ranks in reported:
        where = "" if len(reported) == 1 and len(ranks) in (1, nproc) else f" [rank {','.join(map(str, ranks))}]"
        lines.append(message + where)
    return RankError("\n".join(lines), hint=reported[0][1])
