"""`--nproc`'s launcher (runtime/launch.py) with plain Python ranks: no torch, a second each.

The DeepSpeed flows through it (train, resume, Ctrl-C mid-save, one error for all ranks) are in
test_cli_contract and test_runtime_*; these pin what those cannot reach quickly: the environment a rank
gets, a rank killed by a signal, a signal sent to the launcher alone.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from dsckpt.errors import Interrupted
from dsckpt.runtime import launch

RANK_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
            "TORCHELASTIC_RUN_ID")


HOW = ["spawn", "fork"]  # fresh interpreters (torch's commands, any script) or forks (consolidate, reshard, convert)
PRELUDE = "import json, os, signal, sys, time\n"


def _script(tmp_path, body: str):
    path = tmp_path / "rank.py"
    path.write_text(PRELUDE + "rank = int(os.environ['RANK'])\n" + body)
    return str(path)


def _forking(tmp_path, nproc: int, body: str, argv: list[str]) -> str:
    """A program whose launcher forks ``nproc`` ranks that run ``body`` (then ``os._exit``, as ``cli.app.main``
    ends them); it prints the launch's outcome.  In a fresh interpreter: this one has xdist's threads."""
    path = tmp_path / "forking.py"
    indented = "".join(f"        {line}\n" for line in body.splitlines())
    path.write_text(PRELUDE + "from dsckpt.runtime import launch\n"
                    "from dsckpt.errors import Interrupted\n"
                    "launch.FAILURE_GRACE_S = 0.5\n"  # (as the spawning tests set it, in this process)
                    f"sys.argv[1:] = {argv!r}\n"
                    "try:\n"
                    f"    code = launch.fork_ranks({nproc})\n"
                    "except launch.RankError as exc:\n"
                    "    print(json.dumps({'error': str(exc), 'hint': exc.hint})); sys.exit(2)\n"
                    "except Interrupted:\n"
                    "    sys.exit(130)\n"
                    "if code is None:\n"
                    "    rank = int(os.environ['RANK'])\n"
                    "    try:\n" + indented + "    finally:\n        os._exit(0)\n"
                    "print(json.dumps({'code': code}))\n")
    return str(path)


def _launch(how: str, tmp_path, nproc: int, body: str, argv: list[str] = ()) -> int:
    """``launch.launch`` of a script running ``body``, or the same ranks forked: the exit code, or the RankError."""
    if how == "spawn":
        return launch.launch(nproc, list(argv), script=_script(tmp_path, body))
    temp = tmp_path / "temp"
    temp.mkdir(exist_ok=True)
    proc = subprocess.run([sys.executable, _forking(tmp_path, nproc, body, list(argv))], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "TMPDIR": str(temp)})
    assert proc.returncode in (0, 2), proc.stderr[-3000:]
    assert not list(temp.iterdir())  # the ranks' error folder is gone
    outcome = json.loads(proc.stdout)
    if "error" in outcome:
        raise launch.RankError(outcome["error"], hint=outcome["hint"])
    return outcome["code"]


@pytest.mark.parametrize("how", HOW)
def test_every_rank_gets_torchruns_worker_environment(tmp_path, how):
    body = (f"json.dump({{k: os.environ.get(k) for k in {RANK_ENV!r}}}, "
            f"open(sys.argv[1] + f'/env{{rank}}.json', 'w'))\n")
    assert _launch(how, tmp_path, 3, body, [str(tmp_path)]) == 0
    envs = [json.loads((tmp_path / f"env{r}.json").read_text()) for r in range(3)]
    for r, env in enumerate(envs):
        assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == (str(r), str(r), "3", "3")
        assert env["GROUP_RANK"] == "0" and env["MASTER_ADDR"] == "127.0.0.1"
    assert len({(e["MASTER_PORT"], e["TORCHELASTIC_RUN_ID"]) for e in envs}) == 1  # one rendezvous for all


@pytest.mark.parametrize("how", HOW)
def test_a_rank_killed_by_a_signal_is_named_and_the_others_are_stopped(tmp_path, monkeypatch, how):
    monkeypatch.setattr(launch, "FAILURE_GRACE_S", 0.5)  # rank 0 would wait in a collective: it is stopped
    body = "if rank == 1: os.kill(os.getpid(), signal.SIGKILL)\ntime.sleep(60)\n"
    started = time.monotonic()
    with pytest.raises(launch.RankError, match=r"^rank 1 of 2 was killed by SIGKILL$") as caught:
        _launch(how, tmp_path, 2, body)
    assert "dmesg" in caught.value.hint and time.monotonic() - started < 30


@pytest.mark.parametrize("how", HOW)
def test_a_typed_rank_error_is_reported_once_with_its_ranks(tmp_path, how):
    from dsckpt.runtime.console import ERROR_DIR_ENV

    body = ("json.dump({'message': 'bad thing', 'hint': 'fix it'}, "
            f"open(os.path.join(os.environ[{ERROR_DIR_ENV!r}], f'rank{{rank}}.json'), 'w'))\n"
            + ("sys.exit(2)\n" if how == "spawn" else "os._exit(2)\n"))
    with pytest.raises(launch.RankError, match=r"^bad thing$") as caught:
        _launch(how, tmp_path, 2, body)
    assert caught.value.hint == "fix it"


@pytest.mark.parametrize("how", HOW)
def test_sigint_to_the_launcher_alone_stops_every_rank(tmp_path, how):
    """Not a terminal's Ctrl-C (that reaches every rank itself): `kill -INT` of the launcher only."""
    body = ("open(sys.argv[1] + f'/.up{rank}', 'w').write(str(os.getpid()))\n"
            "os.replace(sys.argv[1] + f'/.up{rank}', sys.argv[1] + f'/up{rank}')\ntime.sleep(120)\n")
    if how == "spawn":
        script = _script(tmp_path, body)
        code = ("import sys; from dsckpt.runtime.launch import launch; from dsckpt.errors import Interrupted\n"
                f"try: launch(2, [{str(tmp_path)!r}], script={script!r})\n"
                "except Interrupted: sys.exit(130)\n")
        parent = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    else:
        parent = subprocess.Popen([sys.executable, _forking(tmp_path, 2, body, [str(tmp_path)])],
                                  start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"up{r}").exists() for r in range(2)) and time.monotonic() < deadline:
            time.sleep(0.05)
        ranks = [int((tmp_path / f"up{r}").read_text()) for r in range(2)]
        os.kill(parent.pid, signal.SIGINT)
        assert parent.wait(timeout=60) == 130
        assert not [pid for pid in ranks if os.path.exists(f"/proc/{pid}")]  # no rank outlives its launcher
    finally:
        if parent.poll() is None:
            os.killpg(parent.pid, signal.SIGKILL)


