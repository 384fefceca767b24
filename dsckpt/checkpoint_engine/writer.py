"""The background engine's writer thread: each queued file persisted into the tag's staging folder, then the commit.

The training thread (``background.AsyncSave``) queues, per save, each file DeepSpeed saved (``QueuedFile``, its state
over the snapshot's host buffers) and then the tag (``QueuedTag``).  The writer, one thread per rank:
1. writes each file to its staged path (``commit.write_temp``: flushed) and CRC-checks it beside the next write;
2. at the tag: the ranks agree over the commit's own gloo group (``parallel.group.Group.agree``: the first failure
   is raised on every rank, its cause as the OS said it), rank 0 publishes the staged folder as the tag, the other
   ranks theirs where storage is node-local, and after another agreement rank 0 moves ``latest``
   (``commit``'s protocol).  A failure anywhere removes the staged files and leaves ``failure`` for the training
   thread's next save or ``wait()`` - on every rank, since every rank reaches the same verdict;
3. runs the tag's ``then`` follow-ups, and sets ``idle`` when the queue is empty.
Every collective carries the group's timeout: a peer that is gone becomes a typed error, never a hang.
"""
from __future__ import annotations

import os
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..errors import BackgroundSaveError, DistributedError, DsckptError
from ..parallel.group import Group
from .commit import SaveTarget, write_temp
from .persist import write_snapshot
from .snapshot import HostPool, Snapshot


@dataclass
class SaveRecord:
    """One save as it went: how long training was held (by the call; by the next optimizer step, for the snapshot's
    deferred copies), how long the background persist took."""
    tag: str
    blocked_s: float
    step_waited_s: float = 0.0
    waited_s: float = 0.0
    nbytes: int = 0
    persist_s: float = 0.0
    ok: bool = False
    memory_waited_s: float = 0.0  # of ``blocked_s``: pinned host memory allocated (or a reservation waited for)


@dataclass
class QueuedTag:
    """A tag the training thread queued: its files, where they are staged and go, what runs once it is published."""
    tag: str
    target: SaveTarget
    staging: str  # the hidden sibling folder's name (``commit.staging_name``)
    record: SaveRecord
    save_latest: bool = True
    temps: list[str] = field(default_factory=list)  # this rank's staged files
    aborted: bool = False  # the save call raised: nothing of it is published
    then: list[Callable[[], None]] = field(default_factory=list)
    done: bool = False

    @property
    def name(self) -> str:
        return os.path.join(self.target.name, self.tag)


@dataclass
class QueuedFile:
    """A file of the tag: its state over the snapshot's host copies, and what orders those copies."""
    temp: str
    state: Any
    snapshot: Snapshot
    ready: Any  # a CUDA event the copies are ordered before, or None on CPU
    staged: Future[None] | None = None  # the deferred copies (an optimizer-states file's)


def cause(error: BaseException) -> DsckptError:
    """A failure as the user needs it: an OS error as the OS said it, about the file it names."""
    if isinstance(error, DsckptError):
        return error
    if isinstance(error, OSError) and error.strerror:
        name = f" {os.path.basename(error.filename)}" if isinstance(error.filename, str) else ""
        return BackgroundSaveError(f"writing{name} failed: {error.strerror}")
    return BackgroundSaveError(f"{type(error).__name__}: {error}")


