"""The storage a path lives on, chosen once from the path (as torch DCP's ``_storage_setup`` chooses a writer): a URL's
objects (``formats.bucket.BucketStorage``, imported for a URL only: fsspec and a cloud's client), else the local file
system (``formats.storage.LocalStorage``).  A new backend is a class that implements ``formats.storage.Storage`` and a
branch here."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

from .storage import LocalStorage, is_url

if TYPE_CHECKING:
    from .bucket import BucketStorage


def storage_for(path: str | os.PathLike[str]) -> LocalStorage | BucketStorage:
    """The storage ``path`` lives on; its names are paths (local) or relative to the URL, or URLs below it (bucket)."""
    if is_url(path):
        from .bucket import BucketStorage

        return BucketStorage(str(path))
    return LocalStorage()
