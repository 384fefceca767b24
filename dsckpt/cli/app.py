"""The `dsckpt` command group and ``main()``, the one place errors become one line and an exit code.

``main()`` turns a ``DsckptError`` into ``dsckpt: error: <message>`` plus ``hint: <advice>`` and exit 2
(usage errors the same way); with ``--json`` stdout also gets one ``{"schema", "error", "hint", "exit"}``
document, so a script reads every outcome the same way.  ``DSCKPT_DEBUG=1`` keeps the traceback.
Ctrl-C is ``Aborted.`` and exit 130.  Inside a rank started by ``--nproc`` the error goes to the
launcher instead, which prints it once for all ranks.
"""
from __future__ import annotations

import os
import signal
import sys
from typing import Any

import click

from .._version import __version__
from ..errors import DsckptError, Interrupted
from ..jsondoc import json_document  # noqa: F401  (the commands' --json writer)

EXIT_PROBLEMS = 1  # inspect found problems
EXIT_ERROR = 2  # a typed dsckpt error (a failed --verify too) or a usage error
EXIT_INTERRUPTED = 130  # Ctrl-C, as a shell reports SIGINT


# command -> the module of this package that registers it: only the command run is imported (the CLI's fixed cost)
COMMANDS = {"check-finite": "check_finite", "consolidate": "consolidate", "convert": "convert", "diff": "diff",
            "inspect": "inspect", "list": "catalog", "prune": "catalog", "reshard": "reshard", "resume": "resume",
            "train": "train", "verify": "verify"}


class _Group(click.Group):
    """Imports a command's module when the command is asked for (``COMMANDS``); lists every command with its whole
    first docstring line (click cuts them at ~45 characters)."""

    def list_commands(self, ctx: click.Context | None) -> list[str]:
        return sorted(set(COMMANDS) | set(self.commands))

    def get_command(self, ctx: click.Context | None, name: str) -> click.Command | None:
        if name not in self.commands and name in COMMANDS:
            from importlib import import_module

            import_module(f"{__package__}.{COMMANDS[name]}")
        return self.commands.get(name)

    def resolve_command(self, ctx: click.Context,
                        args: list[str]) -> tuple[str | None, click.Command | None, list[str]]:
        """A mistyped command gets the nearest name, as a mistyped option does."""
        try:
            return super().resolve_command(ctx, args)
        except click.UsageError as exc:
            import difflib

            close = difflib.get_close_matches(args[0], self.list_commands(ctx), n=1) if args else []
            if close:
                exc.message += f" Did you mean {close[0]!r}?"
            raise

    def all_commands(self) -> dict[str, click.Command]:
        """Every command, its module imported (``--help``, the documented examples)."""
        found = {name: self.get_command(None, name) for name in self.list_commands(None)}
        return {name: cmd for name, cmd in found.items() if cmd is not None}

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, (cmd.help or "").split("\n")[0].strip()) for name, cmd in sorted(self.all_commands().items())
                if not cmd.hidden]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="dsckpt")
def cli() -> None:
    """Inspect, consolidate, reshard and resume DeepSpeed ZeRO checkpoints.

    \b
    Examples:
      dsckpt train --stage 3 --nproc 2 --save-dir runs/demo
      dsckpt inspect runs/demo
      dsckpt consolidate runs/demo model.safetensors
      dsckpt reshard runs/demo runs/demo_ws4 --world-size 4
      dsckpt resume --full-weights model.safetensors --nproc 2 --steps 5
    Every command takes --help; --json prints one JSON document (docs/cli.md).
    """


def result_document(result, **first) -> str:
    """A ``--json`` document of an API result: ``first`` (the input), then the result's own fields by their names."""
    from dataclasses import fields

    def plain(value):
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return str(value) if hasattr(value, "__fspath__") else value
    return json_document(**first, **{f.name: plain(getattr(result, f.name)) for f in fields(result)})


def report_result(result, given: str, as_json: bool, line, group=None) -> None:
    """A writing command's last word, from rank 0 only: its notes on stderr, then ``--json``'s document or
    ``line(result)``."""
    if group is not None and group.rank != 0:
        return
    for note in result.notes:
        click.echo(f"note: {note}", err=True)
    click.echo(result_document(result, input=given) if as_json else line(result))


def require_runtime(command: str) -> None:
    """train/resume need torch and DeepSpeed, which `pip install dsckpt` does not bring."""
    from ..errors import MissingExtraError, missing_modules

    missing = missing_modules("torch", "deepspeed", "safetensors")
    if missing:
        raise MissingExtraError(f"`dsckpt {command}` needs {', '.join(missing)}, not installed",
                                hint="pip install 'dsckpt[runtime]'  (inspect and consolidate work without it)")


def quiet_rank() -> bool:
    """A process of a torchrun-launched run other than rank 0: every process reaches the same verdict
    (``parallel.group``), rank 0 prints it."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and os.environ.get("RANK", "0") != "0" \
        and "LOCAL_RANK" in os.environ


def in_launched_rank() -> bool:
    """A rank started by `--nproc` (its launcher already ran the preflight)."""
    if "LOCAL_RANK" not in os.environ:
        return False
    from ..runtime.console import ERROR_DIR_ENV

    return ERROR_DIR_ENV in os.environ


def world_size_for(nproc: int) -> int:
    return int(os.environ.get("WORLD_SIZE", "1")) if "LOCAL_RANK" in os.environ else nproc


def _in_group() -> bool:
    dist = sys.modules.get("torch.distributed")  # (never imported here: inspect and consolidate need no torch)
    return dist is not None and dist.is_available() and dist.is_initialized()


def _exit(code: int) -> None:
    """Exit; in a process of a distributed run, without interpreter teardown: gloo's threads, still joinable
    when static destructors run, abort the process ("terminate called without an active exception",
    measured: ``runtime.engine.shutdown``) and the exit code with it; a forked rank runs none of its
    parent's exit handlers."""
    if _in_group():
        dist = sys.modules["torch.distributed"]
        import contextlib

        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        _hard_exit(code)
    if _forked():
        _hard_exit(code)
    sys.exit(code)


