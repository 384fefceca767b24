"""Options shared by the commands: the writing commands' (``writing_options``), the precision vocabulary, and the
runtime's (train, resume) knobs."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, TypeVar

import click

from ..dtypes import PRECISION_WORDS, TRAINING_PRECISION

if TYPE_CHECKING:
    from ..api.options import WriteOptions
    from ..progress import Phase

F = TypeVar("F", bound=Callable[..., Any])  # a click command function

SKIP_CRC_HELP = ("Do not check each storage read against the CRC-32 in its zip record (checked by default: a "
                 "damaged byte is refused, naming the file); a note says it was skipped.")
TRUST_HELP = ("Trust whoever wrote CHECKPOINT: copy pickled objects of any class as recorded and follow symlinks "
              "out of it (default: such client-state entries are left out with a note, such links refused).")


class Precision(click.ParamType):
    """fp32 / bf16 / fp16 under any of their usual spellings (32, float32, bfloat16, 16, float16), for
    --precision and --dtype alike; ``training`` gives DeepSpeed's spelling ("32", "bf16", "16")."""

    name = "precision"

    def __init__(self, training: bool = False):
        self.training = training

    def get_metavar(self, param, ctx=None) -> str:
        return "[fp32|bf16|fp16]"

    def shell_complete(self, ctx, param, incomplete):
        from click.shell_completion import CompletionItem

        return [CompletionItem(word) for word in ("fp32", "bf16", "fp16") if word.startswith(incomplete)]

    def convert(self, value, param, ctx):
        word = PRECISION_WORDS.get(str(value).lower())
        if word is None:
            self.fail(f"{value!r} is not a precision; use fp32 (or 32, float32), bf16 (bfloat16) or fp16 (16, float16)",
                      param, ctx)
        return TRAINING_PRECISION[word] if self.training else word


class Registered(click.Choice):
    """A choice among a registry's names, read when first needed: the registry imports every plug-in, which only
    a command that runs (or its --help) should pay for."""

    def __init__(self, names: Callable[[], list[str]]):
        self._names = names
        super().__init__(())

    @property
    def choices(self):
        return tuple(self._names())

    @choices.setter
    def choices(self, value) -> None:  # (click.Choice sets it; the registry answers instead)
        pass


class LazyHelp(click.Option):
    """An option whose help text is built when --help is shown (``help`` is a function returning it)."""

    def __init__(self, *args, help_text: Callable[[], str], **kwargs):
        self._help_text = help_text
        super().__init__(*args, **kwargs)

    def get_help_record(self, ctx):
        self.help = self._help_text()
        return super().get_help_record(ctx)


