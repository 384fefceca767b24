"""The one ``--json`` document writer: ``schema`` first, then the command's fields (docs/cli.md#json-vocabulary-schema-2).
A base module: every command prints through it without importing more than ``json``."""
from __future__ import annotations

import json
from typing import Any

JSON_SCHEMA = 2  # bump on an incompatible change


def json_document(**fields: Any) -> str:
    return json.dumps({"schema": JSON_SCHEMA, **fields})