def _hard_exit(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _forked() -> bool:
    launch = sys.modules.get("dsckpt.runtime.launch")  # (imported only by a command that launches)
    return launch is not None and launch.forked_rank()


_in_main = False


def may_fork_ranks() -> bool:
    """``--nproc`` may fork its ranks from this process: ``main`` runs it, and ends each of them."""
    if not _in_main:
        return False
    from ..runtime.launch import may_fork

    return may_fork()


def become_rank() -> None:
    """A rank forked by ``--nproc`` (``cli.options.parallel_group``) from here on behaves as one it started."""
    _handle_interrupts_as_rank()


def _handle_interrupts_as_rank() -> None:
    signal.signal(signal.SIGINT, _raise_interrupted)
    sys.unraisablehook = _unraisable_unless_interrupted


def _unraisable_unless_interrupted(unraisable: Any) -> None:
    """The handler may run inside a ``__del__`` (a collected ``Popen`` was seen), where Python prints the raise
    as "Exception ignored"; the interruption is not lost: ``Interrupted.signalled`` stays set."""
    if not isinstance(unraisable.exc_value, Interrupted):
        sys.__unraisablehook__(unraisable)


def _fail(message: str, hint: str | None, code: int, as_json: bool) -> int:
    click.echo(f"dsckpt: error: {message}" + (f"\nhint: {hint}" if hint else ""), err=True)
    if as_json:
        click.echo(json_document(error=message, hint=hint, exit=code))
    return code


def _raise_interrupted(signum, frame) -> None:
    """SIGINT in a `--nproc` rank.  A rank blocked in a collective runs Python's handler only once its
    peers' exit has broken the collective, i.e. while gloo's "Connection reset" is being raised (measured:
    the KeyboardInterrupt then surfaced in contextlib's ``__exit__``, past ``interruptible``, and click
    printed a stray newline for it).  Interrupted passes click by and ends the rank quietly in ``main``.
    Later SIGINTs are ignored: the launcher passes a Ctrl-C on, which the terminal may have sent already."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    Interrupted.signalled = True
    raise Interrupted


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if in_launched_rank():
        _handle_interrupts_as_rank()
    global _in_main
    _in_main = True  # (every way out of here below ends a forked rank with os._exit)
    try:
        code = run(args)
    except SystemExit as exc:
        if not _forked():
            raise
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        if not _forked():
            raise
        import traceback

        traceback.print_exc()
        code = 1
    _exit(code)


STORAGE_LOGGERS = ("gcsfs", "s3fs", "adlfs", "fsspec", "aiohttp", "google", "azure")


def _quiet_storage_clients() -> None:
    """The cloud clients log their retries' tracebacks before they raise; dsckpt raises the typed error for it, once
    (``DSCKPT_DEBUG=1`` keeps their output)."""
    if os.environ.get("DSCKPT_DEBUG") != "1":
        import logging

        for name in STORAGE_LOGGERS:
            logging.getLogger(name).setLevel(logging.CRITICAL + 1)


def run(args: list[str]) -> int:
    """Run one command line in this process and return its exit code (errors printed, as ``main`` prints
    them); a command that ends the process itself (``--nproc``'s launcher, exit codes 1 and 3) raises
    ``SystemExit``."""
    as_json = "--json" in args and "--" not in args[:args.index("--json")]
    if any("://" in arg for arg in args):  # (logging is imported for it: only where a store may be reached)
        _quiet_storage_clients()
    args = args or ["--help"]  # bare `dsckpt`: the help, exit 0 (click's default is the usage, exit 2)
    try:
        cli.main(args, prog_name="dsckpt", standalone_mode=False)
        return 0
    except (click.exceptions.Abort, KeyboardInterrupt, Interrupted):
        if in_launched_rank():  # quiet: the launcher says it once.  No interpreter teardown: gloo's threads
            os._exit(EXIT_INTERRUPTED)  # would print "terminate called without an active exception"
        click.echo("Aborted.", err=True)
        return EXIT_INTERRUPTED
    except click.UsageError as exc:
        hint = f"see `{exc.ctx.command_path} --help`" if exc.ctx else "see `dsckpt --help`"
        return _fail(exc.format_message(), hint, exc.exit_code, as_json)
    except click.ClickException as exc:
        return _fail(exc.format_message(), None, exc.exit_code, as_json)
    except DsckptError as exc:
        if os.environ.get("DSCKPT_DEBUG") == "1":
            raise
        from ..runtime.console import alias, report_rank_error

        exc.named(alias())  # (a URL `resume` fetched: its local copy shown as the URL)
        if in_launched_rank() and report_rank_error(str(exc), exc.hint):
            return EXIT_ERROR  # the launcher prints it once for all ranks
        if quiet_rank():
            return EXIT_ERROR
        return _fail(str(exc), exc.hint, EXIT_ERROR, as_json)
    except BrokenPipeError:
        return 1
    except Exception:
        if Interrupted.signalled and in_launched_rank():  # e.g. gloo's "Connection reset": a peer ended first
            os._exit(EXIT_INTERRUPTED)
        raise
