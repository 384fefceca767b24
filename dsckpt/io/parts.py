"""Parts that any process can upload in any order, then one call makes them an object: each store's own way.

``S3Parts``: S3's multipart upload (AWS, MinIO, Ceph, R2...) through s3fs.  ``AzureBlocks``: an Azure block blob's
staged blocks and their committed list, through adlfs's client.  ``GcsCompose``: GCS has neither (its resumable
uploads take the bytes in order), so each part is a hidden object of its own, composed into the key at the end, as
gcloud storage's parallel composite uploads do.
"""
from __future__ import annotations

import base64
import os
from typing import Any, Callable, Protocol

from ..formats.bucket import typed_error


class PartStore(Protocol):
    """One store's way to make an object of parts.  Calls: ``start`` once (any process; returns the upload's id),
    ``put`` per part (any process, any order, numbers from 1), then ``complete`` once with every part's tag (one
    process), or ``abort`` (one process) - after which the upload's parts are gone."""

    def start(self, key: str) -> str: ...

    def put(self, key: str, upload_id: str, number: int, data: bytearray) -> str: ...

    def complete(self, key: str, upload_id: str, parts: dict[int, str]) -> None: ...

    def abort(self, key: str, upload_id: str) -> None: ...


class S3Parts:
    """S3's multipart upload (AWS, MinIO, Ceph, R2...) through s3fs."""

    def __init__(self, fs):
        self.fs = fs

    def _call(self, key: str, method: str, **kwargs) -> dict:
        bucket, name, _ = self.fs.split_path(key)
        try:
            return self.fs.call_s3(method, Bucket=bucket, Key=name, **kwargs)
        except Exception as exc:
            raise typed_error(f"s3://{key}", exc, f"uploading ({method})") from None

    def start(self, key: str) -> str:
        return self._call(key, "create_multipart_upload")["UploadId"]

    def put(self, key: str, upload_id: str, number: int, data: bytearray) -> str:
        return self._call(key, "upload_part", PartNumber=number, UploadId=upload_id, Body=data)["ETag"]

    def complete(self, key: str, upload_id: str, parts: dict[int, str]) -> None:
        listed = [{"PartNumber": n, "ETag": etag} for n, etag in sorted(parts.items())]
        self._call(key, "complete_multipart_upload", UploadId=upload_id, MultipartUpload={"Parts": listed})

    def abort(self, key: str, upload_id: str) -> None:
        self._call(key, "abort_multipart_upload", UploadId=upload_id)


class AzureBlocks:
    """An Azure block blob's staged blocks, committed as a list (adlfs's client on fsspec's loop).  The id of an
    upload prefixes its block ids; blocks never committed are dropped by the service after a week."""

    def __init__(self, fs):
        self.fs = fs

    def _call(self, key: str, doing: str, act) -> Any:
        from fsspec.asyn import sync

        container, blob, _ = self.fs.split_path(key)

        async def run():
            async with self.fs.service_client.get_container_client(container).get_blob_client(blob) as client:
                return await act(client)
        try:
            return sync(self.fs.loop, run)
        except Exception as exc:
            raise typed_error(f"az://{key}", exc, f"uploading ({doing})") from None

    def start(self, key: str) -> str:
        return os.urandom(8).hex()

    def put(self, key: str, upload_id: str, number: int, data: bytearray) -> str:
        block = base64.b64encode(f"{upload_id}-{number:06d}".encode()).decode()  # (equal lengths, as Azure wants)
        self._call(key, "stage_block", lambda client: client.stage_block(block, bytes(data), length=len(data)))
        return block

    def complete(self, key: str, upload_id: str, parts: dict[int, str]) -> None:
        from azure.storage.blob import BlobBlock

        blocks = [BlobBlock(block_id=parts[n]) for n in sorted(parts)]
        self._call(key, "commit_block_list", lambda client: client.commit_block_list(blocks))

    def abort(self, key: str, upload_id: str) -> None:
        pass


class GcsCompose:
    """GCS: each part a hidden object beside the key (``.<name>.dsckpt-part-<id>-<n>``, never what a reader looks
    for); ``complete`` composes them into the key, 32 at a time (GCS's limit per compose; composites of composites
    above that), then deletes them; ``abort`` deletes them.  A run killed hard (SIGKILL) leaves its part objects."""

    COMPOSE_MAX = 32
    IN_FLIGHT = 32

    def __init__(self, fs):
        self.fs = fs

    def _run(self, key: str, doing: str, *coros) -> list:
        import asyncio  # (here: every verb imports this module, only a GCS upload needs asyncio)

        from fsspec.asyn import sync

        limit = asyncio.Semaphore(self.IN_FLIGHT) if len(coros) > 1 else None

        async def bounded(coro):
            if limit is None:
                return await coro
            async with limit:
                return await coro

        async def run():
            return await asyncio.gather(*(bounded(c) for c in coros))
        try:
            return sync(self.fs.loop, run)
        except Exception as exc:
            raise typed_error(f"gs://{key}", exc, f"uploading ({doing})") from None

    @staticmethod
    def _stem(key: str, upload_id: str) -> str:
        parent, _, name = key.rpartition("/")
        return f"{parent}/.{name}.dsckpt-part-{upload_id}-"

    def start(self, key: str) -> str:
        return os.urandom(8).hex()

    def put(self, key: str, upload_id: str, number: int, data: bytearray) -> str:
        part = f"{self._stem(key, upload_id)}{number:05d}"
        self._run(key, "a part", self.fs._pipe_file(part, bytes(data)))
        return part

    def complete(self, key: str, upload_id: str, parts: dict[int, str]) -> None:
        names, made, level = [parts[n] for n in sorted(parts)], [], 0
        try:
            while len(names) > self.COMPOSE_MAX:
                level += 1
                groups = [names[i:i + self.COMPOSE_MAX] for i in range(0, len(names), self.COMPOSE_MAX)]
                names = [f"{self._stem(key, upload_id)}c{level}-{i:05d}" for i in range(len(groups))]
                made += names
                self._run(key, "compose", *(self.fs._merge(name, group) for name, group in zip(names, groups)))
            self._run(key, "compose", self.fs._merge(key, names))
        finally:
            self._delete(key, list(parts.values()) + made)

    def abort(self, key: str, upload_id: str) -> None:
        stem = self._stem(key, upload_id)
        self._delete(key, [p for p in self.fs.ls(stem.rsplit("/", 1)[0], detail=False, refresh=True)
                           if p.startswith(stem)])

    def _delete(self, key: str, names: list[str]) -> None:
        batches = [names[i:i + 100] for i in range(0, len(names), 100)]  # (GCS's batch limit)
        self._run(key, "deleting its parts", *(self.fs._rm_files(batch) for batch in batches))


BACKENDS: dict[str, Callable[[Any], PartStore]] = {"s3": S3Parts, "gs": GcsCompose, "gcs": GcsCompose,
                                                  "az": AzureBlocks, "abfs": AzureBlocks, "abfss": AzureBlocks}


def streamable(url: str) -> bool:
    """OUT's store takes parts (``BACKENDS``): its outputs can be streamed (``io.stream``)."""
    return url.split("://", 1)[0].lower() in BACKENDS
