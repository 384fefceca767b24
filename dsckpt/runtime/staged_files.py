"""Where a background save's files wait until every rank has written its own: ``<tag>/.dsckpt-saving/<name>``.

A temp keeps the final file name (``torch.save`` names its zip's entries after it), so the file renamed into the tag
folder is byte for byte what a direct save would have written.  ``latest`` is replaced the same way, last.
"""
from __future__ import annotations

import os
from pathlib import Path

from ..io.output import fsync_path
from ..zero.layout import LATEST_FILE

TEMP_FOLDER = ".dsckpt-saving"
TEMP_SUFFIX = ".dsckpt-tmp"


def temp_for(path: str) -> str:
    return os.path.join(os.path.dirname(path), TEMP_FOLDER, os.path.basename(path))


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
