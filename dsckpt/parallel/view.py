"""What each process sees of a checkpoint, and a view in which every process sees all of it.

Hosts with node-local disks see different files at the same path (each host its own ranks' files; `latest`
only on rank 0's). ``build_view(group, ckpt, tag, scratch, trust)``:
1. survey: every process lists the regular files it sees in CKPT and one folder down (the tag folders), with
   sizes, and what is wrong where (``parallel.survey``);
2. owners: a file's owner is the lowest process that sees it; all that see it must agree on its size;
3. the tag: ``tag``, else what `latest` says, else the only tag folder (``survey.choose_tag``, as
   ``zero.layout.discover``); a problem is refused only where one process reading alone meets it (``survey.met``:
   a link in another tag folder is no concern of this run);
4. the view: a folder in ``scratch`` laid out as CKPT (its top-level files and the tag folder).  A file this
   process sees is a symlink to it (a copy, when small: `latest`, configs); any other is a sparse file of its size holding the owner's metadata bytes
   (a torch zip: everything but its storages' data; a small file: all of it).
Every process then opens the same checkpoint model from its view (``View.open``), so every plan is the same
everywhere; the storage bytes a process will read from a sparse file are sent to it before it writes
(``transfer``).  One process sees everything: its view is CKPT itself, opened as given.
"""
from __future__ import annotations

import contextlib
import enum
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from ..errors import CorruptFileError, DistributedError, DsckptError, OutputError, TagError
from ..formats.positional import pwrite_all
from ..formats.torchzip import StorageIndex, StorageLocation, is_torch_zip
from ..formats.backends import storage_for
from ..formats.storage import SAME_NAMES, Alias, LocalStorage
from ..io.skeleton import SMALL, skeleton
from ..limits import limit
from ..saves_in_flight import settle
from ..zero import layout as L
from ..zero.offloaded import OFFLOADED_DIR
from ..zero.reader import Checkpoint, open_checkpoint
from .group import Group
from .survey import choose_tag, met, refuse, survey

if TYPE_CHECKING:
    from ..io.remote import RemoteStore

SMALL_FILE = SMALL  # top-level files up to this size travel whole (latest, configs, trainer and RNG state)


class Seen(enum.Enum):
    """How a process sees the checkpoint it reads."""
    DIRECT = "direct"  # the checkpoint itself (one process)
    GATHERED = "gathered"  # a scratch folder: this process's files linked, others' sparse, their bytes sent by owners
    BUCKET = "bucket"  # a scratch folder of sparse files, their bytes fetched from object storage as plans need them


@dataclass
class View:
    root: Path  # open_checkpoint(root, tag) on every process
    tag: str | None  # None: CKPT is a tag folder itself (or, seen directly, what `latest` names)
    scratch: Path | None  # the folder the view is made in (None: DIRECT)
    real: Path  # CKPT as this process sees it
    owners: dict[str, int] = field(default_factory=dict)  # relative path -> the process that reads it
    local: set[str] = field(default_factory=set)  # relative paths this process sees itself
    rank: int = 0  # this process
    store: "RemoteStore | None" = None  # BUCKET: every byte comes from there (checked as it lands)
    shared: bool = False  # every process sees every file of the view itself (one host, or a shared file system)

    @property
    def seen(self) -> Seen:
        return Seen.BUCKET if self.store is not None else Seen.DIRECT if self.scratch is None else Seen.GATHERED

    @property
    def bucket(self) -> "RemoteStore":
        """The store of a BUCKET view."""
        if self.store is None:
            raise TypeError(f"{self.real}: a {self.seen.value} view has no store")
        return self.store

    def owns(self, path: Path) -> bool:
        """This process is the one that reads ``path`` (a view path) for everyone (a store's bytes are checked as
        they arrive, not read again)."""
        if self.seen is Seen.BUCKET:
            return False
        return self.direct or self.owners.get(self.rel(path) or "") == self.rank

    @property
    def direct(self) -> bool:
        return self.seen is Seen.DIRECT

    def open(self, trust: bool) -> Checkpoint:
        """The checkpoint model, the same on every process.  Links out of CKPT are refused unless ``trust``: here
        for a direct view, by each host's survey otherwise."""
        with self.real_names():
            ckpt = open_checkpoint(self.root, self.tag)
        if self.direct and not trust:
            L.require_contained(ckpt.layout)
        return ckpt

    def path(self, rel: str) -> Path:
        return self.root / rel

    def rel(self, path: Path) -> str | None:
        """A view path's relative name, or None for a path outside the view."""
        try:
            return Path(path).relative_to(self.root).as_posix()
        except ValueError:
            return None

    def real_path(self, path: Path) -> Path:
        """A path of the view as this process sees it in CKPT (a tag folder's checkpoint root: CKPT's parent)."""
        if self.seen is not Seen.GATHERED:
            return Path(path)
        return self.real.parent / Path(path).relative_to(self.root.parent)

    def close(self) -> None:
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)

    @property
    def alias(self) -> Alias:
        """The view's paths as the user named them: its root as CKPT (or the URL), its scratch folder as CKPT's
        parent (a tag folder's checkpoint root)."""
        if self.direct:
            return SAME_NAMES
        given = self.bucket.url if self.seen is Seen.BUCKET else str(self.real)
        pairs = [(str(self.root), given)]
        if self.scratch is not None and self.scratch != self.root:
            parent = given.rstrip("/").rsplit("/", 1)[0] if self.seen is Seen.BUCKET else str(self.real.parent)
            pairs.append((str(self.scratch), parent))
        return Alias(tuple(pairs))

    @contextlib.contextmanager
    def real_names(self) -> Iterator[None]:
        """An error met while reading the view names the file as the user gave it, not its scratch copy."""
        try:
            yield
        except DsckptError as exc:
            raise exc.named(self.alias)


