"""The one reader of small JSON files: safetensors indexes, client-state sidecars, DeepSpeed and HF configs."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import ConfigError, CorruptFileError
from ..limits import check


def read_json(path: Path, what: str, error: type[Exception] = CorruptFileError) -> Any:
    """A JSON document of bounded size (MAX_JSON_BYTES: a LimitExceededError before reading) and nesting; any other
    failure is an ``error`` naming the file and ``what`` it should have been."""
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise error(f"{path}: not a readable {what} ({exc})") from None
    check("MAX_JSON_BYTES", size, str(path), f"the size of this {what}")
    try:
        return json.loads(path.read_bytes())
    except RecursionError:
        raise error(f"{path}: {what} is nested too deeply") from None
    except (OSError, ValueError) as exc:
        raise error(f"{path}: not a readable {what} ({exc})") from None


def read_json_object(path: Path, what: str) -> dict[str, Any]:
    """A config file's JSON object; a ConfigError when it is anything else."""
    value = read_json(path, what, ConfigError)
    if not isinstance(value, dict):
        raise ConfigError(f"{what} must be a JSON object", at=path)
    return value
