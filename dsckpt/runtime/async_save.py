"""Saving without stopping training: a DeepSpeed checkpoint engine that snapshots, then persists in the background.

``enable_async_save(engine)`` works on any engine ``deepspeed.initialize`` returned (dsckpt's runtime, a plain loop,
Lightning's ``DeepSpeedStrategy``, the HF Trainer, Accelerate: they all call ``engine.save_checkpoint``).  Every rank:
1. ``enable_async_save(engine)`` once, on every rank, after ``deepspeed.initialize``: it makes a gloo group for the
   commit, installs ``AsyncCheckpointEngine`` as ``engine.checkpoint_engine`` and wraps the engine's
   ``save_checkpoint``, ``step``, ``destroy`` and ``load_checkpoint`` (a checkpoint of another data-parallel size
   or ZeRO stage is then loaded through ``planned_load``, without a copy), and its optimizer's ``step``.
2. ``engine.save_checkpoint(dir, tag, ...)`` first waits for the previous save's persist (logged when it waited)
   and raises its failure, if any (``BackgroundSaveError``). DeepSpeed then builds each file's state and calls
   ``save(state, path)``: the state's tensor storages are copied to host memory (reused pinned buffers on a GPU,
   copies queued on the current stream) and the file queued. An optimizer-states file's copies are left out of the
   call: on a CPU they run on a thread, on a GPU on a stream of their own beside the next forward and backward; the
   optimizer's next ``step`` waits for them. ``latest`` is not written by DeepSpeed. At
   ZeRO-3 the persistent parameters DeepSpeed partitions for the save are put back afterwards, not gathered again
   (``kept_parameters``).
3. The writer thread writes each file to ``<tag>/.dsckpt-saving/<name>`` as ``torch.save`` would, from the host
   buffers on several threads, read back as written (``persist.write_snapshot``), and flushes it.  At the tag's end
   all ranks agree (a gather over the commit group): every rank publishes its temps (renamed into place and flushed;
   for a ``save_dir`` in a bucket - ``s3://``, ``gs://``, ``az://`` - uploaded from a local staging folder:
   ``staged_files.Targets``); after a second agreement rank 0 moves ``latest``. A crash at any moment leaves
   ``latest`` on the previous tag; a failure on any rank removes every rank's temps (and what it uploaded) and is
   raised on every rank at its next save, step or ``wait()``. ``then()``'s follow-ups run after the commit.
4. ``AsyncSave.wait()`` blocks until every queued save is durable; ``close()`` (also run by ``engine.destroy()``,
   ``runtime.engine.shutdown()`` and at interpreter exit) waits and stops the thread; saves after it block.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
import types
import weakref
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Callable

import torch

from .. import saves_in_flight
from ..errors import BackgroundSaveError, ConfigError, DsckptError
from ..formats.storage import local_only
from .kept_parameters import persistent_parameters_kept
from .persist import write_snapshot
from .save_queue import QueuedFile, QueuedTag, SaveRecord
from .snapshot import HostPool, Snapshot
from .staged_files import LocalTarget, SaveTarget, Targets, remove_temps, write_temp

log = logging.getLogger("dsckpt")
_OPEN: "weakref.WeakSet[AsyncSave]" = weakref.WeakSet()  # what close_all waits for before a process ends

try:
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine
except ImportError:  # pragma: no cover - the runtime extra always brings DeepSpeed
    CheckpointEngine = object


class AsyncCheckpointEngine(CheckpointEngine):
    """DeepSpeed's checkpoint-engine interface answered by an ``AsyncSave``: ``save`` snapshots and queues."""

    def __init__(self, saver: "AsyncSave"):
        self.name = "dsckpt-async"
        self.saver = saver

    def create(self, info: Any) -> None:
        self.saver._begin(info.save_dir, str(info.tag))

    def save(self, state_dict: Any, path: str) -> None:
        self.saver._snapshot(state_dict, path)

    def load(self, path: str, map_location: Any = None) -> Any:
        from .safe_load import safe_torch_load

        return safe_torch_load(path, map_location=map_location)

    def commit(self, info: Any) -> bool:
        return True  # the background writer commits, once every rank's files are durable


