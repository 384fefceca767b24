"""Where a background save's files wait until every rank has written its own, and where they go then.

A temp keeps the final file name (``torch.save`` names its zip's entries after it): ``<tag>/.dsckpt-saving/<name>``,
so the file published is byte for byte what a direct save would have written.  A ``SaveTarget`` publishes a tag;
``Targets.for_path(save_dir)`` chooses it once from the path the trainer passed to ``save_checkpoint``:
* ``LocalTarget``: a folder - each temp renamed into the tag folder, flushed; ``latest`` replaced the same way, last;
* ``BucketTarget``: ``s3://``, ``gs://``, ``az://`` (DeepSpeed's ``torch.save`` cannot write there) - DeepSpeed
  saves into a local staging folder; each temp is uploaded as the tag's object (visible only once whole), then
  removed; ``latest`` is an object written last.
Order of calls, by the writer thread of every rank, once every rank's temps are durable and CRC-checked:
``publish(files, leader)`` (each rank its own files; the leader, rank 0, also what DeepSpeed wrote beside the tags),
all ranks agree, then rank 0 ``publish_latest(tag)``; on a failure anywhere, ``discard(files)`` on every rank.
"""
from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Protocol

from ..formats.backends import storage_for
from ..formats.bucket import BucketStorage
from ..io.output import fsync_path
from ..io.writeback import following
from ..zero.layout import LATEST_FILE

TEMP_FOLDER = ".dsckpt-saving"
TEMP_SUFFIX = ".dsckpt-tmp"


def temp_for(path: str) -> str:
    return os.path.join(os.path.dirname(path), TEMP_FOLDER, os.path.basename(path))


def write_temp(write: Callable[[Any, str], None], state: Any, path: str, follow: bool = True) -> Path:
    """``write(state, temp)`` into ``path``'s temp, then flushed; ``follow``: a writer that does not start the
    disk on what it wrote gets a thread that does as the file grows (``io.writeback.following``)."""
    temp = Path(temp_for(path))
    temp.parent.mkdir(parents=True, exist_ok=True)
    with following(temp) if follow else contextlib.nullcontext():
        write(state, str(temp))
    fsync_path(temp)
    return temp


def remove_temps(paths: list[str]) -> None:
    for path in paths:
        try:
            os.remove(temp_for(path))
        except FileNotFoundError:
            pass
    for folder in {os.path.dirname(temp_for(p)) for p in paths}:
        try:
            os.rmdir(folder)
        except OSError:
            pass  # another rank's temps are still in it; the last rank removes it


def publish_latest(save_dir: Path, tag: str) -> None:
    """`latest` replaced in one step, flushed with its folder: what makes a tag the one a resume picks."""
    temp = save_dir / f".{LATEST_FILE}{TEMP_SUFFIX}"
    temp.write_text(tag)
    fsync_path(temp)
    os.replace(temp, save_dir / LATEST_FILE)
    fsync_path(save_dir, files=False)


class SaveTarget(Protocol):
    name: str  # what the trainer passed: messages name it
    local: str  # the folder DeepSpeed saves into

    def publish(self, files: list[str], leader: bool) -> None: ...

    def publish_latest(self, tag: str) -> None: ...

    def discard(self, files: list[str]) -> None: ...

    def latest(self) -> str | None:
        """The tag `latest` names now (None: there is none)."""

    def close(self) -> None: ...


class LocalTarget:
    def __init__(self, save_dir: str):
        self.name = self.local = str(save_dir)

    def publish(self, files: list[str], leader: bool) -> None:
        for path in files:
            os.replace(temp_for(path), path)
        remove_temps(files)
        for folder in sorted({os.path.dirname(p) for p in files}):
            fsync_path(Path(folder), files=False)

    def publish_latest(self, tag: str) -> None:
        publish_latest(Path(self.local), tag)

    def discard(self, files: list[str]) -> None:
        pass  # the temps are all there is (removed by the caller)

    def latest(self) -> str | None:
        path = Path(self.local) / LATEST_FILE
        return path.read_text().strip() if path.exists() else None

    def close(self) -> None:
        pass


class BucketTarget:
    def __init__(self, bucket: BucketStorage):
        from ..io.remote import scratch_folder

        self.bucket = bucket
        self.name = self.bucket.url  # (what messages name)
        self.scratch = scratch_folder(".dsckpt-save-")
        self.local = str(self.scratch / self.bucket.root.rsplit("/", 1)[-1])
        os.makedirs(self.local, exist_ok=True)
        self.uploaded: list[str] = []

    def _put(self, local: str, path: str) -> None:
        name = Path(path).relative_to(self.local).as_posix()  # (the object's name below the URL)
        self.bucket.replace(Path(local), name)
        self.uploaded.append(name)

    def publish(self, files: list[str], leader: bool) -> None:
        self.uploaded = []
        for path in files:
            self._put(temp_for(path), path)
        remove_temps(files)
        for path in files:
            with_tag = os.path.dirname(path)
            if os.path.isdir(with_tag) and not os.listdir(with_tag):
                os.rmdir(with_tag)
        if leader:  # what DeepSpeed wrote beside the tags itself (its zero_to_fp32.py)
            for entry in os.scandir(self.local):
                if entry.is_file() and entry.name != LATEST_FILE and not entry.name.startswith("."):
                    self._put(entry.path, entry.path)
                    os.remove(entry.path)

    def publish_latest(self, tag: str) -> None:
        self.bucket.write(LATEST_FILE, tag.encode())

    def discard(self, files: list[str]) -> None:
        for name in self.uploaded:  # best effort: the failure that brought us here is the one to report
            with contextlib.suppress(Exception):
                self.bucket.remove(name)
        self.uploaded = []

    def latest(self) -> str | None:
        try:
            size = self.bucket.object_size(LATEST_FILE)
            return None if size is None else self.bucket.read(LATEST_FILE, 0, size).decode().strip()
        except Exception:  # (no bucket, no access: no tag to fall back on)
            return None

    def close(self) -> None:
        shutil.rmtree(self.scratch, ignore_errors=True)


class Targets:
    """The target of each ``save_checkpoint(save_dir)``, chosen from the path; a bucket's (its staging folder) kept
    from save to save, removed by ``close``."""

    def __init__(self) -> None:
        self.buckets: dict[str, BucketTarget] = {}

    def for_path(self, save_dir: str | os.PathLike[str]) -> LocalTarget | BucketTarget:
        storage = storage_for(save_dir)
        if not isinstance(storage, BucketStorage):
            return LocalTarget(str(save_dir))
        url = storage.url
        if url not in self.buckets:
            self.buckets[url] = BucketTarget(storage)
        return self.buckets[url]

    def close(self) -> None:
        for bucket in self.buckets.values():
            bucket.close()
