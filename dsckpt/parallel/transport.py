"""How the processes of a run pass small objects (plans, verdicts) to each other.

Two transports behind one protocol:
1. ``GlooTransport``: torch.distributed over gloo, for torchrun's processes on one or many hosts.
2. ``LocalTransport``: for ``--nproc N`` on one host, no torch at all (its import costs each process a
   second or more): rank 0 is a hub the others connect to over loopback TCP, authenticated with a key
   only the launcher and its children know (``multiprocessing.connection``'s HMAC handshake).  A gather
   is every object sent to the hub and the list sent back; a broadcast goes through the hub.
Either way a peer that is gone or silent past ``DSCKPT_DIST_TIMEOUT`` seconds becomes one
``DistributedError``.
"""
from __future__ import annotations

import datetime
import os
import time
import socket
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import Any, Protocol

from ..errors import DistributedError

TIMEOUT_ENV = "DSCKPT_DIST_TIMEOUT"
HUB_ENV = "DSCKPT_LOCAL_HUB"  # "port:hexkey", set by the --nproc launcher for its ranks
GONE_HINT = "see that process's own output; rerun the same command on every host"


def timeout_s() -> float:
    return float(os.environ.get(TIMEOUT_ENV, "600"))


def gone(detail: str) -> DistributedError:
    return DistributedError(f"a process of the run stopped or cannot be reached ({detail[:200]}); nothing was published",
                            hint=GONE_HINT)


class Transport(Protocol):
    def gather(self, obj: Any) -> list[Any]: ...

    def broadcast(self, obj: Any, src: int) -> Any: ...


class comm_errors:
    """gloo's failures (a peer gone, a timeout) as one typed error."""

    def __enter__(self) -> "comm_errors":
        return self

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        if exc is not None and isinstance(exc, RuntimeError) and not isinstance(exc, DistributedError):
            raise gone(str(exc).splitlines()[0]) from None


class GlooTransport:
    """torch.distributed's default group (started here when none is), or ``group``: a gloo group of its own."""

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            with comm_errors():
                dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s()))
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)

    def gather(self, obj: Any) -> list[Any]:
        import torch.distributed as dist

        out: list[Any] = [None] * self.size
        with comm_errors():
            dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast(self, obj: Any, src: int) -> Any:
        import torch.distributed as dist

        box = [obj]
        with comm_errors():
            dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]


def hub_environment(port: int) -> dict[str, str]:
    """What the launcher gives every rank so they find (and trust) the hub."""
    return {HUB_ENV: f"{port}:{os.urandom(16).hex()}"}


def _connection(sock: socket.socket) -> Connection:
    # Connection writes a large message's header and body apart: under Nagle the body waits for a delayed ACK
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return Connection(sock.detach())


class LocalTransport:
    """Rank 0 holds one connection to every other rank (step 2)."""

    def __init__(self, rank: int, size: int, hub: str) -> None:
        port, key = hub.split(":")
        self.rank, self.size, self.timeout = rank, size, timeout_s()
        address, authkey = ("127.0.0.1", int(port)), bytes.fromhex(key)
        try:
            if rank == 0:
                self.peers = self._accept(address, authkey)
            else:
                self.hub = self._connect(address, authkey)
        except (OSError, EOFError, AuthenticationError) as exc:
            raise gone(f"{type(exc).__name__}: {exc}") from None

    def _accept(self, address: tuple[str, int], authkey: bytes) -> dict[int, Connection]:
        peers: dict[int, Connection] = {}
        with socket.create_server(address) as server:
            server.settimeout(self.timeout)  # a rank that never comes is an error, not a hang
            while len(peers) < self.size - 1:
                sock, _ = server.accept()
                sock.settimeout(None)
                conn = _connection(sock)
                deliver_challenge(conn, authkey)  # the order Client() expects
                answer_challenge(conn, authkey)
                peers[self._recv(conn)] = conn
        return peers

    def _connect(self, address: tuple[str, int], authkey: bytes) -> Connection:
        deadline = time.monotonic() + self.timeout
        while True:  # rank 0 may not be listening yet
            try:
                conn = _connection(socket.create_connection(address))
            except ConnectionRefusedError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.002)
                continue
            answer_challenge(conn, authkey)  # the order _accept expects
            deliver_challenge(conn, authkey)
            conn.send(self.rank)
            return conn

    def _recv(self, conn: Connection) -> Any:
        try:
            if not conn.poll(self.timeout):
                raise gone(f"no word for {self.timeout:.0f} s")
            return conn.recv()
        except (OSError, EOFError) as exc:
            raise gone(f"{type(exc).__name__}: {exc}") from None

    def _send(self, conn: Connection, obj: Any) -> None:
        try:
            conn.send(obj)
        except (OSError, EOFError) as exc:
            raise gone(f"{type(exc).__name__}: {exc}") from None

    def gather(self, obj: Any) -> list[Any]:
        if self.rank != 0:
            self._send(self.hub, obj)
            gathered: list[Any] = self._recv(self.hub)
            return gathered
        everyone = [obj] + [self._recv(self.peers[r]) for r in range(1, self.size)]
        for conn in self.peers.values():
            self._send(conn, everyone)
        return everyone

    def broadcast(self, obj: Any, src: int) -> Any:
        if self.rank != 0:
            if self.rank == src:
                self._send(self.hub, obj)
                return obj
            return self._recv(self.hub)
        if src != 0:
            obj = self._recv(self.peers[src])
        for r, conn in self.peers.items():
            if r != src:
                self._send(conn, obj)
        return obj
