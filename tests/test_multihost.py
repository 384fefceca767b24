"""Consolidate and reshard over torch.distributed (issue 28): many processes, many hosts, node-local files.

Hosts are simulated on this machine: each host is a torchrun node (``--nnodes K --node-rank k``, rendezvous
on 127.0.0.1) in a private mount namespace where the checkpoint path shows only that host's files (bind
mounts) and the output folder is that host's own.  The oracle is the single-process command: the same bytes.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import FIXTURES, PYTHONPATH, ROOT, run_cli
from dsckpt.runtime.launch import free_port

pytest.importorskip("torch")
pytestmark = pytest.mark.runtime  # starts process groups (no DeepSpeed): kept out of test-fast


def namespaces_refused() -> str | None:
    """Why this machine cannot simulate hosts with private mount namespaces (None: it can)."""
    try:
        proc = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"], capture_output=True,
                              text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"`unshare --mount` could not run: {exc}"
    if proc.returncode:
        return f"`unshare --mount` exited {proc.returncode}: {proc.stderr.strip()[:200] or 'no message'}"
    return None


REFUSED = namespaces_refused()
needs_namespaces = pytest.mark.skipif(REFUSED is not None, reason=f"hosts cannot be simulated here ({REFUSED}): "
                                      "the multi-host tests need private mount namespaces (root, or user namespaces)")




class Hosts:
    """K simulated hosts: ``files[k]`` are the checkpoint files host k sees (paths relative to the fixture)."""

    def __init__(self, tmp: Path, fixture: str, files: list[list[str]]):
        self.tmp, self.k = tmp, len(files)
        self.ckpt, self.outroot = tmp / "ckpt", tmp / "outroot"  # the paths every host uses
        self.ckpt.mkdir()
        self.outroot.mkdir()
        for host, names in enumerate(files):
            for name in names:
                dst = self.seen(host) / name
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(FIXTURES / fixture / name, dst)
            self.out(host).mkdir(parents=True)

    def seen(self, host: int) -> Path:
        return self.tmp / f"host{host}" / "ckpt"

    def out(self, host: int) -> Path:
        return self.tmp / f"host{host}" / "out"

    def start(self, *args, nproc: int = 1, env: dict | None = None) -> list[subprocess.Popen]:
        port = free_port()
        procs = []
        for host in range(self.k):
            run = (f"{shlex.quote(sys.executable)} -m torch.distributed.run --nnodes {self.k} --node-rank {host} "
                   f"--nproc-per-node {nproc} --master-addr 127.0.0.1 --master-port {port} -m dsckpt "
                   + " ".join(shlex.quote(str(a)) for a in args))
            script = (f"mount --bind {shlex.quote(str(self.seen(host)))} {shlex.quote(str(self.ckpt))} && "
                      f"mount --bind {shlex.quote(str(self.out(host)))} {shlex.quote(str(self.outroot))} && {run}")
            procs.append(subprocess.Popen(["unshare", "--mount", "--propagation", "private", "bash", "-c", script],
                                          cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                          start_new_session=True,
                                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": PYTHONPATH,
                                               **(env or {})}))
        return procs

    def run(self, *args, nproc: int = 1) -> list[tuple[int, str, str]]:
        procs = self.start(*args, nproc=nproc)
        outputs = [p.communicate(timeout=300) for p in procs]
        return [(p.returncode, out, err) for p, (out, err) in zip(procs, outputs)]

    def listing(self, host: int) -> list[str]:
        root = self.out(host)
        return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


Z3 = "z3_ws3_bf16"
Z3_SPLIT = [["latest", "reference.pt", "step3/zero_pp_rank_0_mp_rank_00_model_states.pt", "step3/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
             "step3/zero_pp_rank_1_mp_rank_00_model_states.pt", "step3/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"],
            ["step3/zero_pp_rank_2_mp_rank_00_model_states.pt", "step3/bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt"]]
Z2 = "z2_ws3_bf16"  # ZeRO-2: one model-states file, written by rank 0 only (on host 0)
Z2_SPLIT = [["latest", "reference.pt", "step3/mp_rank_00_model_states.pt", "step3/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
             "step3/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"],
            ["step3/bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt"]]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The single-process outputs every distributed run must equal byte for byte."""
    root = tmp_path_factory.mktemp("single")
    for name in (Z3, Z2):
        for m in (2, 4):
            proc = run_cli("reshard", FIXTURES / name, root / f"{name}_ws{m}", "-w", m, "--no-fsync", "-q")
            assert proc.returncode == 0, proc.stderr
        for out in ("m.safetensors", "m.pt", "sharded"):
            proc = run_cli("consolidate", FIXTURES / name, root / f"{name}_{out}", "--no-fsync", "-q",
                           *(["--max-shard-size", "20KB"] if out == "sharded" else []))
            assert proc.returncode == 0, proc.stderr
    return root


