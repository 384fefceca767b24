__version__ = "0.1.0"
JSON_SCHEMA = 2  # version of every --json document (docs/cli.md#json-output); bump on an incompatible change
