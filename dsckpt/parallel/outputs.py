"""Where a distributed run's outputs land: which processes share a filesystem, temp paths, publishing.

``storage_groups(group, out)``: processes that see the same folder at OUT's parent form one storage group
(one host with a node-local disk; every process on a shared filesystem).  Found by probing, not by host
names: the lowest unassigned process creates a probe folder beside OUT named with a token, every process
that sees it joins that group, until all are assigned.  Each group's leader (its lowest process) owns the
group's temp output and publishes it.

``GroupStaging``: one temp path per storage group, the same name everywhere (from rank 0), written by the
group's members; published by the leaders (``io.output.Staging``, the one commit protocol) only after every
process has agreed that every part is written and flushed - so an interrupted run publishes nothing.  On
error every process removes its group's temp.  One process is one group of one: no probe, Staging's own temp name.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

from ..io.output import TEMP_MARK, Staging, remove_path
from .group import Group


@dataclass(frozen=True)
class StorageGroups:
    of: tuple[int, ...]  # process -> its storage group's leader

    def members(self, leader: int) -> list[int]:
        return [r for r, g in enumerate(self.of) if g == leader]

    @property
    def leaders(self) -> list[int]:
        return sorted(set(self.of))


def storage_groups(group: Group, out: Path) -> StorageGroups:
    if group.size == 1:
        return StorageGroups((0,))
    token = group.broadcast(os.urandom(4).hex() if group.rank == 0 else None, 0)
    probe = out.parent / f".{out.name}.dsckpt-probe-{token}"
    of: list[int | None] = [None] * group.size
    while None in of:
        leader = of.index(None)
        error = None
        if group.rank == leader:
            try:
                probe.mkdir()
                (probe / "leader").write_text(str(leader))
            except OSError as exc:
                error = exc
        group.agree(error)
        seen = None
        if of[group.rank] is None:
            with contextlib.suppress(OSError):
                seen = leader if (probe / "leader").read_text() == str(leader) else None
        for rank, answer in enumerate(group.gather(seen)):
            if answer is not None and of[rank] is None:
                of[rank] = answer
        if group.rank == leader:
            remove_path(probe)
        group.agree(None)  # the probe is gone before the next leader makes its own
    return StorageGroups(tuple(of))  # type: ignore[arg-type]


class GroupStaging:
    """OUT's temp path in this process's storage group, committed by ``io.output.Staging`` (see the module
    docstring): the leader of each publishing group owns a ``Staging``; every phase ends in agreement."""

    def __init__(self, group: Group, groups: StorageGroups, out: Path, directory: bool, fsync: bool,
                 publishing: set[int]):
        """``publishing``: the storage groups (leaders) that receive a part of OUT; the others write nothing."""
        self.group, self.out, self.directory, self.fsync = group, out, directory, fsync
        self.leader = groups.of[group.rank]
        self.leads = self.leader == group.rank and self.leader in publishing
        self.staging = Staging(fsync) if self.leads else None  # OUT's temp, and rank 0's sidecars
        self._tmp: Path | None = None  # one process: Staging names it (and removes dead processes' temps)
        if group.size > 1:
            pid, token = group.broadcast((os.getpid(), os.urandom(4).hex()) if group.rank == 0 else None, 0)
            self._tmp = out.parent / f".{out.name}{TEMP_MARK}{pid}-{token}"

    @property
    def tmp(self) -> Path:
        """OUT's temp path (named once ``create`` has run, at one process)."""
        if self._tmp is None:
            raise RuntimeError("GroupStaging.tmp read before create()")
        return self._tmp

    @property
    def own(self) -> Staging:
        """The leader's ``Staging`` (other processes have none)."""
        if self.staging is None:
            raise RuntimeError("only a publishing group's leader stages OUT")
        return self.staging

    @property
    def durable(self) -> tuple[Path, ...]:
        """The temps the commit will fsync (a write's context: ``io.context.WriteContext.durable``); every member
        writes into OUT's, its leader flushes it."""
        return (self._tmp,) if self.fsync and self._tmp is not None else ()

    def create(self) -> None:
        """The leaders make the temp folder (a file output is created by its writer); all agree."""
        def make() -> None:
            if self.leads:
                self._tmp = self.own.temp_for(self.out, self.directory, self._tmp)
        self.group.step(make)

    def publish(self, stale: list[Path] | None = None) -> None:
        """Every part is written (agreed by the caller): leaders flush, all agree, leaders rename into place
        and remove ``stale`` (an existing folder's files the new output supersedes: a previous index's shards)."""
        if self.leads:
            self.own.remove_on_commit(stale or ())
        self.group.step(lambda: self.own.flush() if self.leads else None)
        self.group.step(lambda: self.own.publish() if self.leads else None)

    def abort(self) -> None:
        """Every process removes the temp, each once its own writes have stopped: a member still writing when
        its leader aborted (a Ctrl-C reaches the processes one by one) may have made folders in it again."""
        if self._tmp is not None and self.group.size > 1:
            remove_path(self._tmp)
        if self.leads:
            self.own.abort()
