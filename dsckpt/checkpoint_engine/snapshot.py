"""A checkpoint file's state copied out of the training's memory, as ``torch.save`` would see it at that moment.

Every distinct tensor storage is copied once (views, offsets, strides, ``requires_grad`` and parameters kept), so the
file written later holds the same storages stock ``torch.save`` would have written: the next optimizer step may
rewrite the originals in place.  On a GPU the copies go to pinned host buffers reused from save to save, queued on
the current stream (the caller records an event after them).  ``Snapshot(pool, defer=True)`` is for state only the
optimizer's step changes: it takes the tree at once and leaves the copies to ``finish()`` (the caller runs it on a
thread of its own and makes the next step wait for it), so the forward and backward that follow run beside them.
A GPU tensor's copies go on ``copy_stream`` (ordered after the work already queued on the current stream) a piece at
a time: the copy engine runs device-to-host copies in the order they were queued, so any device-to-host read the
training makes meanwhile (a ``.item()`` in ZeRO-3's forward) waits behind the pieces in flight, not behind the whole
file (docs/dev/performance-log.md 39).
"""
from __future__ import annotations

import copy
import ctypes
import mmap
import threading
import time
import weakref
from typing import Any

import torch


PINNED_IN_PLACE = 1 << 20  # a smaller pinned buffer comes from torch's allocator (its rounding costs < 1 MiB)
PACE_PIECE = 128 << 20  # a deferred GPU copy is queued in pieces of this size...
PACE_IN_FLIGHT = 2  # ...this many at once (one keeps the copy engine busy while the next is queued)


class HostPool:
    """Host buffers by size, kept from one save to the next: a fresh buffer faults on every page it is first written
    (docs/dev/performance-log.md 28), so the rank keeps one copy of its state after the first save.  A large pinned
    buffer is mapped memory pinned in place at its own size (``cudaHostRegister``): torch's pinned allocator rounds
    each allocation up to a power of two, 1.81x the state on the bench rank (logs 34, 35); ``close`` unpins them."""

    def __init__(self):
        self.free: dict[tuple[int, bool], list[torch.UntypedStorage]] = {}
        self.lock = threading.Lock()
        self.pinned: list[torch.UntypedStorage] = []
        self._unpin = weakref.finalize(self, _unpin_all, self.pinned)  # a pool dropped without close() unpins too
        self._unpin.atexit = False  # (the process's end frees them)
        self.reserving: dict[int, int] = {}  # pinned sizes a ``reserve`` thread has yet to allocate, and how many
        self.reserved = threading.Condition(self.lock)
        self.waited_s = 0.0  # how long takes waited for pinned memory: a reservation, or their own allocation

    def reserve(self, sizes: list[int]) -> threading.Thread:
        """Pinned buffers of ``sizes`` allocated on a thread of their own, off the training thread, so that the first
        save takes them instead of allocating (and pinning) in its call; a take of a size still being reserved waits
        for it rather than allocating a second one."""
        with self.lock:
            for n in sizes:
                self.reserving[n] = self.reserving.get(n, 0) + 1
        thread = threading.Thread(target=self._fill, args=(list(sizes),), name="dsckpt-async-reserve", daemon=True)
        thread.start()
        return thread

    def _fill(self, sizes: list[int]) -> None:
        order = sorted(sizes, reverse=True)  # (the largest first: what a save waits longest for)
        try:
            carved = self._arena(order)
        except Exception:  # (no memory for it at once: one buffer at a time, below)
            carved = []
        for i, n in enumerate(order):
            try:
                buffer = carved[i] if i < len(carved) else self._allocate(n, pinned=True)
            except Exception:  # (no memory now: the save allocates itself, and says so if it must wait)
                buffer = None
            with self.reserved:
                if buffer is not None:
                    self.free.setdefault((n, True), []).append(buffer)
                self.reserving[n] -= 1
                if not self.reserving[n]:
                    del self.reserving[n]
                self.reserved.notify_all()

    def take(self, nbytes: int, pinned: bool) -> torch.UntypedStorage:
        with self.reserved:
            if pinned and nbytes in self.reserving and not self.free.get((nbytes, pinned)):
                start = time.perf_counter()
                self.reserved.wait_for(lambda: nbytes not in self.reserving or bool(self.free.get((nbytes, pinned))))
                self.waited_s += time.perf_counter() - start
            spare = self.free.get((nbytes, pinned))
            if spare:
                return spare.pop()
        start = time.perf_counter()
        buffer = self._allocate(nbytes, pinned)
        if pinned:
            self.waited_s += time.perf_counter() - start
        return buffer

    def _allocate(self, nbytes: int, pinned: bool) -> torch.UntypedStorage:
        if not pinned or nbytes < PINNED_IN_PLACE:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned).untyped_storage()
        region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)  # pages of its own: no registered range shares one
        buffer = torch.frombuffer(region, dtype=torch.uint8).untyped_storage()  # (the storage keeps the region)
        # backed first: the driver registering pages not yet backed stalls the GPU's launches (log 46)
        if not (populate(buffer) and pin_in_place(buffer)):
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).untyped_storage()  # (torch's, then)
        with self.lock:
            self.pinned.append(buffer)
        return buffer

    def _arena(self, sizes: list[int]) -> list[torch.UntypedStorage]:
        """Buffers for the leading ``sizes`` (largest first) that are pinned in place, carved from one mapping backed
        and registered once: the driver's cost is per registration, and ZeRO-1/2 copies each module parameter to a
        buffer of its own (log 47); [] where fewer than two sizes qualify or the driver refuses."""
        pinned_sizes = [n for n in sizes if n >= PINNED_IN_PLACE]
        if len(pinned_sizes) < 2:
            return []
        whole, pieces = carved_region(pinned_sizes)
        if not (populate(whole) and pin_in_place(whole)):
            return []
        with self.lock:
            self.pinned.append(whole)  # (unpinned as one: each piece is a view of it)
        return pieces

    def close(self) -> None:
        """Unpin what ``take`` pinned (the buffers are freed with the last reference to them)."""
        with self.lock:
            self.free = {}
        self._unpin()

    def give_back(self, buffers: list[tuple[torch.UntypedStorage, bool]]) -> None:
        with self.lock:
            for buf, pinned in buffers:
                self.free.setdefault((buf.nbytes(), pinned), []).append(buf)