def test_rendezvous_ports_come_from_below_the_ephemeral_range_whatever_the_seed():
    """A port of the ephemeral range may be taken by any outgoing connection before the store binds it, and the
    runtime seeds Python's random before it starts its process group: two runs picked the same port (both seen in
    full test runs)."""
    import random

    low = launch._ephemeral_low()
    random.seed(0)
    first = [launch.free_port() for _ in range(8)]
    random.seed(0)
    second = [launch.free_port() for _ in range(8)]
    assert all(20000 <= port < low for port in first + second) and first != second


def test_interrupted_is_not_an_exception_libraries_swallow():
    assert not issubclass(Interrupted, Exception)  # as KeyboardInterrupt: `except Exception` lets it pass


@pytest.mark.parametrize("how", HOW)
def test_nproc_ranks_meet_without_torch_and_a_vanished_rank_is_one_typed_error(tmp_path, monkeypatch, how):
    """``--nproc``'s ranks gather and broadcast over the launcher's local hub; none imports torch for it, its
    connections send at once (TCP_NODELAY: else a large object waits ~40 ms for a delayed ACK), and when
    rank 2 exits mid-run the others get a DistributedError at once (not a hang until the timeout)."""
    body = ("import socket\n"
            "from dsckpt.parallel.group import init_group\n"
            "from dsckpt.errors import DistributedError\n"
            "g = init_group()\n"
            "conns = list(g.transport.peers.values()) if rank == 0 else [g.transport.hub]\n"
            "seen = {'gather': g.gather(rank * 10), 'bcast': g.broadcast(f'from {rank}', src=1),\n"
            "        'torch': 'torch' in sys.modules, 'nodelay': [socket.socket(fileno=os.dup(c.fileno()))\n"
            "        .getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for c in conns]}\n"
            "if rank == 2: sys.exit(0)\n"
            "try: g.gather(rank)\n"
            "except DistributedError as exc: seen['error'] = str(exc)\n"
            "json.dump(seen, open(sys.argv[1] + f'/seen{rank}.json', 'w'))\n")
    monkeypatch.setenv("DSCKPT_DIST_TIMEOUT", "60")
    started = time.monotonic()
    assert _launch(how, tmp_path, 3, body, [str(tmp_path)]) == 0
    assert time.monotonic() - started < 30
    for r in range(3):
        if r == 2:
            continue
        seen = json.loads((tmp_path / f"seen{r}.json").read_text())
        assert seen["gather"] == [0, 10, 20] and seen["bcast"] == "from 1" and seen["torch"] is False
        assert seen["nodelay"] == [1] * (2 if r == 0 else 1)
        assert "a process of the run stopped or cannot be reached" in seen["error"]


