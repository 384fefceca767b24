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


def _script(tmp_path, body: str):
    path = tmp_path / "rank.py"
    path.write_text("import json, os, signal, sys, time\nrank = int(os.environ['RANK'])\n" + body)
    return str(path)


def test_every_rank_gets_torchruns_worker_environment(tmp_path):
    script = _script(tmp_path, f"json.dump({{k: os.environ.get(k) for k in {RANK_ENV!r}}}, "
                               f"open(sys.argv[1] + f'/env{{rank}}.json', 'w'))\n")
    assert launch.launch(3, [str(tmp_path)], script=script) == 0
    envs = [json.loads((tmp_path / f"env{r}.json").read_text()) for r in range(3)]
    for r, env in enumerate(envs):
        assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == (str(r), str(r), "3", "3")
        assert env["GROUP_RANK"] == "0" and env["MASTER_ADDR"] == "127.0.0.1"
    assert len({(e["MASTER_PORT"], e["TORCHELASTIC_RUN_ID"]) for e in envs}) == 1  # one rendezvous for all


def test_a_rank_killed_by_a_signal_is_named_and_the_others_are_stopped(tmp_path, monkeypatch):
    monkeypatch.setattr(launch, "FAILURE_GRACE_S", 0.5)  # rank 0 would wait in a collective: it is stopped
    script = _script(tmp_path, "if rank == 1: os.kill(os.getpid(), signal.SIGKILL)\ntime.sleep(60)\n")
    started = time.monotonic()
    with pytest.raises(launch.RankError, match=r"^rank 1 of 2 was killed by SIGKILL$") as caught:
        launch.launch(2, [], script=script)
    assert "dmesg" in caught.value.hint and time.monotonic() - started < 30


def test_a_typed_rank_error_is_reported_once_with_its_ranks(tmp_path):
    from dsckpt.runtime.console import ERROR_DIR_ENV

    script = _script(tmp_path, "json.dump({'message': 'bad thing', 'hint': 'fix it'}, "
                               f"open(os.path.join(os.environ[{ERROR_DIR_ENV!r}], f'rank{{rank}}.json'), 'w'))\n"
                               "sys.exit(2)\n")
    with pytest.raises(launch.RankError, match=r"^bad thing$") as caught:
        launch.launch(2, [], script=script)
    assert caught.value.hint == "fix it"


def test_sigint_to_the_launcher_alone_stops_every_rank(tmp_path):
    """Not a terminal's Ctrl-C (that reaches every rank itself): `kill -INT` of the launcher only."""
    script = _script(tmp_path, "open(sys.argv[1] + f'/.up{rank}', 'w').write(str(os.getpid()))\n"
                               "os.replace(sys.argv[1] + f'/.up{rank}', sys.argv[1] + f'/up{rank}')\ntime.sleep(120)\n")
    code = ("import sys; from dsckpt.runtime.launch import launch; from dsckpt.errors import Interrupted\n"
            f"try: launch(2, [{str(tmp_path)!r}], script={script!r})\n"
            "except Interrupted: sys.exit(130)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
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


def test_interrupted_is_not_an_exception_libraries_swallow():
    assert not issubclass(Interrupted, Exception)  # as KeyboardInterrupt: `except Exception` lets it pass


def test_nproc_ranks_meet_without_torch_and_a_vanished_rank_is_one_typed_error(tmp_path, monkeypatch):
    """``--nproc``'s ranks gather and broadcast over the launcher's local hub; none imports torch for it, and
    when rank 2 exits mid-run the others get a DistributedError at once (not a hang until the timeout)."""
    script = _script(tmp_path, "from dsckpt.parallel.group import init_group\n"
                               "from dsckpt.errors import DistributedError\n"
                               "g = init_group()\n"
                               "seen = {'gather': g.gather(rank * 10), 'bcast': g.broadcast(f'from {rank}', src=1),\n"
                               "        'torch': 'torch' in sys.modules}\n"
                               "if rank == 2: sys.exit(0)\n"
                               "try: g.gather(rank)\n"
                               "except DistributedError as exc: seen['error'] = str(exc)\n"
                               "json.dump(seen, open(sys.argv[1] + f'/seen{rank}.json', 'w'))\n")
    monkeypatch.setenv("DSCKPT_DIST_TIMEOUT", "60")
    started = time.monotonic()
    assert launch.launch(3, [str(tmp_path)], script=script) == 0
    assert time.monotonic() - started < 30
    for r in range(3):
        if r == 2:
            continue
        seen = json.loads((tmp_path / f"seen{r}.json").read_text())
        assert seen["gather"] == [0, 10, 20] and seen["bcast"] == "from 1" and seen["torch"] is False
        assert "a process of the run stopped or cannot be reached" in seen["error"]


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
