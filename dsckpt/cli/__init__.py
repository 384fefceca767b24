"""The `dsckpt` command line: thin click commands over the library, one module per command.

Heavy imports (torch, DeepSpeed) happen inside the commands that need them, so `inspect` and
`consolidate` start fast.  ``app`` holds the group and ``main()``; a command's module is imported when the
command is run (``app.COMMANDS``), and registers it on the group.
"""
from .app import EXIT_ERROR, EXIT_PROBLEMS, cli, main

__all__ = ["cli", "main", "EXIT_ERROR", "EXIT_PROBLEMS"]