class Writer:
    """One rank's writer thread and what it shares with the training thread (``queue``, ``idle``, ``failure``)."""

    def __init__(self, group: Group, pool: HostPool, report: Callable[[str], None]):
        self.group, self.pool, self.report = group, pool, report
        self.write: Callable[[Any, str], None] = write_snapshot  # (tests swap in slowed or failing writers)
        self.queue: queue.Queue[QueuedFile | QueuedTag | None] = queue.Queue()
        self.failure: DsckptError | None = None
        self.idle = threading.Event()
        self.idle.set()
        self.hooks = threading.Lock()  # a tag's ``then`` list against the writer finishing it
        self.checker = ThreadPoolExecutor(1, thread_name_prefix="dsckpt-async-check")
        self.thread = threading.Thread(target=self._run, name="dsckpt-async-save", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.queue.put(None)
        self.thread.join()
        self.checker.shutdown()

    def _run(self) -> None:
        error: BaseException | None = None
        started: float | None = None
        checks: list[Future[None]] = []
        while True:
            item = self.queue.get()
            if item is None:
                return
            started = started or time.perf_counter()
            if isinstance(item, QueuedFile):
                if error is None:
                    try:
                        checks.append(self._persist(item))
                    except BaseException as exc:  # reported at the commit, on every rank
                        if isinstance(exc, OSError) and exc.filename is None:
                            exc.filename = item.temp  # (a pwrite's error names no file)
                        error = exc
                if item.staged is not None:
                    wait([item.staged])  # (a failed tag's copies too: the buffers go back to the pool)
                self.pool.give_back(item.snapshot.buffers)
                item.state = item.snapshot = None  # type: ignore[assignment]
                continue
            error = error or next((e for e in (c.exception() for c in checks) if e is not None), None)
            checks = []
            if item.aborted:  # (the call raised here; the other ranks learn it at the agreement)
                error = error or BackgroundSaveError("save_checkpoint raised on this rank")
            try:
                self._commit(item, error, started)
            except BaseException as exc:  # not one of the commit's own failures: the thread must live on to say it
                self.failure = BackgroundSaveError(f"the background commit failed ({type(exc).__name__}: {exc})",
                                                   hint="`dsckpt list` and `dsckpt verify` of the save folder say "
                                                        "what is there", at=item.name)
            with self.hooks:
                item.done, actions = True, (item.then if item.record.ok else [])
            try:
                for action in actions:
                    action()
            except BaseException as exc:  # a trainer's follow-up failed: reported like a failed save
                self.failure = BackgroundSaveError(f"after publishing: {type(exc).__name__}: {exc}", at=item.name)
            error, started = None, None
            if self.queue.empty():
                self.idle.set()

    def _persist(self, item: QueuedFile) -> Future[None]:
        """The file written and flushed; another writer's (a test's) gets its CRC check while the next file is
        written (``write_snapshot`` reads back as it writes)."""
        from ..io.integrity import check_files

        if item.ready is not None:
            item.ready.synchronize()
        if item.staged is not None:
            item.staged.result()
        own = self.write is write_snapshot
        write_temp(self.write, item.state, item.temp, follow=not own)
        return self.checker.submit(check_files, [] if own else [Path(item.temp)])

    def _persisted(self, tag: QueuedTag, error: BaseException | None) -> BaseException | None:
        """The target's part of making this rank's files durable (a bucket: uploaded as hidden objects)."""
        if error is not None:
            return error
        try:
            tag.target.persist(tag.staging, tag.temps)
        except (OSError, DsckptError) as exc:
            return exc
        return None

    def _commit(self, tag: QueuedTag, error: BaseException | None, started: float) -> None:
        rank, target, published = self.group.rank, tag.target, False

        def phase(ranks: Callable[[int], bool], act: Callable[[], None]) -> None:
            failed = None
            if ranks(rank):
                try:
                    act()
                except (OSError, DsckptError) as exc:
                    failed = cause(exc)
            self.group.agree(failed)

        try:
            error = self._persisted(tag, error)
            self.group.agree(None if error is None else cause(error))  # every rank's files durable
            phase(lambda r: True, lambda: target.open_publish(tag.tag, tag.staging, leader=rank == 0))
            phase(lambda r: True, lambda: target.publish(tag.tag, tag.staging, tag.temps, leader=rank == 0))
            published = True
            phase(lambda r: True, lambda: target.close_publish(tag.tag, tag.staging, leader=rank == 0))
            if tag.save_latest:
                phase(lambda r: r == 0, lambda: target.publish_latest(tag.tag))
        except DsckptError as exc:  # (a peer gone or silent past the timeout too: parallel.transport)
            self._failed(tag, exc, published)
            return
        finally:
            tag.record.persist_s = time.perf_counter() - started
        tag.record.ok = True
        if rank == 0:
            rec = tag.record
            size = f"{rec.nbytes / 1e9:.2f} GB" if rec.nbytes >= 1e8 else f"{rec.nbytes / 1e6:.1f} MB"
            memory = (f" ({rec.memory_waited_s:.2f} s of it waiting for pinned host memory)"
                      if rec.memory_waited_s >= 0.01 else "")
            self.report(f"saved {tag.name}: training blocked {rec.blocked_s * 1e3:.0f} ms{memory}, "
                        f"{size} persisted in {rec.persist_s:.2f} s "
                        f"({rec.nbytes / 1e9 / max(rec.persist_s, 1e-9):.2f} GB/s)")

    def _failed(self, tag: QueuedTag, error: DsckptError, published: bool) -> None:
        """Staged files removed; the failure, saying what is on disk now, left for the training thread."""
        target, visible = tag.target, None
        try:
            visible = target.discard(tag.tag, tag.staging, tag.temps, leader=self.group.rank == 0)
        except (OSError, DsckptError):
            pass  # what is left is said below
        latest = target.latest()
        now = f"`latest` still names {latest!r}" if latest else "no `latest` was written"
        if published:
            state = f"the tag folder is complete but {now}"
        elif visible:
            state = f"{visible}; {now}"
        else:
            state = f"nothing of it was published, {now}"
        staging = os.path.join(target.local, tag.staging)
        left = [p for p in tag.temps if os.path.exists(p)]
        if left:
            state += f"; its partial files are left in {staging} (`dsckpt prune` removes them)"
        if tag.aborted:
            return  # the call itself raised on this rank: the caller has that error
        about = f" [{error.at}]" if error.at is not None and str(error.at) not in error.message else ""
        peer_gone = isinstance(error, DistributedError)  # (its own words say nothing was published: said below)
        self.failure = BackgroundSaveError(
            f"the background save failed: {error.message.removesuffix('; nothing was published')}{about}; {state}",
            hint=error.hint if peer_gone else "free space or fix permissions (or a bucket's credentials) where the "
                                              "checkpoint goes, then save again", at=tag.name)