def _same_tree(a: Path, b: Path) -> list[str]:
    names = sorted(p.relative_to(a).as_posix() for p in a.rglob("*") if p.is_file())
    assert names == sorted(p.relative_to(b).as_posix() for p in b.rglob("*") if p.is_file())
    return [n for n in names if (a / n).read_bytes() != (b / n).read_bytes()]


@pytest.mark.parametrize("out", ["m.safetensors", pytest.param("m.pt", marks=pytest.mark.slow),
                                 "sharded"])
def test_nproc_consolidate_writes_the_same_bytes(single, tmp_path, out):
    """Two local processes: a .safetensors file filled in two parts, the other formats by rank 0."""
    extra = ["--max-shard-size", "20KB"] if out == "sharded" else []
    proc = run_cli("consolidate", FIXTURES / Z3, tmp_path / out, "--nproc", "2", "--no-fsync", "-q", *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = single / f"{Z3}_{out}"
    if want.is_dir():
        assert _same_tree(want, tmp_path / out) == []
    else:
        assert want.read_bytes() == (tmp_path / out).read_bytes()
    assert [p.name for p in tmp_path.iterdir() if "dsckpt" in p.name] == []  # no temp or view left


def test_nproc_consolidate_with_force_replaces_only_what_it_wrote(tmp_path):
    """Into an existing sharded folder: the shards its old index named go, a file dsckpt did not write stays."""
    out = tmp_path / "sharded"
    proc = run_cli("consolidate", FIXTURES / Z3, out, "--max-shard-size", "8KB", "--no-fsync", "-q")
    assert proc.returncode == 0, proc.stderr
    old = {p.name for p in out.glob("model-*")}
    (out / "README.md").write_text("mine")
    proc = run_cli("consolidate", FIXTURES / Z3, out, "--nproc", "2", "--force", "--no-fsync", "-q")
    assert proc.returncode == 0, proc.stderr[-3000:]
    new = {p.name for p in out.glob("model-*")}
    assert len(old) > 1 and new == {"model-00001-of-00001.safetensors"} and (out / "README.md").read_text() == "mine"


def test_nproc_reshard_writes_the_same_bytes(single, tmp_path):
    proc = run_cli("reshard", FIXTURES / Z2, tmp_path / "out", "-w", "4", "--nproc", "3", "--no-fsync", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count('"schema"') == 1  # one result document, from rank 0
    assert _same_tree(single / f"{Z2}_ws4", tmp_path / "out") == []


def test_nproc_errors_are_said_once_and_nothing_is_published(tmp_path):
    """--nproc's ranks (forks of the command): a missing rank file is one typed error, exit 2, no traceback."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / Z3, ckpt)
    (ckpt / "step3" / "bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt").unlink()
    proc = run_cli("reshard", ckpt, tmp_path / "out", "-w", "2", "--nproc", "2")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.splitlines()[0] == (f"dsckpt: error: {ckpt}/step3: optimizer-states file of rank 2 is missing "
                                           "(the checkpoint records world size 3)")
    assert proc.stderr.count("dsckpt: error:") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no output, no temp, no view


@needs_namespaces
@pytest.mark.parametrize("name, split, nproc", [(Z3, Z3_SPLIT, 1), (Z2, Z2_SPLIT, 2)])
def test_node_local_reshard_puts_each_target_rank_on_its_host(single, tmp_path, name, split, nproc):
    """2 hosts x nproc processes, each seeing only its own rank files; 4 target ranks: ranks 0-1 on host 0,
    2-3 on host 1 (target rank r on the host of process r * N // M), `latest` and the files every rank reads
    (ZeRO-2's model states) on both.  Together they are the single-process output, byte for byte."""
    hosts = Hosts(tmp_path, name, split)
    results = hosts.run("reshard", hosts.ckpt, hosts.outroot / "out", "-w", "4", "--no-fsync", nproc=nproc)
    assert all(code == 0 for code, _, _ in results), [err[-2000:] for _, _, err in results]
    want = single / f"{name}_ws4"
    ranks = {0: ("rank_0_", "rank_1_"), 1: ("rank_2_", "rank_3_")}
    for host in (0, 1):
        got = hosts.listing(host)
        assert "out/latest" in got
        for rel in got:
            assert (hosts.out(host) / rel).read_bytes() == (want / rel.removeprefix("out/")).read_bytes(), rel
        per_rank = [r for r in got if "zero_pp_rank_" in r]
        assert per_rank and all(any(k in r for k in ranks[host]) for r in per_rank), got
    together = set(hosts.listing(0)) | set(hosts.listing(1))
    assert together == {f"out/{p.relative_to(want).as_posix()}" for p in want.rglob("*") if p.is_file()}
    if name == Z2:
        assert "out/step3/mp_rank_00_model_states.pt" in set(hosts.listing(0)) & set(hosts.listing(1))
    assert "wrote" in results[0][1] and results[1][1] == ""  # rank 0 reports


@needs_namespaces
def test_node_local_gather_and_consolidate_write_on_rank_0s_host(single, tmp_path):
    hosts = Hosts(tmp_path, Z3, Z3_SPLIT)
    results = hosts.run("reshard", hosts.ckpt, hosts.outroot / "out", "-w", "2", "--gather", "--no-fsync")
    assert all(code == 0 for code, _, _ in results), [err[-2000:] for _, _, err in results]
    assert _same_tree(single / f"{Z3}_ws2", hosts.out(0) / "out") == [] and hosts.listing(1) == []
    results = hosts.run("consolidate", hosts.ckpt, hosts.outroot / "m.safetensors", "--no-fsync", nproc=2)
    assert all(code == 0 for code, _, _ in results), [err[-2000:] for _, _, err in results]
    assert (hosts.out(0) / "m.safetensors").read_bytes() == (single / f"{Z3}_m.safetensors").read_bytes()
    assert (hosts.out(0) / "m.safetensors.client_state.json").exists() and hosts.listing(1) == []


@needs_namespaces
def test_a_zero_infinity_run_on_node_local_disks_consolidates_and_reshards_as_one_process_does(tmp_path):
    """Each host holds its ranks' files and their swap files (offloaded_tensors/rankNN/): the bytes the plan reads
    from the other host's swap files travel as a rank file's do (issue 70)."""
    name = "nvme_z3_ws2_fp32"
    files = lambda r: [f"step3/zero_pp_rank_{r}_mp_rank_00_{k}_states.pt" for k in ("model", "optim")] + \
        sorted(p.relative_to(FIXTURES / name).as_posix() for p in (FIXTURES / name / f"step3/offloaded_tensors/rank0{r}").iterdir())
    hosts = Hosts(tmp_path, name, [["latest", "reference.pt", *files(0)], files(1)])
    results = hosts.run("consolidate", hosts.ckpt, hosts.outroot / "m.safetensors", "--no-fsync", "--no-client-state")
    assert all(code == 0 for code, _, _ in results), [err[-2000:] for _, _, err in results]
    assert run_cli("consolidate", FIXTURES / name, tmp_path / "single.safetensors", "--no-fsync",
                   "--no-client-state").returncode == 0
    assert (hosts.out(0) / "m.safetensors").read_bytes() == (tmp_path / "single.safetensors").read_bytes()
    results = hosts.run("reshard", hosts.ckpt, hosts.outroot / "out", "-w", "3", "--gather", "--no-fsync")
    assert all(code == 0 for code, _, _ in results), [err[-2000:] for _, _, err in results]
    assert run_cli("reshard", FIXTURES / name, tmp_path / "single", "-w", "3", "--no-fsync", "-q").returncode == 0
    assert _same_tree(tmp_path / "single", hosts.out(0) / "out") == []


@needs_namespaces
def test_a_rank_file_no_host_holds_is_one_error_and_nothing_is_published(tmp_path):
    hosts = Hosts(tmp_path, Z3, [Z3_SPLIT[0], Z3_SPLIT[1][:1]])  # rank 2's optimizer file is nowhere
    results = hosts.run("reshard", hosts.ckpt, hosts.outroot / "out", "-w", "2")
    assert all(code != 0 for code, _, _ in results)
    errors = [line for _, _, err in results for line in err.splitlines() if line.startswith("dsckpt: error:")]
    assert errors == [f"dsckpt: error: {hosts.ckpt}/step3: optimizer-states file of rank 2 is missing (the "
                      "checkpoint records world size 3)"], errors
    assert "Traceback (most recent call last)" not in results[0][2].split("dsckpt: error:")[0]
    assert hosts.listing(0) == [] and hosts.listing(1) == []  # no output, no temp, no view (hidden files too)
    assert os.listdir(hosts.out(0)) == [] and os.listdir(hosts.out(1)) == []


def _worker(node: int, port: int) -> int | None:
    """The pid of the dsckpt process torchrun started on simulated host ``node`` (found by its environment)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"dsckpt" in cmdline and b"torch.distributed.run" not in cmdline and \
                f"GROUP_RANK={node}".encode() in env and f"MASTER_PORT={port}".encode() in env:
            return int(pid)
    return None


@needs_namespaces
def test_a_killed_host_ends_the_run_with_one_error_and_nothing_published(tmp_path):
    """Host 1's process is killed as soon as torchrun has started it: host 0's process stops at its next
    collective (or when the group cannot form) with a DistributedError and leaves nothing behind."""
    hosts = Hosts(tmp_path, Z3, Z3_SPLIT)
    procs = hosts.start("reshard", hosts.ckpt, hosts.outroot / "out", "-w", "2", env={"DSCKPT_DIST_TIMEOUT": "8"})
    port = int(procs[0].args[-1].split("--master-port ")[1].split()[0])
    deadline = time.monotonic() + 120
    while (victim := _worker(1, port)) is None:
        assert time.monotonic() < deadline and procs[1].poll() is None, "host 1's process never started"
        time.sleep(0.001)
    os.kill(victim, signal.SIGKILL)
    _, err = procs[0].communicate(timeout=180)
    procs[1].communicate(timeout=180)
    errors = [line for line in err.splitlines() if line.startswith("dsckpt: error:")]
    assert procs[0].returncode != 0 and len(errors) == 1, err[-3000:]
    assert "a process of the run stopped or cannot be reached" in errors[0] and "nothing was published" in errors[0]
    assert os.listdir(hosts.out(0)) == []  # no output, no temp, no view


def test_a_refused_namespace_says_why_in_the_skip_reason(tmp_path, monkeypatch):
    """Where `unshare` is refused (a container without the privilege), the skip names unshare's own words."""
    fake = tmp_path / "unshare"
    fake.write_text("#!/bin/sh\necho 'unshare: unshare failed: Operation not permitted' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert namespaces_refused() == "`unshare --mount` exited 1: unshare: unshare failed: Operation not permitted"


def test_nproc_convert_writes_the_same_bytes_and_the_same_notes(tmp_path):
    """convert at 2 processes: the same universal files and the same notes as one process writes."""
    one = run_cli("convert", FIXTURES / Z2, tmp_path / "one", "--to", "universal", "--no-fsync", "--json")
    two = run_cli("convert", FIXTURES / Z2, tmp_path / "two", "--to", "universal", "--no-fsync", "--json",
                  "--nproc", "2")
    assert one.returncode == two.returncode == 0, two.stderr[-3000:]
    assert _same_tree(tmp_path / "one", tmp_path / "two") == []
    assert json.loads(one.stdout)["notes"] == json.loads(two.stdout)["notes"]