def _read_latest(root: Path) -> str | tuple[str, str | None] | None:
    """``latest`` read as one process reads it (bounded, checked), or its refusal as (message, hint)."""
    try:
        return L.read_latest(root)
    except TagError as exc:
        return (str(exc), exc.hint)


def _skeleton(path: Path, size: int) -> list[tuple[int, bytes]]:
    """The bytes of ``path`` every process needs to read its metadata (``io.skeleton``: the rule a bucket's view
    follows too)."""
    with open(path, "rb") as fh:
        return skeleton(lambda spans: [os.pread(fh.fileno(), end - start, start) for start, end in spans], size)


def _owned_skeleton(path: Path, size: int) -> list[tuple[int, bytes]] | str:
    try:
        return _skeleton(path, size)
    except OSError as exc:
        return f"{path}: reading failed ({exc.strerror or exc})"


def build_view(group: Group, ckpt: str | os.PathLike[str], tag: str | None, scratch_parent: Path,
               trust: bool) -> View:
    """The view of CKPT (see the module docstring); a URL's: ``remote_view``."""
    settle()  # a save of this process still in flight: read once it has finished (a survey would see its temps)
    if not isinstance(storage_for(ckpt), LocalStorage):
        return group.step(lambda: remote_view(group, str(ckpt), tag, Path(scratch_parent)))
    if group.size == 1:
        return View(Path(ckpt), tag, None, Path(ckpt))
    ckpt, scratch_parent = Path(ckpt), Path(scratch_parent).absolute()  # (CKPT as typed: messages name it so)
    surveyed = group.gather(survey(ckpt, trust))
    owners: dict[str, int] = {}
    sizes: dict[str, int] = {}
    for rank, (seen, _) in enumerate(surveyed):
        for rel, size in seen.items():
            if rel in sizes and sizes[rel] != size:
                raise DistributedError(f"{sizes[rel]:,} bytes on process {owners[rel]} but {size:,} on "
                                       f"process {rank}: the hosts hold different checkpoints at this path", at=ckpt / rel)
            owners.setdefault(rel, rank)
            sizes[rel] = size
    if not sizes and not any(problems for _, problems in surveyed):
        raise DistributedError("no process sees any file there", hint="run the command with the "
                               "checkpoint's path as each host sees it", at=ckpt)
    latest = owners.get(L.LATEST_FILE)
    text = group.broadcast(_read_latest(ckpt) if group.rank == latest else None, latest) if latest is not None else None
    if isinstance(text, tuple):  # the owner's read refused it (too long, a link out, not text): all say so
        raise TagError(*text)
    problems = sorted(((rel, p) for _, found in surveyed for rel, p in found.items()), key=lambda item: item[0])
    refuse([p for rel, p in problems if "/" not in rel])  # (a top-level file: met before the tag is chosen)
    chosen = choose_tag(sizes, tag, text, ckpt)
    refuse([p for rel, p in problems if met(rel, chosen)])
    wanted = sorted(rel for rel in sizes if "/" not in rel or (chosen is not None and rel.split("/")[0] == chosen))
    local = set(surveyed[group.rank][0])
    payloads: dict[str, list[tuple[int, bytes]]] = {}
    for rel in wanted:  # the owner of a file some process lacks sends its metadata bytes to all
        if any(rel not in seen for seen, _ in surveyed):
            owner = owners[rel]
            payload = group.broadcast(_owned_skeleton(ckpt / rel, sizes[rel]) if group.rank == owner else None, owner)
            if isinstance(payload, str):  # the owner could not read it: everyone stops here
                raise DistributedError(f"{payload} [process {owner}]")
            if rel not in local:
                payloads[rel] = payload
    name = ckpt.absolute().name  # (CKPT typed as "." has no name of its own)
    scratch = scratch_parent / f".{name}.dsckpt-view-{group.rank}-{os.urandom(4).hex()}"
    shared = all(set(wanted) <= set(seen) for seen, _ in surveyed)
    view = View(scratch / name, chosen, scratch, ckpt, {rel: owners[rel] for rel in wanted}, local & set(wanted),
                group.rank, shared=shared)
    error = None
    try:  # this process's own files: it alone may fail here, so all agree before going on
        (view.root / chosen if chosen else view.root).mkdir(parents=True)
        for rel in wanted:
            view.path(rel).parent.mkdir(parents=True, exist_ok=True)  # (offloaded_tensors/rankNN/ below the tag)
            if rel in local and sizes[rel] <= SMALL_FILE:  # a copy: `latest` and companions are read as files
                shutil.copyfile(ckpt / rel, view.path(rel))
            elif rel in local:
                os.symlink((ckpt / rel).resolve(), view.path(rel))
            else:
                with open(view.path(rel), "wb") as fh:
                    fh.truncate(sizes[rel])
                    for offset, data in payloads[rel]:
                        pwrite_all(fh.fileno(), data, offset)
    except OSError as exc:
        error = OutputError(f"writing failed ({exc.strerror or exc}) - this process's view of the "
                            "checkpoint, made beside OUT; nothing was left there", at=scratch)
    try:
        group.agree(error)
    except BaseException:
        view.close()
        raise
    return view