class AsyncSave:
    """The handle ``enable_async_save`` returns: ``wait()``, ``close()``, ``then(action)``, ``records`` (one a save)."""

    def __init__(self, engine: Any, write: Callable[[Any, str], None] | None = None,
                 report: Callable[[str], None] | None = None):
        import torch.distributed as dist

        self.engine = engine
        self.write = write or write_snapshot
        self.report = report or log.info  # rank 0's one line per save
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.group = dist.new_group(backend="gloo") if self.world > 1 else None  # the commit's own channel
        self.records: list[SaveRecord] = []
        self.pool = HostPool()
        self.queue: queue.Queue = queue.Queue()
        self.failure: BackgroundSaveError | None = None
        self.current: QueuedTag | None = None
        self.last: QueuedTag | None = None
        self.hooks = threading.Lock()
        self.in_save = False
        self.targets = Targets()  # where the save in progress goes (a bucket's staging folder reused)
        self.target: SaveTarget | None = None
        self.idle = threading.Event()
        self.idle.set()
        self.checker = ThreadPoolExecutor(1, thread_name_prefix="dsckpt-async-check")
        self.stager = ThreadPoolExecutor(1, thread_name_prefix="dsckpt-async-stage")  # copies left to the step
        self.staging: list[Future[None]] = []
        self.copy_stream = torch.cuda.Stream() if torch.cuda.is_available() else None  # (on the engine's device)
        self.defers = False  # the optimizer's step is wrapped: an optimizer-states file's copies may wait for it
        self.thread = threading.Thread(target=self._run, name="dsckpt-async-save", daemon=True)
        self.thread.start()
        self.closed = False
        self._wrap(engine)
        _OPEN.add(self)
        import concurrent.futures.thread  # noqa: F401  (its exit hook registered first, so it runs after ours)

        # a script that ends right after a save: persist before the interpreter stops the readers' thread pools
        threading._register_atexit(self.close)  # type: ignore[attr-defined]

    # -- the training thread ---------------------------------------------------------------------
    def _wrap(self, engine: Any) -> None:
        save, step, destroy = engine.save_checkpoint, engine.step, getattr(engine, "destroy", None)
        load = engine.load_checkpoint
        engine.checkpoint_engine = AsyncCheckpointEngine(self)

        def save_checkpoint(save_dir, tag=None, client_state={}, save_latest=True, exclude_frozen_parameters=False):
            if self.closed:  # the writer has stopped: DeepSpeed's own blocking save, into a folder
                closed = f"{save_dir}: a save into a bucket needs dsckpt's background engine, which was closed"
                local_only(save_dir, ConfigError(closed, hint="save before close(), or into a local folder"))
                return save(save_dir, tag=tag, client_state=client_state, save_latest=save_latest,
                            exclude_frozen_parameters=exclude_frozen_parameters)
            waited = self._wait_previous()
            start = time.perf_counter()
            self.target = self.targets.for_path(save_dir)
            self.current, self.in_save = None, True
            self.idle.clear()
            try:
                with persistent_parameters_kept(getattr(engine, "optimizer", None)):
                    save(self.target.local, tag=tag, client_state=client_state, save_latest=False,
                         exclude_frozen_parameters=exclude_frozen_parameters)
            except BaseException:
                if self.current is not None:
                    self.current.aborted = True  # its temps are removed; `latest` stays
                self._queue_tag()
                raise
            finally:
                self.in_save = False
            if self.current is not None:
                self.current.save_latest = save_latest
                rec = self.current.record
                rec.blocked_s, rec.waited_s = time.perf_counter() - start, waited
                self.records.append(rec)
            self._queue_tag()
            return True

        def checked_step(*args, **kwargs):
            if self.failure is not None:
                self._raise()
            return step(*args, **kwargs)

        def load_checkpoint(load_dir, tag=None, **kwargs):
            from .planned_load import load_any_layout

            self._wait_previous(say=False)  # a tag still being written is not loadable yet
            return load_any_layout(engine, load, load_dir, tag, **kwargs)

        optimizer = getattr(engine, "optimizer", None)
        if optimizer is not None and callable(getattr(optimizer, "step", None)):
            optimizer_step, self.defers = optimizer.step, True

            def staged_step(_optimizer, *args, **kwargs):
                self._staged()  # the snapshot's deferred copies done before the step rewrites what they read
                return optimizer_step(*args, **kwargs)
            optimizer.step = types.MethodType(staged_step, optimizer)  # (a method: torch's LR schedulers rewrap it)

        engine.save_checkpoint, engine.step, engine.load_checkpoint = save_checkpoint, checked_step, load_checkpoint
        if destroy is not None:
            def destroy_after_persist(*args, **kwargs):
                self.close()
                return destroy(*args, **kwargs)

            engine.destroy = destroy_after_persist

    def _queue_tag(self) -> None:
        current, self.current = self.current, None
        if current is None:
            self.idle.set()  # DeepSpeed wrote nothing through the engine
        else:
            self.last = current
            self.queue.put(current)

    def _begin(self, save_dir: str, tag: str) -> None:
        if self.in_save:  # DeepSpeed's other saves (save_16bit_model) create/save/commit on their own
            target = self.target or LocalTarget(save_dir)
            self.current = QueuedTag(str(save_dir), tag, True, SaveRecord(tag, 0.0), target=target)

    def _snapshot(self, state: Any, path: str) -> None:
        if self.current is None:  # a save outside save_checkpoint: written now, as stock does
            self.write(state, path)
            return
        snap = Snapshot(self.pool, defer=self.defers and path.endswith("optim_states.pt"),  # (only the step changes it)
                        copy_stream=self.copy_stream)
        copied = snap.take(state)
        ready = snap.ready_event()
        staged = self.stager.submit(snap.finish) if snap.pending or snap.paced else None
        if staged is not None:
            self.staging.append(staged)
        self.current.files.append(path)
        self.current.record.nbytes += snap.nbytes
        self.queue.put(QueuedFile(path, copied, snap, ready, staged))

    def _wait_previous(self, say: bool = True) -> float:
        start = time.perf_counter()
        if not self.idle.is_set():
            self.idle.wait()
            waited = time.perf_counter() - start
            if self.rank == 0 and say:
                self.report(f"waited {waited:.2f} s for the previous save to persist before saving again")
        else:
            waited = 0.0
        if self.failure is not None:
            self._raise()
        return waited

    def _staged(self) -> None:
        """Every deferred copy done (the time waited is the last save's ``step_waited_s``)."""
        if not self.staging:
            return
        staging, self.staging = self.staging, []
        start = time.perf_counter()
        wait(staging)  # (the host waits: the step's kernels may run on other streams than the current one)
        if self.records:
            self.records[-1].step_waited_s += time.perf_counter() - start

    def _raise(self) -> None:
        failure, self.failure = self.failure, None
        raise failure  # type: ignore[misc]

    def then(self, action: Callable[[], None]) -> None:
        """Run ``action`` on this rank's writer once the last save is published (now, when none is pending):
        a trainer's deletion of older checkpoints, a folder moved into place.  A failed save drops its actions."""
        with self.hooks:
            if self.last is not None and not self.last.done:
                self.last.then.append(action)
                return
        action()

    def wait(self) -> None:
        """Block until every save queued so far is durable (``latest`` moved); raise a background failure."""
        self._wait_previous(say=False)

    def close(self) -> None:
        """Wait for the saves in flight, then stop the writer (idempotent; a failure is raised once).  Saves after
        it block, as DeepSpeed's own do."""
        if self.closed:
            return
        self.closed = True
        self.idle.wait()
        self.queue.put(None)
        self.thread.join()
        for stop in (self.checker.shutdown, self.stager.shutdown, self.targets.close, self.pool.close):
            stop()
        if self.failure is not None:
            self._raise()

    # -- the writer thread -----------------------------------------------------------------------
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
                        error = exc
                if item.staged is not None:
                    wait([item.staged])  # (a failed tag's copies too: the buffers go back to the pool)
                self.pool.give_back(item.snapshot.buffers)
                item.state = item.snapshot = None  # type: ignore[assignment]
                continue
            error = error or next((e for e in (c.exception() for c in checks) if e is not None), None)
            checks = []
            try:
                if item.aborted:
                    remove_temps(item.files)
                else:
                    self._commit(item, error, started)
            except BaseException as exc:  # the commit's own channel broke: the tag is not published
                self.failure = BackgroundSaveError("the background commit failed "
                                                   f"({type(exc).__name__}: {exc})", at=item.name)
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

    def _persist(self, item: QueuedFile) -> "Future[None]":
        """The file written and flushed; another writer's (a test's) gets its CRC check while the next file is
        written (``write_snapshot`` reads back as it writes)."""
        from ..io.integrity import check_files

        if item.ready is not None:
            item.ready.synchronize()
        if item.staged is not None:
            item.staged.result()
        own = self.write is write_snapshot
        temp = write_temp(self.write, item.state, item.path, follow=not own)
        return self.checker.submit(check_files, [] if own else [temp])

    def _commit(self, tag: QueuedTag, error: BaseException | None, started: float) -> None:
        failed = self._agree(error is None)
        target = tag.target or LocalTarget(tag.save_dir)
        if not failed:
            try:
                target.publish(tag.files, leader=self.rank == 0)
            except (OSError, DsckptError) as exc:
                error = exc
            failed = self._agree(error is None)
        if not failed and self.rank == 0 and tag.save_latest:
            try:
                target.publish_latest(tag.tag)
            except (OSError, DsckptError) as exc:
                error = exc
        if not failed:
            failed = self._agree(error is None)
        tag.record.persist_s = time.perf_counter() - started
        if failed:
            remove_temps(tag.files)
            target.discard(tag.files)
            latest = target.latest()
            kept = f"`latest` still names {latest!r}" if latest else "no `latest` written"
            here = f" ({type(error).__name__}: {error})" if error is not None else ""
            self.failure = BackgroundSaveError(
                f"the background save failed on rank(s) {', '.join(map(str, failed))}{here}; its files "
                f"were removed, {kept}", hint="free space or fix permissions (or a bucket's credentials) where the "
                "checkpoint goes, then save again", at=tag.name)
            return
        tag.record.ok = True
        if self.rank == 0:
            rec = tag.record
            size = f"{rec.nbytes / 1e9:.2f} GB" if rec.nbytes >= 1e8 else f"{rec.nbytes / 1e6:.1f} MB"
            self.report(f"saved {tag.name}: training blocked {rec.blocked_s * 1e3:.0f} ms, "
                        f"{size} persisted in {rec.persist_s:.2f} s "
                        f"({rec.nbytes / 1e9 / max(rec.persist_s, 1e-9):.2f} GB/s)")

    def _agree(self, ok: bool) -> list[int]:
        """The ranks that failed, the same list on every rank."""
        if self.group is None:
            return [] if ok else [self.rank]
        import torch.distributed as dist

        flags = [torch.zeros(1, dtype=torch.int32) for _ in range(self.world)]
        dist.all_gather(flags, torch.tensor([0 if ok else 1], dtype=torch.int32), group=self.group)
        return [r for r, flag in enumerate(flags) if flag.item()]


