"""An output in object storage: staged locally, then uploaded (``io.remote`` reads; this writes).

``Upload`` (a command's OUT is a URL): the command publishes into a local staging folder as it would locally (its
safetensors files and zips there are placeholders of uploads streamed as they were written: ``io.stream``); then
each file is uploaded (fsspec ``put_file``: multipart for large ones) or its streamed upload completed - an object
is visible only once complete - the files a reader looks for (``latest``, ``latest_universal``, ``*.index.json``,
DCP's ``.metadata``, a single file after its sidecars) last; a failed or interrupted upload deletes what this run
uploaded; with ``--force`` the shards an existing OUT's index named and the new output does not write again are
deleted once it is up, anything else there stays.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from ..errors import OutputError
from ..formats.safetensors_file import SHADOWING_WEIGHTS
from .output import publish_order
from ..formats.bucket import BucketStorage
from .remote import scratch_folder
from .skeleton import SMALL
from .multipart import PARTS_IN_FLIGHT, Streams, chunksize, signals_deferred

def upload_order(names: list[str], last: str | None = None) -> list[str]:
    """``io.output.publish_order``, the local commit's, then ``last`` (a single-file OUT after its sidecars): what
    a reader looks for comes last."""
    return sorted(publish_order(names), key=lambda name: name == last)


class Upload:
    """A command's OUT in a bucket: staged locally under ``local``, uploaded by ``publish``."""

    def __init__(self, url: str, force: bool):
        self.url = url.rstrip("/")
        self.bucket = BucketStorage(self.url)  # OUT itself: its name "", what is beside it (sidecars) in `parent`
        self.parent = BucketStorage(self.url.rsplit("/", 1)[0])
        self.force = force
        self.scratch = scratch_folder(".dsckpt-upload-")
        self.local = self.scratch / Path(self.bucket.root).name
        self.uploaded: list[str] = []
        self.streams: Streams | None = None  # io.multipart.Streams: the files already uploaded as parts, completed in order here
        self.superseded: set[str] = set()
        self.shadowing: list[str] = []  # weights files in an existing OUT that a loader would read before an index
        # s3fs: parts as streamed ones, PARTS_IN_FLIGHT at once (its defaults hold up to 500 MiB in memory)
        self.part_options = {"chunksize": chunksize(), "max_concurrency": PARTS_IN_FLIGHT} \
            if url.lower().startswith("s3://") else {}

    def check(self) -> None:
        """Refuse an existing OUT unless ``force`` (before any work, as locally)."""
        exists = self.bucket.exists()
        if exists and not self.force:
            raise OutputError("already exists", hint="--force replaces what dsckpt writes there", at=self.url)
        if exists:
            self.superseded = self._indexed_shards()
            self.shadowing = [name for name in SHADOWING_WEIGHTS if self.bucket.exists(name)]

    def _indexed_shards(self) -> set[str]:
        """The shards the indexes in an existing OUT folder name: replaced by the new output, so the ones it does
        not write again are deleted after it is up (as locally; anything else there stays)."""
        names: set[str] = set()
        try:
            for name, size in self.bucket.starting_with("").items():
                if name.endswith(".index.json") and size <= SMALL:  # (an index: read whole)
                    weight_map = json.loads(self.bucket.read(name, 0, size)).get("weight_map", {})
                    names |= {v for v in weight_map.values() if isinstance(v, str) and "/" not in v}
        except (ValueError, AttributeError):  # not an index we wrote: its shards are left alone
            return set()
        return names

    def publish(self) -> list[str]:
        """Upload what the command staged (OUT and its sidecars beside it); on any failure delete what this run
        uploaded, then raise.  The URLs written."""
        staged = sorted(self.local.rglob("*")) if self.local.is_dir() else [self.local]
        staged += sorted(self.scratch.glob(self.local.name + ".client_state.*"))  # a single file's sidecars
        files = {p.relative_to(self.scratch).as_posix(): p for p in staged if p.is_file()}
        single = self.local.name if self.local.is_file() else None
        written = {rel.split("/", 1)[1] for rel in files if "/" in rel}
        for name in self.shadowing if self.local.is_dir() else ():  # (as locally: export.sharded.replaced_shards)
            if name not in written:
                raise OutputError(f"holds {name}, which from_pretrained would load instead of the sharded "
                                  "weights written beside it; dsckpt does not delete objects it did not write",
                                  hint=f"move {self.url}/{name} away, or write to another prefix", at=self.url)
        try:
            with signals_deferred() as stop:  # (Ctrl-C lands between two objects)
                for rel in upload_order(list(files), last=single):
                    self.uploaded.append(rel)
                    key = self.parent.key(rel)
                    if self.streams is not None and key in self.streams.pending:
                        self.streams.complete(key)  # (its placeholder staged here holds no data)
                    else:
                        self.parent.replace(files[rel], rel, **self.part_options)
                    stop()
        except BaseException as exc:
            self.abort()
            if isinstance(exc, Exception):
                raise OutputError(f"upload failed ({type(exc).__name__}: {str(exc)[:200]}); what this "
                                  "run uploaded was deleted", at=self.url) from None
            raise
        out = self.local.name
        for name in sorted(self.superseded - {rel.split("/", 1)[1] for rel in files if rel.startswith(out + "/")}):
            self.bucket.remove(name)  # superseded shards, once the new index is up
        base = self.url.rsplit("/", 1)[0]
        return [f"{base}/{rel}" for rel in files]

    def abort(self) -> None:
        for rel in reversed(self.uploaded):
            try:
                self.parent.remove(rel)
            except Exception:  # best effort: the error that brought us here is the one to report
                pass
        self.uploaded.clear()

    def close(self) -> None:
        shutil.rmtree(self.scratch, ignore_errors=True)
