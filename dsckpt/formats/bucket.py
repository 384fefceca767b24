"""Objects under one URL prefix (``s3://``, ``gs://``, ``az://``; fsspec) as a ``formats.storage.Storage``.

``storage_for(url)`` chooses it.  Its names are relative to the prefix (``"step3/mp_rank_00_model_states.pt"``;
``""`` is the prefix itself) or URLs at or below it; its errors name the URL (``shown``).  What the protocol asks of a
backend, an object store answers so:
* reading: ``list``, ``size``, ``open`` (seekable, ranged GETs underneath), ``pread`` (one ranged GET; a short
  answer is a ``CorruptFileError``: the object is shorter than listed); ``advise`` does nothing; no kernel-side
  copies.  A command that reads a checkpoint in a bucket reads it through a local view this storage fills
  (``io.remote.RemoteStore``, built on it), so its plans keep local names and every storage is CRC-checked as it
  lands;
* publishing: an object is visible only once whole, but nothing is renamed in one step, so the staging is local:
  ``replace(staged, name)`` uploads a staged local file as object ``name`` (multipart for large ones),
  ``merge_into(staged_folder, name, order)`` each of a staged folder's files in ``order`` (what points at others
  last), ``write`` a small object in one request (``latest``), ``remove`` an object or every object under a name;
  ``flush`` does nothing (a completed upload is durable).  ``create`` streams one object (visible when closed).
Credentials and endpoints come from the clouds' own settings (``AWS_ENDPOINT_URL``, ``AWS_PROFILE``, the chain).
"""
from __future__ import annotations

import builtins
import os
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable

from ..errors import CheckpointNotFoundError, CorruptFileError, MissingExtraError, OutputError, UnreadableFileError
from ..progress import Phase, Progress
from .storage import Entry

EXTRAS = {"s3": ("s3fs", "s3"), "gs": ("gcsfs", "gcs"), "gcs": ("gcsfs", "gcs"), "az": ("adlfs", "azure"),
          "abfs": ("adlfs", "azure"), "abfss": ("adlfs", "azure")}
Name = str | os.PathLike[str]


def filesystem(url: str) -> tuple[Any, str]:
    """fsspec's filesystem for ``url`` and the path inside it; a missing backend is a ``MissingExtraError``."""
    scheme, rest = url.split("://", 1)
    scheme = scheme.lower()  # S3:// is s3:// (the cloud tools take either; fsspec knows only the lower case)
    package, extra = EXTRAS[scheme]
    try:
        from fsspec.core import url_to_fs

        fs, inside = url_to_fs(f"{scheme}://{rest}")
        return fs, str(inside)
    except ImportError:
        raise MissingExtraError(f"reading {scheme}:// needs fsspec and {package}, not installed",
                                hint=f"pip install 'dsckpt[{extra}]'", at=url) from None


def typed_error(url: str, exc: BaseException, doing: str) -> Exception:
    """The store's own exception as dsckpt's typed error, named by ``url``."""
    if isinstance(exc, FileNotFoundError):
        return CheckpointNotFoundError("no such object or prefix", at=url)
    if isinstance(exc, PermissionError):
        return UnreadableFileError(f"access denied while {doing}", hint="check the credentials the cloud's "
                                   "own tools use (AWS_PROFILE, the credential chain) and the bucket's policy", at=url)
    return UnreadableFileError(f"{doing} failed ({type(exc).__name__}: {str(exc)[:200]})", at=url)