def carved_region(sizes: list[int], align: int = mmap.PAGESIZE) -> tuple[torch.UntypedStorage, list[torch.UntypedStorage]]:
    """One private mapping holding a storage per size, each starting on a page of its own; (the whole, the pieces)."""
    offsets, end = [], 0
    for n in sizes:
        offsets.append(end)
        end += -(-n // align) * align
    region = mmap.mmap(-1, end, flags=mmap.MAP_PRIVATE)
    whole = torch.frombuffer(region, dtype=torch.uint8).untyped_storage()
    pieces = [torch.frombuffer(region, dtype=torch.uint8, count=n, offset=o).untyped_storage()
              for n, o in zip(sizes, offsets)]
    return whole, pieces


def _unpin_all(buffers: list[torch.UntypedStorage]) -> None:
    for buffer in buffers:
        torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())
    buffers.clear()


MADV_DONTFORK, MADV_HUGEPAGE, MADV_POPULATE_WRITE = 10, 14, 23  # Linux's madvise advice (the last from 5.14)


def populate(buffer: torch.UntypedStorage) -> bool:
    """Back a privately mapped buffer's pages, huge where the kernel gives them, without holding the GIL (ctypes and
    torch let it go): by the kernel in one call, or by writing zeros where it cannot.  The pages stay out of forked
    children (a DataLoader's workers): a fork copies private pages that are pinned into the child.  False where
    the kernel refuses that."""
    libc = ctypes.CDLL(None, use_errno=True)
    address, length = ctypes.c_void_p(buffer.data_ptr()), ctypes.c_size_t(buffer.nbytes())
    if libc.madvise(address, length, MADV_DONTFORK) != 0:
        return False
    libc.madvise(address, length, MADV_HUGEPAGE)  # (advice: refused where huge pages are off)
    if libc.madvise(address, length, MADV_POPULATE_WRITE) != 0:
        torch.empty(0, dtype=torch.uint8).set_(buffer).zero_()
    return True


def pin_in_place(buffer: torch.UntypedStorage) -> bool:
    """Page-lock host memory where it is (cudaHostRegister, portable to every device's context; torch's binding lets
    the GIL go and initialises torch's CUDA state, without which ``is_pinned`` denies it); False where the driver
    refuses, its error then cleared so that torch's next kernel-launch check does not raise it."""
    if int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.nbytes(), 1)) == 0:
        return True
    _clear_cuda_error()
    return False


