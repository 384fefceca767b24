"""The `dsckpt` command line: thin click commands over the library, one module per command.

Heavy imports (torch, DeepSpeed) happen inside the commands that need them, so `inspect` and
`consolidate` start fast.  ``app`` holds the group and ``main()``; importing a command module
registers it on the group.
"""
from . import catalog, check_finite, consolidate, convert, diff, inspect, reshard, resume, train, verify  # noqa: F401
from .app import EXIT_ERROR, EXIT_PROBLEMS, cli, main

__all__ = ["cli", "main", "EXIT_ERROR", "EXIT_PROBLEMS"]
