"""Output formats as plug-ins: one ``Format`` subclass per module, registered by the module itself.

A format answers four questions, and nothing outside it asks them again:
* **how it is chosen** - ``suffixes`` (OUT's name, any case), ``name`` (``--format``, ``--hf``),
  ``directory`` (OUT is a folder), and for reading back, ``reads(path)`` (sniffing a given file);
* **what it needs from the plan** - ``prepare(ckpt, plan, request)`` returns a ``Prepared``: the plan as
  this format writes it (names stripped, adapters picked, aliases duplicated), the companions it will
  copy, notes for the user; checks that can fail run here, before a byte is written;
* **how it writes** - ``write(prepared, temp path, context)`` returns the names written (the caller,
  ``api.consolidation``, stages, verifies and publishes them: ``io.output``); every reader and writer it calls gets
  ``context`` (``io.context.WriteContext``: the source storage, CRC ledger, streams, write-back, progress);
* **how several processes write it** - a format that ``splits`` (one file filled in parts, a folder's shards dealt
  out) answers ``share(prepared, k, n, streamed)``: the tensors writer ``k`` of ``n`` writes; then rank 0 calls
  ``begin(prepared, temp path, context)`` once (its answer - a streamed file's upload id - is handed to every
  writer) and each writer ``write_part(prepared, temp path, context, (k, n), begun)``; every writer returns the same
  names.  A format that ``streams_tensors`` reads every tensor byte through the context's storage, so a checkpoint
  in object storage may still be arriving while its parts go up;
* **how it reads back** - ``read(path)`` lists ``Stored`` tensors (name, dtype, shape, absolute byte range)
  for ``--verify``, ``inspect``, ``diff`` and the full-weights reader.

The built-in formats (safetensors, torch, sharded, hf, peft, merged, lightning) are modules of this package,
imported the first time the registry is used; registering a format of one's own never disables them.
Modelled on torch.distributed.checkpoint's StorageWriter/SavePlanner split: planning is pure and
testable, writing moves bytes.
"""
from __future__ import annotations

import math
import os
import shlex
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..dtypes import ITEMSIZE
from ..errors import OutputError
from .plugins import Plugins

if TYPE_CHECKING:
    from ..io.context import WriteContext
    from ..plan.consolidate import Plan, TensorPlan
    from ..zero.reader import Checkpoint

BUILTIN_MODULES = ("safetensors", "sharded", "torch_file", "hf", "peft", "merged", "lightning")  # registration order


@dataclass(frozen=True)
class Stored:
    """One tensor inside a written file: where its bytes are."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    path: Path
    offset: int  # absolute, first element
    stride: tuple[int, ...] | None = None  # None: contiguous

    @property
    def span_bytes(self) -> int:
        if not all(self.shape):
            return 0
        if self.stride is None:
            return math.prod(self.shape) * ITEMSIZE[self.dtype]
        return (1 + sum((s - 1) * st for s, st in zip(self.shape, self.stride))) * ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class Listing:
    tensors: list[Stored]
    metadata: dict[str, str] = field(default_factory=dict)
    files: list[Path] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)  # what a .pt holds beside its state_dict


@dataclass(frozen=True)
class Request:
    """What the user asked of ``consolidate`` that a format may need to prepare its output."""
    max_shard_bytes: int
    config: Path | None = None  # --config: a model config for the Hugging Face export
    strip_prefixes: tuple[str, ...] = ()
    duplicate_tied: bool = False
    trust: bool = False  # follow links out of the checkpoint when copying companions
    renames: tuple[tuple[str, str], ...] = ()  # --rename: (pattern, replacement), after the prefixes are stripped
    base: Path | None = None  # --base: the base model a PEFT run's adapter is merged into (``merged``)


@dataclass(frozen=True)
class Prepared:
    """A format's output, decided: the plan it writes and what it carries beside the tensors."""
    format: "Format"  # the one that writes (``hf`` hands a PEFT run to ``peft``)
    plan: "Plan"
    request: Request
    companions: Any = None  # the format's own record of files to copy (configs, tokenizer)
    client_state: dict[str, Any] | None = None  # for a format that stores it inside OUT
    notes: tuple[str, ...] = ()
    pickled: Any = None  # a torch-zip format's pickle and storages (``pickle_writer.dumps``): writable, checked early