@pytest.mark.parametrize("how", HOW)
def test_an_aborted_run_leaves_no_temp_when_a_member_writes_after_its_leader_gave_up(tmp_path, how):
    """A Ctrl-C reaches the processes one at a time: the leader abandons the staged output first, a member
    still writing its part makes a folder in it again; its own abort removes that too."""
    body = ("from pathlib import Path\n"
            "from dsckpt.parallel.group import init_group\n"
            "from dsckpt.parallel.outputs import GroupStaging, storage_groups\n"
            "g = init_group()\n"
            "out = Path(sys.argv[1]) / 'out' / 'ckpt'\n"
            "staged = GroupStaging(g, storage_groups(g, out), out, directory=True, fsync=False, publishing={0})\n"
            "staged.create()\n"
            "seen = g.gather(sorted(os.listdir(out.parent)))\n"
            "if rank == 0: staged.abort()\n"
            "g.gather(None)\n"
            "if rank == 1:\n"
            "    (staged.tmp / 'step1').mkdir(parents=True, exist_ok=True)\n"
            "    (staged.tmp / 'step1' / 'part').write_bytes(b'x')\n"
            "    staged.abort()\n"
            "g.gather(None)\n"
            "if rank == 0: json.dump([seen, sorted(os.listdir(out.parent))], open(sys.argv[1] + '/seen.json', 'w'))\n")
    (tmp_path / "out").mkdir()
    assert _launch(how, tmp_path, 2, body, [str(tmp_path)]) == 0
    staged, left = json.loads((tmp_path / "seen.json").read_text())
    assert len(staged[0]) == 1 and ".ckpt.dsckpt-tmp-" in staged[0][0]  # (the temp existed)
    assert left == []


def test_the_cli_forks_its_ranks_where_it_may_and_not_where_it_must_not():
    """``dsckpt consolidate --nproc N`` from ``main`` forks (no interpreter start per rank); a process with a
    second thread, or with torch imported, or not entered through ``main``, starts fresh interpreters."""
    code = ("import sys, threading\n"
            "from dsckpt.cli import app\n"
            "print(app.may_fork_ranks())\n"
            "app._in_main = True\n"
            "print(app.may_fork_ranks())\n"
            "stop = threading.Event(); t = threading.Thread(target=stop.wait); t.start()\n"
            "print(app.may_fork_ranks()); stop.set(); t.join()\n"
            "sys.modules['torch'] = None\n"
            "print(app.may_fork_ranks())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "True", "False", "False"]


def test_the_launcher_wakes_when_a_rank_exits_not_at_its_next_poll():
    """``_ExitWatch.pause`` returns as soon as a watched rank ends (pidfds), and watches only those still running."""
    quick = subprocess.Popen([sys.executable, "-c", "pass"])
    slow = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with launch._ExitWatch([quick, slow]) as watch:
            if not watch.fds:
                pytest.skip("no pidfd_open here: the launcher sleeps its polling period instead")
            start = time.monotonic()
            watch.pause(20)
            assert time.monotonic() - start < 10  # woken by the quick rank's exit, not the 20 s timeout
            assert len(watch.fds) == 1  # the ended rank's pidfd is closed; the slow one is still watched
            start = time.monotonic()
            watch.pause(0.2)
            assert time.monotonic() - start >= 0.15  # nothing else ended: a full pause, not a busy loop
        assert watch.fds == []
    finally:
        slow.kill()
        slow.wait()
        quick.wait()