def enable_async_save(engine: Any, report: Callable[[str], None] | None = None) -> AsyncSave:
    """Make ``engine.save_checkpoint`` return once a snapshot is taken; files persist in the background.

    Call on every rank right after ``deepspeed.initialize``. The files, names and folders are DeepSpeed's own;
    ``latest`` moves only when every rank's files are durable. Returns the handle (``wait()``, ``close()``).
    ``report``: where rank 0's line per save goes (default: the ``dsckpt`` logger at INFO).
    """
    existing = getattr(engine, "_dsckpt_async_save", None)
    if existing is not None and not existing.closed:
        return existing
    saver = AsyncSave(engine, report=report)
    engine._dsckpt_async_save = saver
    return saver


def settle_all() -> None:
    """Every background save of this process finished, durable or failed: a read of a checkpoint waits for it
    (``saves_in_flight``). A failure is not raised here: it stays for the next save, step or ``wait()``."""
    for saver in list(_OPEN):
        if not saver.closed:
            saver.idle.wait()


saves_in_flight.register(settle_all)


def close_all() -> None:
    """Wait for every background save of this process (``runtime.engine.shutdown`` calls it: a finished command
    ends with ``os._exit``, which runs no ``atexit``)."""
    for saver in list(_OPEN):
        saver.close()
