"""The one reader of small JSON files that must hold an object (DeepSpeed configs, Hugging Face configs)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..limits import check


def read_json_object(path: Path, what: str) -> dict[str, Any]:
    """The JSON object in ``path``, or a ConfigError naming the file and ``what`` it should have been; a file over
    MAX_JSON_BYTES is a LimitExceededError before it is read."""
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise ConfigError(f"{path}: not a readable {what} ({exc})") from None
    check("MAX_JSON_BYTES", size, str(path), "the size of the file")
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: not a readable {what} ({exc})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: {what} must be a JSON object")
    return value