class Format:
    """Base of every output format; a subclass overrides what differs (see the module docstring)."""

    name: str = ""
    suffixes: tuple[str, ...] = ()  # file suffixes that pick this format by OUT's name
    accepts: tuple[str, ...] = ()  # further suffixes allowed when it is chosen by name (.pt for a Lightning file)
    directory: bool = False  # OUT is a folder
    default_for_folders: bool = False  # the folder format of an OUT named without a known suffix
    selectable: bool = True  # offered by ``--format`` (hf, peft: by ``--hf``)
    stores_client_state: bool = False  # OUT holds the client state (no sidecar written)
    reties_aliases: bool = False  # loading OUT re-ties tied names itself (shared storage, a config)
    exclude_frozen: bool = False  # its plan leaves frozen parameters out (an adapter)
    duplicates_tied: bool = True  # honours --duplicate-tied (a torch file shares one storage instead)
    takes_config: bool = False  # writes the model config ``Request.config`` names (``--config``)
    splits: bool = False  # several writers fill one output (``share``, ``begin``, ``write_part``)
    streams_tensors: bool = False  # every tensor byte read through the context's storage, streamed to a URL OUT
    computes: bool = False  # OUT holds values computed from the checkpoint, not its bytes (--verify refused)
    summary: str = ""  # one line for --help

    def resolve(self, root: Path, request: Request) -> "Format":
        """The format that writes this checkpoint's output (``hf`` answers ``peft`` for a LoRA run)."""
        return self

    def prepare(self, ckpt: "Checkpoint", plan: "Plan", request: Request) -> Prepared:
        return Prepared(self, plan, request)

    def write(self, prepared: Prepared, path: Path, context: "WriteContext") -> list[str]:
        raise NotImplementedError

    def share(self, prepared: Prepared, k: int, n: int, streamed: bool) -> list["TensorPlan"]:
        """The tensors writer ``k`` of ``n`` writes (``streamed``: OUT goes to a bucket as it is written); by
        default the plan's tensors dealt by bytes (``plan.deal``)."""
        from ..plan.deal import dealt

        tensors = prepared.plan.tensors
        owners = dealt([t.nbytes for t in tensors], n)
        return [t for t, owner in zip(tensors, owners) if owner == k]

    def begin(self, prepared: Prepared, path: Path, context: "WriteContext") -> Any:
        """Rank 0, before any part is written (a format that splits): what every writer's ``write_part`` gets."""
        return None

    def write_part(self, prepared: Prepared, path: Path, context: "WriteContext", part: tuple[int, int],
                   begun: Any) -> list[str]:
        """Writer ``part[0]`` of ``part[1]``'s share of OUT (a format that splits); the names of all of OUT."""
        raise NotImplementedError

    def read(self, path: Path) -> Listing:
        raise NotImplementedError

    def reads(self, path: Path) -> bool:
        """Whether ``path`` (an existing file or folder) is an output of this format."""
        return not self.directory and path.is_file() and path.suffix.lower() in self.suffixes

    def claims(self, root: Path) -> bool:
        """Whether the checkpoint at ``root`` is this format's to export when a related one is asked for
        (an adapter_config.json beside it: PEFT's, not the full model's)."""
        return False

    def replaced_files(self, out: Path) -> tuple[str, ...]:
        """In an existing folder OUT (``--force``): files this output supersedes, removed when it is
        published (e.g. the shards the folder's old index named)."""
        return ()


_FORMATS: Plugins[Format] = Plugins("output format", __package__, BUILTIN_MODULES)


def companion_paths(record: Any) -> list[Path]:
    """The files a format's companion record names (an hf export's config and tokenizer files)."""
    if isinstance(record, Path):
        return [record]
    if isinstance(record, (list, tuple)):
        return [p for r in record for p in companion_paths(r)]
    if is_dataclass(record):
        return [p for f in fields(record) for p in companion_paths(getattr(record, f.name))]
    return []


def register(fmt: Format, *, replace: bool = False) -> Format:
    """Add ``fmt`` (the built-ins stay); a name already taken is refused unless ``replace``."""
    return _FORMATS.register(fmt, replace)


def output_formats() -> dict[str, Format]:
    """Every registered format, built-ins first, by name."""
    return _FORMATS.all()


def selectable() -> list[str]:
    """The names ``--format`` offers."""
    return [name for name, f in output_formats().items() if f.selectable]


def names_a_folder(out: str | Path) -> bool:
    """OUT written with a trailing slash (``model.safetensors/``) is a folder whatever its suffix."""
    return str(out).endswith(("/", os.sep))


def file_suffix(out: str | Path) -> str:
    """OUT's suffix when it is one a file format claims (any case), else "" (``Qwen2.5-0.5B``: a folder)."""
    suffix = Path(out).suffix.lower()
    return suffix if any(suffix in f.suffixes + f.accepts for f in output_formats().values() if not f.directory) else ""


def _edits(a: str, b: str) -> int:
    """Levenshtein distance (suffixes are short)."""
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (ca != cb))
    return row[-1]