def tags_of(argument: str) -> Callable[..., list[Any]]:
    """Shell completion for a --tag option: the tag folders of the local checkpoint the command's ``argument`` names
    (nothing for a URL or a folder that is not there: completion never reaches a store)."""

    def complete(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[Any]:
        from pathlib import Path

        from click.shell_completion import CompletionItem

        from ..zero.layout import list_tags

        folder = ctx.params.get(argument) or _typed_argument(ctx, argument)
        try:
            tags = list_tags(Path(folder)) if folder else []
        except OSError:
            return []
        return [CompletionItem(tag) for tag in tags if tag.startswith(incomplete)]
    return complete


def _typed_argument(ctx: click.Context, name: str) -> str | None:
    """Argument ``name`` of the command line being completed, read from the words every shell's completion script
    passes in COMP_WORDS: click leaves ``ctx.params`` empty while the option being completed lacks its value."""
    import os

    from click.shell_completion import split_arg_string

    words = split_arg_string(os.environ.get("COMP_WORDS", ""))
    if ctx.info_name not in words:
        return None
    takes_value = {opt for p in ctx.command.params if isinstance(p, click.Option) and not p.is_flag and not p.count
                   for opt in p.opts}
    positional, skip = [], False
    for word in words[words.index(ctx.info_name) + 1:]:
        if not skip and not word.startswith("-"):
            positional.append(word)
        skip = not skip and word in takes_value
    arguments = [p.name for p in ctx.command.params if isinstance(p, click.Argument)]
    if name not in arguments or arguments.index(name) >= len(positional):
        return None
    return positional[arguments.index(name)]


def training_options(fn=None, *, steps_help: str = "Optimizer steps to run."):
    if fn is None:
        return lambda f: training_options(f, steps_help=steps_help)
    opts = [
        click.option("--model", default=None, metavar="PKG.MODULE:FACTORY", help="Model factory (default: built-in tiny causal LM)."),
        click.option("--preset", default=None, help="deepspeed, deepspeed_stage_1, ..._2, ..._2_offload, ..._3, ..._3_offload, ..._3_offload_nvme (default: deepspeed_stage_3 unless --stage or --config is given)."),
        click.option("--stage", type=click.IntRange(0, 3), default=None, help="ZeRO stage (overrides the preset's; default: the preset's)."),
        click.option("--config", "config", default=None, type=click.Path(dir_okay=False), help="DeepSpeed JSON config (else $DSCKPT_DEEPSPEED_CONFIG)."),
        click.option("--precision", type=Precision(training=True), default="fp32", show_default=True,
                     help="Training precision (32, bf16, 16 and their other names work too)."),
        click.option("--steps", type=click.IntRange(min=0), default=20, show_default=True, help=steps_help),
        click.option("--save-dir", type=click.Path(file_okay=False), default=None, help="Where to save checkpoints (default: nowhere; nothing is saved)."),
        click.option("--save-every", type=click.IntRange(min=0), default=0, help="Save every N steps (0: once at the end)."),
        click.option("--sync-save", is_flag=True,
                     help="Block training for each save (DeepSpeed's own engine); by default a save returns once a "
                          "snapshot is taken and its files persist in the background, `latest` moved last."),
        click.option("--nproc", type=click.IntRange(min=1), default=1, show_default=True,
                     help="Local ranks (started with the environment torchrun gives its workers)."),
        click.option("--seed", type=int, default=1234, show_default=True),
        click.option("--freeze", is_flag=True, help="Built-in model: freeze its first block."),
        click.option("--offload-optimizer/--no-offload-optimizer", default=None, help="ZeRO-Offload of optimizer state (default: the preset's)."),
        click.option("--offload-parameters/--no-offload-parameters", default=None, help="ZeRO-3 parameter offload (default: the preset's)."),
        click.option("--gradient-accumulation-steps", type=click.IntRange(min=1), default=None),
        click.option("--gradient-clip-val", type=click.FloatRange(min=0), default=None,
                     help="Clip by global norm (DeepSpeed's only mode)."),
        click.option("--verbose", "-v", is_flag=True, help="Show DeepSpeed's own logs and build output."),
        click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON document (logs go to stderr)."),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn




NPROC_HELP = ("Split the work over N local processes (no torch needed); under torchrun the processes of every "
              "host share it instead (docs/cli.md, 'Many processes, many hosts').")


def parallel_group(nproc: int, needs: tuple[str, ...] = ()):
    """The process group this command runs on, or None for one process.  ``--nproc N`` runs the command on N
    local processes (``runtime.launch``; this process only launches): forks of this one where that is safe,
    which start with the modules in ``needs`` imported once, here; else N fresh interpreters.  A process so
    started joins the group of every process of the run, on every host."""
    import os
    import sys

    from ..parallel.group import init_group, launched

    if nproc > 1 and "LOCAL_RANK" not in os.environ:
        from ..runtime import launch
        from .app import become_rank, may_fork_ranks

        if not may_fork_ranks():
            sys.exit(launch.launch(nproc))
        from importlib import import_module

        for module in needs:
            import_module(module)
        if not may_fork_ranks():  # (an import started a thread or loaded torch)
            sys.exit(launch.launch(nproc))
        code = launch.fork_ranks(nproc)
        if code is not None:
            sys.exit(code)
        become_rank()
    return init_group() if launched() else None  # (left without teardown at exit: cli.app._exit)


def crc_skipped_note(skipped: bool) -> list[str]:
    """The loud word a command says when it read without CRC checks; the notes for its ``--json`` document."""
    if not skipped:
        return []
    from ..io.integrity import SKIPPED_NOTE

    click.echo(f"note: {SKIPPED_NOTE}", err=True)
    return [SKIPPED_NOTE]


class ByteBar:
    """The commands' ``dsckpt.progress.Progress``: a bar of bytes on stderr per phase (the verb's name while it writes,
    "fetch", "verify"), each shown after half a second, so quick runs and errors print none.  tqdm (a large part of
    a command's start-up: docs/dev/performance-log.md 29) is loaded only where a bar may show: a terminal, not
    --quiet or --json, rank 0."""

    def __init__(self, verb: str, off: bool) -> None:
        self.verb, self.off = verb, off
        self._bar: Any = None

    def begin(self, phase: Phase, total: int | None) -> None:
        if self.off:
            return
        import sys

        from tqdm import tqdm

        from ..progress import Phase

        self.close()
        self._bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, delay=0.5, file=sys.stderr,
                         leave=False, desc=self.verb if phase is Phase.WRITE else phase.value)

    def advance(self, nbytes: int) -> None:
        if self._bar is not None:
            self._bar.update(nbytes)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> "ByteBar":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_options(force: bool, no_fsync: bool, trust_checkpoint: bool, skip_crc_check: bool, group: Any,
                  bar: ByteBar) -> "WriteOptions":
    """The API's ``WriteOptions`` from the writing options' flags (``writing_options``)."""
    from ..api.options import WriteOptions

    return WriteOptions(force=force, fsync=not no_fsync, trust=trust_checkpoint, check_crc=not skip_crc_check,
                        group=group, progress=bar)


def writing_options(out: str) -> Callable[[F], F]:
    """The options every writing command (consolidate, reshard, convert) takes, in one order and one wording:
    --trust-checkpoint, --skip-crc-check, --no-fsync, --nproc, --quiet, --json.  ``out``: how its help names OUT."""
    options = [click.option("--trust-checkpoint", is_flag=True, help=TRUST_HELP),
               click.option("--skip-crc-check", is_flag=True, help=SKIP_CRC_HELP),
               click.option("--no-fsync", is_flag=True,
                            help=f"Skip flushing {out} to disk before and after the rename (scratch work)."),
               click.option("--nproc", type=click.IntRange(min=1), default=1, show_default=True, help=NPROC_HELP),
               click.option("--quiet", "-q", is_flag=True, help="No progress bar."),
               click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")]

    def add(command: F) -> F:
        for option in reversed(options):
            command = option(command)
        return command
    return add
