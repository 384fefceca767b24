"""The processes of a run: one (``ONE_PROCESS``, no torch) or torchrun's over gloo; one verdict for all.

Every phase of a distributed command ends in ``Group.agree(error)``: each process says whether its part
worked, and if any failed, every process raises the same typed error (the lowest failing rank's, naming
it), so no process goes on into a collective the others have left.  A process that dies mid-phase makes
the others' gloo calls fail (or time out, ``DSCKPT_DIST_TIMEOUT`` seconds, default 600): that becomes one
``DistributedError`` too, and nothing is published.  The verbs (``api``) take ``group=None`` for one process
and run the same steps: with one process every collective is the identity and nothing imports torch.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from .. import errors
from ..errors import DistributedError, DsckptError

T = TypeVar("T")
TIMEOUT_ENV = "DSCKPT_DIST_TIMEOUT"


def launched() -> bool:
    """This process is one of several started by torchrun (or ``--nproc``)."""
    return "LOCAL_RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1


@dataclass(frozen=True)
class Group:
    rank: int = 0
    size: int = 1
    node: int = 0  # torchrun's node rank (GROUP_RANK): processes of one node share a host

    def gather(self, obj: Any) -> list[Any]:
        if self.size == 1:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.size
        with comm_errors():
            dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj: Any, src: int) -> Any:
        if self.size == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        with comm_errors():
            dist.broadcast_object_list(box, src=src)
        return box[0]

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
            rank, (name, message, hint) = failed[0]
            cls = getattr(errors, name, None)
            cls = cls if isinstance(cls, type) and issubclass(cls, DsckptError) else DistributedError
            where = "" if len(failed) == self.size else f" [process {rank} of {self.size}]"
            raise cls(message + where, hint=hint) from error

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


def _describe(error: BaseException) -> tuple[str, str, str | None]:
    if isinstance(error, DsckptError):
        return type(error).__name__, str(error), error.hint
    return "DistributedError", f"{type(error).__name__}: {error}", None


class comm_errors:
    """gloo's failures (a peer gone, a timeout) as one typed error."""

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if exc is not None and isinstance(exc, RuntimeError) and not isinstance(exc, DsckptError):
            raise DistributedError(f"a process of the run stopped or cannot be reached ({str(exc).splitlines()[0][:200]}); "
                                   "nothing was published",
                                   hint="see that process's own output; rerun the same command on every host") from None
        return False


def init_group() -> Group:
    """Join torchrun's group over gloo (TCP: the only service it needs)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=float(os.environ.get(TIMEOUT_ENV, "600")))
        with comm_errors():
            dist.init_process_group("gloo", timeout=timeout)
    return Group(dist.get_rank(), dist.get_world_size(), int(os.environ.get("GROUP_RANK", "0")))

