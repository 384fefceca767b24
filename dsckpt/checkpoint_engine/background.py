"""Saving without stopping training: a DeepSpeed checkpoint engine that snapshots, then persists in the background.

``enable_async_save(engine)`` works on any engine ``deepspeed.initialize`` returned (dsckpt's runtime, a plain loop,
Lightning's ``DeepSpeedStrategy``, the HF Trainer, Accelerate: they all call ``engine.save_checkpoint``).  Every rank:
1. ``enable_async_save(engine)`` once, on every rank, after ``deepspeed.initialize``: a gloo group of its own for the
   commit (the run's timeout), ``AsyncCheckpointEngine`` as ``engine.checkpoint_engine``, and the engine's
   ``save_checkpoint``, ``destroy`` and ``load_checkpoint`` wrapped (a checkpoint of another data-parallel size or
   ZeRO stage is then loaded through ``planned_load``, without a copy), and whatever may write the optimizer's
   state fenced (``fences``).
2. ``engine.save_checkpoint(dir, tag, ...)`` first waits for the previous save (bounded: ``lifecycle.save_timeout_s``)
   and raises its failure, if any - on every rank at this same call.  DeepSpeed then builds each file's state and
   calls ``save(state, path)``: the state's tensor storages are copied to host memory (reused pinned buffers on a
   GPU) and the file queued for the writer, to be written into the tag's hidden staging folder (``commit``).  An
   optimizer-states file's copies are left past the call (a thread on CPU, a stream of their own on a GPU); anything
   that would rewrite what they read waits for them first.  ``latest`` is not written by DeepSpeed.
3. The writer thread (``writer``) persists, then commits: the tag appears whole by one rename once every rank's
   files are durable, ``latest`` after it; a failure anywhere leaves the previous tag and ``latest`` as they were.
4. ``wait(timeout=None)`` blocks until every queued save is published; ``close()`` (also run by ``engine.destroy()``,
   ``torch.distributed.destroy_process_group``, ``runtime.engine.shutdown()`` and at interpreter exit) waits and
   stops the writer - a failure found there ends the process with a non-zero status (``lifecycle``).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Callable

import torch

from ..errors import BackgroundSaveError, ConfigError
from ..formats.storage import local_only
from . import lifecycle
from .commit import LocalTarget, Targets, new_owner, require_plain_tag, staged, staging_name
from .fences import fence_state_writers
from .kept_parameters import persistent_parameters_kept
from .snapshot import HostPool, Snapshot
from .writer import QueuedFile, QueuedTag, SaveRecord, Writer

log = logging.getLogger("dsckpt")

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
        self.saver._begin(str(info.tag))

    def makedirs(self, path: Any, exist_ok: bool = False) -> None:
        self.saver._makedirs(str(path), exist_ok)

    def save(self, state_dict: Any, path: str) -> None:
        self.saver._snapshot(state_dict, path)

    def load(self, path: str, map_location: Any = None) -> Any:
        from .safe_load import safe_torch_load

        return safe_torch_load(path, map_location=map_location)

    def commit(self, info: Any) -> bool:
        return True  # the background writer commits, once every rank's files are durable


class AsyncSave:
    """The handle ``enable_async_save`` returns: ``wait()``, ``close()``, ``then(action)``, ``records`` (one a save)."""

    def __init__(self, engine: Any, report: Callable[[str], None] | None = None):
        self.engine = engine
        self.report = report or log.info  # rank 0's one line per save
        group = lifecycle.commit_group()
        self.rank = group.rank
        self.owner = group.broadcast(new_owner() if group.rank == 0 else None, 0)  # the staging folders' names
        self.records: list[SaveRecord] = []
        self.pool = HostPool()
        self.writer = Writer(group, self.pool, self.report)
        self.current: QueuedTag | None = None
        self.last: QueuedTag | None = None
        self.in_save = False
        self.targets = Targets()  # where the save in progress goes (a bucket's staging folder reused)
        self.target: LocalTarget | Any = None
        self.tag = ""
        self.stager = ThreadPoolExecutor(1, thread_name_prefix="dsckpt-async-stage")  # copies left past the call
        self.staging: list[Future[None]] = []
        self.copy_stream = torch.cuda.Stream() if torch.cuda.is_available() else None  # (on the engine's device)
        self.defers = False  # the optimizer's writers are fenced: an optimizer-states file's copies may wait for them
        self.reserve: threading.Thread | None = None  # the first save's pinned buffers, allocated off the call
        self.closed = False
        self._wrap(engine)
        lifecycle.opened(self)

    @property
    def idle(self) -> threading.Event:
        return self.writer.idle

    # -- the training thread ---------------------------------------------------------------------
    def _wrap(self, engine: Any) -> None:
        save, destroy, load = engine.save_checkpoint, getattr(engine, "destroy", None), engine.load_checkpoint
        engine.checkpoint_engine = AsyncCheckpointEngine(self)

        def save_checkpoint(save_dir, tag=None, client_state={}, save_latest=True, exclude_frozen_parameters=False):
            if self.closed:  # the writer has stopped: DeepSpeed's own blocking save, into a folder
                closed = f"{save_dir}: a save into a bucket needs dsckpt's background engine, which was closed"
                local_only(save_dir, ConfigError(closed, hint="save before close(), or into a local folder"))
                return save(save_dir, tag=tag, client_state=client_state, save_latest=save_latest,
                            exclude_frozen_parameters=exclude_frozen_parameters)
            name = require_plain_tag(str(tag) if tag is not None else f"global_step{engine.global_steps}", save_dir)
            waited = self._wait_previous()
            start, memory = time.perf_counter(), self.pool.waited_s
            self.tag = name
            self.target = self.targets.for_path(save_dir)
            self.current, self.in_save = None, True
            self.writer.idle.clear()
            offloaded = self._offloaded_dir(engine)
            existed = os.path.isdir(offloaded) if offloaded else True
            try:
                with persistent_parameters_kept(getattr(engine, "optimizer", None)):
                    save(self.target.local, tag=self.tag, client_state=client_state, save_latest=False,
                         exclude_frozen_parameters=exclude_frozen_parameters)
                if not existed and self.current is not None:
                    self._adopt(offloaded)
            except BaseException:
                if self.current is not None:
                    self.current.aborted = True  # nothing of it is published; `latest` stays
                self._queue_tag()
                raise
            finally:
                self.in_save = False
            if self.current is not None:
                self.current.save_latest = save_latest
                rec = self.current.record
                rec.blocked_s, rec.waited_s = time.perf_counter() - start, waited
                rec.memory_waited_s = self.pool.waited_s - memory
                self.records.append(rec)
            self._queue_tag()
            return True

        def load_checkpoint(load_dir, tag=None, trust=False, **kwargs):
            """DeepSpeed's load, weights-only (``trust=True``: DeepSpeed's own unpickler, for a checkpoint whose
            client state holds classes beyond plain data - their pickles may then run code)."""
            from .planned_load import load_any_layout

            self._wait_previous(say=False)  # a tag still being written is not loadable yet
            self._staged()  # (the load rewrites what a save's deferred copies read)
            if not trust:
                return load_any_layout(engine, load, load_dir, tag, **kwargs)
            from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

            checkpoint_engine, engine.checkpoint_engine = engine.checkpoint_engine, TorchCheckpointEngine()
            try:
                return load(load_dir, tag=tag, **kwargs)
            finally:
                engine.checkpoint_engine = checkpoint_engine

        self.defers = fence_state_writers(engine, self._staged)
        engine.save_checkpoint, engine.load_checkpoint = save_checkpoint, load_checkpoint
        if destroy is not None:
            def destroy_after_persist(*args, **kwargs):
                self.close()
                return destroy(*args, **kwargs)

            engine.destroy = destroy_after_persist

    def _offloaded_dir(self, engine: Any) -> str:
        """Where DeepSpeed copies this rank's NVMe swap folder inside the tag (itself, in the call), or ''."""
        nvme = getattr(engine, "zero_nvme_offload_optimizer", None)
        if not callable(nvme) or not nvme():
            return ""
        rank = engine.local_rank if engine.use_node_local_storage() else engine.global_rank
        return os.path.join(self.target.local, self.tag, "offloaded_tensors", f"rank{rank:0>2d}")

    def _adopt(self, offloaded: str) -> None:
        """The NVMe files DeepSpeed copied into the visible tag folder go into the staging folder with the rest."""
        assert self.current is not None
        staged_dir = os.path.join(self.target.local, self.current.staging, "offloaded_tensors")
        os.makedirs(staged_dir, exist_ok=True)
        staged = os.path.join(staged_dir, os.path.basename(offloaded))
        os.replace(offloaded, staged)
        self.current.temps += sorted(entry.path for entry in os.scandir(staged))  # (a bucket uploads them too)
        for folder in (os.path.dirname(offloaded), os.path.dirname(os.path.dirname(offloaded))):
            try:
                os.rmdir(folder)  # (another rank's is still there: the last one removes it)
            except OSError:
                break

    def _queue_tag(self) -> None:
        current, self.current = self.current, None
        if current is None:
            self.writer.idle.set()  # DeepSpeed wrote nothing through the engine
        else:
            self.last = current
            self.writer.queue.put(current)

    def _begin(self, tag: str) -> None:
        if self.in_save:  # DeepSpeed's other saves (save_16bit_model) create/save/commit on their own
            target = self.target or LocalTarget(".")
            self.current = QueuedTag(tag, target, staging_name(tag, self.owner), SaveRecord(tag, 0.0))

    def _makedirs(self, path: str, exist_ok: bool) -> None:
        """DeepSpeed makes the save folder (rank 0, before its barrier: the stale staging folders go then) and the
        tag folder (made hidden: the staging folder)."""
        target = self.target
        if self.in_save and target is not None and os.path.normpath(path) == os.path.normpath(target.local):
            os.makedirs(path, exist_ok=True)
            target.prepare(self.tag, staging_name(self.tag, self.owner))
        elif self.current is not None and os.path.normpath(path) == os.path.normpath(os.path.join(target.local,
                                                                                                   self.tag)):
            os.makedirs(os.path.join(target.local, self.current.staging), exist_ok=True)
        else:
            os.makedirs(path, exist_ok=exist_ok)

    def _snapshot(self, state: Any, path: str) -> None:
        current = self.current
        tag_dir = os.path.join(self.target.local, self.tag) if current is not None else ""
        if current is None or os.path.dirname(os.path.normpath(path)) != os.path.normpath(tag_dir):
            self.writer.write(state, path)  # a save outside save_checkpoint's tag: written now, as stock does
            return
        snap = Snapshot(self.pool, defer=self.defers and path.endswith("optim_states.pt"),  # (only the step changes it)
                        copy_stream=self.copy_stream)
        copied = snap.take(state)
        ready = snap.ready_event()
        deferred = self.stager.submit(snap.finish) if snap.pending or snap.paced else None
        if deferred is not None:
            self.staging.append(deferred)
        temp = staged(path, tag_dir, os.path.join(self.target.local, current.staging))
        current.temps.append(temp)
        current.record.nbytes += snap.nbytes
        self.writer.queue.put(QueuedFile(temp, copied, snap, ready, deferred))

    def _wait_previous(self, say: bool = True, timeout: float | None = None) -> float:
        """Wait (bounded) for every save queued so far; raise its failure - on every rank at the same call."""
        if threading.current_thread() is self.writer.thread:
            return 0.0  # a follow-up of this save (``then``): it is published, and the writer cannot wait on itself
        start = time.perf_counter()
        limit = lifecycle.save_timeout_s() if timeout is None else timeout
        if not self.writer.idle.wait(limit):
            raise BackgroundSaveError(
                f"a background save is still being written after {limit:.0f} s",
                hint="the file system may be hung; training can go on, but no later save is trusted until this one "
                     f"finishes (DSCKPT_SAVE_TIMEOUT sets the wait)", at=self.last.name if self.last else None)
        waited = time.perf_counter() - start
        if waited > 0.01 and self.rank == 0 and say:
            self.report(f"waited {waited:.2f} s for the previous save to persist before saving again")
        failure, self.writer.failure = self.writer.failure, None
        if failure is not None:
            raise failure
        return waited

    def _staged(self) -> None:
        """Every deferred copy done (the time waited is the last save's ``step_waited_s``); on a GPU, once the
        optimizer holds its state, the pinned buffers a save will need reserved off this thread."""
        if self.reserve is None and self.copy_stream is not None and not self.records:
            sizes = gpu_state_sizes(self.engine)
            if sizes:
                self.reserve = self.pool.reserve(sizes)
        if not self.staging:
            return
        staging, self.staging = self.staging, []
        start = time.perf_counter()
        wait(staging)  # (the host waits: the step's kernels may run on other streams than the current one)
        if self.records:
            self.records[-1].step_waited_s += time.perf_counter() - start

    def then(self, action: Callable[[], None]) -> None:
        """Run ``action`` on this rank's writer once the last save is published (now, when none is pending):
        a trainer's deletion of older checkpoints, a folder moved into place.  A failed save drops its actions.
        An action may read or convert the checkpoint: reads do not wait on the writer that runs them."""
        with self.writer.hooks:
            if self.last is not None and not self.last.done:
                self.last.then.append(action)
                return
        action()

    def wait(self, timeout: float | None = None) -> None:
        """Block until every save queued so far is published (``latest`` moved), at most ``timeout`` seconds (default
        ``DSCKPT_SAVE_TIMEOUT``, else the run's timeout); raise a background failure, or one for the time out."""
        self._wait_previous(say=False, timeout=timeout)

    def close(self, timeout: float | None = None) -> None:
        """Wait for the saves in flight (bounded), then stop the writer (idempotent; a failure is raised once).  Saves
        after it block, as DeepSpeed's own do."""
        if self.closed:
            return
        self.closed = True
        try:
            self._wait_previous(say=False, timeout=timeout)
        finally:
            if self.writer.idle.is_set():  # (a writer stuck in a hung write is left to the process's end)
                self.writer.stop()
                for stop in (self.stager.shutdown, self.targets.close, self.pool.close):
                    stop()


