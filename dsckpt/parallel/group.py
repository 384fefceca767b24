"""The processes of a run: one (``ONE_PROCESS``), ``--nproc``'s (no torch) or torchrun's over gloo; one verdict for all.

Every phase of a distributed command ends in ``Group.agree(error)``: each process says whether its part
worked, and if any failed, every process raises the same typed error (the lowest failing rank's, naming
it), so no process goes on into a collective the others have left.  A process that dies mid-phase makes
the others' calls fail (or time out, ``DSCKPT_DIST_TIMEOUT`` seconds, default 600): that becomes one
``DistributedError`` too, and nothing is published.  The verbs (``api``) take ``group=None`` for one process
and run the same steps: with one process every collective is the identity.  How objects travel is the
``transport``'s business (``parallel.transport``): only torchrun's processes import torch for it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from .. import errors
from ..errors import DistributedError, DsckptError

if TYPE_CHECKING:  # (sockets and challenges load with a group of several: one process starts without them)
    from .transport import Transport

T = TypeVar("T")


def launched() -> bool:
    """This process is one of several started by torchrun (or ``--nproc``)."""
    return "LOCAL_RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1


@dataclass(frozen=True)
class Group:
    rank: int = 0
    size: int = 1
    node: int = 0  # torchrun's node rank (GROUP_RANK): processes of one node share a host

    transport: Transport | None = field(default=None, compare=False, repr=False)

    def gather(self, obj: Any) -> list[Any]:
        return [obj] if self.size == 1 else self._wire().gather(obj)

    def broadcast(self, obj: Any, src: int) -> Any:
        return obj if self.size == 1 else self._wire().broadcast(obj, src)

    def _wire(self) -> Transport:
        if self.transport is None:
            raise RuntimeError(f"a group of {self.size} processes without a transport")
        return self.transport

    def agree(self, error: BaseException | None) -> None:
        """Raise on every process if ``error`` was raised on any (re-raised here unchanged)."""
        if self.size == 1:
            if error is not None:
                raise error
            return
        mine = None if error is None else _describe(error)
        verdicts = self.gather(mine)
        failed = [(r, v) for r, v in enumerate(verdicts) if v is not None]
        if error is not None and failed[0][0] == self.rank and isinstance(error, DsckptError):
            raise error
        if failed:
            rank, (name, message, hint, at) = failed[0]
            cls = getattr(errors, name, None)
            cls = cls if isinstance(cls, type) and issubclass(cls, DsckptError) else DistributedError
            where = "" if len(failed) == self.size else f" [process {rank} of {self.size}]"
            raise cls(message + where, hint=hint, at=at) from error

    def step(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` here, then agree: its result on every process, or the same error on every process."""
        try:
            result = fn()
        except Exception as exc:  # anything: the others must not wait in a collective this process never joins
            self.agree(exc)
            raise
        self.agree(None)
        return result


ONE_PROCESS = Group()


def _describe(error: BaseException) -> tuple[str, str, str | None, str | None]:
    """An error as it travels: its class's name, message, hint and what it is about (data still: ``at``)."""
    if isinstance(error, DsckptError):
        return type(error).__name__, error.message, error.hint, None if error.at is None else str(error.at)
    return "DistributedError", f"{type(error).__name__}: {error}", None, None


def init_group() -> Group:
    """Join the run's group: ``--nproc``'s local hub, else torchrun's over gloo (TCP: the only service it needs)."""
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    from .transport import HUB_ENV, GlooTransport, LocalTransport

    hub = os.environ.get(HUB_ENV)
    transport = LocalTransport(rank, size, hub) if hub else GlooTransport()
    return Group(rank, size, int(os.environ.get("GROUP_RANK", "0")), transport)