class BucketStorage:
    """The objects under ``url`` (see the module docstring); one instance may be shared by threads."""

    kernel_copies = False  # no descriptor to copy from kernel-side

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.fs, self.root = filesystem(self.url)
        self.root = self.root.rstrip("/")

    def relative(self, name: Name) -> str:
        """``name`` relative to the prefix: given so, or as a URL at or below it."""
        text = os.fspath(name)
        if text == self.url or text.startswith(self.url + "/"):
            text = text[len(self.url):]
        rel = Path(text).as_posix().strip("/")
        return "" if rel == "." else rel

    def key(self, name: Name) -> str:
        """The store's own path of ``name``."""
        rel = self.relative(name)
        return f"{self.root}/{rel}" if rel else self.root

    def shown(self, name: Name) -> str:
        """``name`` as the user would type it: the URL."""
        rel = self.relative(name)
        return f"{self.url}/{rel}" if rel else self.url

    def _call(self, name: Name, doing: str, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except Exception as exc:  # the store's own errors, named by the URL the user typed
            raise typed_error(self.shown(name), exc, doing) from None

    # reading
    def list(self, prefix: Name = "") -> builtins.list[Entry]:
        """Objects directly below ``prefix`` and one level down, with their sizes (hidden names left out)."""
        found = self._call(prefix, "listing", lambda: self.fs.find(self.key(prefix), maxdepth=2, detail=True))
        start = self.key(prefix) + "/"
        out = []
        for name, info in sorted(found.items()):
            rel = name[len(start):] if name.startswith(start) else ""
            if info.get("type", "file") == "file" and rel and not any(p.startswith(".") for p in rel.split("/")):
                out.append(Entry(Path(prefix) / rel, int(info["size"])))
        return out

    def find(self, prefix: Name = "") -> builtins.list[str]:
        """The names of every object below ``prefix``, at any depth, hidden ones too (relative to ``prefix``)."""
        start = self.key(prefix) + "/"
        self.fs.invalidate_cache(self.key(prefix))  # (another process may have written since a listing was cached)
        found = self._call(prefix, "listing", lambda: self.fs.find(self.key(prefix)))
        return [name[len(start):] for name in found if name.startswith(start)]

    def starting_with(self, start: str) -> dict[str, int]:
        """Name -> size of the objects directly under the prefix whose names start with ``start``."""
        found = self._call("", "listing", lambda: self.fs.glob(f"{self.root}/{start}*", detail=True))
        return {name.rsplit("/", 1)[-1]: int(info["size"]) for name, info in found.items()
                if info.get("type", "file") == "file"}

    def size(self, name: Name) -> int:
        return int(self._call(name, "looking it up", lambda: self.fs.size(self.key(name))))

    def object_size(self, name: Name = "") -> int | None:
        """The size of object ``name``, None when it is a prefix (a folder) or nothing."""
        try:
            info = self.fs.info(self.key(name))
        except FileNotFoundError:
            return None
        except Exception as exc:
            raise typed_error(self.shown(name), exc, "looking it up") from None
        return int(info["size"]) if info.get("type") == "file" else None

    def exists(self, name: Name = "") -> bool:
        return bool(self._call(name, "looking at it", lambda: self.fs.exists(self.key(name))))

    def open(self, name: Name) -> BinaryIO:
        handle: BinaryIO = self._call(name, "opening", lambda: self.fs.open(self.key(name), "rb"))
        return handle

    def read(self, name: Name, start: int, end: int, exact: bool = True) -> bytes:
        """Bytes ``[start, end)`` of object ``name`` in one ranged GET (``exact``: all of them, or a typed error)."""
        data: bytes = self._call(name, f"reading bytes {start}-{end}",
                                 lambda: self.fs.cat_file(self.key(name), start=start, end=end))
        if exact and len(data) != end - start:
            raise CorruptFileError(f"{len(data):,} of {end - start:,} bytes at offset {start:,} (the object is "
                                   "shorter than listed: truncated or replaced while reading?)", at=self.shown(name))
        return data

    def pread(self, name: Name, nbytes: int, offset: int, into: Any = None) -> bytes | bytearray:
        data = self.read(name, offset, offset + nbytes)
        if into is None:
            return data
        memoryview(into).cast("B")[:nbytes] = data
        filled: bytearray = into
        return filled

    def advise(self, name: Name, ranges: Iterable[tuple[int, int]]) -> None:
        pass  # (a ranged GET reads what it asks for)

    # writing and publishing
    def create(self, name: Name) -> BinaryIO:
        """A stream writing object ``name``; the object appears when the stream is closed, not before."""
        handle: BinaryIO = self._call(name, "uploading", lambda: self.fs.open(self.key(name), "wb"))
        return handle

    def write(self, name: Name, data: bytes) -> None:
        """A small object in one request."""
        self._call(name, "writing", lambda: self.fs.pipe_file(self.key(name), data))

    def flush(self, name: Name, files: bool = True) -> None:
        pass  # (an object is durable once its upload completed)

    def replace(self, temp: Path, final: Name, **options: Any) -> None:
        """Publish the staged local file ``temp`` as object ``final`` (``options``: fsspec's, e.g. part sizes)."""
        try:
            self.fs.put_file(str(temp), self.key(final), **options)
        except FileNotFoundError:  # (the store's answer for a bucket that is not there)
            raise OutputError("uploading failed: no such bucket", at=self.shown(final)) from None
        except Exception as exc:
            raise typed_error(self.shown(final), exc, "uploading") from None

    def copy(self, source: Name, final: Name) -> None:
        """Object ``source`` copied to ``final`` by the store itself (no bytes through this host)."""
        self._call(final, "copying", lambda: self.fs.copy(self.key(source), self.key(final)))

    def merge_into(self, temp: Path, final: Name,
                   order: Callable[[builtins.list[str]], builtins.list[str]] = sorted) -> None:
        """Publish a staged local folder's files under ``final``, one by one in ``order`` (of their relative names)."""
        files = {p.relative_to(temp).as_posix(): p for p in temp.rglob("*") if p.is_file()}
        for rel in order(builtins.list(files)):
            self.replace(files[rel], Path(final) / rel)

    def remove(self, name: Name) -> None:
        """Delete object ``name``, or, where no object has that name, every object under it (absent is fine): an
        object's removal never reaches objects whose names merely continue it (``name/...``)."""
        try:
            if self.object_size(name) is not None:
                self.fs.rm_file(self.key(name))
            else:
                self.fs.rm(self.key(name), recursive=True)
        except FileNotFoundError:
            pass
        except Exception as exc:
            raise typed_error(self.shown(name), exc, "deleting") from None

    def fetch(self, name: Name, local: Path, progress: Progress | None = None) -> None:
        """Object ``name`` (or every object under it) copied whole to ``local``; ``progress``: a ``FETCH`` of its
        bytes, the total first, then each chunk as it lands."""
        folder = "/" if self._call(name, "looking it up", lambda: self.fs.isdir(self.key(name))) else ""
        callback = self._call(name, "listing", lambda: _counted(self.fs, self.key(name), progress))
        self._call(name, "fetching the source", lambda: self.fs.get(self.key(name) + folder, str(local) + folder,
                                                                    recursive=True, callback=callback))

    def close(self) -> None:
        pass

    def __enter__(self) -> "BucketStorage":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _counted(fs: Any, inside: str, progress: Progress | None) -> Any:
    """An fsspec callback for ``fs.get`` of ``inside`` telling ``progress`` of the bytes (fsspec counts files; each
    file's own callback counts bytes)."""
    from fsspec.callbacks import Callback, NoOpCallback

    if progress is None:
        return NoOpCallback()
    advance = progress.advance

    class Chunks(Callback):  # type: ignore[misc]  # one file's
        def relative_update(self, inc: int = 1) -> None:
            advance(inc)

    class Files(Callback):  # type: ignore[misc]
        def relative_update(self, inc: int = 1) -> None:
            pass  # (a file done: its bytes were told)

        def branched(self, path_1: str, path_2: str, **kwargs: Any) -> Callback:
            return Chunks()

    progress.begin(Phase.FETCH, sum(info["size"] for info in fs.find(inside, detail=True).values()))
    return Files()