# Other tools' file formats: OUT named so means a file of that kind, which no format here writes (not a folder)
FOREIGN_FILE_SUFFIXES = (".gguf", ".ggml", ".onnx", ".pkl", ".pickle", ".npz", ".npy", ".h5", ".hdf5", ".msgpack",
                         ".tflite", ".mlmodel", ".nemo", ".tar", ".zip", ".gz", ".json", ".txt")


def _refuse_near_miss(out: Path) -> None:
    """A folder name whose suffix looks like a typo of a file format's (``model.safetensor``, ``.savetensors``),
    hides one (``model.safetensors.tmp``) or is another tool's file format (``model.gguf``): a folder is surely not
    what was meant.  ``Qwen2.5-0.5B-sft`` is far from every suffix and stays a folder."""
    known = sorted({s for f in output_formats().values() if not f.directory for s in f.suffixes + f.accepts})
    suffixes = [s.lower() for s in out.suffixes]
    if not suffixes:
        return
    if suffixes[-1] in FOREIGN_FILE_SUFFIXES:
        raise OutputError(f"ends in {out.suffix!r}, a file format dsckpt does not write (it writes "
                          f"{', '.join(known)}, or a folder)",
                          hint=f"name OUT with one of those suffixes, or end it with / for a sharded folder of that name", at=out)
    hidden = next((s for s in suffixes[:-1] if s in known), None)
    near = [k for k in known if _edits(suffixes[-1], k) <= (1 if len(k) <= 4 else 2)]
    meant = hidden or (min(near, key=lambda k: _edits(suffixes[-1], k)) if near else None)
    if meant:
        stem = out.name[:out.name.lower().index(hidden)] if hidden else out.name[:-len(suffixes[-1])]
        fixed = out.with_name(stem + meant)
        raise OutputError(f"ends in {out.suffix!r}, which no format writes; did you mean {fixed.name}?",
                          hint=f"write {shlex.quote(str(fixed))}, or end OUT with / for a sharded folder of that name", at=out)


def for_output(out: str | Path, form: str | None = None) -> Format:
    """The format for OUT: ``form`` when given (checked against OUT's name), else what the name says.

    A known file suffix (any case) picks its format; anything else - no suffix, a suffix no format
    claims (``gpt2-v1.5``), a trailing slash - is a folder.  A name that contradicts ``form``
    (``lt.safetensors`` with ``lightning``, ``model.pt`` with a folder format) is refused: the file
    would lie about what it holds.
    """
    suffix = "" if names_a_folder(out) else file_suffix(out)
    if form is None:
        if suffix:
            return next(f for f in output_formats().values() if not f.directory and suffix in f.suffixes)
        if not names_a_folder(out):
            _refuse_near_miss(Path(out))
        return next(f for f in output_formats().values() if f.directory and f.default_for_folders)
    fmt = by_name(form)
    if fmt.directory and suffix:
        raise OutputError(f"ends in {suffix}, a file suffix, but {fmt.name} writes a folder",
                          hint="name the folder without a file suffix (or end it with /)", at=out)
    if not fmt.directory and names_a_folder(out):
        raise OutputError(f"names a folder, but {fmt.name} writes one file", at=out)
    if not fmt.directory and suffix and suffix not in fmt.suffixes + fmt.accepts:
        owner = next(f.name for f in output_formats().values() if suffix in f.suffixes)
        raise OutputError(f"ends in {suffix}, the suffix of {owner} files, but --format {fmt.name} "
                          f"writes {'/'.join(fmt.suffixes + fmt.accepts)}",
                          hint=f"name it {shlex.quote(str(Path(out).with_suffix(fmt.suffixes[0])))}" if fmt.suffixes else None, at=out)
    return fmt


def by_name(name: str) -> Format:
    """A format chosen explicitly (``--hf``, ``--format``) rather than by OUT's suffix."""
    if name not in output_formats():
        raise OutputError(f"unknown output format {name!r}; known: {', '.join(sorted(output_formats()))}")
    return output_formats()[name]


def for_input(path: Path) -> Format | None:
    """The format of an existing consolidated file or folder, or None (not one any format reads).

    A DeepSpeed checkpoint is told apart first by ``api.paths.classify``: call that for a user's path.
    """
    return next((f for f in output_formats().values() if f.reads(Path(path))), None)


def weights_file_in(folder: Path) -> Path | None:
    """The first file in ``folder`` a format reads: a ``save_pretrained`` folder's weights when it has no index."""
    inside = sorted(c for c in folder.iterdir() if c.is_file() and for_input(c) is not None)
    return inside[0] if inside else None
