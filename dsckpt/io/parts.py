"""Parts that any process can upload in any order, then one call makes them an object: each store's own way.

``S3Parts``: S3's multipart upload (AWS, MinIO, Ceph, R2...) through s3fs.  ``AzureBlocks``: an Azure block blob's
staged blocks and their committed list, through adlfs's client.  GCS is not here: its resumable uploads take the
bytes in order, so outputs to gs:// are staged and uploaded whole (``io.upload``).
"""
from __future__ import annotations

import base64
import secrets
from typing import Any

from .remote import typed_error


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
        return secrets.token_hex(8)

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


BACKENDS = {"s3": S3Parts, "az": AzureBlocks, "abfs": AzureBlocks, "abfss": AzureBlocks}


def streamable(url: str) -> bool:
    """OUT's store takes parts (``BACKENDS``): its outputs can be streamed (``io.stream``)."""
    return url.split("://", 1)[0].lower() in BACKENDS
