"""How a tag becomes visible: staged whole in a hidden sibling, published by one rename, ``latest`` last.

The one commit protocol of every save dsckpt makes (the background engine's and the runtime's blocking save):

1. ``prepare`` (rank 0, before any rank writes): leftovers of dead processes' saves into the folder are removed
   (``.<tag>.dsckpt-tmp-<pid>-<id>``, a kill -9's) and so is this run's own failed attempt at the same tag;
2. every rank writes its files into the staging folder ``staging_name(tag, owner)`` beside the tags (``owner``:
   rank 0's pid and a token, the same name on every rank), each file flushed (``write_temp``);
3. ``persist``: every rank, its files written: nothing more for a folder; a bucket's rank uploads its files as
   hidden objects under the staging name;
4. once every rank's files are durable (the ranks agree), ``open_publish`` on every rank: in a bucket rank 0 writes
   the marker ``<tag>/dsckpt-publishing.json`` naming the staging (readers treat a tag holding it as incomplete);
5. after an agreement ``publish`` on every rank: rank 0 renames the folder to ``<tag>`` (flushed first; a tag saved
   again is swapped in whole, ``LocalStorage.swap_in``, so no reader ever sees it mixed or missing) - in a bucket
   each rank has the store copy its objects to the tag's names, then removes the hidden ones;
6. after an agreement ``close_publish`` on every rank: a rank whose staging folder is still there (storage rank 0
   does not see) renames its own; in a bucket rank 0 removes the marker;
7. after another agreement rank 0 replaces ``latest`` (``publish_latest``).
A failure before 4: every rank ``discard``s its files and rank 0 the folder; ``latest`` and every tag are as they
were (in a bucket too: nothing of a reused tag is touched before every rank's objects are whole).  A bucket's publish
cut after 4 (a bucket has no rename: the copies into a reused tag can be cut between two objects) keeps its staged
objects and marker: rank 0's next ``persist`` in any process finishes the copies from them (roll forward), since
every object under the staging name was whole before the first copy and each is removed only once copied.
``Targets.for_path(save_dir)`` chooses the target once from the path the trainer passed: ``LocalTarget`` for a
folder, ``BucketTarget`` for ``s3://``, ``gs://``, ``az://`` (DeepSpeed saves into a local scratch folder).
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Protocol

from ..errors import DsckptError, TagError
from ..formats.backends import storage_for
from ..formats.bucket import BucketStorage
from ..formats.storage import TEMP_MARK
from ..io.output import LOCAL, dead_temps, fsync_path, remove_path
from ..io.writeback import following
from ..zero.layout import LATEST_FILE, PUBLISHING

def require_plain_tag(tag: str, save_dir: object) -> str:
    """``tag`` when it names one visible folder beside `latest`, what a save publishes by one rename and every
    reader lists; else a ``TagError`` before anything is written."""
    if tag in ("", ".", "..") or tag.startswith(".") or "/" in tag or "\\" in tag or "\0" in tag:
        raise TagError(f"tag {tag!r} is not one folder name: a tag is published as one folder beside `latest` "
                       "(no path separators, not hidden)", hint=f"e.g. tag={tag.strip('.').replace('/', '_')!r}",
                       at=save_dir)
    return tag


def staging_name(tag: str, owner: str) -> str:
    """The hidden sibling a tag is written into (``owner``: ``<pid>-<token>`` of rank 0)."""
    return f".{tag}{TEMP_MARK}{owner}"


def new_owner() -> str:
    return f"{os.getpid()}-{os.urandom(4).hex()}"


def staged(path: str, tag_dir: str, staging: str) -> str:
    """Where ``path`` (a file DeepSpeed names inside the tag folder) is written until the tag is published."""
    return os.path.join(staging, os.path.relpath(path, tag_dir))


def write_temp(write: Callable[[Any, str], None], state: Any, temp: str, follow: bool = True) -> None:
    """``write(state, temp)``, then flushed; ``follow``: a writer that does not start the disk on what it wrote
    gets a thread that does as the file grows (``io.writeback.following``)."""
    Path(temp).parent.mkdir(parents=True, exist_ok=True)
    with following(Path(temp)) if follow else contextlib.nullcontext():
        write(state, temp)
    fsync_path(Path(temp))


def remove_files(paths: list[str]) -> None:
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def publish_latest(save_dir: Path, tag: str) -> None:
    """`latest` replaced in one step, flushed with its folder: what makes a tag the one a resume picks."""
    temp = save_dir / f".{LATEST_FILE}{TEMP_MARK}{new_owner()}"
    temp.write_text(tag)
    fsync_path(temp)
    os.replace(temp, save_dir / LATEST_FILE)
    fsync_path(save_dir, files=False)


def publish_tag(save_dir: Path, staging: Path, tag: str) -> None:
    """The staged tag folder flushed and renamed into place (swapped whole over a tag of the same name)."""
    fsync_path(staging)  # every file's data, then the folder's entries, before the rename makes them a tag
    LOCAL.swap_in(staging, save_dir / tag)
    fsync_path(save_dir, files=False)  # the renamed tag folder is durable before `latest` names it


class SaveTarget(Protocol):
    """Where a tag goes.  Calls: ``prepare`` (rank 0, in the save call, before the ranks write); then by the writer
    thread of each rank ``persist`` (its files written), and each after an agreement: ``open_publish``,
    ``publish``, ``close_publish`` (every rank), ``publish_latest`` (rank 0); or ``discard`` on every rank when any
    failed."""
    name: str  # what the trainer passed: messages name it
    local: str  # the folder DeepSpeed saves into

    def prepare(self, tag: str, staging: str) -> None: ...

    def persist(self, staging: str, files: list[str]) -> None: ...

    def open_publish(self, tag: str, staging: str, leader: bool) -> None: ...

    def publish(self, tag: str, staging: str, files: list[str], leader: bool) -> None: ...

    def close_publish(self, tag: str, staging: str, leader: bool) -> None: ...

    def publish_latest(self, tag: str) -> None: ...

    def discard(self, tag: str, staging: str, files: list[str], leader: bool) -> str | None:
        """Remove what the failed save of ``tag`` staged; what of it stays visible (None: nothing)."""

    def left_if_stopped(self) -> str | None:
        """What stays visible if the process stops now, mid-publish (None: nothing of the save in flight)."""

    def latest(self) -> str | None:
        """The tag `latest` names now (None: there is none)."""

    def close(self) -> None: ...


class LocalTarget:
    def __init__(self, save_dir: str):
        self.name = self.local = str(save_dir)

    def prepare(self, tag: str, staging: str) -> None:
        for path in dead_temps(Path(self.local)):  # saves of processes that are gone (kill -9)
            remove_path(path)
        remove_path(Path(self.local) / staging)  # this run's own earlier attempt at the tag, failed

    def persist(self, staging: str, files: list[str]) -> None:
        pass  # (each file flushed as written)

    def open_publish(self, tag: str, staging: str, leader: bool) -> None:
        pass  # (one rename publishes: nothing to mark)

    def publish(self, tag: str, staging: str, files: list[str], leader: bool) -> None:
        if leader:
            publish_tag(Path(self.local), Path(self.local) / staging, tag)

    def close_publish(self, tag: str, staging: str, leader: bool) -> None:
        folder = Path(self.local) / staging
        if not leader and folder.is_dir():  # (still there only on storage rank 0 does not see)
            publish_tag(Path(self.local), folder, tag)

    def publish_latest(self, tag: str) -> None:
        publish_latest(Path(self.local), tag)

    def discard(self, tag: str, staging: str, files: list[str], leader: bool) -> str | None:
        remove_files(files)
        if leader:
            remove_path(Path(self.local) / staging)
        return None

    def left_if_stopped(self) -> str | None:
        return None  # (one rename publishes the whole tag)

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
        self.marked: str | None = None  # rank 0: the staging its marker in the tag names
        self.opened: str | None = None  # the staging whose copies began (the ranks agreed on the marker)
        self.cut: set[str] = set()  # this process's publishes that were cut: rolled forward by the next save
        self.recover = True  # rank 0's first persist looks for what other processes left
        self.leader = False

    def prepare(self, tag: str, staging: str) -> None:
        remove_path(Path(self.local) / staging)
        self.leader = True  # (only rank 0 prepares: its persist rolls cut publishes forward, off the save call)

    def roll_forward(self) -> None:
        """Publishes that were cut, finished from their staged objects; the staged objects of saves cut before
        their publish began (a killed process's) removed.  This process's saves in flight are left alone."""
        names = self.bucket.find()
        cut = set(self.cut)
        for marker in [n for n in names if n.count("/") == 1 and n.endswith(f"/{PUBLISHING}")]:
            tag = marker.split("/")[0]
            try:
                staging = str(json.loads(self.bucket.read(marker, 0, self.bucket.size(marker)))["staging"])
            except (ValueError, KeyError, TypeError):
                continue  # (not a marker dsckpt wrote: the tag stays refused, nothing is guessed)
            if TEMP_MARK not in staging or "/" in staging:
                continue  # (likewise)
            if self._mine(staging) and staging not in cut:
                continue  # (being published now, by this process's writer)
            for rel in self.bucket.find(staging):
                self.bucket.copy(f"{staging}/{rel}", f"{tag}/{rel}")
                self.bucket.remove(f"{staging}/{rel}")
            self.bucket.remove(marker)
            self.cut.discard(staging)
        for staging in {n.split("/")[0] for n in names if n.startswith(".") and TEMP_MARK in n.split("/")[0]}:
            if not self._mine(staging):
                self.bucket.remove(staging)

    @staticmethod
    def _mine(staging: str) -> bool:
        return staging.rsplit(TEMP_MARK, 1)[1].startswith(f"{os.getpid()}-")

    def _name(self, path: str, staging: str, under: str) -> str:
        return f"{under}/{Path(os.path.relpath(path, os.path.join(self.local, staging))).as_posix()}"

    def persist(self, staging: str, files: list[str]) -> None:
        if self.leader and (self.recover or self.cut):
            try:
                self.roll_forward()
                self.recover = False
            except DsckptError:  # (no bucket, no access: this save's upload fails too, and says so)
                pass
        self.uploaded = []
        for path in files:  # (hidden objects: readers leave them out, nothing of the tag changes yet)
            name = self._name(path, staging, staging)
            self.bucket.replace(Path(path), name)
            self.uploaded.append(name)
        remove_files(files)

    def open_publish(self, tag: str, staging: str, leader: bool) -> None:
        if leader:
            self.bucket.write(f"{tag}/{PUBLISHING}", json.dumps({"staging": staging}).encode())
            self.marked = staging

    def publish(self, tag: str, staging: str, files: list[str], leader: bool) -> None:
        self.opened = staging
        for name in self.uploaded:
            self.bucket.copy(name, f"{tag}/{name.split('/', 1)[1]}")
        for name in self.uploaded:
            self.bucket.remove(name)
        self.uploaded = []
        shutil.rmtree(os.path.join(self.local, staging), ignore_errors=True)
        if leader:  # what DeepSpeed wrote beside the tags itself (its zero_to_fp32.py)
            for entry in os.scandir(self.local):
                if entry.is_file() and entry.name != LATEST_FILE and not entry.name.startswith("."):
                    self.bucket.replace(Path(entry.path), entry.name)
                    os.remove(entry.path)

    def close_publish(self, tag: str, staging: str, leader: bool) -> None:
        if leader:
            self.bucket.remove(f"{tag}/{PUBLISHING}")
        self.marked = self.opened = None

    def publish_latest(self, tag: str) -> None:
        self.bucket.write(LATEST_FILE, tag.encode())

    def discard(self, tag: str, staging: str, files: list[str], leader: bool) -> str | None:
        remove_files(files)
        shutil.rmtree(os.path.join(self.local, staging), ignore_errors=True)
        self.uploaded = []
        opened, marked, self.opened, self.marked = self.opened, self.marked, None, None
        if opened == staging:  # copies may have begun: the staged objects finish them (roll_forward)
            self.cut.add(staging)
            return self._marked_note()
        with contextlib.suppress(Exception):  # best effort: the failure that brought us here is the one to report
            self.bucket.remove(staging)  # (every rank's hidden objects of the tag; the tag itself is untouched)
            if marked == staging:  # (marked, but no copy began: the tag is as it was)
                self.bucket.remove(f"{tag}/{PUBLISHING}")
        return None

    def left_if_stopped(self) -> str | None:
        return self._marked_note() if self.marked or self.opened else None

    def _marked_note(self) -> str:
        return (f"its publish into the bucket had begun: the tag is marked incomplete ({PUBLISHING}) until the next "
                f"save into {self.name} finishes it from the staged objects")

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