def _clear_cuda_error() -> None:
    """cudaGetLastError of the runtime torch loaded (torch.cuda.cudart() does not expose it)."""
    with open("/proc/self/maps") as maps:
        runtime = next((line.split()[-1] for line in maps if "libcudart.so" in line), None)
    if runtime is not None:
        ctypes.CDLL(runtime).cudaGetLastError()


class Snapshot:
    """A file's state with every tensor storage copied to host memory, views kept as ``torch.save`` sees them."""

    def __init__(self, pool: HostPool, defer: bool = False, copy_stream: Any = None):
        self.pool, self.nbytes, self.defer, self.copy_stream = pool, 0, defer, copy_stream
        self.on_copy_stream = False  # a GPU copy was queued on ``copy_stream``
        self.copies: dict[Any, Any] = {}
        self.buffers: list[tuple[torch.UntypedStorage, bool]] = []  # (buffer, pinned)
        self.pending: list[tuple[torch.UntypedStorage, torch.UntypedStorage]] = []  # (host, source) left to finish()
        self.paced: list[tuple[torch.UntypedStorage, torch.Tensor]] = []  # (host, GPU source) left to finish()

    def take(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj)
        if isinstance(obj, dict):
            out = copy.copy(obj)  # keeps the mapping's class (OrderedDict and friends)
            for key, value in obj.items():
                out[key] = self.take(value)
            return out
        if isinstance(obj, list):
            return [self.take(v) for v in obj]
        if isinstance(obj, tuple):
            items = [self.take(v) for v in obj]
            return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
        try:
            return copy.deepcopy(obj)  # the caller may change its objects the moment the save returns
        except Exception:
            return obj

    def _tensor(self, t: torch.Tensor) -> torch.Tensor:
        source = t.detach().untyped_storage()
        key = (source.data_ptr(), str(t.device))
        host = self.copies.get(key) if source.nbytes() else None  # empty storages share pointer 0
        if host is None:
            host = self.pool.take(source.nbytes(), pinned=t.is_cuda)
            if self.defer and not t.is_cuda:
                self.pending.append((host, source))
            elif self.defer and self.copy_stream is not None:
                self._copy_beside(host, t)
            else:
                host.copy_(source, non_blocking=t.is_cuda)
            self.copies[key] = host
            self.buffers.append((host, t.is_cuda))
            self.nbytes += source.nbytes()
        view = torch.empty(0, dtype=t.dtype).set_(host, t.storage_offset(), t.size(), t.stride())
        if isinstance(t, torch.nn.Parameter):
            return torch.nn.Parameter(view, requires_grad=t.requires_grad)
        return view.requires_grad_(t.requires_grad) if t.is_floating_point() or t.is_complex() else view

    def _copy_beside(self, host: torch.UntypedStorage, t: torch.Tensor) -> None:
        if not self.on_copy_stream:  # the sources' last writes are on the current stream
            self.copy_stream.wait_stream(torch.cuda.current_stream(t.device))
            self.on_copy_stream = True
        self.paced.append((host, t.detach()))

    def ready_event(self) -> Any:
        """A CUDA event after the GPU copies queued on the current stream, or None without any (those ``finish``
        queues on ``copy_stream`` are done when it returns)."""
        if not any(pinned for _, pinned in self.buffers) or self.on_copy_stream:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream())
        return event

    def finish(self) -> None:
        """The copies ``defer`` left, done when it returns (host ones through tensors: their ``copy_`` runs
        without the GIL; GPU ones paced on ``copy_stream``)."""
        pending, self.pending = self.pending, []
        for host, source in pending:
            _bytes(host).copy_(_bytes(source))
        paced, self.paced = self.paced, []
        if not paced:
            return
        in_flight: list[Any] = []
        with torch.cuda.stream(self.copy_stream):
            for host, source in paced:
                src, dst = _bytes(source.untyped_storage()), _bytes(host)
                for at in range(0, src.numel(), PACE_PIECE):
                    dst[at:at + PACE_PIECE].copy_(src[at:at + PACE_PIECE], non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(self.copy_stream)
                    in_flight.append(event)
                    if len(in_flight) >= PACE_IN_FLIGHT:
                        in_flight.pop(0).synchronize()
                source.record_stream(self.copy_stream)  # (the allocator keeps the source's memory until it is copied)
        for event in in_flight:
            event.synchronize()


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),))
