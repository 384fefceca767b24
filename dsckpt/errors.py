"""Typed errors: one class per broken invariant, each message names the file or tensor.

The CLI maps every ``DsckptError`` to a one-line message and exit code 2; anything else is a bug
and keeps its traceback.  ``DSCKPT_DEBUG=1`` shows the traceback for dsckpt errors too.
"""
from __future__ import annotations

from typing import Callable


class Interrupted(BaseException):
    """Ctrl-C (or a launcher's SIGINT/SIGTERM) ended a run: exit 130.  Not a KeyboardInterrupt, which click
    would answer with a stray newline on stderr in every process; a BaseException, as KeyboardInterrupt is,
    so that no library's ``except Exception`` swallows it."""

    signalled = False  # set by a rank's SIGINT handler: a collective's error raised after it is this interruption


class DsckptError(Exception):
    """Base class of every error dsckpt raises on purpose.

    ``at`` is what the error is about - a file, a folder, a tensor - kept as data apart from the ``message`` and
    shown first (``str(error)`` is ``"<at>: <message>"``), so that whoever knows a file by another name (a
    bucket's local view, a copy another host sent) renames it with ``named`` instead of rewriting text."""

    hint: str | None = None  # advice for the user (CLI flags belong here, not in the message)
    at: object = None  # str or os.PathLike: the file or place it concerns (None: the message says all)

    def __init__(self, message: str, hint: str | None = None, at: object = None):
        super().__init__(message)
        self.message = message
        if hint is not None:
            self.hint = hint
        if at is not None:
            self.at = at

    def __str__(self) -> str:
        return self.message if self.at is None else f"{self.at}: {self.message}"

    def named(self, name: "Callable[[object], object]") -> "DsckptError":
        """This error with ``at`` as ``name`` gives it (a local view's path as the URL the user typed)."""
        if self.at is not None:
            self.at = name(self.at)
        return self


class MissingExtraError(DsckptError):
    """A command needs packages the base install leaves out (torch, DeepSpeed: the runtime extra)."""


class ConfigError(DsckptError):
    """A DeepSpeed config or runtime argument is invalid."""


class UnsupportedPrecisionError(ConfigError):
    """The requested training precision cannot run on this machine (or the model came out in another)."""


class CheckpointNotFoundError(DsckptError):
    """The path does not exist or holds no DeepSpeed checkpoint."""


class TagError(DsckptError):
    """No tag can be chosen: ambiguous, or named but missing."""


class MissingRankError(DsckptError):
    """A rank file that the checkpoint's own world size requires is absent."""


class UnreadableFileError(DsckptError):
    """A file exists but cannot be opened or read (permission denied, an I/O error)."""


class CorruptFileError(DsckptError):
    """A file cannot be parsed: truncated, not a zip, a broken pickle, a bad header."""


class LimitExceededError(CorruptFileError):
    """A size a file declares (pickle, container, world size, nesting...) is beyond a safety limit."""


class ByteRangeError(CorruptFileError):
    """A tensor or zip entry points outside its storage or file, or overlaps another."""


class UnsafeCheckpointError(DsckptError):
    """Loading would need a class outside the allowlist (code could run); names the class."""


class UnsupportedCheckpointError(DsckptError):
    """A valid checkpoint of a kind dsckpt does not handle yet (TP/PP > 1, unknown stage)."""


class InconsistentCheckpointError(DsckptError):
    """Files disagree with each other or with the recorded shapes (numel accounting, mixed runs)."""


class AmbiguousRankError(InconsistentCheckpointError):
    """Two files claim the same rank (``zero_pp_rank_0`` and ``zero_pp_rank_00``, a stale ``bf16_`` copy)."""


class OutputError(DsckptError):
    """The output path is unusable: exists, is an input, or its folder is missing."""


class WorldSizeMismatchError(DsckptError):
    """A sharded checkpoint is loaded at another data-parallel world size."""


class StateDictMismatchError(DsckptError):
    """Strict full-weights loading found missing, unexpected or mis-shaped keys."""


class VerificationError(DsckptError):
    """A written output does not match its source."""


class BackgroundSaveError(DsckptError):
    """A checkpoint persisted in the background failed; the previous tag and `latest` are intact."""


class DistributedError(DsckptError):
    """A distributed run (torchrun, --nproc) lost a process or disagreed about its input."""


def missing_modules(*names: str) -> list[str]:
    """The modules among ``names`` that cannot be imported here (for a ``MissingExtraError``); nothing is imported."""
    import importlib.util

    def absent(module: str) -> bool:
        try:
            return importlib.util.find_spec(module) is None
        except (ImportError, ValueError):  # a blocked or broken package counts as absent
            return True

    return [name for name in names if absent(name)]