def gpu_state_sizes(engine: Any) -> list[int]:
    """The GPU storages a save of ``engine`` copies, by size, once its optimizer holds state (none before its first
    step): each flat fp32 partition and its per-element state, and at ZeRO-1/2 the module's 16-bit parameters (each
    cloned by DeepSpeed for the model-states file)."""
    optimizer = getattr(engine, "optimizer", None)
    flats = getattr(optimizer, "fp32_partitioned_groups_flat", None) or \
        getattr(optimizer, "single_partition_of_fp32_groups", None) or []
    state = getattr(getattr(optimizer, "optimizer", None), "state", {})
    if not flats or not any(flat in state for flat in flats):
        return []
    sizes = []
    for flat in flats:
        tensors = [flat] + [v for v in state.get(flat, {}).values() if isinstance(v, torch.Tensor) and v.dim()]
        sizes += [t.untyped_storage().nbytes() for t in tensors if t.is_cuda]
    if engine.zero_optimization_stage() < 3:
        sizes += [p.numel() * p.element_size() for p in engine.module.parameters() if p.is_cuda]
    return sizes


def enable_async_save(engine: Any, report: Callable[[str], None] | None = None) -> AsyncSave:
    """Make ``engine.save_checkpoint`` return once a snapshot is taken; files persist in the background.

    Call on every rank right after ``deepspeed.initialize``. The files, names and folders are DeepSpeed's own; a tag
    folder appears only complete and ``latest`` moves only when every rank's files are durable. Returns the handle
    (``wait()``, ``close()``, ``then()``).  ``report``: where rank 0's line per save goes (default: the ``dsckpt``
    logger at INFO; ``report=print`` shows it in a plain script).
    """
    existing = getattr(engine, "_dsckpt_async_save", None)
    if existing is not None and not existing.closed:
        return existing
    saver = AsyncSave(engine, report=report)
    engine._dsckpt_async_save = saver
    return saver