class _Url(str):
    """A URL that joins like a path in messages (``url / "latest"``)."""

    def __truediv__(self, name: str) -> "_Url":
        return _Url(f"{self.rstrip('/')}/{name}")


def remote_view(group: Group, url: str, tag: str | None, scratch_parent: Path, every_tag: bool = False) -> View:
    """A checkpoint in object storage as a view (``io.remote``, steps 1-2): each process lists and fetches the
    skeleton itself; the storages come when a command asks for them (``transfer.fetch``).  ``every_tag``: the
    objects of every tag folder, not only the chosen one's."""
    from ..io.remote import RemoteStore  # (a bucket's modules, imported for one only)

    store = RemoteStore(url)
    sizes = store.objects()
    if sizes.get(L.LATEST_FILE, 0) > limit("MAX_LATEST_BYTES"):
        raise TagError(f"longer than {limit('MAX_LATEST_BYTES')} bytes; expected one tag name",
                       at=store.shown(L.LATEST_FILE))
    latest = store.read(L.LATEST_FILE, 0, sizes[L.LATEST_FILE]).decode("utf-8", "replace") \
        if L.LATEST_FILE in sizes else None
    no_ranks = not any(L.RANK_FILE_RE.match(rel.rsplit("/", 1)[-1]) for rel in sizes)  # a weights folder
    chosen = None if every_tag or no_ranks else choose_tag(sizes, tag, latest, _Url(store.url))
    if chosen is not None and any(rel.startswith(f"{chosen}/zero_pp_rank_") for rel in sizes):  # ZeRO-3: NVMe too?
        sizes.update({e.name.as_posix(): e.size for e in store.list(f"{chosen}/{OFFLOADED_DIR}")})
    wanted = sorted(rel for rel in sizes if "/" not in rel or every_tag or
                    (chosen is not None and rel.split("/")[0] == chosen))
    name = store.url.rsplit("/", 1)[-1]
    scratch = scratch_parent / f".{name}.dsckpt-view-{group.rank}-{os.urandom(4).hex()}"
    view = View(scratch / name, chosen, scratch, scratch / name, {rel: group.rank for rel in wanted}, set(),
                group.rank, store)
    others = [rel for rel in sizes if chosen is not None and "/" in rel and rel.split("/")[0] != chosen
              and L.RANK_FILE_RE.match(rel.split("/")[1])]
    try:
        (view.root / chosen if chosen else view.root).mkdir(parents=True)
        write_skeletons(store, view, {rel: sizes[rel] for rel in wanted})
        for rel in others:  # the other tags by name only (empty files): `latest` may name one, `inspect` lists them
            view.path(rel).parent.mkdir(parents=True, exist_ok=True)
            view.path(rel).touch()
    except OSError as exc:
        view.close()
        raise OutputError(f"writing failed ({exc.strerror or exc}) - the local view of {url}", at=scratch) from None
    except BaseException:
        view.close()
        raise
    return view


def write_skeletons(store: RemoteStore, view: View, sizes: dict[str, int]) -> None:
    """Each object as a sparse file of its size holding its skeleton (every object's at once: a few round trips)."""
    names = list(sizes)
    with ThreadPoolExecutor(8) as pool:
        skeletons = list(pool.map(lambda rel: store.skeleton(rel, sizes[rel]), names))
    for rel, skeleton in zip(names, skeletons):
        view.path(rel).parent.mkdir(parents=True, exist_ok=True)
        with open(view.path(rel), "wb") as fh:
            fh.truncate(sizes[rel])
            for offset, data in skeleton:
                pwrite_all(fh.fileno(), data, offset)


def zip_storages(path: Path) -> list[StorageLocation]:
    """Where the storages of a torch zip lie (none for any other file, or one its reader will refuse)."""
    try:
        return list(StorageIndex(path).storages.values()) if is_torch_zip(path) else []
    except CorruptFileError:
        return []
